"""Operator suspensions in the core: held mail stays in core, ends on time, every policy.

Each transition of the suspension state is driven directly: suspend (nothing goes
out, no agent is asked for), a delivery in flight finishing meanwhile, resume (mail
goes at once, the window it had), the TTL running out in tick, new queues made while
a suspension is in force, a transport suspended, retry reviving a dead destination.
"""

from __future__ import annotations

import pytest

from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.explain import explain, status
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.policy import PolicyTable
from pyqmgr.scheduler.queue import Dsn
from pyqmgr.scheduler.suspension import Suspension, Target, TargetError, parse_target
from pyqmgr.settings.policies import load
from tests.unit.params import Params

POLICIES = ["nqmgr", "oqmgr", "finch", "zmailer"]


def sched(policy: str = "nqmgr", **params: int) -> Scheduler:
    p = {"destination_recipient_limit": 1, "initial_destination_concurrency": 2, **params}
    return Scheduler(lambda n: Params(**p), policies=PolicyTable(load(policy)),
                     process_limit_for=lambda name: 10)


def routes(n: int, dest: str, transport: str = "smtp", start: int = 0) -> list[Route]:
    return [Route(transport, dest, dest, Recipient(i, f"r{i}@{dest}"))
            for i in range(start, start + n)]


def hold(target: Target, now: float = 0.0, ttl: float = 100.0) -> Suspension:
    return Suspension(target, "maintenance", "root", now, now + ttl, 1e9 + ttl)


def drain(s: Scheduler, now: float = 0.0) -> list[str]:
    """Select (and finish) everything deliverable now; the destinations served.

    Destinations of transports other than smtp are named ``transport:destination``.
    """
    got = []
    while (name := s.allocate()) is not None:
        e = s.select(name, now).deliver
        if e is None:
            continue
        got.append(e.queue.name if name == "smtp" else f"{name}:{e.queue.name}")
        s.done(e, 0, None, False, now)
    return got


@pytest.mark.parametrize("policy", POLICIES)
def test_a_suspended_destination_gets_no_agent_and_resumes_at_once(policy):
    s = sched(policy)
    s.assign(Message("Q1", 0.0), routes(3, "a.example") + routes(3, "b.example", start=3),
             now=0.0)
    s.suspend(hold(Target(None, "a.example")))
    assert drain(s) == ["b.example"] * 3
    a = s.transports["smtp"].queues["a.example"]
    assert len(a.todo) == 3 and a.busy_count == 0, "held mail stays in core"
    assert s.allocate() is None, "no agent is asked for on a held destination's account"
    assert s.resume(Target(None, "a.example")).resumed is not None
    assert drain(s) == ["a.example"] * 3
    assert not s.transports["smtp"].queues


@pytest.mark.parametrize("policy", POLICIES)
def test_the_ttl_ends_a_suspension_in_tick(policy):
    s = sched(policy)
    s.assign(Message("Q1", 0.0), routes(2, "a.example"), now=0.0)
    d = s.suspend(hold(Target(None, "a.example"), now=0.0, ttl=50.0))
    assert 50.0 in d.timers
    d = s.tick(49.9)
    assert drain(s, 49.9) == [] and not d.ended
    d = s.tick(50.0)
    assert [str(e.target) for e in d.ended] == ["destination a.example"]
    assert not s.suspensions
    assert drain(s, 50.0) == ["a.example"] * 2


def test_a_queue_made_while_suspended_is_held_too():
    """Idle queues are discarded; the next mail makes a new one, which must be held."""
    s = sched()
    s.suspend(hold(Target("smtp", "a.example")))
    s.assign(Message("Q1", 0.0), routes(1, "a.example") + routes(1, "b.example", start=1),
             now=0.0)
    s.assign(Message("Q2", 0.0), routes(1, "a.example", transport="relay"), now=0.0)
    assert sorted(drain(s)) == ["b.example", "relay:a.example"], (
        "other transports are not held")
    held = s.transports["smtp"].queues["a.example"]
    assert held.gate is not None and held.status == "held"


def test_a_delivery_in_flight_finishes_and_the_window_is_kept():
    s = sched(initial_destination_concurrency=3)
    s.assign(Message("Q1", 0.0), routes(5, "a.example"), now=0.0)
    e = s.select("smtp", 0.0).deliver
    assert e is not None
    s.suspend(hold(Target(None, "a.example")))
    s.done(e, 0, None, False, 1.0)
    q = s.transports["smtp"].queues["a.example"]
    window = q.window
    assert drain(s, 1.0) == [] and len(q.todo) == 4
    s.resume(Target(None, "a.example"))
    assert q.window == window
    assert drain(s, 2.0) == ["a.example"] * 4


def test_a_suspended_transport_gets_no_agents_and_a_pending_one_gets_nothing():
    s = sched()
    s.assign(Message("Q1", 0.0), routes(2, "a.example"), now=0.0)
    assert s.allocate() == "smtp"  # an agent is on its way
    s.suspend(hold(Target("smtp", None)))
    assert s.select("smtp", 0.0).deliver is None, "the agent that comes gets nothing"
    assert s.allocate() is None
    assert s.transports["smtp"].pending == 0
    s.resume(Target("smtp", None))
    assert drain(s) == ["a.example"] * 2


def test_a_transport_suspension_applies_to_a_transport_made_later():
    s = sched()
    s.suspend(hold(Target("relay", None)))
    s.assign(Message("Q1", 0.0), routes(1, "a.example", transport="relay"), now=0.0)
    assert s.allocate() is None


def test_nqmgr_jobs_held_only_by_suspended_destinations_resume_with_them():
    """The job becomes a blocker while its destination is held; resume unblocks it."""
    s = sched("nqmgr")
    s.assign(Message("Q1", 0.0), routes(2, "a.example"), now=0.0)
    s.assign(Message("Q2", 0.0), routes(2, "b.example"), now=0.0)
    s.suspend(hold(Target(None, "a.example")))
    assert drain(s) == ["b.example"] * 2
    s.resume(Target(None, "a.example"))
    assert drain(s) == ["a.example"] * 2


def test_resume_names_exactly_the_target_suspended():
    s = sched()
    s.suspend(hold(Target(None, "a.example")))
    assert s.resume(Target("smtp", "a.example")).resumed is None
    assert s.resume(Target(None, "a.example")).resumed is not None
    assert s.resume(Target(None, "a.example")).resumed is None


def test_retry_revives_a_dead_destination():
    s = sched(initial_destination_concurrency=1, failed_cohort_limit=1)
    s.assign(Message("Q1", 0.0), routes(1, "a.example"), now=0.0)
    e = s.select("smtp", 0.0).deliver
    assert e is not None
    s.done(e, 1, Dsn("4.4.1", "connect refused"), False, 0.0)
    q = s.transports["smtp"].queues["a.example"]
    assert q.throttled
    assert list(s.retry(Target(None, "a.example")).affected) == ["smtp:a.example"]
    assert "a.example" not in s.transports["smtp"].queues, "revived and idle: discarded"
    assert list(s.retry(Target(None, "a.example")).affected) == []


def test_explain_and_status_report_the_suspension():
    s = sched()
    s.assign(Message("Q1", 0.0), routes(2, "a.example"), now=0.0)
    s.suspend(Suspension(Target(None, "a.example"), "remote asked", "root(uid=0)",
                         0.0, 600.0, 2e9))
    (r,) = explain(s, "a.example", 10.0)["reasons"]
    assert r["constraint"] == "suspended" and r["setting"] == "pyqmgr suspend"
    assert r["by"] == "root(uid=0)" and r["ends_in"] == 590.0
    assert "remote asked" in r["text"]
    q1 = explain(s, "Q1", 10.0)["reasons"]
    assert [x["constraint"] for x in q1] == ["suspended"]
    st = status(s, 10.0)
    (dest,) = st["destinations"]
    assert dest["suspended"]["reason"] == "remote asked"
    assert st["suspensions"][0]["target"] == "destination a.example"


def test_explain_a_suspended_destination_with_nothing_in_core():
    s = sched()
    s.suspend(hold(Target(None, "quiet.example")))
    answer = explain(s, "quiet.example", 0.0)
    assert [r["constraint"] for r in answer["reasons"]] == ["suspended"]


@pytest.mark.parametrize(("text", "want"), [
    ("example.com", Target(None, "example.com")),
    ("Example.COM", Target(None, "example.com")),
    ("smtp", Target("smtp", None)),
    ("smtp:", Target("smtp", None)),
    ("smtp:Example.com", Target("smtp", "example.com")),
    ("relay:[10.0.0.1]:25", Target("relay", "[10.0.0.1]:25")),
    ("[10.0.0.1]:25", Target(None, "[10.0.0.1]:25")),
    ("nosuchservice", Target(None, "nosuchservice")),
])
def test_targets(text, want):
    assert parse_target(text, {"smtp", "relay"}) == want


@pytest.mark.parametrize("text", ["", "  ", ":example.com", "a b", "x\x01", "a" * 301])
def test_bad_targets(text):
    with pytest.raises(TargetError):
        parse_target(text, {"smtp"})
