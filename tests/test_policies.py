"""Every scheduling policy delivers real mail on real Postfix, chosen in pyqmgr.cf.

The seed's schedulers run beside nqmgr per transport; whatever a policy decides, the
mail must all arrive once and the queue empty, with the log lines admins' tools read.
Postfix's own oqmgr runs the same workload as the reference for the oqmgr policy.
"""

from __future__ import annotations

import pytest

from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.sink import SinkServer


def _workload(pf: PostfixInstance, srv: SinkServer, n: int = 30) -> list[str]:
    msgs = [("s@test.example", [f"r{i}@d{i % 3}.example", f"x{i}@d{(i + 1) % 3}.example"])
            for i in range(n)]
    qids = pf.smtp_send(msgs)
    pf.wait_until(lambda: sum(len(m.recipients) for m in srv.messages()) >= 2 * n, 60,
                  f"{2 * n} recipients at the sink")
    pf.wait_queue_empty(30)
    return qids


@pytest.mark.parametrize("policy", ["nqmgr", "oqmgr", "finch", "zmailer"])
def test_policy_from_pyqmgr_cf_delivers_everything_once(postfix_instance, sink, policy):
    srv: SinkServer = sink(latency=0.01)
    nexthop = f"smtp:[127.0.0.1]:{srv.port}"
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", pyqmgr_cf={"scheduler_policy": policy},
        transports={f"d{i}.example": nexthop for i in range(3)})
    qids = _workload(pf, srv)
    got = sorted(r for m in srv.messages() for r in m.recipients)
    assert len(got) == len(set(got)) == 60, "every recipient exactly once"
    pf.wait_removed(qids)
    warnings = [ln.text for ln in pf.maillog.lines()
                if ln.program_name == "qmgr" and ln.severity in ("warning", "error", "fatal")]
    assert not warnings, warnings


def test_stock_oqmgr_runs_in_the_testbed(postfix_instance, sink):
    """The reference itself: Postfix's oqmgr binary as the qmgr service."""
    srv: SinkServer = sink(latency=0.01)
    nexthop = f"smtp:[127.0.0.1]:{srv.port}"
    pf: PostfixInstance = postfix_instance(
        qmgr="oqmgr", transports={f"d{i}.example": nexthop for i in range(3)})
    _workload(pf, srv, 10)
    commands = [" ".join(argv) for argv in pf.processes().values()]
    assert any("postfix-oqmgr/qmgr" in c for c in commands), commands
    assert any(ln.program_name == "qmgr" and ln.text.endswith("(queue active)")
               for ln in pf.maillog.lines()), "oqmgr logs as postfix/qmgr, like stock"


def test_policies_chosen_per_transport_run_side_by_side(postfix_instance, sink):
    """``relay_scheduler_policy = zmailer`` beside the default nqmgr, in one qmgr.

    Each destination has a sink of its own and ten messages; the zmailer transport
    never has two sessions at its destination, while nqmgr's window (initial
    concurrency 5) lets the smtp destination have several.
    """
    slow, fast = sink(latency=0.3), sink(latency=0.3)
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", pyqmgr_cf={"scheduler_policy": "nqmgr",
                                  "relay_scheduler_policy": "zmailer"},
        transports={"z.example": f"relay:[127.0.0.1]:{slow.port}",
                    "n.example": f"smtp:[127.0.0.1]:{fast.port}"},
        main_cf={"smtp_connection_cache_on_demand": "no",
                 "relay_connection_cache_on_demand": "no"})
    msgs = [("s@test.example", [f"r{i}@z.example"]) for i in range(10)]
    msgs += [("s@test.example", [f"r{i}@n.example"]) for i in range(10)]
    pf.smtp_send(msgs)
    pf.wait_until(lambda: slow.delivered_count() + fast.delivered_count() >= 20, 60,
                  "20 deliveries at the two sinks")
    pf.wait_queue_empty(30)
    assert slow.snapshot().max_concurrent == 1, "zmailer: one agent per destination"
    assert fast.snapshot().max_concurrent >= 3, "nqmgr: the window admits several"
