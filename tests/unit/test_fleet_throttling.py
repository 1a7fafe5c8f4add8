"""A fleet's shared throttling in the core: told by one scheduler, applied by another.

Two Schedulers stand for two servers of a fleet. What one finds (a dead site, a
response rule's cut) comes out of its event as ``throttled`` decisions while it
shares throttling, and only then; the other applies it with ``learnt`` as if it had
seen it, says who saw what, and recovers by its own timers and deliveries.
"""

from __future__ import annotations

import pytest

from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.decisions import DEAD, RULE, Throttling
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.policy import PolicyTable
from pyqmgr.scheduler.queue import Dsn
from pyqmgr.scheduler.shaping import Shaping, parse_rules
from pyqmgr.settings.policies import load
from tests.unit.params import Params

TOO_MANY = Dsn("4.7.0", "host mx[192.0.2.1] said: 421 4.7.0 too many connections")
REFUSED = Dsn("4.4.1", "connect to mx[192.0.2.1]:25: Connection refused")
RULES = tuple(parse_rules("/too many connections/ throttle window=0.5 quiet=30s\n"
                          "/\\[TS01\\]/ throttle suspend=10m\n", "rules"))


def server(shaping: Shaping | None = None, share: bool = True, **params: int) -> Scheduler:
    p = {"destination_recipient_limit": 1, "initial_destination_concurrency": 4,
         "destination_concurrency_limit": 20, "failed_cohort_limit": 1, **params}
    s = Scheduler(lambda n: Params(**p), policies=PolicyTable(load("nqmgr")),
                  shaping_for=lambda name: shaping, min_backoff_time=300)
    s.share_throttling = share
    return s


def mail(s: Scheduler, n: int, now: float = 0.0, dest: str = "d.example") -> None:
    s.assign(Message(f"Q{now}{dest}", now),
             [Route("smtp", dest, dest, Recipient(i, f"r{i}@{dest}")) for i in range(n)],
             now=now)


def starts(s: Scheduler, now: float) -> list:
    got = []
    while s.allocate() is not None:
        d = s.select("smtp", now)
        if d.deliver is not None:
            got.append(d.deliver)
    return got


def dies() -> Scheduler:
    """A server whose one delivery at a time kills the site at its first failure."""
    return server(initial_destination_concurrency=1)


def test_a_site_that_dies_here_is_news_for_the_fleet():
    a = dies()
    mail(a, 3)
    e = starts(a, 0.0)[0]
    d = a.done(e, 1, REFUSED, False, 1.0)
    assert d.throttled == (Throttling("smtp", "d.example", "d.example", DEAD, "4.4.1",
                                      REFUSED.reason, 300),)


def test_without_sharing_there_is_no_news():
    a = server(share=False, initial_destination_concurrency=1)
    mail(a, 3)
    e = starts(a, 0.0)[0]
    assert a.done(e, 1, REFUSED, False, 1.0).throttled == ()
    assert a.transports["smtp"].queues["d.example"].throttled, "dead here all the same"


def test_a_dead_site_seen_elsewhere_is_dead_here_and_its_mail_waits():
    a, b = dies(), server()
    mail(a, 3)
    (news,) = a.done(starts(a, 0.0)[0], 1, REFUSED, False, 1.0).throttled
    mail(b, 5, now=1.0)
    assert len(starts(b, 1.0)) == 4, "b delivers to the site until it hears"
    d = b.learnt(news, "relay1", 1.5)
    q = b.transports["smtp"].queues["d.example"]
    assert q.throttled and q.dsn is not None and q.dsn.status == "4.4.1"
    assert q.dsn.reason == "delivery temporarily suspended: " + REFUSED.reason
    assert q.todo.size == 0, "the waiting entry went to the retry transport"
    retry = b.transports["retry"].queues
    assert sum(x.todo.size for x in retry.values()) == 1
    assert d.timers == (301.5,)
    (text,) = [t for _, t in d.log]
    assert text == (f"fleet: d.example (smtp): \"4.4.1 {REFUSED.reason}\" seen by relay1: "
                    "dead here too for 5m (1 waiting deferred)")
    assert d.throttled == (), "news heard is not told again"
    # New mail for it waits too, and a timer revives it as one of its own would.
    mail(b, 1, now=2.0, dest="d.example")
    assert starts(b, 2.0) == []
    b.tick(301.5)
    assert not q.throttled


def test_a_delivery_that_succeeds_here_revives_a_site_the_fleet_called_dead():
    a, b = dies(), server()
    mail(a, 3)
    (news,) = a.done(starts(a, 0.0)[0], 1, REFUSED, False, 1.0).throttled
    mail(b, 2, now=1.0)
    out = starts(b, 1.0)
    b.learnt(news, "relay1", 1.5)
    q = b.transports["smtp"].queues["d.example"]
    assert q.throttled
    b.done(out[0], 0, None, False, 2.0)
    assert not q.throttled, "stock revives a dead site on a success; so does the fleet's"


def test_news_of_a_site_with_no_mail_here_holds_for_new_mail_without_a_queue():
    """News routes nothing: it makes no queue (one made from a notice once carried the
    notice's nexthop to the next mail for its destination), and holds when this
    server's own routing makes the queue."""
    a, b = dies(), server()
    mail(a, 3)
    (news,) = a.done(starts(a, 0.0)[0], 1, REFUSED, False, 1.0).throttled
    mail(b, 1, now=1.0, dest="other.example")
    d = b.learnt(news, "relay1", 1.0)
    assert "d.example" not in b.transports["smtp"].queues
    assert d.log == (("info", f"fleet: d.example (smtp): \"4.4.1 {REFUSED.reason}\" seen "
                              "by relay1: no mail here for it yet: holds for mail that "
                              "comes within 5m"),)
    mail(b, 2, now=5.0)
    q = b.transports["smtp"].queues["d.example"]
    assert q.throttled and q.revive_at == 301.0, "what remains of the backoff"
    assert all(e.queue.name != "d.example" for e in starts(b, 5.0))
    assert sum(x.todo.size for x in b.transports["retry"].queues.values()) >= 2


def test_news_that_lapsed_before_mail_came_holds_nothing():
    b = server()
    news = Throttling("smtp", "d.example", "d.example", DEAD, "4.4.1", "refused", 30)
    b.learnt(news, "relay1", 0.0)
    mail(b, 2, now=31.0)
    assert not b.transports["smtp"].queues["d.example"].throttled
    assert b.fleet_heard == {}


def test_news_for_a_transport_with_no_mail_here_makes_no_transport():
    b = server()
    news = Throttling("relay", "d.example", "d.example", DEAD, "4.4.1", "refused", 300)
    d = b.learnt(news, "relay1", 0.0)
    assert "relay" not in b.transports
    assert d.log == (("info", "fleet: d.example (relay): \"4.4.1 refused\" seen by relay1: "
                              "no mail here for it yet: holds for mail that comes within "
                              "5m"),)


def test_news_kept_is_bounded(monkeypatch):
    from pyqmgr.scheduler import throttling

    monkeypatch.setattr(throttling, "MAX_HEARD", 100)
    b = server()
    for i in range(1000):
        b.learnt(Throttling("smtp", f"d{i}.example", f"d{i}.example", DEAD, "4.4.1", "r",
                            300), "relay1", i / 100)
    assert len(b.fleet_heard) == 100
    assert ("smtp", "d999.example") in b.fleet_heard


@pytest.mark.parametrize("kind", [DEAD, RULE])
def test_news_naming_another_nexthop_for_a_queue_changes_nothing(kind):
    """A notice that names a destination's queue with somebody else's nexthop neither
    reroutes its mail nor throttles it."""
    b = server(Shaping(rules=RULES))
    mail(b, 3, now=0.0, dest="victim.example")
    q = b.transports["smtp"].queues["victim.example"]
    news = Throttling("smtp", "victim.example", "[192.0.2.66]:25", kind, "4.7.0",
                      TOO_MANY.reason, 300 if kind == DEAD else 0,
                      "" if kind == DEAD else "rules, line 1")
    d = b.learnt(news, "relay1", 0.5)
    assert d.log == (("warning", f"fleet: [192.0.2.66]:25 (smtp): \"4.7.0 {TOO_MANY.reason}"
                                 "\" seen by relay1: this server routes victim.example to "
                                 "victim.example, not [192.0.2.66]:25: ignored"),)
    assert q.nexthop == "victim.example" and not q.throttled and q.cap == 0
    mail(b, 2, now=1.0, dest="victim.example")
    out = starts(b, 1.0)
    assert len(out) == 4 and {e.queue.nexthop for e in out} == {"victim.example"}


@pytest.mark.parametrize("kind", [DEAD, RULE])
def test_news_kept_for_a_queue_routed_elsewhere_changes_nothing(kind):
    """The forged notice of issue #31 sent before any mail for the victim: the queue
    the mail makes has this server's nexthop, and the news does not hold."""
    b = server(Shaping(rules=RULES))
    news = Throttling("smtp", "victim.example", "[192.0.2.66]:25", kind, "4.7.0",
                      TOO_MANY.reason, 300 if kind == DEAD else 0,
                      "" if kind == DEAD else "rules, line 1")
    b.learnt(news, "relay1", 0.0)
    d = b.assign(Message("Q1", 1.0), [Route("smtp", "victim.example", "victim.example",
                                            Recipient(i, f"r{i}@victim.example"))
                                      for i in range(5)], now=1.0)
    assert d.log == (("warning", f"fleet: [192.0.2.66]:25 (smtp): \"4.7.0 {TOO_MANY.reason}"
                                 "\" seen by relay1: this server routes victim.example to "
                                 "victim.example, not [192.0.2.66]:25: ignored"),)
    q = b.transports["smtp"].queues["victim.example"]
    assert q.nexthop == "victim.example" and not q.throttled and q.cap == 0
    out = starts(b, 1.0)
    assert len(out) == 4 and {e.queue.nexthop for e in out} == {"victim.example"}
    assert b.fleet_heard == {}


def test_a_rule_that_fires_here_is_news_and_cuts_there_from_its_own_flight():
    a, b = server(Shaping(rules=RULES)), server(Shaping(rules=RULES))
    mail(a, 10)
    out = starts(a, 0.0)
    d = a.done(out[0], 1, TOO_MANY, False, 1.0)
    (news,) = d.throttled
    assert news == Throttling("smtp", "d.example", "d.example", RULE, "4.7.0",
                              TOO_MANY.reason, rule="rules, line 1")
    mail(b, 10)
    assert len(starts(b, 0.0)) == 4
    d = b.learnt(news, "relay1", 1.2)
    q = b.transports["smtp"].queues["d.example"]
    assert q.cap == 2, "0.5 x the 4 in flight here"
    (text,) = [t for _, t in d.log]
    assert text == (f"shaping: d.example (smtp): throttling reply \"4.7.0 {TOO_MANY.reason}\""
                    " seen by relay1 (fleet) matched rules, line 1: window capped at 2 "
                    "(4 in flight)")
    # It steps back up by its own quiet interval.
    b.open_gates(31.2)
    assert q.cap == 3


def test_a_backoff_rule_holds_there_too():
    a, b = server(Shaping(rules=RULES)), server(Shaping(rules=RULES))
    mail(a, 3)
    held = Dsn("4.7.0", "[TS01] Messages temporarily deferred")
    (news,) = a.done(starts(a, 0.0)[0], 1, held, False, 1.0).throttled
    mail(b, 3)
    b.learnt(news, "relay1", 1.0)
    q = b.transports["smtp"].queues["d.example"]
    assert q.gate is not None and q.gate.kind == "backoff" and q.gate.until == 601.0
    assert starts(b, 2.0) == []


def test_a_cut_made_here_a_moment_ago_is_not_made_twice():
    a, b = server(Shaping(rules=RULES)), server(Shaping(rules=RULES))
    mail(a, 10)
    (news,) = a.done(starts(a, 0.0)[0], 1, TOO_MANY, False, 1.0).throttled
    mail(b, 10)
    out = starts(b, 0.0)
    b.done(out[0], 1, TOO_MANY, False, 1.0)
    q = b.transports["smtp"].queues["d.example"]
    cap = q.cap
    d = b.learnt(news, "relay1", 1.3)
    assert q.cap == cap
    assert d.log[0][1].endswith("matched rules, line 1: cut here already")


def test_a_rule_this_server_lacks_is_a_warning():
    b = server(Shaping(rules=RULES))
    mail(b, 2)
    news = Throttling("smtp", "d.example", "d.example", RULE, "4.7.0", "x", rule="other:9")
    d = b.learnt(news, "relay1", 1.0)
    assert d.log[0][0] == "warning" and "does not have: ignored" in d.log[0][1]
    assert b.transports["smtp"].queues["d.example"].cap == 0
