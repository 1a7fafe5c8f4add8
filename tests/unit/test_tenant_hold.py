"""A tenant's suspension in the core (issue #34): only its mail waits, only where the
target says, and all of it comes back when the suspension ends."""

from __future__ import annotations

import math

import pytest

from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.suspension import Suspension, TargetError, parse_target
from pyqmgr.scheduler.tenant_hold import HELD
from tests.unit.params import Params
from tests.unit.test_preemption import ONE_AT_A_TIME


def scheduler() -> Scheduler:
    return Scheduler(lambda name: Params(**ONE_AT_A_TIME))  # type: ignore[arg-type]


def add(s: Scheduler, name: str, tenant: str, dest: str, now: float = 0.0) -> Message:
    m = Message(name, now, tenant=tenant)
    s.read_limit(m)
    s.assign(m, [Route("smtp", dest, dest, Recipient(0, f"r@{dest}"))], now=now)
    return m


def drain(s: Scheduler, now: float = 0.0) -> list[str]:
    out = []
    while (entry := s.select("smtp", now).deliver) is not None:
        out.append(f"{entry.message.queue_id}@{entry.queue.name}")
        s.done(entry, 0, None, False, now)
    return out


def suspend(s: Scheduler, spec: str, until: float = 100.0) -> list[str]:
    target = parse_target(spec, {"smtp"})
    return list(s.suspend(Suspension(target, "TSS04", "test", 0.0, until, until)).affected)


def test_only_the_tenants_mail_at_the_target_waits_and_comes_back():
    s = scheduler()
    add(s, "a1", "acme", "yahoo.example")
    add(s, "a2", "acme", "gmail.example")
    add(s, "b1", "beta", "yahoo.example")
    assert suspend(s, "tenant:acme@yahoo.example") == ["tenant acme: 1 deliveries held"]
    add(s, "a3", "acme", "yahoo.example")  # new mail of acme there is held too
    assert sorted(drain(s)) == ["a2@gmail.example", "b1@yahoo.example"]
    held = s.transports[HELD]
    assert sorted(q.name for q in held.queues.values()) == ["acme smtp:yahoo.example"]
    assert not held.wants_agent()
    decisions = s.resume(parse_target("tenant:acme@yahoo.example", {"smtp"}))
    assert decisions.resumed is not None
    assert drain(s) == ["a1@yahoo.example", "a3@yahoo.example"]
    assert not held.queues


def test_everywhere_and_the_end_of_its_time():
    s = scheduler()
    add(s, "a1", "acme", "yahoo.example")
    add(s, "a2", "acme", "gmail.example")
    add(s, "b1", "beta", "gmail.example")
    suspend(s, "tenant:acme", until=50.0)
    assert drain(s) == ["b1@gmail.example"]
    decisions = s.tick(60.0)
    assert [str(x.target) for x in decisions.ended] == ["tenant acme"]
    assert sorted(drain(s, 60.0)) == ["a1@yahoo.example", "a2@gmail.example"]


def test_a_destination_dead_when_the_suspension_ends_takes_the_mail_to_retry():
    s = scheduler()
    add(s, "a1", "acme", "yahoo.example")
    suspend(s, "tenant:acme@smtp:yahoo.example")
    add(s, "b1", "beta", "yahoo.example")
    entry = s.select("smtp", 0.0).deliver
    assert entry is not None and entry.message.queue_id == "b1"
    from pyqmgr.scheduler.queue import Dsn
    s.done(entry, 4, Dsn("4.4.1", "connection refused"), False, 0.0)
    assert s.transports["smtp"].queues.get("yahoo.example") is None or \
        s.transports["smtp"].queues["yahoo.example"].throttled
    s.resume(parse_target("tenant:acme@smtp:yahoo.example", {"smtp"}))
    retry = s.transports.get("retry")
    assert retry is not None and sum(len(q.todo) for q in retry.queues.values()) == 1


def test_two_suspensions_of_one_tenant_release_only_what_neither_holds():
    s = scheduler()
    add(s, "a1", "acme", "yahoo.example")
    add(s, "a2", "acme", "gmail.example")
    suspend(s, "tenant:acme")
    suspend(s, "tenant:acme@yahoo.example")
    s.resume(parse_target("tenant:acme", {"smtp"}))
    assert drain(s) == ["a2@gmail.example"]
    assert sum(len(q.todo) for q in s.transports[HELD].queues.values()) == 1


@pytest.mark.parametrize("spec, text", [
    ("tenant:acme", "tenant acme"),
    ("tenant:acme@site:yahoo", "tenant acme at site yahoo"),
    ("tenant:acme@smtp:yahoo.example", "tenant acme at destination smtp:yahoo.example"),
    ("tenant:acme@smtp:", "tenant acme at transport smtp"),
    ("tenant:Acme.Example@yahoo.example", "tenant Acme.Example at destination yahoo.example"),
])
def test_targets_read_and_written_alike(spec, text):
    target = parse_target(spec, {"smtp"})
    assert str(target) == text
    assert parse_target(target.spec, {"smtp"}) == target


@pytest.mark.parametrize("spec", ["tenant:", "tenant:@x", "tenant:a@tenant:b"])
def test_bad_tenant_targets(spec):
    with pytest.raises(TargetError):
        parse_target(spec, {"smtp"})


def test_a_tenant_suspension_never_gates_the_destination():
    s = scheduler()
    add(s, "b1", "beta", "yahoo.example")
    suspend(s, "tenant:acme@yahoo.example")
    assert s.suspensions.for_queue("smtp", "yahoo.example", "yahoo.example") is None
    assert math.isinf(s.transports[HELD].suspension.until) if HELD in s.transports else True


def test_a_response_rule_holds_the_tenant_at_the_destination_only():
    """Yahoo's TSS04 to one tenant's mail: ``suspend_tenant=1h`` holds that tenant
    there, not the destination: another tenant's mail to it still goes."""
    from pyqmgr.scheduler.policy import PolicyTable
    from pyqmgr.scheduler.queue import Dsn
    from pyqmgr.scheduler.shaping import Shaping, parse_rules
    from pyqmgr.settings.policies import load

    rules = tuple(parse_rules("/TSS04/  throttle suspend_tenant=1h\n", "rules"))
    s = Scheduler(lambda n: Params(destination_recipient_limit=1,  # type: ignore[arg-type]
                                   initial_destination_concurrency=5),
                  policies=PolicyTable(load("nqmgr")),
                  shaping_for=lambda name: Shaping(rules=rules))
    s.suspensions.wall_offset = 1_000_000.0
    for i in range(3):
        add(s, f"a{i}", "acme", "yahoo.example")
        add(s, f"b{i}", "beta", "yahoo.example")
    first = s.select("smtp", 0.0).deliver
    assert first is not None and first.message.tenant == "acme"
    d = s.done(first, 4, Dsn("4.7.0", "[TSS04] Messages from 192.0.2.1 temporarily "
                                      "deferred due to unexpected volume"), False, 1.0)
    assert any("tenant acme at destination smtp:yahoo.example held 1h" in text
               for _, text in d.log), d.log
    (held,) = s.suspensions.tenants["acme"]
    assert held.who == "response rule rules, line 1" and held.wall_until == 1_003_601.0
    assert sorted(x.split("@")[0] for x in drain(s, 2.0)) == ["b0", "b1", "b2"]
    s.tick(3602.0)
    # a0 got the reply: deferred, as any 4xx; the rest of acme's mail waited.
    assert sorted(x.split("@")[0] for x in drain(s, 3602.0)) == ["a1", "a2"]


def test_a_site_target_holds_the_tenant_at_every_destination_of_the_site_only():
    """tenant:acme@site:google: acme's mail to both of google's domains waits, its
    mail to another domain and beta's to google go."""
    from pyqmgr.scheduler.policy import PolicyTable
    from pyqmgr.scheduler.structures import SiteLimits, SiteTable
    from pyqmgr.settings.policies import load

    limits = SiteLimits(20, "smtp_site_concurrency_limit")
    table = SiteTable(lambda t: limits if t == "smtp" else None,
                      pinned={"a.example": "google", "b.example": "google"})
    s = Scheduler(lambda n: Params(destination_recipient_limit=1,  # type: ignore[arg-type]
                                   initial_destination_concurrency=5),
                  policies=PolicyTable(load("nqmgr")), sites=table)
    add(s, "a1", "acme", "a.example")
    add(s, "a2", "acme", "b.example")
    add(s, "a3", "acme", "c.example")
    add(s, "b1", "beta", "a.example")
    assert suspend(s, "tenant:acme@site:google") == ["tenant acme: 2 deliveries held"]
    add(s, "a4", "acme", "b.example")
    assert sorted(drain(s, 1.0)) == ["a3@c.example", "b1@a.example"]
    s.resume(parse_target("tenant:acme@site:google", {"smtp"}))
    assert sorted(drain(s, 2.0)) == ["a1@a.example", "a2@b.example", "a4@b.example"]
