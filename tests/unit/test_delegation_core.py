"""Delivery policy delegation in the core: each answer as a transition on a Scheduler.

The daemon asks the policy service while the entry is selected; these check what the
core does with each answer: DEFER puts the entry back and gates the destination with a
``policy service`` gate that the gate heap reopens (the recipients stay in core, the
agent gets another destination's entry); REJECT with bounce moves the recipients to
the error transport with the reply's DSN; HOLD drops the message's waiting entries
without deferring them while a delivery under way finishes, then the message is
finished. Under every policy, with and without shaping.
"""

from __future__ import annotations

import pytest

from pyqmgr.scheduler.core import ERROR, Route, Scheduler
from pyqmgr.scheduler.explain import explain, status
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.policy import PolicyTable
from pyqmgr.scheduler.queue import Dsn
from pyqmgr.scheduler.shaping import Rate, Shaping
from pyqmgr.settings.policies import load
from tests.unit.params import Params

POLICIES = ["nqmgr", "oqmgr", "finch", "zmailer"]
SETTING = "delivery_policy_service"


def sched(policy: str = "nqmgr", shaping: Shaping | None = None, **params: int) -> Scheduler:
    p = {"destination_recipient_limit": 1, "initial_destination_concurrency": 5,
         "destination_concurrency_limit": 20, **params}
    return Scheduler(lambda n: Params(**p), policies=PolicyTable(load(policy)),
                     shaping_for=(lambda name: shaping) if shaping else None)


def routes(n: int, dest: str, start: int = 0) -> list[Route]:
    return [Route("smtp", dest, dest, Recipient(i, f"r{i}@{dest}"))
            for i in range(start, start + n)]


def take(s: Scheduler, now: float) -> list:
    got = []
    while s.allocate() is not None:
        e = s.select("smtp", now).deliver
        if e is not None:
            got.append(e)
    return got


@pytest.mark.parametrize("policy", POLICIES)
def test_defer_gates_the_destination_and_the_agent_gets_another(policy):
    s = sched(policy)
    m = Message("Q1", 0.0)
    s.assign(m, routes(3, "slow.example") + routes(2, "free.example", 10), now=0.0)
    assert s.allocate() == "smtp"
    first = s.select("smtp", 0.0).deliver
    assert first is not None
    held = first.queue
    other_name = "free.example" if held.name == "slow.example" else "slow.example"
    d = s.hold_back(first, 60.0, SETTING, f"{held.nexthop}: policy service replied 450", 0.0)
    assert not first.busy and held.busy_count == 0
    assert held.gate is not None and held.gate.kind == "policy service"
    assert held.gate.until == 60.0 and held.gate.setting == SETTING
    assert d.gate_timers == (60.0,)
    assert m.rcpt_count == 5 and m.refcount == 5, "nothing left core"
    assert not d.deferrals and not d.finished
    # The same agent asks again: another destination, never the gated one.
    again = s.reselect("smtp", 0.0).deliver
    assert again is not None and again.queue.name == other_name
    rest = take(s, 0.0)
    assert all(e.queue.name == other_name for e in rest)
    # Reopened by the heap: its entries go out.
    s.open_gates(60.0)
    assert held.gate is None
    got = take(s, 60.0)
    count = 3 if held.name == "slow.example" else 2
    count = min(count, s.transports["smtp"].dest_cap or count)  # zmailer: one at a time
    assert [e.queue.name for e in got] == [held.name] * count


def test_reselect_does_not_eat_another_agents_pending_count():
    s = sched()
    s.assign(Message("Q1", 0.0), routes(2, "a.example") + routes(2, "b.example", 5), now=0.0)
    assert s.allocate() == "smtp" and s.allocate() == "smtp"
    t = s.transports["smtp"]
    assert t.pending == 2
    e = s.select("smtp", 0.0).deliver
    assert t.pending == 1
    s.hold_back(e, 10.0, SETTING, "x", 0.0)
    s.reselect("smtp", 0.0)
    assert t.pending == 1, "the second agent is still pending"


def test_a_later_gate_in_force_is_kept():
    s = sched(shaping=Shaping(Rate(1, 100.0)))
    s.assign(Message("Q1", 0.0), routes(3, "d.example"), now=0.0)
    (e,) = take(s, 0.0)
    q = e.queue
    assert q.gate is not None and q.gate.kind == "rate" and q.gate.until == 100.0
    s.hold_back(e, 30.0, SETTING, "policy", 0.0)
    assert q.gate.kind == "rate" and q.gate.until == 100.0, "the longer gate stays"
    s.open_gates(100.0)
    assert q.gate is None
    (e,) = take(s, 100.0)
    s.hold_back(e, 500.0, SETTING, "policy", 100.0)
    assert q.gate.kind == "policy service" and q.gate.until == 500.0


def test_a_gate_outlives_an_idle_queue_without_shaping():
    s = sched()
    s.assign(Message("Q1", 0.0), routes(1, "d.example"), now=0.0)
    (e,) = take(s, 0.0)
    t = s.transports["smtp"]
    s.hold_back(e, 50.0, SETTING, "policy", 0.0)
    assert "d.example" in t.shapes and t.shaping is None
    # Another entry of the queue finishes and it empties: not possible while the
    # entry waits; it is still there, gated.
    assert t.queues["d.example"].todo.first() is e
    s.open_gates(50.0)
    (e2,) = take(s, 50.0)
    assert e2 is e
    s.done(e, 0, None, False, 51.0)
    assert "d.example" not in t.queues and "d.example" not in t.shapes, "neutral: gone"


def test_explain_and_status_show_the_policy_gate():
    s = sched()
    s.assign(Message("Q1", 0.0), routes(2, "d.example"), now=0.0)
    e = take(s, 0.0)[0]
    s.hold_back(e, 42.0, SETTING, "d.example: policy service inet:127.0.0.1:10040 "
                "replied \"450 4.7.1 too many\"", 2.0)
    reasons = explain(s, "d.example", 2.0)["reasons"]
    (r,) = [r for r in reasons if r["constraint"] == "policy service"]
    assert r["setting"] == SETTING and "too many" in r["text"] and r["opens_in"] == 40.0
    (d,) = status(s, 2.0)["destinations"]
    assert d["gate"] == {"kind": "policy service", "setting": SETTING, "opens_in": 40.0,
                         "text": "d.example: policy service inet:127.0.0.1:10040 replied "
                                 "\"450 4.7.1 too many\""}


def test_hold_back_on_a_transport_that_died_meanwhile_sends_it_to_retry():
    s = sched()
    m = Message("Q1", 0.0)
    s.assign(m, routes(3, "d.example"), now=0.0)
    a = take(s, 0.0)[0]
    # Another agent of the transport was unreachable while the service was asked.
    s.throttle_transport("smtp", Dsn("4.3.0", "mail transport unavailable"), 1.0)
    s.hold_back(a, 60.0, SETTING, "policy", 1.0)
    retry = s.transports["retry"]
    assert not a.queue.todo
    assert m.refcount == 3 and m.rcpt_count == 3, "nothing lost"
    assert sum(len(q.todo) for q in retry.queues.values()) == 1, "a went to retry"
    assert a.queue.busy_count == 2, "the other two are still out"


@pytest.mark.parametrize("policy", POLICIES)
def test_reject_moves_the_recipients_to_the_error_transport(policy):
    s = sched(policy)
    m = Message("Q1", 0.0)
    s.assign(m, routes(2, "d.example"), now=0.0)
    e = take(s, 0.0)[0]
    rcpts = list(e.recipients)
    assert s.reject_to_error(e, Dsn("5.7.1", "no mail for you"), 0.0).rejected
    err = s.transports[ERROR]
    (eq,) = err.queues.values()
    assert eq.nexthop == "5.7.1 no mail for you"
    assert eq.todo.first().recipients == rcpts
    assert m.refcount == 2 and m.rcpt_count == 2
    assert s.allocate() == ERROR
    assert s.select(ERROR, 0.0).deliver.recipients == rcpts


def test_reject_with_the_error_transport_dead_leaves_the_entry_queued():
    s = sched()
    s.assign(Message("Q1", 0.0), routes(1, "d.example"), now=0.0)
    (e,) = take(s, 0.0)
    s.throttle_transport(ERROR, Dsn("4.3.0", "mail transport unavailable"), 0.0)
    assert not s.reject_to_error(e, Dsn("5.7.1", "no"), 0.0).rejected
    assert e.busy, "still selected: the caller holds it back"
    s.hold_back(e, 60.0, SETTING, "error transport unavailable", 0.0)
    assert e.queue.todo.first() is e and e.queue.gate is not None


@pytest.mark.parametrize("policy", POLICIES)
def test_hold_drops_waiting_entries_and_finishes_after_the_one_under_way(policy):
    s = sched(policy)
    m = Message("Q1", 0.0, more=True)
    other = Message("Q2", 0.0)
    s.assign(m, routes(4, "a.example") + routes(3, "b.example", 10), now=0.0)
    s.assign(other, routes(2, "a.example", 20), now=0.0)
    under_way = s.select("smtp", 0.0).deliver if s.allocate() else None
    asked = s.select("smtp", 0.0).deliver if s.allocate() else None
    assert under_way is not None and asked is not None
    if asked.message is not m:
        pytest.skip(f"{policy} chose another message second")
    d = s.drop_message(asked, 1.0)
    finished = list(d.finished)
    assert m.more is False, "no more recipients are read"
    assert not d.deferrals and not m.deferred
    left = [e for t in s.transports.values() for q in t.queues.values() for e in q.todo]
    assert all(e.message is other for e in left), left
    assert len(left) == 2 or (under_way.message is other and len(left) == 1)
    if under_way.message is m:
        assert m.refcount == 1 and not finished
        finished += s.done(under_way, 0, None, False, 2.0).finished
    assert finished == [m]
    assert m.rcpt_count == 0


def test_hold_walks_only_the_messages_own_peers_under_nqmgr():
    s = sched()
    m = Message("Q1", 0.0)
    s.assign(m, routes(3, "a.example"), now=0.0)
    for k in range(50):
        s.assign(Message(f"O{k}", 0.0), routes(1, f"d{k}.example", 100 + k), now=0.0)
    e = s.select("smtp", 0.0).deliver if s.allocate() else None
    assert e is not None and e.message is m
    assert s.drop_message(e, 0.0).finished == (m,)
    assert sum(len(q.todo) for q in s.transports["smtp"].queues.values()) == 50


@pytest.mark.parametrize("policy", POLICIES)
def test_a_fleet_hold_lifts_early_and_only_its_own_kind(policy):
    """The fleet holds a destination back with a gate of its own kind; a session given
    back lifts that gate before its time, and lifting leaves another kind's gate."""
    s = sched(policy)
    s.assign(Message("Q1", 0.0), routes(3, "busy.example"), now=0.0)
    assert s.allocate() == "smtp"
    first = s.select("smtp", 0.0).deliver
    assert first is not None
    queue = first.queue
    s.hold_back(first, 1.0, "fleet_destination_concurrency_limit", "full", 0.0, "fleet")
    assert queue.gate is not None and queue.gate.kind == "fleet" and queue.status == "held"
    assert take(s, 0.1) == []
    s.lift_hold("smtp", "busy.example", "policy service", 0.2)
    assert queue.gate is not None, "another kind's lift leaves the fleet's gate"
    s.lift_hold("smtp", "busy.example", "fleet", 0.3)
    assert queue.gate is None and queue.status == "ready"
    assert take(s, 0.3), "the destination delivers again"
    # Nothing to lift: no error.
    s.lift_hold("smtp", "gone.example", "fleet", 0.4)
    s.lift_hold("relay", "busy.example", "fleet", 0.4)
