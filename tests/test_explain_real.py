"""pyqmgr explain on real Postfix: each constraint made real, named with its setting.

The core's unit tests (tests/unit/test_explain.py) make every situation directly;
these make three of them happen on a running instance, with real agents and a sink,
and read the answer through the control channel as an admin would.
"""

from __future__ import annotations

import json
import pwd

from pyqmgr.testbed.instance import PostfixInstance, free_port
from pyqmgr.testbed.sink import SinkServer
from tests.test_control import EX_NOPERM, cli, wait_for_channel
from tests.trust_helpers import throwaway_user


def reasons_for(pf: PostfixInstance, target: str) -> list[dict]:
    proc = cli(pf, "explain", target, "--json")
    assert proc.returncode == 0, proc.stderr
    reply = json.loads(proc.stdout)
    return reply["reasons"]


def wait_for_reason(pf: PostfixInstance, target: str, constraint: str) -> dict:
    found: list[dict] = []

    def present() -> bool:
        found[:] = [r for r in reasons_for(pf, target) if r["constraint"] == constraint]
        return bool(found)

    pf.wait_until(present, 30, f"explain {target} naming '{constraint}'")
    return found[0]


def test_a_full_window_at_its_limit(postfix_instance, sink):
    srv: SinkServer = sink(latency=2.0)
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"w.example": f"smtp:[127.0.0.1]:{srv.port}"},
        main_cf={"smtp_destination_concurrency_limit": "2",
                 "smtp_connection_cache_on_demand": "no"})
    wait_for_channel(pf)
    pf.smtp_send([("s@test.example", [f"r{i}@w.example"]) for i in range(6)])
    full = wait_for_reason(pf, f"[127.0.0.1]:{srv.port}", "window full")
    assert full["setting"] == "smtp_destination_concurrency_limit", full
    assert full["window"] == 2 and full["limit"] == 2
    pf.wait_until(lambda: srv.delivered_count() >= 6, 60, "the six deliveries")


def test_a_dead_destination_with_its_cohorts_and_retry_time(postfix_instance):
    port = free_port()  # nothing listens: every connection is refused
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"dead.example": f"smtp:[127.0.0.1]:{port}"},
        main_cf={"initial_destination_concurrency": "1",
                 "smtp_destination_concurrency_failed_cohort_limit": "1",
                 "minimal_backoff_time": "600s", "maximal_backoff_time": "1200s"})
    wait_for_channel(pf)
    pf.smtp_send([("s@test.example", [f"r{i}@dead.example"]) for i in range(3)])
    dead = wait_for_reason(pf, f"[127.0.0.1]:{port}", "dead destination")
    assert dead["setting"] == "minimal_backoff_time", dead
    assert dead["fail_cohorts"] == 1.0
    assert 0 < dead["retry_in"] <= 600, dead
    assert "refused" in dead["text"].lower() or "connect" in dead["text"].lower(), dead


def test_a_transport_at_its_process_limit(postfix_instance, sink):
    srv_a: SinkServer = sink(latency=3.0)
    srv_b: SinkServer = sink(latency=0.1)
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr",
        transports={"a.example": f"one:[127.0.0.1]:{srv_a.port}",
                    "b.example": f"one:[127.0.0.1]:{srv_b.port}"},
        master_cf_extra=["one unix - - n - 1 smtp"],
        main_cf={"one_connection_cache_on_demand": "no"})
    wait_for_channel(pf)
    pf.smtp_send([("s@test.example", ["r0@a.example"])])
    pf.wait_until(lambda: srv_a.open_sessions() >= 1, 20, "the slow delivery under way")
    pf.smtp_send([("s@test.example", ["r1@b.example"])])
    limit = wait_for_reason(pf, f"[127.0.0.1]:{srv_b.port}", "process limit")
    assert limit["setting"] == "master.cf one maxproc", limit
    assert limit["limit"] == 1
    pf.wait_until(lambda: srv_b.delivered_count() >= 1, 30, "b delivered after a")


def explain_reply(pf: PostfixInstance, target: str) -> dict:
    proc = cli(pf, "explain", target, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_preempted_job_in_explain_and_jobs(postfix_instance, sink, pyqmgr_for_others):
    """A 40-recipient message preempted by a 2-recipient one, held there for 20 s.

    One delivery agent (maxproc 1), one recipient per delivery, slot cost 2: after
    BIG's first delivery (3 s at the sink) it has a slot, the loan covers SMALL's two
    entries, and SMALL preempts it. SMALL's first delivery takes 20 s at the sink and
    it still has its second entry, so the stack stays while explain and jobs are read:
    as root, as an unprivileged user authorized_mailq_users names, and refused to a
    user it does not name.
    """
    srv: SinkServer = sink(latency=lambda a: {"a0@big.example": 3.0,
                                              "b0@small.example": 20.0}.get(a, 0.05))
    nexthop = f"slow:[127.0.0.1]:{srv.port}"
    with throwaway_user() as stranger:
        pf: PostfixInstance = postfix_instance(
            qmgr="pyqmgr", transports={"big.example": nexthop, "small.example": nexthop},
            master_cf_extra=["slow unix - - n - 1 smtp"],
            main_cf={"slow_destination_recipient_limit": "1",
                     "slow_delivery_slot_cost": "2",
                     "authorized_mailq_users": f"root, {stranger.pw_name}"})
        wait_for_channel(pf)
        (big,) = pf.smtp_send([("s@test.example", [f"a{i}@big.example" for i in range(40)])])
        pf.wait_until(lambda: srv.open_sessions() >= 1, 20, "BIG's first delivery under way")
        (small,) = pf.smtp_send([("s@test.example", ["b0@small.example", "b1@small.example"])])
        pre = wait_for_reason(pf, big, "preempted")
        assert srv.outcomes("b1@small.example") == [], "the stack is still there"
        assert pre["setting"] == "slow_delivery_slot_cost", pre
        assert pre["preempted_by"] == small and small in str(pre["text"]), pre

        jobs = cli(pf, "jobs", "slow", "--json")
        assert jobs.returncode == 0, jobs.stderr
        reply = json.loads(jobs.stdout)
        assert reply["policy"] == "nqmgr" and reply["current_job"] == small
        assert reply["stacks"] == [[big, small]], reply["stacks"]
        top, bottom = reply["jobs"][:2]
        assert (top["queue_id"], top["stack_level"], top["preempts"]) == (small, 1, big)
        # With one recipient per delivery, Postfix queues per recipient (b0@nexthop).
        assert top["current"] and [(d["destination"].split("@")[0], d["in_flight"])
                                   for d in top["destinations"]] == [("b1", 0), ("b0", 1)]
        assert (bottom["queue_id"], bottom["stack_level"]) == (big, 0)
        assert bottom["preempted_by"] == [small] and not bottom["current"]
        # BIG paid for SMALL's two entries (2 x 2 slots) with one slot saved: on loan.
        assert bottom["slots_available"] == 1 - 2 * 2 and bottom["loan"] == 3, bottom
        assert reply["settings"]["slow_delivery_slot_cost"] == 2

        as_stranger = cli(pf, "jobs", "slow", user=stranger, others=pyqmgr_for_others)
        assert as_stranger.returncode == 0, as_stranger.stderr
        assert f"preemption stack, preempted first: {big} <- {small}" in as_stranger.stdout
        refused = cli(pf, "jobs", "slow", user=pwd.getpwnam("nobody"),
                      others=pyqmgr_for_others)
        assert refused.returncode == EX_NOPERM, (refused.stdout, refused.stderr)
        assert "is not allowed to read the scheduler's state" in refused.stderr
        unknown = cli(pf, "jobs", "nosuch")
        assert unknown.returncode == 1
        assert unknown.stderr.startswith('pyqmgr jobs: jobs: no transport "nosuch" in core')
        assert srv.outcomes("b1@small.example") == [], (
            "SMALL finished while the checks ran: they did not all see the stack")
    pf.wait_until(lambda: srv.delivered_count() >= 42, 60, "all 42 deliveries")


def test_a_blocker_job_on_the_message_and_its_destinations(postfix_instance, sink):
    """A message whose two destinations are both at their window (1) is a blocker.

    Two recipients per delivery (with one, Postfix would queue each recipient apart,
    each with its own window), four per destination: each destination's first
    delivery takes 20 s and the second waits. When a later message arrives for a
    third destination, selection walks past the first message's job and tags it and
    both its destinations as blockers.
    """
    slow = {name: sink(latency=lambda a: 20.0 if a.startswith("r0@") else 0.05)
            for name in ("s1", "s2")}
    fast: SinkServer = sink(latency=0.0)
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr",
        transports={"s1.example": f"smtp:[127.0.0.1]:{slow['s1'].port}",
                    "s2.example": f"smtp:[127.0.0.1]:{slow['s2'].port}",
                    "fast.example": f"smtp:[127.0.0.1]:{fast.port}"},
        main_cf={"smtp_destination_concurrency_limit": "1",
                 "initial_destination_concurrency": "1",
                 "smtp_destination_recipient_limit": "2",
                 "smtp_connection_cache_on_demand": "no"})
    wait_for_channel(pf)
    (blocked,) = pf.smtp_send([("s@test.example", [f"r{i}@{n}.example" for n in slow
                                                   for i in range(4)])])
    pf.wait_until(lambda: all(s.open_sessions() >= 1 for s in slow.values()), 20,
                  "a delivery under way at both slow destinations")
    pf.smtp_send([("s@test.example", ["x@fast.example"])])
    pf.wait_until(lambda: fast.delivered_count() >= 1, 20,
                  "the later message delivered past the blocked one")
    reply = explain_reply(pf, blocked)
    assert reply["kind"] == "message", reply
    blockers = [r for r in reply["reasons"] if r["constraint"] == "blocker job"]
    assert len(blockers) == 1, reply["reasons"]
    assert blockers[0]["setting"] == "smtp_destination_concurrency_limit"
    assert blocked in str(blockers[0]["text"])
    full = sorted(r["destination"] for r in reply["reasons"]
                  if r["constraint"] == "window full")
    assert full == sorted(f"[127.0.0.1]:{s.port}" for s in slow.values()), reply["reasons"]
    for s in slow.values():
        dest = explain_reply(pf, f"[127.0.0.1]:{s.port}")
        (blocker,) = [r for r in dest["reasons"] if r["constraint"] == "blocker job"]
        assert blocker["setting"] == "smtp_destination_concurrency_limit", blocker
    jobs = json.loads(cli(pf, "jobs", "smtp", "--json").stdout)
    (job,) = [j for j in jobs["jobs"] if j["queue_id"] == blocked]
    assert job["blocker"] and {d["todo"] for d in job["destinations"]} == {1}, job
    assert all(s.outcomes(f"r2@{n}.example") == [] for n, s in slow.items()), (
        "a slow destination finished while the checks ran")
