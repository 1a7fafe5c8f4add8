"""status and explain from the core: the right constraint and the setting behind it.

Each situation of the issue is made in the core directly (a full window, a dead
destination, a blocker job, a preempted job, a transport at its process limit, a
policy's own reason), and explain must name it; status must show the same numbers.
"""

from __future__ import annotations

import json

from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.explain import explain, status
from pyqmgr.scheduler.finch import Finch
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.policy import PolicyTable
from pyqmgr.scheduler.queue import Dsn
from pyqmgr.scheduler.zmailer import Zmailer
from tests.unit.params import Params


def routes(n: int, dest: str = "d.example", prefix: str = "r") -> list[Route]:
    return [Route("smtp", dest, dest, Recipient(i, f"{prefix}{i}@{dest}")) for i in range(n)]


def constraints(answer: dict) -> list[str]:
    json.dumps(answer)  # every answer goes over the wire as JSON
    return [r["constraint"] for r in answer["reasons"]]


def test_a_full_window_names_the_concurrency_limit():
    s = Scheduler(lambda n: Params(destination_concurrency_limit=2,
                                   initial_destination_concurrency=2,
                                   destination_recipient_limit=1))
    s.assign(Message("Q1", 0.0), routes(5), now=0.0)
    assert s.select("smtp", 0.0).deliver and s.select("smtp", 0.0).deliver
    answer = explain(s, "d.example", 0.0)
    (full,) = [r for r in answer["reasons"] if r["constraint"] == "window full"]
    assert full["setting"] == "smtp_destination_concurrency_limit"
    assert full["window"] == 2 and full["limit"] == 2
    (dest,) = status(s, 0.0)["destinations"]
    assert (dest["window"], dest["in_flight"], dest["queued_entries"]) == (2, 2, 3)


def test_a_window_below_its_limit_names_the_feedback():
    s = Scheduler(lambda n: Params(destination_concurrency_limit=20,
                                   initial_destination_concurrency=1,
                                   destination_recipient_limit=1))
    s.assign(Message("Q1", 0.0), routes(3), now=0.0)
    assert s.select("smtp", 0.0).deliver
    (full,) = explain(s, "d.example", 0.0)["reasons"]
    assert full["setting"] == "smtp_destination_concurrency_positive_feedback"


def test_a_dead_destination_names_its_cohorts_and_retry_time():
    s = Scheduler(lambda n: Params(initial_destination_concurrency=1,
                                   destination_recipient_limit=1),
                  min_backoff_time=300)
    s.assign(Message("Q1", 0.0), routes(3), now=0.0)
    e = s.select("smtp", 10.0).deliver
    assert e is not None
    s.done(e, 1, Dsn("4.4.1", "connect refused"), False, 10.0)
    answer = explain(s, "d.example", 20.0)
    (dead,) = [r for r in answer["reasons"] if r["constraint"] == "dead destination"]
    assert dead["setting"] == "minimal_backoff_time"
    assert dead["retry_in"] == 290.0 and dead["since"] == -10.0
    assert dead["fail_cohorts"] == 1.0 and "connect refused" in str(dead["text"])
    (dest,) = [d for d in status(s, 20.0)["destinations"] if d["name"] == "d.example"]
    assert dest["dead"] and dest["retry_in"] == 290.0


def test_a_transport_at_its_process_limit():
    s = Scheduler(lambda n: Params(destination_recipient_limit=1),
                  process_limit_for=lambda name: 2)
    s.assign(Message("Q1", 0.0), routes(2, "a.example") + routes(2, "b.example"), now=0.0)
    assert s.select("smtp", 0.0).deliver and s.select("smtp", 0.0).deliver
    answer = explain(s, "b.example", 0.0)
    assert "process limit" in constraints(answer)
    (r,) = [r for r in answer["reasons"] if r["constraint"] == "process limit"]
    assert r["setting"] == "master.cf smtp maxproc" and r["busy"] == 2


def test_a_blocker_job_and_its_destination():
    s = Scheduler(lambda n: Params(destination_concurrency_limit=1,
                                   initial_destination_concurrency=1,
                                   destination_recipient_limit=1))
    s.assign(Message("Q1", 0.0), routes(3, "slow.example"), now=0.0)
    s.assign(Message("Q2", 1.0), routes(1, "fast.example"), now=1.0)
    assert s.select("smtp", 1.0).deliver is not None  # Q1 to slow, window now full
    assert s.select("smtp", 1.0).deliver is not None  # Q1 is a blocker, Q2 goes
    assert "blocker job" in constraints(explain(s, "Q1", 1.0))
    assert "blocker job" in constraints(explain(s, "slow.example", 1.0))


def test_a_preempted_job_names_the_job_that_preempted_it():
    s = Scheduler(lambda n: Params(destination_recipient_limit=1,
                                   initial_destination_concurrency=1,
                                   destination_concurrency_limit=1,
                                   delivery_slot_cost=2, delivery_slot_loan=0,
                                   delivery_slot_discount=0))
    big = Message("BIG", 0.0)
    s.assign(big, routes(40, "big.example"), now=0.0)
    busy = []
    for _ in range(4):  # BIG earns slots
        e = s.select("smtp", 0.0).deliver
        assert e is not None
        s.done(e, 0, None, False, 0.0)
    # Two recipients: after its first delivery SMALL still holds the stack.
    s.assign(Message("SMALL", 1.0), routes(2, "small.example"), now=1.0)
    e = s.select("smtp", 2.0).deliver
    assert e is not None and e.message.queue_id == "SMALL", "preemption happened"
    busy.append(e)
    answer = explain(s, "BIG", 2.0)
    (pre,) = [r for r in answer["reasons"] if r["constraint"] == "preempted"]
    assert pre["preempted_by"] == "SMALL" and pre["setting"] == "smtp_delivery_slot_cost"
    assert explain(s, "SMALL", 2.0, busy=busy)["in_flight"] == 1


def test_policies_explain_themselves():
    s = Scheduler(lambda n: Params(destination_recipient_limit=1,
                                   destination_concurrency_limit=0,
                                   initial_destination_concurrency=100),
                  policies=PolicyTable(Finch), process_limit_for=lambda name: 12)
    s.assign(Message("BIG", 0.0), routes(30), now=0.0)
    while s.select("smtp", 0.0).deliver is not None:
        pass
    answer = explain(s, "BIG", 0.0)
    (r,) = [r for r in answer["reasons"] if r["constraint"] == "message concurrency"]
    # 12 workers: another while c < 10 or c < 10 * (12 - c), so it stops at 11.
    assert r["setting"] == "smtp_finch_scale_max_concurrency" and r["concurrency"] == 11
    z = Scheduler(lambda n: Params(destination_recipient_limit=1),
                  policies=PolicyTable(Zmailer), process_limit_for=lambda name: 1)
    z.assign(Message("A", 0.0), routes(2, "a.example"), now=0.0)
    z.assign(Message("B", 0.0), routes(2, "b.example"), now=0.0)
    assert z.select("smtp", 0.0).deliver is not None
    assert "thread waiting" in constraints(explain(z, "b.example", 0.0))
    assert "policy destination cap" in constraints(explain(z, "a.example", 0.0))


def test_unknown_targets_and_status_as_json():
    s = Scheduler(lambda n: Params())
    assert explain(s, "nowhere.example", 0.0)["kind"] == "unknown"
    s.assign(Message("Q1", 0.0), routes(3), now=0.0)
    snap = status(s, 0.0)
    json.dumps(snap)
    (t,) = snap["transports"]
    assert t["name"] == "smtp" and t["policy"] == "nqmgr" and t["queued_recipients"] == 3
    assert explain(s, "d.example", 0.0)["reasons"][0]["constraint"] == "none"


def test_a_blocker_with_two_destinations_is_one_reason():
    """Found on real Postfix: the policy was asked per destination and said it twice."""
    s = Scheduler(lambda n: Params(destination_concurrency_limit=1,
                                   initial_destination_concurrency=1,
                                   destination_recipient_limit=1))
    s.assign(Message("Q1", 0.0), routes(2, "a.example") + routes(2, "b.example"), now=0.0)
    s.assign(Message("Q2", 1.0), routes(1, "fast.example"), now=1.0)
    picked = [s.select("smtp", 1.0).deliver for _ in range(3)]
    assert [(e.message.queue_id, e.queue.name) for e in picked if e is not None] == [
        ("Q1", "a.example"), ("Q1", "b.example"), ("Q2", "fast.example")]
    answer = explain(s, "Q1", 1.0)
    assert constraints(answer).count("blocker job") == 1, answer["reasons"]
    assert sorted(r["destination"] for r in answer["reasons"]
                  if r["constraint"] == "window full") == ["a.example", "b.example"]
