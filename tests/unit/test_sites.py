"""Provider sites in the core (issue #33): each transition on a Scheduler, per policy.

A site caps the deliveries in flight of its member destinations together; a full
site gates every member until one delivery ends; a domain whose site is not known
yet counts as a site of its own while the core asks for a lookup; a lookup's answer
moves the domain's queues, deliveries in flight and all. With sites off nothing of
it exists (``Queue.site`` is None everywhere).
"""

from __future__ import annotations

import math

import pytest

from pyqmgr.control.render import status_lines
from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.explain import explain, status
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.policy import PolicyTable
from pyqmgr.scheduler.queue import Dsn
from pyqmgr.scheduler.shaping import Rate, Shaping, parse_rules
from pyqmgr.scheduler.site import QUIT_GRACE
from pyqmgr.scheduler.structures import MAX_KNOWN, SiteLimits, SiteTable, site_domain
from pyqmgr.scheduler.suspension import Suspension, Target, TargetError, parse_target
from pyqmgr.settings.policies import load
from pyqmgr.site_names import load_providers, replied_from_site
from tests.unit.params import Params

POLICIES = ["nqmgr", "oqmgr", "finch", "zmailer"]
LIMITS = SiteLimits(2, "smtp_site_concurrency_limit")


def sched(policy: str = "nqmgr", limit: int = 2, pinned: dict[str, str] | None = None,
          transports: tuple[str, ...] = ("smtp",), **params: int) -> Scheduler:
    p = {"destination_recipient_limit": 1, "initial_destination_concurrency": 5,
         "destination_concurrency_limit": 20, **params}
    limits = SiteLimits(limit, "smtp_site_concurrency_limit")
    table = SiteTable(lambda t: limits if t in transports else None, pinned=pinned,
                      skip=frozenset({"relay.example"}))
    return Scheduler(lambda n: Params(**p), policies=PolicyTable(load(policy)), sites=table)


def mail(s: Scheduler, dest: str, n: int, qid: str | None = None, transport: str = "smtp"):
    m = Message(qid or f"Q{dest}", 0.0)
    d = s.assign(m, [Route(transport, dest, dest, Recipient(i, f"r{i}@{dest}"))
                     for i in range(n)])
    return m, d


def done(s: Scheduler, entry, status: int, dsn, crashed: bool, now: float):
    """A delivery ends, then its QUIT grace passes (a full site counts it that much
    longer: site.QUIT_GRACE); the decisions of the end itself."""
    d = s.done(entry, status, dsn, crashed, now)
    s.tick(now + QUIT_GRACE)
    return d


def drain(s: Scheduler, now: float = 1.0) -> list:
    """Every entry agents get now (each select is one agent)."""
    out = []
    while (e := s.select("smtp", now).deliver) is not None:
        out.append(e)
    return out


@pytest.mark.parametrize("policy", POLICIES)
def test_a_full_site_gates_every_member_until_a_delivery_ends(policy):
    s = sched(policy, pinned={"a.example": "g", "b.example": "g", "c.example": "g"})
    for d in ("a.example", "b.example", "c.example"):
        mail(s, d, 5)
    first = drain(s)
    assert len(first) == 2, "the site takes two at once, whatever the windows say"
    t = s.transport("smtp")
    site = t.queues["a.example"].site
    assert site is not None and site.busy == 2 and site.full
    assert all(q.gate is site.gate and q.status == "held" for q in t.queues.values())
    assert site.gate is not None and site.gate.kind == "site"
    assert site.gate.text == "site g holds 2 of 2 sessions"
    assert not s.has_work("smtp"), "no agent is asked for while the site is full"
    d = s.done(first[0], 0, None, False, 2.0)
    assert site.gate is not None and site.busy == 2, "its QUIT may not have arrived yet"
    assert 2.0 + QUIT_GRACE in d.timers
    s.tick(2.0 + QUIT_GRACE)
    assert site.gate is None and all(q.gate is None for q in t.queues.values())
    assert len(drain(s, 2.0)) == 1
    assert site.busy == 2


def test_a_site_with_a_limit_of_its_own():
    """site_concurrency_limit_maps: google takes 3 at once, microsoft 1, the rest the
    transport's 2; explain names the table's entry."""
    limits = SiteLimits(2, "smtp_site_concurrency_limit")
    table = SiteTable(lambda t: limits, pinned={"a.example": "google", "b.example": "google",
                                                "c.example": "microsoft",
                                                "d.example": "other"},
                      own_limits={"google": 3, "microsoft": 1})
    s = Scheduler(lambda n: Params(destination_recipient_limit=1,
                                   initial_destination_concurrency=5), sites=table)
    for d in ("a.example", "b.example", "c.example", "d.example"):
        mail(s, d, 5)
    drain(s)
    t = s.transport("smtp")
    busy = {name: site.busy for (_, name), site in table.sites.items()}
    assert busy == {"google": 3, "microsoft": 1, "other": 2}, busy
    site = t.queues["c.example"].site
    assert site is not None and site.limit == 1
    assert site.setting == "site_concurrency_limit_maps (microsoft) in pyqmgr.cf"
    assert t.queues["d.example"].site.setting == "smtp_site_concurrency_limit"


@pytest.mark.parametrize("policy", POLICIES)
def test_without_sites_nothing_changes(policy):
    s = Scheduler(lambda n: Params(destination_recipient_limit=1),
                  policies=PolicyTable(load(policy)))
    for d in ("a.example", "b.example"):
        mail(s, d, 5)
    assert drain(s)
    assert s.sites is None
    assert all(q.site is None for q in s.transport("smtp").queues.values())


def test_an_unknown_domain_is_its_own_site_and_is_asked_once():
    s = sched()
    _, d = mail(s, "a.example", 3)
    assert d.resolve == ("a.example",)
    _, d = mail(s, "a.example", 1, qid="Q2")
    assert d.resolve == (), "asked once until answered"
    site = s.transport("smtp").queues["a.example"].site
    assert site is not None and site.name == "a.example"
    assert len(drain(s)) == 2


def test_an_answer_moves_the_domains_queues_with_their_deliveries():
    s = sched(pinned={"b.example": "google"})
    mail(s, "a.example", 4)
    mail(s, "b.example", 4)
    got = drain(s)
    assert len(got) == 4, "two sites of two"
    t = s.transport("smtp")
    qa, qb = t.queues["a.example"], t.queues["b.example"]
    assert qa.site is not None and qa.site.name == "a.example" and qa.site.full
    d = s.site_learnt("a.example", "google", 3600.0, 1.0)
    assert d == d._replace(resolve=()), d
    assert qa.site is qb.site and qa.site is not None
    google = qa.site
    assert google.busy == 4 and google.full and qa.gate is google.gate
    assert s.sites is not None and ("smtp", "a.example") not in s.sites.sites, \
        "the empty site is gone"
    # Two deliveries must end before the site (limit 2) has room again.
    done(s, got[0], 0, None, False, 2.0)
    assert google.gate is not None and drain(s, 2.0) == []
    done(s, got[1], 0, None, False, 2.0)
    done(s, got[2], 0, None, False, 2.0)
    assert google.gate is None and len(drain(s, 2.0)) == 1


def test_a_stale_answer_is_asked_again_and_used_meanwhile():
    s = sched()
    mail(s, "a.example", 1)
    s.site_learnt("a.example", "google", 10.0, 1.0)
    e = drain(s)[0]
    done(s, e, 0, None, False, 5.0)
    assert "a.example" not in s.transport("smtp").queues, "the idle queue went"
    m = Message("Q9", 0.0)
    d = s.assign(m, [Route("smtp", "a.example", "a.example", Recipient(0, "r@a.example"))],
                 now=11.0)
    assert d.resolve == ("a.example",)
    site = s.transport("smtp").queues["a.example"].site
    assert site is not None and site.name == "google"


def test_what_is_not_grouped():
    s = sched(transports=("smtp",))
    for nexthop in ("[192.0.2.1]", "[mx.example]:2525", "relay.example"):
        m = Message(f"Q{nexthop}", 0.0)
        d = s.assign(m, [Route("smtp", nexthop, nexthop, Recipient(0, "r@x.example"))])
        assert d.resolve == ()
        assert s.transport("smtp").queues[nexthop].site is None
    _, d = mail(s, "a.example", 1, transport="local")
    assert d.resolve == () and s.transport("local").queues["a.example"].site is None


@pytest.mark.parametrize(("nexthop", "domain"), [
    ("Example.COM", "example.com"), ("example.com.", "example.com"),
    ("example.com:2525", "example.com"), ("[example.com]", None), ("[::1]:25", None),
    ("example.com:smtp", None), ("", None), ("a:b:c", None)])
def test_site_domain(nexthop, domain):
    assert site_domain(nexthop) == domain


def test_a_send_failure_gives_the_site_its_slot_back():
    s = sched(pinned={"a.example": "g", "b.example": "g"})
    mail(s, "a.example", 3)
    mail(s, "b.example", 3)
    got = drain(s)
    site = got[0].queue.site
    assert site is not None and site.full
    s.send_failed(got[0], Dsn("4.3.0", "agent gone"), 1.0)
    assert site.busy == 1 and site.gate is None


def test_a_dead_member_does_not_take_the_site_with_it():
    s = sched(pinned={"a.example": "g", "b.example": "g"}, initial_destination_concurrency=1)
    mail(s, "a.example", 3)
    mail(s, "b.example", 3)
    got = drain(s)
    assert len(got) == 2
    dead = next(e for e in got if e.queue.name == "a.example")
    done(s, dead, 1, Dsn("4.4.1", "connect refused"), False, 2.0)
    t = s.transport("smtp")
    assert "a.example" in t.queues and t.queues["a.example"].status == "dead"
    assert t.queues["b.example"].status == "ready"
    site = t.queues["b.example"].site
    assert site is not None and site.busy == 1 and site.gate is None
    done(s, next(e for e in got if e.queue.name == "b.example"), 0, None, False, 3.0)
    assert [e.queue.name for e in drain(s, 3.0)] == ["b.example"] * 2


def test_a_suspended_member_stays_suspended_when_its_site_opens():
    s = sched(pinned={"a.example": "g", "b.example": "g"})
    mail(s, "a.example", 3)
    mail(s, "b.example", 3)
    got = drain(s)
    s.suspend(Suspension(Target(None, "b.example"), "maintenance", "root", 1.0, 100.0,
                         1e9))
    for e in got:
        done(s, e, 0, None, False, 2.0)
    t = s.transport("smtp")
    assert t.queues["b.example"].status == "held"
    assert t.queues["a.example"].gate is None
    assert {e.queue.name for e in drain(s, 2.0)} == {"a.example"}


def test_an_agent_is_asked_for_only_as_far_as_the_site_has_room():
    s = sched(limit=1, pinned={"a.example": "g"})
    mail(s, "a.example", 5)
    t = s.transport("smtp")
    q = t.queues["a.example"]
    assert t.room(q) == 1, "the window has 5, the site 1"
    assert s.allocate() == "smtp" and s.allocate() is None


def test_known_answers_are_bounded():
    table = SiteTable(lambda t: LIMITS)
    for i in range(MAX_KNOWN + 10):
        table.learn(f"d{i}.example", "g", math.inf)
    assert len(table.known) == MAX_KNOWN and "d0.example" not in table.known


def waiting_sched(**kw: int) -> Scheduler:
    table = SiteTable(lambda t: LIMITS if t == "smtp" else None, wait=0.2)
    p = {"destination_recipient_limit": 1, **kw}
    return Scheduler(lambda n: Params(**p), sites=table)


def test_a_new_domain_waits_for_its_first_lookup_until_the_answer():
    s = waiting_sched()
    _, d = mail(s, "a.example", 3)
    assert d.resolve == ("a.example",) and d.timers == (0.2,)
    q = s.transport("smtp").queues["a.example"]
    assert q.status == "held" and q.gate is not None and q.gate.kind == "site lookup"
    assert drain(s, 0.05) == [] and not s.has_work("smtp")
    mail(s, "a.example", 1, qid="Q2")
    assert q.gate is not None, "more mail for it waits too"
    s.site_learnt("a.example", "google", 3600.0, 0.05)
    assert q.site is not None and q.site.name == "google" and q.gate is None
    assert len(drain(s, 0.05)) == 2, "then the site's limit"


def test_an_answered_new_domains_own_site_goes_at_once():
    """The site made only to hold a new domain for its lookup goes with the answer,
    not at its wait's end: nothing of it is left for a tick to open and drop, and its
    policy hears of no site opening (issue #44: the cost of a new domain)."""
    s = waiting_sched()
    mail(s, "a.example", 1)
    table = s.sites
    assert table is not None and ("smtp", "a.example") in table.sites
    opened: list[object] = []
    policy = s.transport("smtp").policy
    real = policy.site_opened
    policy.site_opened = lambda site: (opened.append(site.name), real(site))  # type: ignore[method-assign]
    s.site_learnt("a.example", "google", 3600.0, 0.05)
    assert ("smtp", "a.example") not in table.sites and set(table.due) == set()
    s.tick(0.3)
    assert "a.example" not in opened and [k for k in table.sites] == [("smtp", "google")]


def test_a_burst_of_new_domains_asks_for_a_wake_up_per_50_ms_not_each():
    """Each new domain's wait ends on the 50 ms grid (site.wait_end): 100 domains
    seen a millisecond apart ask for three deadlines, each at most 50 ms past its
    own 200 ms, never before it."""
    s = waiting_sched()
    asked: set[float] = set()
    for i in range(100):
        now = 1.0 + i * 0.001
        m = Message(f"Q{i}", now)
        d = s.assign(m, [Route("smtp", f"n{i}.example", f"n{i}.example",
                               Recipient(0, f"r@n{i}.example"))], now=now)
        assert len(d.timers) == 1 and now + 0.2 <= d.timers[0] < now + 0.25 + 1e-9
        asked.update(d.timers)
    assert len(asked) == 3, sorted(asked)


def test_a_slow_lookup_lets_the_mail_go_at_the_domains_own_site():
    s = waiting_sched()
    mail(s, "a.example", 3)
    q = s.transport("smtp").queues["a.example"]
    s.tick(0.1)
    assert q.gate is not None
    s.tick(0.2)
    assert q.gate is None and len(drain(s, 0.2)) == 2
    assert s.sites is not None and not s.sites.due
    s.site_learnt("a.example", "google", 3600.0, 0.5)
    assert q.site is not None and q.site.name == "google" and q.site.busy == 2


def test_a_lookup_waiting_its_turn_holds_its_domain_then_waits_from_its_query():
    s = waiting_sched()
    mail(s, "a.example", 3)
    q = s.transport("smtp").queues["a.example"]
    s.site_lookup_waits(("a.example",), 5.0, 0.01)  # queued: up to its timeout
    d = s.tick(0.3)
    assert q.gate is not None and q.gate.until == 5.0, "held past site_dns_wait"
    assert d.timers == (5.0,), "the tick at 0.2 found it held on: due again then"
    d = s.site_lookup_waits(("A.example",), 1.3, 1.1)  # its query goes at 1.1
    assert d.timers == (1.3,) and q.gate is not None and q.gate.until == 1.3
    s.tick(1.2)
    assert q.gate is not None
    s.tick(1.3)
    assert q.gate is None and len(drain(s, 1.3)) == 2, "its wait from the query ran out"


def test_a_lapsed_or_answered_wait_is_not_held_again():
    s = waiting_sched()
    mail(s, "a.example", 3)
    mail(s, "b.example", 1, qid="Q2")
    s.tick(0.2)
    q = s.transport("smtp").queues["a.example"]
    assert q.gate is None
    assert s.site_lookup_waits(("a.example",), 5.0, 0.3).timers == ()
    assert q.gate is None, "its mail already went at its own site"
    s.site_learnt("b.example", "google", 3600.0, 0.3)
    assert s.site_lookup_waits(("b.example", "c.example"), 5.0, 0.3).timers == ()


def test_a_failed_lookup_ends_the_wait_at_once():
    s = waiting_sched()
    mail(s, "a.example", 3)
    s.site_learnt("a.example", "a.example", 300.0, 0.01)
    q = s.transport("smtp").queues["a.example"]
    assert q.gate is None and len(drain(s, 0.01)) == 2
    assert s.sites is not None and not s.sites.due


def test_a_known_domain_does_not_wait_again():
    s = waiting_sched()
    mail(s, "a.example", 1)
    s.site_learnt("a.example", "google", 10.0, 0.0)
    e = drain(s, 0.0)[0]
    done(s, e, 0, None, False, 1.0)
    _, d = mail(s, "a.example", 1, qid="Q3")
    q = s.transport("smtp").queues["a.example"]
    assert d.resolve == () and q.gate is None and q.site is not None
    assert q.site.name == "google"


RATE_REPLY = Dsn("4.7.28", "host mx[192.0.2.1] said: 421 4.7.28 Our system has detected an "
                           "unusual rate of mail from your IP address")
SITE_RULES = """
/4\\.7\\.28/        throttle window=0.5 quiet=30s step=1 ttl=5m
/\\[TS01\\]/        throttle suspend=60s quiet=30s ttl=5m
/\\[TSS04\\]/       throttle rate=0.5 quiet=30s ttl=5m
"""


def throttling_sched(limit: int = 8, rate: Rate | None = None) -> Scheduler:
    rules = parse_rules(SITE_RULES, "rules")
    table = SiteTable(lambda t: SiteLimits(limit, "site_concurrency_limit in pyqmgr.cf",
                                           Shaping(rate=rate))
                      if t == "smtp" else None,
                      pinned={f"d{i}.example": "g" for i in range(4)})
    return Scheduler(lambda n: Params(destination_recipient_limit=1,
                                      initial_destination_concurrency=5),
                     sites=table, shaping_for=lambda name: Shaping(rules=rules))


def test_a_throttling_reply_to_one_domain_slows_its_whole_site():
    s = throttling_sched()
    for i in range(4):
        mail(s, f"d{i}.example", 10)
    out = drain(s, 0.0)
    assert len(out) == 8
    site = out[0].queue.site
    assert site is not None and site.full
    hit = next(e for e in out if e.queue.name == "d0.example")
    d = done(s, hit, 1, RATE_REPLY, False, 1.0)
    assert site.bound == 4, "half of the 8 in flight (the refused one counted, as for a "\
        "destination)"
    assert any("sites: site g (smtp): throttling reply matched rules, line 2: site capped "
               "at 4 (8 in flight)" in text for _, text in d.log), d.log
    others = [e for e in out if e is not hit]
    for e in others[:3]:
        done(s, e, 0, None, False, 2.0)
    assert site.busy == 4 and drain(s, 2.0) == [], "every domain of the site waits"
    for e in others[3:]:
        done(s, e, 0, None, False, 3.0)
    got = drain(s, 3.0)
    assert len(got) == 4 and site.busy == 4
    # A quiet interval gives a step back; the TTL ends the cap.
    s.tick(31.0)
    assert site.bound == 5
    s.tick(400.0)
    assert site.bound == 8 and (site.shape is None or site.shape.rule is None)


def test_a_suspend_rule_holds_the_whole_site_then_lets_it_go():
    s = throttling_sched()
    for i in range(2):
        mail(s, f"d{i}.example", 5)
    out = drain(s, 0.0)
    reply = Dsn("4.7.0", "host mx[192.0.2.1] said: 421 [TS01] Messages from 192.0.2.9 "
                         "temporarily deferred")
    d = done(s, out[0], 1, reply, False, 1.0)
    t = s.transport("smtp")
    assert all(q.gate is not None and q.gate.kind == "site backoff"
               for q in t.queues.values())
    assert 31.0 in d.timers, "the first recovery step; the backoff's end comes after"
    for e in out[1:]:
        done(s, e, 0, None, False, 2.0)
    assert drain(s, 2.0) == []
    assert 61.0 in s.tick(31.0).timers
    assert all(q.gate is not None for q in t.queues.values())
    s.tick(61.0)
    assert all(q.gate is None for q in t.queues.values())
    assert drain(s, 61.0)


def test_a_site_rate_spaces_the_starts_of_all_its_domains():
    s = throttling_sched(limit=0, rate=Rate(2, 1.0))
    for i in range(4):
        mail(s, f"d{i}.example", 5)
    first = drain(s, 0.0)
    assert len(first) == 1
    t = s.transport("smtp")
    assert all(q.gate is not None and q.gate.kind == "site rate" for q in t.queues.values())
    assert t.queues["d1.example"].gate.text == "site g starts a delivery at most every 500ms"
    s.tick(0.49)
    assert drain(s, 0.49) == []
    s.tick(0.5)
    assert len(drain(s, 0.5)) == 1, "the next start (whichever domain's the policy picks)"
    assert all(q.gate is not None for q in t.queues.values())


def test_a_rate_rule_lowers_the_site_rate_it_learnt():
    s = throttling_sched(limit=0)
    for i in range(4):
        mail(s, f"d{i}.example", 20)
    out = drain(s, 0.0)
    assert len(out) == 20, "no rate and no cap: every window's worth"
    reply = Dsn("4.7.0", "host mx[192.0.2.1] said: 421 [TSS04] Messages temporarily "
                         "deferred due to user complaints")
    d = done(s, out[0], 1, reply, False, 1.0)
    assert any("site rate lowered to one start every 100ms" in text for _, text in d.log), \
        d.log
    for e in out[1:]:
        done(s, e, 0, None, False, 1.0)
    got = drain(s, 1.0)
    assert len(got) == 1, "one start, then the site waits 0.1 s"
    assert len(drain(s, 1.05)) == 0
    s.tick(1.1)
    assert len(drain(s, 1.1)) == 1


def test_status_and_explain_say_which_site_holds_a_destination():
    s = sched(pinned={"a.example": "google", "b.example": "google"})
    mail(s, "a.example", 3)
    mail(s, "b.example", 3)
    drain(s, 0.0)
    (r,) = [r for r in explain(s, "b.example", 1.0)["reasons"] if r["constraint"] == "site"]
    assert r["setting"] == "smtp_site_concurrency_limit"
    assert r["text"] == ("site google holds 2 of 2 sessions; the next starts when one of "
                         "its deliveries ends")
    assert r["opens_in"] is None
    st = status(s, 1.0)
    assert st["sites"] == [{"transport": "smtp", "name": "google", "destinations": 2,
                            "in_flight": 2, "limit": 2, "bound": 2, "state": "site",
                            "opens_in": None, "rule": None, "rate_factor": 1.0}]
    assert {d["site"] for d in st["destinations"]} == {"google"}
    text = "\n".join(status_lines(st))
    assert "SITE" in text and "google" in text and "2/2" in text


def test_status_without_sites_has_no_site_keys():
    s = Scheduler(lambda n: Params())
    mail(s, "a.example", 1)
    st = status(s, 0.0)
    assert "sites" not in st and "site" not in st["destinations"][0]


def test_an_operator_suspends_a_whole_site_and_its_later_domains_too():
    s = sched(limit=0, pinned={"a.example": "google", "b.example": "google"})
    mail(s, "a.example", 2)
    target = parse_target("site:Google", {"smtp"})
    assert target == Target(None, None, site="google") and target.spec == "site:google"
    assert str(target) == "site google"
    d = s.suspend(Suspension(target, "provider asked", "root", 0.0, 100.0, 1e9))
    assert d.affected == ("smtp:a.example",)
    mail(s, "b.example", 2)
    mail(s, "c.example", 2)
    assert {e.queue.name for e in drain(s, 1.0)} == {"c.example"}
    t = s.transport("smtp")
    assert t.queues["b.example"].status == "held", "a domain that came later is held too"
    s.resume(target)
    assert {e.queue.name for e in drain(s, 2.0)} == {"a.example", "b.example"}


def test_a_domain_learnt_to_be_at_a_suspended_site_is_held_from_then():
    s = sched(limit=0)
    s.suspend(Suspension(Target(None, None, site="google"), "", "root", 0.0, 100.0, 1e9))
    mail(s, "a.example", 2)
    q = s.transport("smtp").queues["a.example"]
    assert q.gate is None
    s.site_learnt("a.example", "google", 3600.0, 0.5)
    assert q.status == "held"


def test_a_transport_named_site_keeps_its_meaning():
    assert parse_target("site:x.example", {"site"}) == Target("site", "x.example")
    with pytest.raises(TargetError, match="no site name"):
        parse_target("site:", {"smtp"})


def test_a_site_suspension_survives_the_state_file():
    from pyqmgr.daemon.suspensions import suspension_from_record, to_record

    s = Suspension(Target(None, None, site="google"), "asked", "root", 10.0, 110.0, 2e9)
    back = suspension_from_record(to_record(s), 10.0, 2e9 - 100)
    assert back is not None and back.target == s.target and back.reason == "asked"


def test_a_throttled_sites_cap_outlives_its_queues_going_idle():
    s = throttling_sched()
    for i in range(2):
        mail(s, f"d{i}.example", 4)
    out = drain(s, 0.0)
    done(s, out[0], 1, RATE_REPLY, False, 1.0)
    for e in out[1:]:
        done(s, e, 0, None, False, 1.5)
    t = s.transport("smtp")
    while t.queues:
        for e in drain(s, 2.0):
            done(s, e, 0, None, False, 2.5)
    assert s.sites is not None and ("smtp", "g") in s.sites.sites, "kept: its rule holds"
    mail(s, "d2.example", 10)
    assert len(drain(s, 3.0)) == 4, "the cap of 4 holds for the next mail"
    s.tick(400.0)
    assert s.sites.sites[("smtp", "g")].bound == 8


def test_with_site_dead_scope_site_a_dead_destination_takes_its_site():
    limits = SiteLimits(0, "site_concurrency_limit in pyqmgr.cf", dead_takes_site=True)
    table = SiteTable(lambda t: limits if t == "smtp" else None,
                      pinned={"a.example": "g", "b.example": "g"})
    s = Scheduler(lambda n: Params(destination_recipient_limit=1,
                                   initial_destination_concurrency=1),
                  sites=table, min_backoff_time=300)
    mail(s, "a.example", 3)
    mail(s, "b.example", 3)
    mail(s, "c.example", 3)
    got = {e.queue.name: e for e in drain(s, 0.0)}
    d = done(s, got["a.example"], 1, Dsn("4.4.1", "connect refused"), False, 1.0)
    t = s.transport("smtp")
    assert t.queues["a.example"].status == "dead" and t.queues["b.example"].status == "dead"
    assert t.queues["c.example"].status == "ready", "another site lives on"
    assert any("sites: site g (smtp): a.example is dead, and so are its 1 other "
               "destinations (site_dead_scope = site)" in text for _, text in d.log)
    retry = s.transport("retry")
    waiting = sum(len(q.todo) for q in retry.queues.values())
    assert waiting == 4, "both domains' waiting mail goes to the retry transport"


def test_by_default_a_dead_destination_dies_alone():
    s = sched(pinned={"a.example": "g", "b.example": "g"},
              initial_destination_concurrency=1)
    mail(s, "a.example", 3)
    mail(s, "b.example", 3)
    got = {e.queue.name: e for e in drain(s, 0.0)}
    done(s, got["a.example"], 1, Dsn("4.4.1", "connect refused"), False, 1.0)
    t = s.transport("smtp")
    assert t.queues["b.example"].status == "ready"


def test_top_shows_the_sites_with_their_change():
    from pyqmgr.control.top import frame

    s = sched(pinned={"a.example": "google", "b.example": "google"})
    mail(s, "a.example", 3)
    before = status(s, 0.0)
    drain(s, 0.0)
    lines = [text for text, _ in frame(status(s, 1.0), before, "name")]
    (row,) = [ln for ln in lines if ln.startswith("google")]
    assert "2/2" in row and "+2" in row and " site " in f" {row} "
    assert not any(ln.startswith("SITE") for ln, _ in frame(
        status(Scheduler(lambda n: Params()), 0.0), None, "name"))


def _learnt_sched() -> Scheduler:
    """Domains learnt (not pinned) at site google, with the check the daemon's
    settings give the core: a reply counts for the site only from one of its hosts."""
    providers = load_providers(["builtin"])
    rules = parse_rules(SITE_RULES, "rules")
    table = SiteTable(lambda t: SiteLimits(8, "site_concurrency_limit in pyqmgr.cf",
                                           Shaping()) if t == "smtp" else None,
                      replied_from=lambda site, reason: replied_from_site(site, reason,
                                                                          providers))
    s = Scheduler(lambda n: Params(destination_recipient_limit=1,
                                   initial_destination_concurrency=5),
                  sites=table, shaping_for=lambda name: Shaping(rules=rules))
    for i in range(2):
        mail(s, f"d{i}.example", 5)
        s.site_learnt(f"d{i}.example", "google", 3600.0, 0.0)
    return s


def test_a_reply_from_a_host_not_the_sites_own_holds_only_its_destination():
    """Issue #45: d0's owner pointed its MX elsewhere after the lookup; that host's
    [TS01] suspends d0 alone, and d1 keeps delivering."""
    s = _learnt_sched()
    out = drain(s, 0.0)
    hit = next(e for e in out if e.queue.name == "d0.example")
    reply = Dsn("4.7.0", "host tarpit.attacker.example[192.0.2.66] said: 421 [TS01] "
                         "Messages from 192.0.2.9 temporarily deferred")
    done(s, hit, 1, reply, False, 1.0)
    t = s.transport("smtp")
    d0, d1 = t.queues["d0.example"], t.queues["d1.example"]
    assert d0.gate is not None and d0.gate.kind == "backoff", d0.gate
    assert d1.gate is None and d1.site is not None and d1.site.gate is None
    assert d1.site.shape is None or d1.site.shape.rule is None


def test_a_reply_from_one_of_the_sites_hosts_holds_the_whole_site():
    s = _learnt_sched()
    out = drain(s, 0.0)
    reply = Dsn("4.7.0", "host alt1.gmail-smtp-in.l.google.com[192.0.2.1] said: 421 "
                         "[TS01] Messages from 192.0.2.9 temporarily deferred")
    done(s, out[0], 1, reply, False, 1.0)
    t = s.transport("smtp")
    assert all(q.gate is not None and q.gate.kind == "site backoff"
               for q in t.queues.values())
