"""Tenants' fair shares on real Postfix (issue #34): three sender domains with equal
weights, one queuing ten times the others' mail, all for one destination.

``tenant_key = sender_domain`` makes each sender domain a tenant; nqmgr's job list then
takes the tenants' messages in rounds (pyqmgr/scheduler/nqmgr/segment.py). While all
three have mail each gets a third of the deliveries; when the two light ones are done
the heavy one gets every delivery, at the rate all three had together.
"""

from __future__ import annotations

import json

from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.sink import ReceivedMessage, SinkServer
from tests.test_control import cli

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
