"""A tenant's cap at a destination in the core (issue #34): tenant_concurrency_limit."""

from __future__ import annotations

from pyqmgr.pyqmgr_cf import PyqmgrCf
from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.held import HELD
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.policy import PolicyTable
from pyqmgr.scheduler.queue import Dsn
from pyqmgr.scheduler.structures import SiteLimits, SiteTable
from pyqmgr.scheduler.suspension import Suspension, parse_target
from pyqmgr.scheduler.tenant_cap import TenantLimitTable
from pyqmgr.settings.policies import load
from pyqmgr.settings.tenants import tenant_limits
from tests.unit.params import Params


def scheduler(cap: str = "2", sites: dict[str, str] | None = None,
              more: dict[str, str] | None = None, **params: int) -> Scheduler:
    p = {"destination_recipient_limit": 1, "initial_destination_concurrency": 20,
         "destination_concurrency_limit": 20, **params}
    settings = {"tenant_concurrency_limit": cap, **(more or {})}
    table = None
    if sites is not None:
        limits = SiteLimits(0, "smtp_site_concurrency_limit")
        table = SiteTable(lambda t: limits if t == "smtp" else None, pinned=sites)
    return Scheduler(lambda n: Params(**p),  # type: ignore[arg-type]
                     policies=PolicyTable(load("nqmgr")), sites=table,
                     tenant_limits=tenant_table(settings))


def tenant_table(settings: dict[str, str]) -> TenantLimitTable | None:
    """The core's table, read from pyqmgr.cf's values as start-up reads it."""
    return tenant_limits(PyqmgrCf("pyqmgr.cf", True, settings), "sender", True,
                         lambda text: None)


def add(s: Scheduler, name: str, tenant: str, dest: str = "d.example",
        now: float = 0.0) -> Message:
    m = Message(name, now, tenant=tenant)
    s.read_limit(m)
    s.assign(m, [Route("smtp", dest, dest, Recipient(0, f"r@{dest}"))], now=now)
    return m


def selected(s: Scheduler, now: float = 0.0) -> list:
    """Every entry agents get now, none finished."""
    out = []
    while (entry := s.select("smtp", now).deliver) is not None:
        out.append(entry)
    return out


def staged(s: Scheduler) -> int:
    held = s.transports.get(HELD)
    return sum(len(q.todo) for q in held.queues.values()) if held is not None else 0


def test_the_limits_come_from_the_typed_table_alone():
    """The policies' setting answers a policy's own knobs only: a tenant limit there is
    no limit (issue #44: the core once read tenant limits as strings through it)."""
    p = {"destination_recipient_limit": 1, "initial_destination_concurrency": 20,
         "destination_concurrency_limit": 20}
    s = Scheduler(lambda n: Params(**p),  # type: ignore[arg-type]
                  policies=PolicyTable(load("nqmgr"), setting=lambda n, t, d: (
                      "1" if n == "tenant_concurrency_limit" else d)))
    for i in range(3):
        add(s, f"a{i}", "acme")
    assert s.transports["smtp"].tenant_caps is None and len(selected(s)) == 3
    s = scheduler("1")
    for i in range(3):
        add(s, f"a{i}", "acme")
    assert len(selected(s)) == 1 and staged(s) == 2


def test_a_tenant_has_at_most_its_cap_at_a_destination_and_the_rest_follow():
    s = scheduler()
    for i in range(6):
        add(s, f"a{i}", "acme")
    add(s, "b0", "beta")
    add(s, "b1", "beta")
    first = selected(s)
    assert sorted(e.message.queue_id for e in first) == ["a0", "a1", "b0", "b1"]
    assert staged(s) == 4
    # One of acme's ends: its oldest staged one takes the place, and only one.
    s.done(first[0], 0, None, False, 1.0)
    again = selected(s, 1.0)
    assert [e.message.queue_id for e in again] == ["a2"]
    order = []
    pending = list(first[1:]) + again
    while pending:
        entry = pending.pop(0)
        s.done(entry, 0, None, False, 2.0)
        more = selected(s, 2.0)
        order += [e.message.queue_id for e in more]
        pending += more
    assert order == ["a3", "a4", "a5"], "the staged ones in their order, one at a time"
    caps = s.transports["smtp"].tenant_caps
    assert caps is not None and caps.counts == {} and staged(s) == 0


def test_other_destinations_and_tenants_are_not_capped_by_it():
    s = scheduler("1")
    add(s, "a0", "acme", "d.example")
    add(s, "a1", "acme", "d.example")
    add(s, "a2", "acme", "e.example")
    add(s, "n0", "", "d.example")
    got = sorted(e.message.queue_id for e in selected(s))
    assert got == ["a0", "a2", "n0"] and staged(s) == 1


def test_a_dead_destination_takes_the_staged_mail_to_retry():
    s = scheduler("1", initial_destination_concurrency=1)
    add(s, "a0", "acme")
    add(s, "a1", "acme")
    add(s, "a2", "acme")
    (entry,) = selected(s)
    assert staged(s) == 2
    s.done(entry, 4, Dsn("4.4.1", "connection refused"), False, 1.0)
    retry = s.transports.get("retry")
    assert staged(s) == 0
    assert retry is not None and sum(len(q.todo) for q in retry.queues.values()) == 2


def test_a_suspension_takes_the_capped_tenant_and_gives_it_back_capped():
    s = scheduler("1")
    for i in range(3):
        add(s, f"a{i}", "acme")
    (first,) = selected(s)
    target = parse_target("tenant:acme@d.example", {"smtp"})
    s.suspend(Suspension(target, "x", "test", 0.0, 50.0, 50.0))
    s.done(first, 0, None, False, 1.0)
    assert selected(s, 1.0) == [], "held: nothing of acme's goes"
    s.resume(target)
    got = selected(s, 2.0)
    assert len(got) == 1, "capped again at one"
    while got:
        s.done(got.pop(), 0, None, False, 3.0)
        got = selected(s, 3.0)
    assert staged(s) == 0
    caps = s.transports["smtp"].tenant_caps
    assert caps is not None and caps.counts == {}


def test_no_cap_no_structure():
    s = scheduler("0")
    add(s, "a0", "acme")
    assert s.transports["smtp"].tenant_caps is None


GOOGLE = {"a.example": "google", "b.example": "google", "c.example": "google"}


def test_a_site_cap_counts_the_tenant_at_every_destination_of_the_site():
    """tenant_site_concurrency_limit = 2: acme's mail to three of google's domains
    goes two at a time in all, the domains taking turns; beta and a domain off the
    site are not held by it."""
    s = scheduler("0", sites=GOOGLE, more={"tenant_site_concurrency_limit": "2"})
    for i, dest in enumerate(["a.example", "a.example", "b.example", "b.example",
                              "c.example", "c.example"]):
        add(s, f"a{i}", "acme", dest)
    add(s, "b0", "beta", "a.example")
    add(s, "x0", "acme", "off.example")
    first = selected(s)
    assert sorted(e.message.queue_id for e in first) == ["a0", "a1", "b0", "x0"]
    assert staged(s) == 4
    caps = s.transports["smtp"].tenant_caps
    assert caps is not None and caps.counts[("acme", "site google")] == 2
    # A domain no site table knows is a site of its own (sites' fallback).
    assert caps.counts[("acme", "site off.example")] == 1
    # Each of acme's that ends at the site lets one more go, from the other domains
    # in turn (not a.example's own queue first: it has none staged).
    went = []
    pending = [e for e in first if e.message.tenant == "acme" and e.queue.name == "a.example"]
    while pending:
        left = staged(s)
        s.done(pending.pop(0), 0, None, False, 1.0)
        more = selected(s, 1.0)
        assert len(more) == min(left, 1), "one ends, one follows"
        went += [e.queue.name for e in more]
        pending += more
    assert went == ["c.example", "b.example", "c.example", "b.example"], "in turn"

    assert staged(s) == 0 and ("acme", "site google") not in caps.counts


def test_a_rate_spaces_the_tenants_mail_at_a_destination():
    """tenant_rate = 2/1s: acme's entries for d.example enter one every 0.5 s, the
    timers saying when; beta's go at once."""
    s = scheduler("0", more={"tenant_rate": "2/1s"})
    for i in range(4):
        add(s, f"a{i}", "acme", now=0.0)
    add(s, "b0", "beta", now=0.0)
    got = selected(s)
    assert sorted(e.message.queue_id for e in got) == ["a0", "b0"]
    assert staged(s) == 3
    times = []
    now = 0.0
    while staged(s):
        now += 0.25
        s.tick(now)
        for entry in selected(s, now):
            times.append(now)
            s.done(entry, 0, None, False, now)
    assert times == [0.5, 1.0, 1.5]


def test_a_site_rate_is_shared_by_the_sites_destinations():
    s = scheduler("0", sites=GOOGLE, more={"tenant_site_rate": "1/1s"})
    add(s, "a0", "acme", "a.example")
    add(s, "a1", "acme", "b.example")
    add(s, "a2", "acme", "c.example")
    assert [e.message.queue_id for e in selected(s)] == ["a0"]
    seen = []
    now = 0.0
    while staged(s):
        now += 0.25
        s.tick(now)
        seen += [(now, e.message.queue_id) for e in selected(s, now)]
    assert [t for t, _ in seen] == [1.0, 2.0]
    assert sorted(q for _, q in seen) == ["a1", "a2"]


def test_explain_names_the_limit_that_holds_the_mail():
    from pyqmgr.scheduler.explain import explain  # noqa: PLC0415

    s = scheduler("0", sites=GOOGLE, more={"tenant_site_concurrency_limit": "1",
                                           "tenant_rate": "1/10s"})
    add(s, "a0", "acme", "a.example")
    add(s, "a1", "acme", "b.example")
    add(s, "a2", "acme", "a.example")
    selected(s)
    text = str(explain(s, "a1", 0.0))
    assert "site google" in text and "tenant_site_concurrency_limit" in text, text


def test_mail_made_while_the_mx_lookup_ran_moves_to_the_site_found():
    """Each domain is a site of its own until its lookup answers: acme's entries made
    then count there; when both domains turn out to be google's, acme has 4 at a
    site that allows it 2: the 2 newest go back to staging, and follow as the others
    end."""
    p = {"destination_recipient_limit": 1, "initial_destination_concurrency": 20,
         "destination_concurrency_limit": 20}
    limits = SiteLimits(0, "smtp_site_concurrency_limit")
    table = SiteTable(lambda t: limits if t == "smtp" else None)
    s = Scheduler(lambda n: Params(**p),  # type: ignore[arg-type]
                  policies=PolicyTable(load("nqmgr")), sites=table,
                  tenant_limits=tenant_table({"tenant_site_concurrency_limit": "2"}))
    for i, dest in enumerate(["a.example", "a.example", "b.example", "b.example"]):
        add(s, f"a{i}", "acme", dest)
    caps = s.transports["smtp"].tenant_caps
    assert caps is not None and staged(s) == 0
    assert caps.counts == {("acme", "site a.example"): 2, ("acme", "site b.example"): 2}
    s.site_learnt("a.example", "google", 3600.0, 0.1)
    s.site_learnt("b.example", "google", 3600.0, 0.1)
    assert caps.counts == {("acme", "site google"): 2}
    assert staged(s) == 2
    first = selected(s, 0.2)
    assert len(first) == 2
    for entry in first:
        s.done(entry, 0, None, False, 0.3)
    rest = selected(s, 0.3)
    assert len(rest) == 2 and staged(s) == 0


class _NoWalk(dict):
    """A TenantCaps.site_of that fails a walk over every entry counted at any site."""

    def items(self):  # type: ignore[override]
        raise AssertionError("an answer walked every entry counted at a site")

    def __iter__(self):  # type: ignore[override]
        raise AssertionError("an answer walked every entry counted at a site")


def test_an_answer_recounts_its_own_domains_entries_alone():
    """Issue #44: a lookup's answer moved the domain's tenants' entries by walking
    every entry counted at any site (10,000 waiting at a provider's site, and 1,000
    new domains answered, were ten million steps). Now it visits the domain's queue's
    own entries: 2,000 of another domain stay counted where they are, acme's two at
    a.example move to google, and their ends count down google's."""
    p = {"destination_recipient_limit": 1, "initial_destination_concurrency": 20,
         "destination_concurrency_limit": 20}
    limits = SiteLimits(0, "smtp_site_concurrency_limit")
    table = SiteTable(lambda t: limits if t == "smtp" else None,
                      pinned={"big.example": "google"})
    s = Scheduler(lambda n: Params(**p),  # type: ignore[arg-type]
                  policies=PolicyTable(load("nqmgr")), sites=table,
                  tenant_limits=tenant_table({"tenant_site_concurrency_limit": "5000"}))
    for i in range(2000):
        add(s, f"b{i}", "bulk", "big.example")
    add(s, "a0", "acme", "a.example")
    add(s, "a1", "acme", "a.example")
    caps = s.transports["smtp"].tenant_caps
    assert caps is not None
    assert caps.counts == {("bulk", "site google"): 2000, ("acme", "site a.example"): 2}
    caps.site_of = _NoWalk(caps.site_of)
    s.site_learnt("a.example", "google", 3600.0, 0.1)
    assert caps.counts == {("bulk", "site google"): 2000, ("acme", "site google"): 2}
    assert staged(s) == 0
    queue = s.transports["smtp"].queues["a.example"]
    assert len(caps.site_of[queue]) == 2
    out = [e for e in selected(s, 0.2) if e.queue is queue]
    assert len(out) == 2
    for entry in out:
        s.done(entry, 0, None, False, 0.3)
    assert caps.counts[("bulk", "site google")] == 2000  # todo and busy alike
    assert ("acme", "site google") not in caps.counts and queue not in caps.site_of
