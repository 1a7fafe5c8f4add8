"""What the scheduler is doing and why: status snapshots and "why is this not going out".

Postfix shows its scheduler's state only through debug log lines; admins ask "why is
mail to X slow?". These functions answer from the core's own structures, as plain
JSON-able values, for the control channel and its commands (``pyqmgr status``,
``pyqmgr explain``). Each reason names the constraint and the setting that produced it
(:func:`~pyqmgr.scheduler.policy.reason`), so that an admin can tell whether a plateau
comes from shaping configuration or from the remote side.

Nothing here changes the scheduler, does I/O or reads the clock: ``now`` is the
scheduler clock the caller passes (the daemon's ``time.monotonic()``), and times in
the answers are seconds from then. A snapshot walks every in-core queue and entry, so
it costs in proportion to the active queue; it is built in one go when asked, never on
the delivery path.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, cast

from pyqmgr.durations import duration, until
from pyqmgr.scheduler import tenant_cap
from pyqmgr.scheduler.held import HELD, STAGED
from pyqmgr.scheduler.policy import Policy, Reason, reason
from pyqmgr.scheduler.suspension import Suspension

if TYPE_CHECKING:
    from pyqmgr.scheduler.core import Scheduler
    from pyqmgr.scheduler.entry import Entry
    from pyqmgr.scheduler.message import Message
    from pyqmgr.scheduler.queue import Queue
    from pyqmgr.scheduler.shaping import Gate
    from pyqmgr.scheduler.structures import Site
    from pyqmgr.scheduler.transport import Transport


def _in(when: float | None, now: float) -> float | None:
    """Seconds from now; None when never (no time, or a gate with no end: a full site)."""
    return None if when is None or when == math.inf else round(when - now, 3)


def suspension_status(s: Suspension | None, now: float) -> dict[str, object] | None:
    """An operator's suspension as status and explain show it (None: not suspended)."""
    if s is None:
        return None
    return {"target": str(s.target), "reason": s.reason, "by": s.who,
            "since": _in(s.since, now), "ends_in": _in(s.until, now),
            "until": round(s.wall_until) if math.isfinite(s.wall_until) else None}


def _gate_status(gate: Suspension | Gate | None, now: float) -> dict[str, object] | None:
    """Any gate: what kind, the setting behind it, when it opens."""
    if gate is None:
        return None
    if isinstance(gate, Suspension):
        return {"kind": gate.kind, "setting": "pyqmgr suspend", "opens_in": _in(gate.until, now)}
    return {"kind": gate.kind, "setting": gate.setting, "opens_in": _in(gate.until, now),
            "text": gate.text}


def _suspended(s: Suspension, what: str, now: float) -> Reason:
    why = f": {s.reason}" if s.reason else " (no reason given)"
    return reason(
        "suspended", "pyqmgr suspend",
        f"{what} is suspended by {s.who}{why}; the suspension ends "
        f"{until(_in(s.until, now))} unless 'pyqmgr resume' ends it sooner",
        by=s.who, suspension_reason=s.reason, ends_in=_in(s.until, now))


def _busy(t: Transport) -> int:
    return sum(q.busy_count for q in t.queues.values())


def transport_status(sched: Scheduler, t: Transport, now: float) -> dict[str, object]:
    todo = [e for q in t.queues.values() for e in q.todo]
    return {
        "name": t.name,
        "policy": t.policy.name,
        "agents_busy": _busy(t),
        "agents_pending": t.pending,
        "process_limit": sched.process_limit(t.name),
        "destinations": len(t.queues),
        "queued_entries": len(todo),
        "queued_recipients": sum(len(e.recipients) for e in todo),
        "dead": t.throttled,
        "reason": t.dsn.reason if t.dsn is not None else None,
        "retry_in": _in(t.revive_at, now),
        "rate_lock": t.rate_lock,
        "suspended": suspension_status(t.suspension, now),
        "policy_state": t.policy.describe(),
    }


def destination_status(queue: Queue, now: float) -> dict[str, object]:
    t = queue.transport
    return {
        "transport": t.name,
        "name": queue.name,
        "nexthop": queue.nexthop,
        "window": max(queue.window, 0),
        "limit": t.cfg.destination_concurrency_limit,
        "in_flight": queue.busy_count,
        "queued_entries": len(queue.todo),
        "queued_recipients": sum(len(e.recipients) for e in queue.todo),
        "success": round(queue.success, 3),
        "failure": round(queue.failure, 3),
        "fail_cohorts": round(queue.fail_cohorts, 3),
        "state": queue.status,
        "dead": queue.throttled,
        "reason": queue.dsn.reason if queue.dsn is not None else None,
        "retry_in": _in(queue.revive_at, now),
        "rate_delayed_for": _in(queue.paused_until, now) if queue.paused else None,
        "suspended": suspension_status(
            queue.gate if isinstance(queue.gate, Suspension) else None, now),
        "gate": _gate_status(queue.gate, now),
        "cap": queue.cap or None,
        **({"site": queue.site.name} if queue.site is not None else {}),
    }


def site_status(site: Site, now: float) -> dict[str, object]:
    """One provider site (issue #33), as ``pyqmgr status`` shows it."""
    shape = site.shape
    return {
        "transport": site.transport,
        "name": site.name,
        "destinations": len(site.members),
        "in_flight": site.busy,
        "limit": site.limit,
        "bound": site.bound,
        "state": "open" if site.gate is None else site.gate.kind,
        "opens_in": _in(site.gate.until, now) if site.gate is not None else None,
        "rule": shape.rule.where if shape is not None and shape.rule is not None else None,
        "rate_factor": round(shape.rate_factor, 3) if shape is not None else 1.0,
    }


def status(sched: Scheduler, now: float) -> dict[str, object]:
    """Every transport and every in-core destination, as ``pyqmgr status`` shows them."""
    transports = sorted(sched.transports.values(), key=lambda t: t.name)
    return {
        "messages": sched.message_count,
        "recipients": sched.rcpt_count,
        "transports": [transport_status(sched, t, now) for t in transports],
        "destinations": [destination_status(q, now) for t in transports
                         for q in sorted(t.queues.values(), key=lambda q: q.name)],
        "suspensions": [suspension_status(s, now) for s in sched.suspensions],
        **({"sites": [site_status(site, now) for _, site in sorted(
            sched.sites.sites.items(), key=lambda kv: kv[0])]}
           if sched.sites is not None else {}),
    }


# -- explain -------------------------------------------------------------------------


def _capped(sched: Scheduler, staging: Queue, now: float) -> Reason:
    """A limited tenant's staged mail (:mod:`.tenant_cap`): the limit that holds it."""
    tenant, _, origin = staging.name[len(STAGED):].partition(" ")
    transport, _, name = origin.partition(":")
    t = sched.transports.get(transport)
    caps = t.tenant_caps if t is not None else None
    dest = t.queues.get(name) if t is not None else None
    if caps is None:
        return reason("tenant's share", f"{transport}_{tenant_cap.PARAM}",
                      f"tenant {tenant}'s mail for {name} is staged", tenant=tenant)
    scope = tenant_cap.site_scope(caps, dest) if dest is not None else None
    for where, limit, spacing, param, rate_param in (
            (name, caps.limit, caps.spacing, tenant_cap.PARAM, tenant_cap.RATE_PARAM),
            (scope, caps.site_limit, caps.site_spacing, tenant_cap.SITE_PARAM,
             tenant_cap.SITE_RATE_PARAM)):
        if where is None:
            continue
        count = caps.counts.get((tenant, where), 0)
        if limit and count >= limit:
            return reason("tenant's share", f"{transport}_{param}",
                          f"tenant {tenant} has {count} deliveries for {where} under way "
                          f"or waiting, its cap of {limit}: this one follows as one of "
                          "them ends", tenant=tenant, in_use=count, limit=limit)
        at = caps.next_at.get((tenant, where), 0.0)
        if spacing and at > now:
            return reason("tenant's rate", f"{transport}_{rate_param}",
                          f"tenant {tenant} sends to {where} one delivery every "
                          f"{duration(spacing)}: the next {until(at - now)}",
                          tenant=tenant, until=at)
    return reason("tenant's share", f"{transport}_{tenant_cap.PARAM}",
                  f"tenant {tenant}'s mail for {name} follows now", tenant=tenant)


def _transport_reasons(sched: Scheduler, t: Transport, now: float,
                       queue: Queue | None = None) -> list[Reason]:
    out: list[Reason] = []
    if t.name == HELD:
        # A suspended or capped tenant's mail: its own suspensions or cap say why.
        held = [queue] if queue is not None else list(t.queues.values())
        names = sorted({q.name.partition(" ")[0] for q in held})
        return [_suspended(s, str(s.target), now) for tenant in names
                for s in sched.suspensions.tenants.get(tenant, ())] + [
            _capped(sched, q, now) for q in held if q.name.startswith(STAGED)][:1]
    if t.suspension is not None:
        out.append(_suspended(t.suspension, f"transport {t.name}", now))
    if t.throttled:
        retry = _in(t.revive_at, now)
        out.append(reason(
            "transport unavailable", "transport_retry_time",
            f"transport {t.name} is dead ({t.dsn.reason if t.dsn else 'unknown'}); "
            f"tried again {until(retry)}", retry_in=retry))
    limit = sched.process_limit(t.name)
    busy = _busy(t)
    if limit and busy + t.pending >= limit:
        out.append(reason(
            "process limit", f"master.cf {t.name} maxproc",
            f"transport {t.name} has {busy} deliveries and {t.pending} agents pending "
            f"of its process limit {limit}", busy=busy, limit=limit))
    if t.rate_lock:
        out.append(reason(
            "transport rate delay", f"{t.name}_transport_rate_delay",
            f"transport {t.name} waits {duration(t.cfg.transport_rate_delay)} between "
            "deliveries"))
    return out


def _queue_reasons(sched: Scheduler, queue: Queue, now: float) -> list[Reason]:
    t = queue.transport
    out: list[Reason] = []
    if queue.throttled:
        since = (queue.revive_at - sched.min_backoff_time
                 if queue.revive_at is not None else None)
        out.append(reason(
            "dead destination", "minimal_backoff_time",
            f"{queue.nexthop} is dead for {duration(-(_in(since, now) or 0.0))} after "
            f"{queue.fail_cohorts:g} failed cohorts (limit "
            f"{t.cfg.failed_cohort_limit}: {t.name}_destination_concurrency_failed_"
            f"cohort_limit): {queue.dsn.reason if queue.dsn else 'unknown'}; retried "
            f"{until(_in(queue.revive_at, now))}", since=_in(since, now),
            retry_in=_in(queue.revive_at, now), fail_cohorts=queue.fail_cohorts))
        return out
    gate = queue.gate
    if isinstance(gate, Suspension):
        out.append(_suspended(gate, queue.nexthop, now))
        return out
    if gate is not None:
        opens = _in(gate.until, now)
        out.append(reason(gate.kind, gate.setting, gate.text + (
            f"; next start {until(opens)}" if opens is not None else
            "; the next starts when one of its deliveries ends"), opens_in=opens))
        return out
    if queue.paused:
        out.append(reason(
            "rate delay", f"{t.name}_destination_rate_delay",
            f"{queue.nexthop} waits {duration(t.cfg.destination_rate_delay)} between "
            f"deliveries; next {until(_in(queue.paused_until, now))}",
            resume_in=_in(queue.paused_until, now)))
        return out
    room = t.room(queue)
    if room <= 0:
        limit = t.cfg.destination_concurrency_limit
        cap = t.dest_cap
        if cap and queue.busy_count >= cap and (queue.window > cap or not limit):
            out.append(reason(
                "policy destination cap", f"{t.name}_scheduler_policy",
                f"the {t.policy.name} policy allows {cap} delivery at a time to "
                f"{queue.nexthop}", cap=cap))
        elif queue.cap and queue.window >= queue.cap and (not limit or queue.cap < limit):
            rule = queue.shape.rule if queue.shape is not None else None
            where = rule.where if rule else f"{t.name}_response_rules"
            action = rule.describe() if rule else "-"
            out.append(reason(
                "window capped by throttling", where,
                f"{queue.nexthop} has {queue.busy_count} deliveries in flight, its window "
                f"is capped at {queue.cap} after throttling replies ({action}); the cap "
                "rises after a quiet interval", window=queue.window, cap=queue.cap))
        elif limit and queue.window >= limit:
            out.append(reason(
                "window full", f"{t.name}_destination_concurrency_limit",
                f"{queue.nexthop} has {queue.busy_count} deliveries in flight, its "
                f"window is at the limit {limit}", window=queue.window, limit=limit))
        else:
            out.append(reason(
                "window full", f"{t.name}_destination_concurrency_positive_feedback",
                f"{queue.nexthop} has {queue.busy_count} deliveries in flight, its "
                f"window is {queue.window} (below the limit "
                f"{limit or 'none'}; it grows with successful deliveries)",
                window=queue.window, limit=limit))
    return out


def _held(queue: Queue) -> bool:
    """Suspended by an operator: the policy's reasons (a blocker job) follow from that."""
    return isinstance(queue.gate, Suspension) or queue.transport.suspension is not None


def _find_queues(sched: Scheduler, target: str) -> list[Queue]:
    key = target.lower()
    return [q for t in sched.transports.values() for q in t.queues.values()
            if q.name.lower() == key or q.nexthop.lower() == key]


def _find_message(sched: Scheduler, queue_id: str) -> tuple[Message | None, list[Entry]]:
    """The message and its entries waiting in core (a walk over every todo list)."""
    message = None
    entries = []
    for t in sched.transports.values():
        for q in t.queues.values():
            for e in q.todo:
                if e.message.queue_id == queue_id:
                    message = e.message
                    entries.append(e)
    return message, entries


def explain(sched: Scheduler, target: str, now: float,
            busy: list[Entry] | None = None) -> dict[str, object]:
    """Why ``target`` (a destination or a queue id) is not being delivered right now.

    ``busy`` is the daemon's list of entries out with agents (the core keeps no list
    of them), so that a message being delivered says so.
    """
    queues = _find_queues(sched, target)
    if queues:
        reasons: list[Reason] = []
        for queue in queues:
            t = queue.transport
            reasons += _transport_reasons(sched, t, now)
            reasons += _queue_reasons(sched, queue, now)
            if not t.broken and not _held(queue):
                reasons += t.policy.explain(queue, None)
            if not queue.todo and not queue.throttled:
                reasons.append(reason(
                    "nothing waiting", "",
                    f"no mail for {queue.nexthop} waits in the active queue "
                    f"({queue.busy_count} in flight); deferred mail waits for its "
                    "retry time (postqueue -p shows it)"))
        if not reasons:
            reasons.append(reason("none", "", "deliverable now: the next free agent "
                                              "of its transport takes it"))
        return {"target": target, "kind": "destination",
                "destinations": [destination_status(q, now) for q in queues],
                "reasons": reasons}
    held = [s for s in sched.suspensions
            if s.target.destination is not None and s.target.destination == target.lower()]
    if held:
        # Suspended with nothing for it in core now: mail that comes is held.
        return {"target": target, "kind": "destination", "destinations": [],
                "reasons": [_suspended(s, str(s.target), now) for s in held]}
    message, entries = _find_message(sched, target)
    in_flight = [e for e in (busy or []) if e.message.queue_id == target]
    if message is None and in_flight:
        message = in_flight[0].message
    if message is None:
        # The daemon then looks for a queue file of that name (pyqmgr.daemon.queued).
        return {"target": target, "kind": "unknown", "reasons": [reason(
            "not found", "",
            f"{target} is neither a destination in core nor a message in the queue: a "
            "message delivered, returned or deleted, or a destination with no mail in "
            "the active queue now (pyqmgr status lists those in core; postqueue -p the "
            "messages)")]}
    reasons = []
    if in_flight:
        reasons.append(reason("in flight", "",
                              f"{len(in_flight)} deliveries of {target} are under way"))
    seen: set[int] = set()
    for e in entries:
        queue = e.queue
        if id(queue) in seen:
            continue
        seen.add(id(queue))
        t = queue.transport
        for r in _transport_reasons(sched, t, now, queue) + _queue_reasons(sched, queue, now):
            reasons.append({**r, "destination": queue.nexthop})
        if not t.broken and not _held(queue):
            # Asked once per destination; a reason about the message itself (nqmgr's
            # blocker or preempted job, finch's concurrency) comes back each time.
            reasons += [r for r in t.policy.explain(queue, message) if r not in reasons]
    if message.more and message.rcpt_limit <= message.rcpt_count and message.jobs:
        reasons.append(reason(
            "recipient slots used up", "qmgr_message_recipient_limit",
            f"{target} has {message.rcpt_unread} recipients still in its file; more are "
            f"read as its {message.rcpt_count} in-core recipients finish"))
    if not reasons and entries:
        reasons.append(reason("none", "", "deliverable now: the next free agent of its "
                                          "transport takes it"))
    return {"target": target, "kind": "message", "queue": "active", "in_core": True,
            "queued_entries": len(entries), "in_flight": len(in_flight),
            "reasons": reasons}


def destination_state(sched: Scheduler, transport: str, nexthop: str,
                      now: float) -> dict[str, object]:
    """Where a queued message's recipient goes, as ``explain`` of it says: its state
    in core and why nothing goes there now, or that it is not in core.

    A message in the deferred queue names its destination only through its
    recipients (the daemon routes them as the feeder would); this is that
    destination's side: dead, suspended, shaped, at its window, or unknown to the
    scheduler because no mail for it is in the active queue.
    """
    t = sched.transports.get(transport)
    key = nexthop.lower()
    queues = ([q for q in t.queues.values() if q.nexthop.lower() == key]
              if t is not None else [])
    reasons: list[Reason] = _transport_reasons(sched, t, now) if t is not None else []
    for queue in queues:
        reasons += _queue_reasons(sched, queue, now)
    if not queues:
        reasons += [_suspended(s, str(s.target), now) for s in sched.suspensions
                    if s.target.destination == key
                    and s.target.transport in (None, transport)]
    return {"transport": transport, "nexthop": nexthop, "in_core": bool(queues),
            "destinations": [destination_status(q, now) for q in queues],
            "reasons": [{**r, "destination": nexthop} for r in reasons]}


# -- jobs ----------------------------------------------------------------------------


def jobs(sched: Scheduler, transport: str, now: float,
         limit: int | None = None) -> dict[str, object] | None:
    """``pyqmgr jobs TRANSPORT``: its policy's work in the policy's own order.

    None when no such transport is in core (a transport appears when mail for it
    first reaches the active queue). A transport whose policy raised is not asked
    again (its state may be half-changed): its destinations are shown as the
    default :meth:`Policy.jobs_report` reads them from the shared structures.
    """
    t = sched.transports.get(transport)
    if t is None:
        return None
    if t.broken:
        report = Policy.jobs_report(cast(Policy, t.policy), now, limit)
    else:
        report = t.policy.jobs_report(now, limit)
    return {"transport": t.name, **report, "policy": t.policy.name, "broken": t.broken}


# -- what the metrics read of sites ----------------------------------------------------
# The Prometheus exporter (pyqmgr/daemon/metrics*.py) reads sites through these three,
# so that it names nothing of a site's structure: a reply's site for its activity, the
# sites to walk, and each one's numbers (issue #44).


def site_name(queue: Queue) -> str | None:
    """The provider site a destination is counted at; None: none (sites off, an
    address, a transport without sites)."""
    site = queue.site
    return None if site is None else site.name


def sites_in_core(sched: Scheduler) -> list[Site]:
    """The sites in core now, as a list the caller may walk while the core changes."""
    return [] if sched.sites is None else list(sched.sites.sites.values())


def site_load(site: Site) -> tuple[str, str, int, int, int, int]:
    """(transport, name, deliveries in flight, the limit in force (0: none),
    destinations in core, 1 while it takes no delivery else 0) of a site."""
    return (site.transport, site.name, site.busy, site.bound, len(site.members),
            0 if site.gate is None else 1)
