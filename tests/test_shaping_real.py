"""Shaping on real Postfix: a rate with concurrency, and response rules against a 421
session limiter and a provider that answers ``421 4.7.28`` above a rate.

Each test measures at the sink (sessions open over time, when each started) and in
the maillog (deliveries sent and deferred), and runs stock qmgr on the same workload
as the control where the issue compares with stock.
"""

from __future__ import annotations

import os

from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.sink import SinkServer
from tests.test_control import cli, wait_for_channel

HERE = os.path.dirname(os.path.abspath(__file__))
RULES = os.path.join(os.path.dirname(HERE), "contrib", "response_rules.example")


def status_count(pf: PostfixInstance, word: str, domain: str) -> int:
    return len([ln for ln in pf.maillog.lines()
                if f"@{domain}>" in ln.text and f"status={word}" in ln.text])


def wait_all_tried(pf: PostfixInstance, n: int, domain: str, timeout: float) -> None:
    """Every message delivered or deferred once (deferred ones wait an hour)."""
    pf.wait_until(lambda: status_count(pf, "sent", domain)
                  + status_count(pf, "deferred", domain) >= n,
                  timeout, f"{n} messages to {domain} sent or deferred")


def test_a_rate_with_concurrency(postfix_instance, sink):
    """4 a second, 1 s each: several sessions at once, never more than 4 starts a second."""
    srv: SinkServer = sink(latency=1.0)
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"rated.example": f"smtp:[127.0.0.1]:{srv.port}"},
        main_cf={"smtp_connection_cache_on_demand": "no",
                 "smtp_destination_concurrency_limit": "6",
                 "initial_destination_concurrency": "6"},
        pyqmgr_cf={"smtp_destination_rate": "4/1s"})
    wait_for_channel(pf)
    n = 24
    pf.smtp_send([("s@test.example", [f"r{i}@rated.example"]) for i in range(n)])
    srv.wait_delivered(n, 60)
    st = srv.snapshot()
    starts = sorted(st.opened)
    assert len(starts) == n
    rate = (n - 1) / (starts[-1] - starts[0])
    closest = min(b - a for a, b in zip(starts, starts[4:], strict=False))
    print(f"rate 4/1s, 1 s a delivery: {rate:.2f} starts a second, at most "
          f"{st.max_concurrent} sessions at once (mean {st.mean_concurrency():.2f}); "
          f"5 starts span at least {closest:.3f} s")
    assert 1 < st.max_concurrent <= 6, "concurrency above 1 and within the window"
    assert st.max_concurrent >= 3
    assert rate <= 4.0 * 1.02, f"{rate:.2f} starts a second"
    assert closest >= 0.95, "never 5 starts within a second"
    pf.wait_queue_empty(30)
    assert sorted(srv.snapshot().delivered) == sorted(f"r{i}@rated.example" for i in range(n))


def _limiter_run(postfix_instance, sink, qmgr: str, rules: bool) -> tuple[float, float, int]:
    srv: SinkServer = sink(latency=0.5, client_limit=5)
    pyqmgr_cf = {"smtp_response_rules": RULES} if rules else None
    pf: PostfixInstance = postfix_instance(
        qmgr=qmgr, pyqmgr_cf=pyqmgr_cf,
        transports={"limited.example": f"smtp:[127.0.0.1]:{srv.port}"},
        main_cf={"smtp_connection_cache_on_demand": "no",
                 "smtp_destination_concurrency_limit": "20",
                 "initial_destination_concurrency": "5",
                 "smtp_destination_concurrency_positive_feedback": "1/concurrency",
                 "smtp_destination_concurrency_negative_feedback": "1/concurrency",
                 "minimal_backoff_time": "3600s", "maximal_backoff_time": "3600s"})
    n = 150
    pf.smtp_send([("s@test.example", [f"r{i}@limited.example"]) for i in range(n)])
    wait_all_tried(pf, n, "limited.example", 240)
    deferred = status_count(pf, "deferred", "limited.example")
    dead = len([ln for ln in pf.maillog.lines() if "delivery temporarily suspended" in ln.text])
    mean = srv.snapshot().mean_concurrency()
    pf.stop()
    return deferred / n, mean, dead


def test_response_rules_against_the_421_session_limiter(postfix_instance, sink):
    """Server limit 5, client limit 20, initial 5, 1/concurrency feedback; stock as control."""
    stock, stock_mean, _ = _limiter_run(postfix_instance, sink, "stock", rules=False)
    ours, mean, dead = _limiter_run(postfix_instance, sink, "pyqmgr", rules=True)
    print(f"421 limiter on real Postfix: stock {stock:.1%} deferred (mean in flight "
          f"{stock_mean:.2f}); pyqmgr with rules {ours:.1%} (mean {mean:.2f})")
    assert stock >= 0.10, "the control: stock's feedback keeps provoking 421s"
    assert ours < 0.05
    assert mean >= 4.5
    assert dead == 0


def _rate_limit_run(postfix_instance, sink, qmgr: str, rules: bool) -> tuple[int, int, int]:
    srv: SinkServer = sink(latency=0.2, rate_limit=2)
    pyqmgr_cf = {"smtp_response_rules": RULES} if rules else None
    pf: PostfixInstance = postfix_instance(
        qmgr=qmgr, pyqmgr_cf=pyqmgr_cf,
        transports={"gmail.example": f"smtp:[127.0.0.1]:{srv.port}"},
        main_cf={"smtp_connection_cache_on_demand": "no",
                 "smtp_destination_concurrency_limit": "20",
                 "initial_destination_concurrency": "5",
                 "minimal_backoff_time": "3600s", "maximal_backoff_time": "3600s"})
    if rules:
        wait_for_channel(pf)
    n = 30
    pf.smtp_send([("s@test.example", [f"r{i}@gmail.example"]) for i in range(n)])
    wait_all_tried(pf, n, "gmail.example", 240)
    deferred = status_count(pf, "deferred", "gmail.example")
    dead = len([ln for ln in pf.maillog.lines() if "delivery temporarily suspended" in ln.text])
    explained = []
    if rules:
        explained = [ln.text for ln in pf.maillog.lines("postfix/qmgr", contains="shaping:")]
        assert explained, "the rule's action is logged"
        assert "matched " + RULES in explained[0]
        proc = cli(pf, "status", "--json")
        assert proc.returncode == 0
    pf.stop()
    return deferred, dead, srv.snapshot().rejected_rate


def test_response_rules_against_a_provider_rate_limit(postfix_instance, sink):
    """421 4.7.28 above 2 sessions a second: never dead, under a third of stock's deferrals."""
    stock, stock_dead, _ = _rate_limit_run(postfix_instance, sink, "stock", rules=False)
    ours, dead, rejected = _rate_limit_run(postfix_instance, sink, "pyqmgr", rules=True)
    print(f"421 4.7.28 rate limiter on real Postfix: stock {stock} deferred "
          f"({stock_dead} recipients deferred as a dead destination); pyqmgr with rules "
          f"{ours} deferred, {dead} as dead, {rejected} sessions refused by the rate")
    assert stock_dead > 0, "the control: stock declares the destination dead"
    assert dead == 0, "never marked dead"
    assert ours * 3 < stock
