"""Tenants' fair shares on real Postfix (issue #34): three sender domains with equal
weights, one queuing ten times the others' mail, all for one destination.

``tenant_key = sender_domain`` makes each sender domain a tenant; nqmgr's job list then
takes the tenants' messages in rounds (pyqmgr/scheduler/nqmgr/segment.py). While all
three have mail each gets a third of the deliveries; when the two light ones are done
the heavy one gets every delivery, at the rate all three had together.
"""

from __future__ import annotations

import json
import os
import time

from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.sink import ReceivedMessage, SinkServer
from tests.test_control import cli, wait_for_channel

HEAVY, LIGHT = 3000, 300
TENANTS_CF = {"tenant_key": "sender_domain"}


def _shares(messages: list[ReceivedMessage]) -> tuple[dict[str, float], float, float]:
    """Each tenant's share of the deliveries while all three had mail, and the rates
    (a second) of all of them then and of the heavy one alone after."""
    by: dict[str, list[float]] = {}
    for m in messages:
        by.setdefault(m.sender.split("@")[1], []).append(m.time)
    for times in by.values():
        times.sort()
    start = min(t[0] for t in by.values())
    end = min(by["b.example"][-1], by["c.example"][-1])
    inside = {d: sum(1 for x in t if x <= end) for d, t in by.items()}
    total = sum(inside.values())
    alone = [x for x in by["a.example"] if x > end + 1]
    rate_all = total / (end - start)
    rate_alone = (len(alone) - 1) / (alone[-1] - alone[0]) if len(alone) > 100 else 0.0
    return {d: n / total for d, n in sorted(inside.items())}, rate_all, rate_alone


def _run(postfix_instance, sink, qmgr: str, cf: dict[str, str] | None
         ) -> list[ReceivedMessage]:
    srv: SinkServer = sink(latency=0.05)
    pf: PostfixInstance = postfix_instance(
        qmgr=qmgr, transports={"dest.example": f"smtp:[127.0.0.1]:{srv.port}"},
        pyqmgr_cf=cf)
    mail = ([("news@a.example", [f"a{i}@dest.example"]) for i in range(HEAVY)]
            + [("news@b.example", [f"b{i}@dest.example"]) for i in range(LIGHT)]
            + [("news@c.example", [f"c{i}@dest.example"]) for i in range(LIGHT)])
    pf.preload(mail)
    pf.release_preload()
    if qmgr == "pyqmgr":
        pf.wait_until(lambda: srv.delivered_count() >= 200, 60, "deliveries under way")
        jobs = json.loads(cli(pf, "jobs", "smtp", "--limit", "9", "--json").stdout)["jobs"]
        print("\n" + cli(pf, "jobs", "smtp", "--limit", "6").stdout)
        tenants = [j["tenant"] for j in jobs]
        # Rounds: the three tenants' jobs take turns at the head of the list.
        assert set(tenants[:3]) == {"a.example", "b.example", "c.example"}, tenants
        assert all(j["class"] == "default" for j in jobs), jobs
        # One well down the list: still there when explain asks (400 deliveries a s).
        down = json.loads(cli(pf, "jobs", "smtp", "--limit", "1500", "--json").stdout)
        later = [j["queue_id"] for j in down["jobs"] if j["tenant"] == "b.example"][-1]
        why = json.loads(cli(pf, "explain", later, "--json").stdout)
        turn = [r for r in why["reasons"] if r["constraint"] == "class and tenant turn"]
        print(cli(pf, "explain", later).stdout)
        assert turn and turn[0]["tenant"] == "b.example", why
    pf.wait_until(lambda: srv.delivered_count() >= len(mail), 300, "everything delivered")
    pf.wait_queue_empty(60)
    return srv.messages()


def test_three_tenants_one_sending_ten_times_share_deliveries_equally(
        postfix_instance, sink):
    stock, _, _ = _shares(_run(postfix_instance, sink, "stock", None))
    shares, rate_all, rate_alone = _shares(_run(postfix_instance, sink, "pyqmgr",
                                                TENANTS_CF))
    print(f"\nshares while all three had mail: stock "
          f"{', '.join(f'{d} {s:.1%}' for d, s in stock.items())}; pyqmgr with tenants "
          f"{', '.join(f'{d} {s:.1%}' for d, s in shares.items())}; all three "
          f"{rate_all:.0f}/s, the heavy one alone after {rate_alone:.0f}/s")
    for share in shares.values():
        assert abs(share - 1 / 3) <= 0.05, shares
    assert rate_alone >= 0.9 * rate_all, (rate_alone, rate_all)


def _sent(srv: SinkServer, rcpt: str) -> bool:
    return any(m.recipients[0] == rcpt for m in srv.messages())


def test_a_tenant_suspended_by_command_and_by_a_response_rule(
        postfix_instance, sink, tables_dir):
    """``pyqmgr suspend tenant:a.example@DEST``, then a Yahoo-style TSS04 reply to
    a.example's mail with ``suspend_tenant=1h``: each time only a.example's mail to
    that destination waits; b.example's mail there and a.example's elsewhere go."""
    yahoo: SinkServer = sink()
    gmail: SinkServer = sink()
    rules = tables_dir / "rules"
    rules.write_text("/\\[TSS04\\]/  throttle suspend_tenant=1h\n")
    os.chmod(tables_dir, 0o755)
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"yahoo.example": f"smtp:[127.0.0.1]:{yahoo.port}",
                                   "gmail.example": f"smtp:[127.0.0.1]:{gmail.port}"},
        pyqmgr_cf={**TENANTS_CF, "smtp_response_rules": str(rules)})
    dest = f"[127.0.0.1]:{yahoo.port}"
    wait_for_channel(pf)

    # By command.
    out = cli(pf, "suspend", f"tenant:a.example@{dest}", "--reason", "complaints",
              "--ttl", "1h")
    assert out.returncode == 0, out.stderr
    pf.smtp_send([("x@a.example", ["a1@yahoo.example"]), ("x@a.example", ["a2@gmail.example"]),
                  ("x@b.example", ["b1@yahoo.example"])])
    pf.wait_until(lambda: _sent(gmail, "a2@gmail.example") and _sent(yahoo, "b1@yahoo.example"),
                  30, "the others' mail delivered")
    # The delivered ones leave active/ a moment after their deliveries end.
    pf.wait_until(lambda: len(pf.queue_files("active")) == 1, 30,
                  "a.example's held message alone in active/")
    held = pf.queue_files("active")
    why = cli(pf, "explain", held[0]).stdout
    status = cli(pf, "status").stdout
    print(f"\n{why}\n{status[:900]}")
    assert f"tenant a.example at destination {dest} is suspended by root" in why
    assert "complaints" in why
    time.sleep(2)
    assert not _sent(yahoo, "a1@yahoo.example")
    assert cli(pf, "resume", f"tenant:a.example@{dest}").returncode == 0
    pf.wait_until(lambda: _sent(yahoo, "a1@yahoo.example"), 30, "a1 delivered on resume")

    # By a response rule: Yahoo greets the session that carries a.example's message
    # with TSS04; that holds a.example there (and only a.example).
    yahoo.refuse_sessions("421 4.7.0 [TSS04] Messages from 127.0.0.1 temporarily "
                          "deferred due to unexpected volume or user complaints")
    pf.smtp_send([("x@a.example", ["tss@yahoo.example"])])
    (line,) = pf.maillog.wait_for(lambda ln: "held 1h" in ln.text, 30,
                                  what="the rule's tenant hold")
    yahoo.refuse_sessions(None)
    print(line.text)
    assert f"tenant a.example at destination smtp:{dest} held 1h" in line.text
    pf.smtp_send([("x@a.example", ["a3@yahoo.example"]), ("x@a.example", ["a4@gmail.example"]),
                  ("x@b.example", ["b2@yahoo.example"])])
    pf.wait_until(lambda: _sent(gmail, "a4@gmail.example") and _sent(yahoo, "b2@yahoo.example"),
                  30, "the others' mail delivered while a.example is held")
    time.sleep(2)
    assert not _sent(yahoo, "a3@yahoo.example")
    listed = json.loads(cli(pf, "status", "--json").stdout)["suspensions"]
    assert any(h["target"] == f"tenant a.example at destination smtp:{dest}" for h in listed), \
        listed
    assert cli(pf, "resume", f"tenant:a.example@smtp:{dest}").returncode == 0
    pf.wait_until(lambda: _sent(yahoo, "a3@yahoo.example"), 30, "a3 delivered on resume")
    # Nothing lost: all delivered but the message the 421 came for, deferred as any.
    pf.wait_until(lambda: pf.queue_counts()["active"] == 0, 30, "the active queue empty")
    assert pf.queue_counts()["deferred"] == 1


def test_a_tenants_cap_at_a_destination(postfix_instance, sink):
    """smtp_tenant_concurrency_limit = 2: each sender domain has at most two
    deliveries at the destination (so the server, which takes every session, never
    sees more than four for the two), while its window alone would allow twenty; the
    rest follows one as one ends, and explain says why it waits."""
    srv: SinkServer = sink(latency=0.5)
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"dest.example": f"smtp:[127.0.0.1]:{srv.port}"},
        main_cf={"smtp_connection_cache_on_demand": "no"},
        pyqmgr_cf={**TENANTS_CF, "smtp_tenant_concurrency_limit": "2"})
    mail = ([("news@a.example", [f"a{i}@dest.example"]) for i in range(12)]
            + [("news@b.example", [f"b{i}@dest.example"]) for i in range(12)])
    pf.preload(mail)
    pf.release_preload()
    pf.wait_until(lambda: srv.delivered_count() >= 2, 30, "deliveries under way")
    staged = json.loads(cli(pf, "status", "--json").stdout)
    held = next(t for t in staged["transports"] if t["name"] == "pyqmgr-held")
    waiting = [qid for qid in pf.queue_files("active")]
    why = ""
    for qid in waiting:
        text = cli(pf, "explain", qid).stdout
        if "tenant's share" in text:
            why = text
            break
    pf.wait_until(lambda: srv.delivered_count() >= len(mail), 60, "everything delivered")
    pf.wait_queue_empty(30)
    peak = srv.snapshot().max_concurrent
    print(f"\n{why}\npeak sessions at the server: {peak} (cap 2 for each of 2 tenants); "
          f"held transport then: {held['queued_entries']} waiting")
    assert peak <= 4, peak
    assert held["queued_entries"] > 0
    # The control: the same mail without the cap.
    free: SinkServer = sink(latency=0.5)
    pf2: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"dest.example": f"smtp:[127.0.0.1]:{free.port}"},
        main_cf={"smtp_connection_cache_on_demand": "no"}, pyqmgr_cf=TENANTS_CF)
    pf2.preload(mail)
    pf2.release_preload()
    pf2.wait_until(lambda: free.delivered_count() >= len(mail), 60, "everything delivered")
    print(f"without the cap: peak {free.snapshot().max_concurrent}")
    assert free.snapshot().max_concurrent > 4
    assert "tenant a.example has 2 deliveries" in why or \
        "tenant b.example has 2 deliveries" in why, why


def test_a_tenants_rate_at_a_destination(postfix_instance, sink):
    """smtp_tenant_rate = 4/1s: each sender domain's twelve messages reach the server
    one every quarter second or so (about 2.75 s from first to last), the two side by
    side: the rate is each tenant's, not one shared by them (24 messages in about
    2.75 s, not 5.75 s). explain names the rate while the mail waits; nothing lost."""
    srv: SinkServer = sink(latency=0.0)
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"dest.example": f"smtp:[127.0.0.1]:{srv.port}"},
        pyqmgr_cf={**TENANTS_CF, "smtp_tenant_rate": "4/1s"})
    mail = ([("news@a.example", [f"a{i}@dest.example"]) for i in range(12)]
            + [("news@b.example", [f"b{i}@dest.example"]) for i in range(12)])
    pf.preload(mail)
    pf.release_preload()
    pf.wait_until(lambda: srv.delivered_count() >= 4, 30, "deliveries under way")
    why = ""
    for qid in pf.queue_files("active"):
        text = cli(pf, "explain", qid).stdout
        if "tenant's rate" in text:
            why = text
            break
    pf.wait_until(lambda: srv.delivered_count() >= len(mail), 60, "everything delivered")
    pf.wait_queue_empty(30)
    times: dict[str, list[float]] = {"a.example": [], "b.example": []}
    for m in srv.messages():
        times[m.sender.split("@")[1]].append(m.time)
    a, b = sorted(times["a.example"]), sorted(times["b.example"])
    print(f"\n{why}")
    for times_of in (a, b):
        gaps = [y - x for x, y in zip(times_of, times_of[1:], strict=False)]
        print(f"{times_of[-1] - times_of[0]:.2f} s first to last, smallest gap "
              f"{min(gaps):.3f} s")
        assert len(times_of) == 12
        assert times_of[-1] - times_of[0] >= 2.5, "eleven quarter-second slots"
        # A delivery's own time varies a little; slots do not come closer than that.
        assert sum(1 for g in gaps if g < 0.15) <= 1, gaps
    assert max(a[-1], b[-1]) - min(a[0], b[0]) < 4.0, "each tenant its own rate"
    assert "smtp_tenant_rate" in why and "one delivery every 250ms" in why, why
