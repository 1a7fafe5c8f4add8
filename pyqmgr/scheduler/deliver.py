"""An agent's delivery: the entry it gets, and what its reply does (``qmgr_deliver.c``).

When an agent of a transport announces itself, the transport's policy picks the entry
it delivers (:func:`deliver_select`). When the agent's reply comes back,
:func:`deliver_update` turns it into feedback, as stock's ``qmgr_deliver_update``
does: a hop failure is negative feedback on the destination's window (and may kill
the site, deferring its waiting mail), a reply a shaping rule calls throttling slows
the destination instead, and any usable reply revives the transport.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from pyqmgr.scheduler import recovery, tenant_hold
from pyqmgr.scheduler.decisions import DEAD, Throttling
from pyqmgr.scheduler.defer import defer_todo
from pyqmgr.scheduler.entry import entry_done
from pyqmgr.scheduler.gates import started, throttled
from pyqmgr.scheduler.queue import queue_unthrottle
from pyqmgr.scheduler.recovery import SITE_SUSPENDED
from pyqmgr.scheduler.scope import scopes_started
from pyqmgr.scheduler.site import site_speaks, site_throttled
from pyqmgr.scheduler.structures import THROTTLED, Dsn

if TYPE_CHECKING:
    from pyqmgr.scheduler.state import Core
    from pyqmgr.scheduler.structures import Entry, Queue

_DSN_RE = re.compile(r"[245]\.\d{1,3}\.\d{1,3}$")


def dsn_valid(status: str) -> bool:
    """Is this an enhanced status code stock would accept from an agent?"""
    return bool(_DSN_RE.match(status))


def deliver_select(core: Core, name: str) -> Entry | None:
    t = core.transports.get(name)
    if t is None:
        return None
    if t.pending > 0:
        t.pending -= 1
    try:
        entry = None if t.broken or t.suspension is not None else t.policy.select()
    except Exception as exc:  # noqa: BLE001 - a policy's bug must not lose mail
        core.policy_failed(t, "select", exc)
        entry = None
    if entry is not None and t.shaping is not None:
        entry.started = core.now
        started(core, entry.queue)
    if entry is not None:
        scopes_started(core, entry)  # its site's and tenant's counts (:mod:`.scope`)
    if entry is None:
        # Stock would keep the rate lock until some delivery ends; with none under
        # way the transport would never be chosen again.
        t.rate_lock = False
    return entry


def _site_dies(core: Core, queue: Queue, dsn: Dsn, now: float) -> None:
    """``site_dead_scope = site``: a destination found dead takes its site's other
    destinations with it, each dead as stock's dead site is (its waiting mail to the
    retry transport, tried again after minimal_backoff_time)."""
    site = queue.site
    assert site is not None
    others = [m for m in site.members if m is not queue and m.ready]
    for member in others:
        member.window = THROTTLED
        member.dsn = dsn
        member.revive_at = now + core.min_backoff_time
        member.transport.timed_at(member, member.revive_at)
        member.transport.destinations_died += 1
        defer_todo(core, member, dsn)
        member.transport.sync(member)
    if others:
        core.out.log.append(("info", f"sites: site {site.name} ({site.transport}): "
                                     f"{queue.nexthop} is dead, and so are its "
                                     f"{len(others)} other destinations "
                                     "(site_dead_scope = site)"))


def deliver_update(core: Core, entry: Entry, status: int, hop: Dsn | None, crashed: bool,
         now: float) -> None:
    """A delivery finished (``qmgr_deliver_update``).

    ``status`` is the agent's final status (0 all final, else retry needed);
    ``hop`` is the agent's hop-level DSN when it reported one; ``crashed`` means
    no usable reply at all (3.7.11 behaviour: defer the message, leave the
    transport's state alone).
    """
    core.now = now
    queue = entry.queue
    t = queue.transport
    message = entry.message
    if queue.shape is not None and t.shaping is not None and t.shaping.rules:
        queue.shape.dones.append(now)
    if crashed or status != 0:
        message.deferred = True
        rule = None
        if hop is not None and hop.status and t.shaping is not None and t.shaping.rules:
            rule = t.shaping.match(hop.status, hop.reason)
        if rule is not None and rule.throttle and hop is not None:
            # Throttling, not failure: the rule's action instead of negative
            # feedback, and never a failed cohort (the site is alive).
            throttled(core, queue, rule, hop, now, entry.started)
            # The whole site slows only for a reply from one of its own hosts.
            site_wide = site_speaks(core, queue, hop.reason)
            if queue.site is not None and site_wide:
                site_throttled(core, queue.site, rule, now, entry.started)
            if rule.suspend_tenant is not None and message.tenant:
                tenant_hold.rule_holds(core, message.tenant, queue, rule, hop, now,
                                       site_wide)
            if core.recovery_watch is not None:
                recovery.wait(core, message, t.name, queue.name, recovery.why(hop, rule.where))
        elif hop is not None and hop.status:
            dsn = Dsn(
                hop.status if dsn_valid(hop.status) else "4.0.0",
                SITE_SUSPENDED + (hop.reason or "unknown error"),
            )
            if core.recovery_watch is not None:
                # A site failure: this mail waits for the site, which is watched
                # once it is dead (_defer_todo).
                recovery.wait(core, message, t.name, queue.name, None)
            if queue.ready:
                if queue.throttle(dsn, now, core.min_backoff_time):
                    core.out.timers.append(now + core.min_backoff_time)
                    defer_todo(core, queue, dsn)
                    site = queue.site
                    if site is not None and site.limits is not None and \
                            site.limits.dead_takes_site and \
                            site_speaks(core, queue, hop.reason):
                        _site_dies(core, queue, dsn, now)
                    if core.share_throttling:
                        core.out.throttled.append(Throttling(
                            t.name, queue.name, queue.nexthop, DEAD, dsn.status,
                            hop.reason or "unknown error", core.min_backoff_time))
                t.sync(queue)
    if not crashed:
        core.transport_unthrottle(t)
        if hop is None or not hop.reason:
            queue_unthrottle(queue)
            if status == 0 and core.recovery_watch:
                recovery.delivered_again(core, queue)
    entry_done(core, entry, busy=True)
