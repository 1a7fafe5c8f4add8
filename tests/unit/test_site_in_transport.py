"""One transport's site as a suspension target (issue #46: a source at one site).

``out11:site:google`` holds out11's site google alone: with source pools, one sending
address at one provider, while the other sources there and out11 elsewhere go on.
``site:google`` still holds the site in every transport; both can be in force and
each is resumed by its own name. The target round-trips through its spec (the name
every control, the state file and the fleet's table use).
"""

from __future__ import annotations

import pytest

from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.explain import explain, status
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.policy import PolicyTable
from pyqmgr.scheduler.queue import Dsn
from pyqmgr.scheduler.structures import SiteLimits, SiteTable
from pyqmgr.scheduler.suspension import (
    MAX_TARGET,
    Suspension,
    Target,
    TargetError,
    parse_target,
)
from pyqmgr.settings.policies import load
from tests.unit.params import Params

SOURCES = ("out10", "out11")
KNOWN = {"smtp", *SOURCES}


def sched(policy: str = "nqmgr", **more: int) -> Scheduler:
    limits = SiteLimits(20, "site_concurrency_limit")
    table = SiteTable(lambda t: limits if t in SOURCES else None,
                      pinned={"a.example": "google", "b.example": "google",
                              "y.example": "yahoo"})
    params = {"destination_recipient_limit": 1, "initial_destination_concurrency": 5, **more}
    return Scheduler(lambda n: Params(**params),  # type: ignore[arg-type]
                     policies=PolicyTable(load(policy)), sites=table)


def mail(s: Scheduler, transport: str, dest: str, n: int = 2, tenant: str = "") -> None:
    m = Message(f"Q{transport}{dest}{tenant}", 0.0, tenant=tenant)
    s.read_limit(m)
    s.assign(m, [Route(transport, dest, dest, Recipient(i, f"r{i}@{dest}")) for i in range(n)])


def drain(s: Scheduler, now: float = 1.0) -> list[str]:
    """Every delivery each source's agents get now, as SOURCE:DEST (each ends at once)."""
    out = []
    for transport in SOURCES:
        while (e := s.select(transport, now).deliver) is not None:
            out.append(f"{transport}:{e.queue.name}")
            s.done(e, 0, None, False, now)
    return sorted(out)


def hold(target: Target, until: float = 100.0) -> Suspension:
    return Suspension(target, "4.7.28 at google", "root", 0.0, until, 1e9 + until)


# -- the name ------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "want", "spec", "said"), [
    ("out11:site:Google", Target("out11", None, site="google"), "out11:site:google",
     "site google in transport out11"),
    ("out11:SITE:google", Target("out11", None, site="google"), "out11:site:google",
     "site google in transport out11"),
    ("tenant:acme@out11:site:google", Target("out11", None, site="google", tenant="acme"),
     "tenant:acme@out11:site:google", "tenant acme at site google in transport out11"),
    ("site:google", Target(None, None, site="google"), "site:google", "site google"),
    ("out11:google.com", Target("out11", "google.com"), "out11:google.com",
     "destination out11:google.com"),
])
def test_a_target_round_trips_through_its_spec(text, want, spec, said):
    target = parse_target(text, KNOWN)
    assert target == want
    assert target.spec == spec and str(target) == said
    assert parse_target(target.spec, KNOWN) == target


def test_each_site_target_has_a_key_of_its_own():
    keys = {parse_target(text, KNOWN).key for text in (
        "site:google", "out10:site:google", "out11:site:google", "out11:google",
        "tenant:acme@out11:site:google", "out11:site:yahoo", "out11:")}
    assert len(keys) == 7
    assert parse_target("out11:site:google", KNOWN).key == ("out11:site:", "google", None)


@pytest.mark.parametrize(("text", "error"), [
    ("out11:site:", "no site name after 'out11:site:'"),
    ("out99:site:google", "no transport 'out99' (not a master.cf service)"),
    ("out11:site:goo gle", "a target has no spaces or control characters"),
    ("out11:site:" + "g" * MAX_TARGET, f"target longer than {MAX_TARGET} characters"),
    ("out11:site:google:25", "site name 'google:25' has a ':' or '@'"),
    ("out11:site:google@out10", "site name 'google@out10' has a ':' or '@'"),
    ("tenant:acme@out11:site:", "no site name after 'out11:site:'"),
    (":site:google", "no transport before ':'"),
])
def test_a_bad_transport_site_is_a_clear_error(text, error):
    with pytest.raises(TargetError) as exc:
        parse_target(text, KNOWN)
    assert error in str(exc.value)


# -- the core ------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["nqmgr", "oqmgr", "finch", "zmailer"])
def test_only_that_transports_site_is_held(policy):
    s = sched(policy)
    for source in SOURCES:
        mail(s, source, "a.example")
        mail(s, source, "y.example")
    target = parse_target("out11:site:google", KNOWN)
    d = s.suspend(hold(target))
    assert d.affected == ("out11:a.example",), "one site's members, nothing else"
    # A domain that comes later to out11's google is held too; out10's goes.
    mail(s, "out11", "b.example")
    mail(s, "out10", "b.example")
    assert drain(s) == ["out10:a.example"] * 2 + ["out10:b.example"] * 2 + [
        "out10:y.example"] * 2 + ["out11:y.example"] * 2
    out11 = s.transport("out11")
    assert {q.name: q.status for q in out11.queues.values()} == {
        "a.example": "held", "b.example": "held"}
    assert not s.has_work("out11"), "no agent is asked for out11 while only google waits"
    answer = explain(s, "a.example", 1.0)
    assert any("suspended by root: 4.7.28 at google" in r["text"] for r in answer["reasons"])
    assert status(s, 1.0)["suspensions"][0]["target"] == "site google in transport out11"
    assert s.resume(target).resumed is not None
    assert drain(s, 2.0) == ["out11:a.example"] * 2 + ["out11:b.example"] * 2


def test_a_domain_learnt_to_be_at_the_site_later_is_held_in_that_transport_only():
    s = sched()
    s.suspend(hold(parse_target("out11:site:google", KNOWN)))
    mail(s, "out11", "c.example")
    mail(s, "out10", "c.example")
    q11, q10 = (s.transport(t).queues["c.example"] for t in ("out11", "out10"))
    s.site_learnt("c.example", "google", 3600.0, 0.5)
    assert q11.status == "held" and q10.gate is None


def test_the_site_everywhere_and_in_one_transport_are_resumed_each_by_its_name():
    s = sched()
    mail(s, "out10", "a.example")
    mail(s, "out11", "a.example")
    one, every = (parse_target(t, KNOWN) for t in ("out11:site:google", "site:google"))
    s.suspend(hold(one, until=200.0))
    s.suspend(hold(every))
    assert drain(s) == []
    s.resume(every)
    assert drain(s, 2.0) == ["out10:a.example"] * 2, "out11's own suspension holds on"
    s.tick(201.0)
    assert drain(s, 201.0) == ["out11:a.example"] * 2, "its ttl ends it"


def test_the_ttl_ends_it_and_a_retry_revives_only_that_transports_site():
    s = sched()
    mail(s, "out11", "a.example")
    decisions = s.suspend(hold(parse_target("out11:site:google", KNOWN), until=50.0))
    assert 50.0 in decisions.timers
    ended = s.tick(60.0).ended
    assert [str(x.target) for x in ended] == ["site google in transport out11"]
    assert drain(s, 60.0) == ["out11:a.example"] * 2


def test_retry_revives_the_dead_destinations_of_that_transports_site_only():
    s = sched(initial_destination_concurrency=1, failed_cohort_limit=1)
    for source in SOURCES:
        mail(s, source, "a.example", 1)
        e = s.select(source, 0.0).deliver
        assert e is not None
        s.done(e, 1, Dsn("4.4.1", "connect refused"), False, 0.0)
    dead = [s.transport(t).queues["a.example"] for t in SOURCES]
    assert all(q.throttled for q in dead)
    assert list(s.retry(parse_target("out11:site:google", KNOWN)).affected) == [
        "out11:a.example"]
    assert dead[0].throttled, "out10's destination at google stays dead"


def test_a_tenant_at_one_transports_site():
    """tenant:acme@out11:site:google: acme's mail from out11 to google waits; its mail
    from out10 there, from out11 elsewhere, and beta's from out11 to google go."""
    s = sched()
    mail(s, "out11", "a.example", 1, tenant="acme")
    mail(s, "out10", "a.example", 1, tenant="acme")
    mail(s, "out11", "y.example", 1, tenant="acme")
    mail(s, "out11", "a.example", 1, tenant="beta")
    target = parse_target("tenant:acme@out11:site:google", KNOWN)
    assert list(s.suspend(hold(target)).affected) == ["tenant acme: 1 deliveries held"]
    mail(s, "out11", "b.example", 1, tenant="acme")
    assert drain(s) == ["out10:a.example", "out11:a.example", "out11:y.example"]
    s.resume(target)
    assert drain(s, 2.0) == ["out11:a.example", "out11:b.example"]


# -- the state file ------------------------------------------------------------------


@pytest.mark.parametrize("text", ["out11:site:google", "tenant:acme@out11:site:google",
                                  "tenant:acme@site:google", "tenant:acme",
                                  "tenant:acme@out11:a.example", "site:google"])
def test_the_state_file_keeps_the_target_whole(text):
    """A record read back names what was suspended: a tenant's suspension that came
    back without its tenant would hold everyone's mail there."""
    from pyqmgr.daemon.suspensions import suspension_from_record, to_record

    s = Suspension(parse_target(text, KNOWN), "asked", "root", 10.0, 110.0, 2e9)
    back = suspension_from_record(to_record(s), 10.0, 2e9 - 100)
    assert back is not None and back.target == s.target and back.target.spec == text
