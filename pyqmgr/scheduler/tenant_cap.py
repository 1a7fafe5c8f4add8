"""A tenant's limits at a destination and at a site (issue #34).

One tenant's flood can take every session a destination gives the relay, and its
throttling then falls on everyone. Four settings (each per transport too, by
Postfix's naming rule: ``smtp_tenant_concurrency_limit``) bound what one tenant takes:

=================================  ===================================================
``tenant_concurrency_limit``       each tenant's most entries (deliveries under way or
                                   waiting for an agent) at one destination
``tenant_site_concurrency_limit``  the same at one site (sites on: every destination
                                   one provider's MX hosts serve, :mod:`.site`)
``tenant_rate``                    each tenant's most entries a period at one
                                   destination (``N/PERIOD``: ``10/1s``, ``600/h``)
``tenant_site_rate``               the same at one site
=================================  ===================================================

A tenant's mail beyond them waits staged in a queue of the transport ``pyqmgr-held``
(named ``+TENANT TRANSPORT:QUEUE``, beside the suspended tenants' queues of
:mod:`.tenant_hold`) and comes back oldest first when the limit allows: one each time
one of its entries there ends (O(1) a delivery; at a site, the site's staging queues
take turns), and at the time a rate gives the next slot (a timer per staging queue).
The destination's window, and every other tenant's mail, are untouched; a tenant's
share is its own limit, not a slice of the window. A rate counts entries as they
enter the destination's queue, which is when they become deliveries the window may
start: the tenant's mail there starts at most that often.

The counts are kept by scope: a destination queue's name, or a site's scope name
(:data:`~pyqmgr.scheduler.structures.SITE_SCOPE`, "site " and its name, as the
fleet's units; no queue name has a space). An entry counted at a site remembers which
(:attr:`TenantCaps.site_of`): a destination's site may be learnt or change while the
entry is out, and the count it ends must be the one it started.

A destination that dies while a tenant's mail is staged for it sends that mail to
the retry transport with its own, as new mail would be; a tenant suspended there
(:mod:`.tenant_hold`) takes its staged mail with it, and what comes back is limited
again. The moves themselves are :mod:`.entry`'s (this module cannot import it).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pyqmgr.scheduler.held import HELD, STAGED, held_queue_for, holding
from pyqmgr.scheduler.queue import queue_obtain
from pyqmgr.scheduler.structures import ERROR, RETRY, SITE_SCOPE, TenantCaps

if TYPE_CHECKING:
    from pyqmgr.scheduler.message import Message
    from pyqmgr.scheduler.state import Core
    from pyqmgr.scheduler.structures import Entry, Queue, Transport


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """One transport's limits on each tenant, as pyqmgr.cf sets them (0: none):
    entries at a destination and at a site, and the seconds between a tenant's
    entries there (its rate's interval)."""

    limit: int = 0
    site_limit: int = 0
    spacing: float = 0.0
    site_spacing: float = 0.0


@dataclass(frozen=True, slots=True)
class TenantLimitTable:
    """Every transport's :class:`TenantLimits`, read and checked once from pyqmgr.cf
    (:func:`pyqmgr.settings.tenants.tenant_limits`): the global values, and those of
    each transport a ``<transport>_`` form names."""

    default: TenantLimits
    by_transport: dict[str, TenantLimits] = field(default_factory=dict)

    def for_transport(self, transport: str) -> TenantLimits:
        return self.by_transport.get(transport, self.default)


PARAM = "tenant_concurrency_limit"
SITE_PARAM = "tenant_site_concurrency_limit"
RATE_PARAM = "tenant_rate"
SITE_RATE_PARAM = "tenant_site_rate"
#: Past rate slots kept before a sweep drops the stale ones (bounded memory: a tenant
#: that sent to 100,000 destinations once must not keep 100,000 slots).
NEXT_KEPT = 10_000


def caps_for(table: TenantLimitTable | None, transport: str) -> TenantCaps | None:
    """The transport's tenant caps, from the parsed limits; None when it has none
    (the retry, error and held transports never have any)."""
    if table is None or transport in (RETRY, ERROR, HELD):
        return None
    limits = table.for_transport(transport)
    if not (limits.limit or limits.site_limit or limits.spacing or limits.site_spacing):
        return None
    return TenantCaps(limits.limit, limits.site_limit, limits.spacing, limits.site_spacing)


def site_scope(caps: TenantCaps, queue: Queue) -> str | None:
    """The site scope a queue's entries count in, or None (no site, or no site limit)."""
    if queue.site is None or not (caps.site_limit or caps.site_spacing):
        return None
    return SITE_SCOPE + queue.site.name


def blocked(caps: TenantCaps, tenant: str, queue: Queue, now: float) -> float | None:
    """None when one more of the tenant's entries may enter ``queue`` now; else 0.0
    when it waits for one of its entries to end, or the time its rate allows one."""
    wait: float | None = None
    for scope, limit, spacing in ((queue.name, caps.limit, caps.spacing),
                                  (site_scope(caps, queue), caps.site_limit,
                                   caps.site_spacing)):
        if scope is None:
            continue
        key = (tenant, scope)
        if limit and caps.counts.get(key, 0) >= limit:
            return 0.0
        if spacing and (at := caps.next_at.get(key, 0.0)) > now:
            wait = at if wait is None else max(wait, at)
    return wait


def capped_queue(core: Core, message: Message, queue: Queue) -> Queue:
    """Where a new entry of the message's tenant for ``queue`` goes: ``queue`` while
    the tenant's limits there allow it, else its staging queue."""
    caps = queue.transport.tenant_caps
    if caps is None or not message.tenant:
        return queue
    tenant = message.tenant
    wait = blocked(caps, tenant, queue, core.now)
    if wait is None:
        return queue
    staging = staging_queue(core, caps, tenant, queue)
    if wait > 0:
        arm(core, caps, staging, wait)
    return staging


def staging_queue(core: Core, caps: TenantCaps, tenant: str, queue: Queue) -> Queue:
    """The tenant's staging queue for ``queue``, known to the queue's site."""
    staging = held_queue_for(core, tenant, queue, staged=True)
    scope = site_scope(caps, queue)
    if scope is not None:
        caps.staged_at.setdefault((tenant, scope), {})[staging.name] = staging
    return staging


def recount(caps: TenantCaps, queue: Queue) -> list[Entry]:
    """The queue moved to another site (its MX lookup answered): its tenants'
    entries counted at the old site count at the new one. Returns the todo entries,
    newest first, that put a tenant over its site limit there: they go back to
    staging (the caller moves them: the moves are :mod:`.entry`'s)."""
    scope = site_scope(caps, queue)
    if scope is None or not caps.site_limit:
        return []
    mine = caps.site_of.get(queue, {})
    for entry, old in mine.items():
        if old != scope:
            tenant = entry.message.tenant
            _less(caps, (tenant, old))
            caps.counts[(tenant, scope)] = caps.counts.get((tenant, scope), 0) + 1
            mine[entry] = scope
    over: list[Entry] = []
    extra: dict[str, int] = {}
    for entry in reversed(list(queue.todo)):
        tenant = entry.message.tenant
        if not tenant or mine.get(entry) != scope:
            continue
        if extra.get(tenant, 0) + caps.site_limit < caps.counts.get((tenant, scope), 0):
            extra[tenant] = extra.get(tenant, 0) + 1
            over.append(entry)
    return over


def arm(core: Core, caps: TenantCaps, staging: Queue, when: float) -> None:
    """A staging queue's mail may go at ``when`` (a rate's next slot): wake then."""
    if caps.armed.get(staging.name, -1.0) == when:
        return
    caps.armed[staging.name] = when
    heapq.heappush(caps.timed, (when, staging.name))
    core.out.timers.append(when)


def made(queue: Queue, entry: Entry, now: float) -> None:
    """A new entry of a tenant landed in ``queue``: count it, take its rate slot."""
    caps = queue.transport.tenant_caps
    tenant = entry.message.tenant
    if caps is None or not tenant:
        return
    scope = site_scope(caps, queue)
    for where, limit, spacing in ((queue.name, caps.limit, caps.spacing),
                                  (scope, caps.site_limit, caps.site_spacing)):
        if where is None:
            continue
        key = (tenant, where)
        if limit:
            caps.counts[key] = caps.counts.get(key, 0) + 1
        if spacing:
            caps.next_at[key] = max(caps.next_at.get(key, now), now) + spacing
            if len(caps.next_at) > NEXT_KEPT:
                caps.next_at = {k: at for k, at in caps.next_at.items() if at > now}
    if scope is not None and caps.site_limit:
        caps.site_of.setdefault(queue, {})[entry] = scope


def ended(caps: TenantCaps, entry: Entry) -> str | None:
    """An entry of a tenant ended at its queue: one fewer there (and at its site);
    the site scope it counted in, whose staged mail may now follow."""
    tenant = entry.message.tenant
    if caps.limit:
        _less(caps, (tenant, entry.queue.name))
    mine = caps.site_of.get(entry.queue)
    scope = mine.pop(entry, None) if mine is not None else None
    if scope is not None:
        _less(caps, (tenant, scope))
        if not mine:
            del caps.site_of[entry.queue]
    return scope


def _less(caps: TenantCaps, key: tuple[str, str]) -> None:
    left = caps.counts.get(key, 0) - 1
    if left > 0:
        caps.counts[key] = left
    else:
        caps.counts.pop(key, None)


def destination(core: Core, staging: Queue) -> Queue | None:
    """The destination queue a staging queue holds mail for (made again if it left the
    core while idle); None when its transport is gone or has no limits."""
    origin = staging.name.partition(" ")[2]
    transport, _, name = origin.partition(":")
    t = core.transports.get(transport)
    if t is None or t.tenant_caps is None:
        return None
    return t.queues.get(name) or queue_obtain(core, t, name, staging.nexthop)


def next_release(core: Core, staging: Queue, dest: Queue) -> Entry | None:
    """The staging queue's oldest entry if the tenant's limits at ``dest`` let it go
    now; else None (and, when a rate is what holds it, a timer for its slot)."""
    caps = dest.transport.tenant_caps
    oldest = staging.todo.first()
    if caps is None or oldest is None or dest.throttled:
        return None
    tenant = oldest.message.tenant
    if holding(core, tenant, dest) is not None:
        return None
    wait = blocked(caps, tenant, dest, core.now)
    if wait is None:
        return oldest
    if wait > 0:
        arm(core, caps, staging, wait)
    return None


def site_release(caps: TenantCaps, tenant: str, scope: str,
                 release: Callable[[Queue], bool]) -> bool:
    """Offer the tenant's staging queues with mail for the site's destinations to
    ``release`` in turn until one releases mail; whether one did. The first in turn
    goes to the end first, so that a site's destinations share its slots.

    A delivery's end costs the stagings tried, not the site's (#44: a site of 30,000
    domains made it 1.7 ms): the turn stops at the first that releases, and a drained
    staging leaves the index the first time it is met (paid for by its entry). The
    moves are :mod:`.entry`'s, hence ``release``; it changes the index only when it
    releases, which ends the walk."""
    key = (tenant, scope)
    index = caps.staged_at.get(key)
    while index and not next(iter(index.values())).todo:
        del index[next(iter(index))]
    if not index:
        caps.staged_at.pop(key, None)
        return False
    first = next(iter(index))
    index[first] = index.pop(first)
    drained: list[str] = []
    try:
        for name, staging in index.items():
            if not staging.todo:
                drained.append(name)
            elif release(staging):
                return True
        return False
    finally:
        for name in drained:
            index.pop(name, None)
        if not index:
            caps.staged_at.pop(key, None)


def due(core: Core, t: Transport, now: float) -> list[Queue]:
    """The staging queues whose rate slot has come (their timers fired)."""
    caps = t.tenant_caps
    out: list[Queue] = []
    if caps is None:
        return out
    held = core.transports.get(HELD)
    while caps.timed and caps.timed[0][0] <= now:
        when, name = heapq.heappop(caps.timed)
        if caps.armed.get(name) != when:
            continue
        del caps.armed[name]
        staging = held.queues.get(name) if held is not None else None
        if staging is not None and staging.todo and staging.name.startswith(STAGED):
            out.append(staging)
    return out
