"""Time passing costs the destinations due, not every destination in core
(``enable.enable_due`` and ``Transport.timed``): stock gives each dead or paused
queue a timer of its own; a walk over every queue at every tick would cost a
20,000-destination active queue 20,000 steps per timer."""

from __future__ import annotations

from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.queue import Dsn
from tests.unit.params import Params


class NoWalk(dict):
    """A transport's queues that may be looked up by name but not walked."""

    def values(self):
        raise AssertionError("every queue walked")

    def items(self):
        raise AssertionError("every queue walked")

    def __iter__(self):
        raise AssertionError("every queue walked")


def make() -> Scheduler:
    return Scheduler(lambda name: Params(initial_destination_concurrency=1,
                                         destination_recipient_limit=1),
                     min_backoff_time=300, transport_retry_time=60)


def mail(s: Scheduler, domain: str, n: int = 2, qid: str = "") -> None:
    s.assign(Message(qid or f"Q{domain}", 0.0),
             [Route("smtp", domain, domain, Recipient(i, f"u{i}@{domain}")) for i in range(n)])


def kill(s: Scheduler, now: float) -> str:
    e = s.select("smtp", now).deliver
    assert e is not None
    s.done(e, -1, Dsn("4.4.1", "connect refused"), False, now)
    return e.queue.name


def test_a_tick_walks_only_the_queues_due():
    s = make()
    for i in range(2000):
        mail(s, f"d{i}.example")
    t = s.transport("smtp")
    dead = [t.queues[kill(s, float(k))] for k in range(3)]
    assert all(q.throttled for q in dead)
    t.queues = NoWalk(t.queues)
    s.tick(300.0)
    # Revived, and idle (its mail went to the retry transport): out of the core.
    assert not dead[0].throttled and dead[0].name not in t.queues, "due at 300"
    assert dead[1].throttled and dead[2].throttled
    s.tick(302.0)
    assert not any(q.throttled for q in dead)
    assert len(t.timed) == 0 and len(t.queues) == 1997


def test_a_queue_gone_and_back_is_not_revived_by_the_old_ones_time():
    s = make()
    mail(s, "a.example", n=1)
    name = kill(s, 0.0)
    t = s.transport("smtp")
    old = t.queues[name]
    s.enable_all()  # the F trigger revives every dead destination now: the idle one goes
    assert name not in t.queues
    mail(s, "a.example", n=3, qid="Q2")
    kill(s, 100.0)
    new = t.queues[name]
    assert new is not old and new.revive_at == 400.0
    s.tick(300.0)
    assert new.throttled, "the old queue's time (300) is not the new one's (400)"
    s.tick(400.0)
    assert not new.throttled
