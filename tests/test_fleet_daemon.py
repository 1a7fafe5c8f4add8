"""Three Postfix servers with pyqmgr as one sender: the fleet's limits through one real
Redis, against a sink that takes 5 sessions and answers 421 beyond (issue #23).

Each server is a real Postfix instance (its own master, queue and smtp agents) whose
qmgr is pyqmgr with ``shared_state`` pointing at one redis-server; the sink sees all
three as one client (127.0.0.1), as a provider sees one sender's relays. The same
workload on three stock instances shows what the fleet saves: stock's servers each
open their own 5 and meet the 421s.
"""

from __future__ import annotations

import threading
import time

import pytest

from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.redis import RedisServer
from pyqmgr.testbed.sink import SinkServer

NODES = 3
PER_NODE = 60
SINK_SESSIONS = 5
LATENCY = 0.2
#: One session per delivery.
SMTP = {"smtp_connection_cache_on_demand": "no"}


def fleet_cf(redis: RedisServer, **extra: str) -> dict[str, str]:
    return {"shared_state": redis.url, "fast_fleet_destination_concurrency_limit":
            str(SINK_SESSIONS), **extra}


def start_nodes(postfix_instance, sink: SinkServer, pyqmgr_cf: dict[str, str] | None,
                qmgr: str = "pyqmgr") -> list[PostfixInstance]:
    return [postfix_instance(
        qmgr=qmgr, pyqmgr_cf=pyqmgr_cf,
        transports={"big.example": f"fast:[127.0.0.1]:{sink.port}"},
        master_cf_extra=["fast unix - - n - 20 smtp"], main_cf=SMTP)
        for _ in range(NODES)]


def send_all(nodes: list[PostfixInstance], tag: str) -> None:
    """Each node gets its share at once, in parallel, as a busy relay would."""
    errors: list[BaseException] = []

    def send(i: int, pf: PostfixInstance) -> None:
        try:
            pf.smtp_send([("s@test.example", [f"{tag}{i}-{k}@big.example"])
                          for k in range(PER_NODE)])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(i, pf)) for i, pf in enumerate(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def deferred(nodes: list[PostfixInstance]) -> int:
    return sum(len(pf.maillog.lines(contains="status=deferred")) for pf in nodes)


def run_workload(nodes: list[PostfixInstance], sink: SinkServer, tag: str,
                 timeout: float = 120) -> tuple[float, float]:
    """Send the workload; wait until every recipient is at the sink. (busy share, s)."""
    started = time.monotonic()
    send_all(nodes, tag)
    total = NODES * PER_NODE
    # A deferred message waits out its backoff: what counts is each one's first try.
    nodes[0].wait_until(lambda: len(sink.messages()) + deferred(nodes) >= total, timeout,
                        f"all {total} messages at the sink or deferred")
    took = time.monotonic() - started
    stats = sink.snapshot()
    return stats.mean_concurrency() / SINK_SESSIONS, took


def test_three_nodes_keep_to_the_fleets_five_sessions(postfix_instance, sink, redis_server):
    redis = redis_server()
    srv: SinkServer = sink(latency=LATENCY, client_limit=SINK_SESSIONS)
    nodes = start_nodes(postfix_instance, srv, fleet_cf(redis))
    busy, took = run_workload(nodes, srv, "f")
    stats = srv.snapshot()
    total = NODES * PER_NODE
    defers = deferred(nodes)
    print(f"\nfleet of {NODES}: {total} messages in {took:.1f} s; sink at most "
          f"{stats.max_concurrent} sessions, busy {busy:.0%} of {SINK_SESSIONS}; "
          f"421s {stats.rejected_421} of {stats.sessions} sessions; deferrals {defers}")
    # Every session beyond the sink's five is answered 421: none means the sink never
    # saw more than the fleet's limit.
    assert stats.rejected_421 == 0 and stats.max_concurrent <= SINK_SESSIONS
    assert defers < 0.05 * total
    assert busy > 0.9, f"the sink was busy {busy:.0%} of its {SINK_SESSIONS} sessions"
    assert max(stats.delivered.values()) == 1, "a recipient delivered twice"
    for pf in nodes:
        assert not pf.maillog.lines(contains="shared state"), "Redis was there all along"


def test_three_stock_nodes_on_the_same_workload_meet_the_421s(postfix_instance, sink):
    """The same workload without a fleet: each stock qmgr opens its own sessions."""
    srv: SinkServer = sink(latency=LATENCY, client_limit=SINK_SESSIONS)
    nodes = start_nodes(postfix_instance, srv, None, qmgr="stock")
    send_all(nodes, "s")
    total = NODES * PER_NODE
    # Deferred mail waits out its backoff: what counts is the first attempt.
    nodes[0].wait_until(lambda: len(srv.messages()) + deferred(nodes) >= total, 120,
                        "every message tried once")
    stats = srv.snapshot()
    rate = stats.rejected_421 / max(stats.sessions, 1)
    print(f"\nstock, {NODES} servers: 421s {stats.rejected_421} of {stats.sessions} "
          f"sessions ({rate:.0%}); deferrals {deferred(nodes)} of {total}")
    assert stats.rejected_421 > 0, "stock's three servers should exceed the sink's five"


@pytest.mark.parametrize("mode", ["local", "hold"])
def test_redis_gone_at_start_follows_the_failure_mode(postfix_instance, sink, redis_server,
                                                      mode):
    """Redis stopped before any mail: local delivers under each node's own limits with
    a warning; hold delivers nothing to the shared destination until Redis is back."""
    redis = redis_server()
    srv: SinkServer = sink(latency=0.05)
    (pf,) = [postfix_instance(
        qmgr="pyqmgr", pyqmgr_cf=fleet_cf(redis, shared_state_failure=mode,
                                          shared_state_timeout="200ms"),
        transports={"big.example": f"fast:[127.0.0.1]:{srv.port}"},
        master_cf_extra=["fast unix - - n - 20 smtp"], main_cf=SMTP)]
    redis.stop(remove=False)
    pf.smtp_send([("s@test.example", [f"r{k}@big.example"]) for k in range(10)])
    warning = pf.maillog.wait_for(r"warning: shared state redis://127\.0\.0\.1:\d+: ", 30)
    assert f"shared_state_failure = {mode}" in warning[0].text
    if mode == "local":
        pf.wait_until(lambda: len(srv.messages()) == 10, 30, "local delivery without Redis")
    else:
        time.sleep(2)
        assert srv.messages() == [], "hold must start nothing while Redis is gone"
        assert pf.queue_counts()["active"] == 10
        redis.start()
        pf.wait_until(lambda: len(srv.messages()) == 10, 30, "delivery once Redis is back")
        pf.maillog.wait_for("answering again; fleet limits apply", 10)
    assert len(pf.maillog.lines(contains="warning: shared state")) == 1, "one a minute"
