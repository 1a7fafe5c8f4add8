"""Operators' controls on the core: ``pyqmgr suspend``, ``resume`` and ``retry``.

A suspension holds a destination or a whole transport: mail stays in core and no agent
is asked for it until its time runs out (``Scheduler.tick``) or it is resumed. Retry
revives dead destinations now, as a flush does for all. The daemon's
:mod:`pyqmgr.daemon.suspensions` checks who asks and keeps the state file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyqmgr.scheduler import tenant_hold
from pyqmgr.scheduler.gates import regate
from pyqmgr.scheduler.queue import queue_done, queue_unthrottle
from pyqmgr.scheduler.suspension import Target

if TYPE_CHECKING:
    from pyqmgr.scheduler.state import Core
    from pyqmgr.scheduler.structures import Queue, Transport
    from pyqmgr.scheduler.suspension import Suspension


def matching_queues(core: Core, target: Target) -> list[Queue]:
    """The in-core destination queues a destination (or site) target covers."""
    if target.site is not None:
        table = core.sites
        if table is None:
            return []
        # One transport's site (``out11:site:google``) is one dict lookup; a site in
        # every transport one a transport. Then the site's members, once.
        names = [target.transport] if target.transport is not None else list(core.transports)
        found: list[Queue] = []
        for name in names:
            site = table.sites.get((name, target.site))
            if site is not None:
                found.extend(site.members)
        return found
    dest = target.destination
    if dest is None:
        return []
    if target.transport is not None:
        t = core.transports.get(target.transport)
        transports = [t] if t is not None else []
    else:
        transports = list(core.transports.values())
    return [q for t in transports for q in t.queues.values()
            if q.name.lower() == dest or q.nexthop.lower() == dest]


def resume(core: Core, target: Target) -> Suspension | None:
    s = core.suspensions.remove(target)
    if s is not None:
        apply_target(core, target)
    return s


def _whole_transport(core: Core, target: Target) -> Transport | None:
    """The in-core transport a whole-transport target (``TRANSPORT:``) names."""
    assert target.transport is not None
    return core.transports.get(target.transport)


def apply_target(core: Core, target: Target) -> list[str]:
    """Bring the queues and transport of ``target`` in line with the table."""
    if target.tenant is not None:
        return tenant_hold.apply(core, target)
    names: list[str] = []
    if target.destination is None and target.site is None:
        t = _whole_transport(core, target)
        if t is not None:
            was = t.suspension
            t.suspension = core.suspensions.for_transport(t.name)
            names.append(t.name)
            if was is not None and t.suspension is None:
                t.rate_lock = False
        return names
    for queue in matching_queues(core, target):
        names.append(f"{queue.transport.name}:{queue.name}")
        regate(core, queue)
    return names


def _still_throttled(t: Transport) -> bool:
    """Read afresh after an unthrottle: mypy keeps ``t.throttled`` narrowed to True
    across the call, and the compiled build (mypyc) would take its word for it."""
    return t.throttled


def retry(core: Core, target: Target) -> list[str]:
    if target.tenant is not None:
        # A tenant is not dead or alive; its target's destinations may be.
        if target.everywhere:
            return []
        target = Target(target.transport, target.destination, target.site)
    revived: list[str] = []
    if target.destination is None and target.site is None:
        t = _whole_transport(core, target)
        if t is not None and t.throttled:
            core.transport_unthrottle(t)
            if not _still_throttled(t):
                revived.append(t.name)
        return revived
    for queue in matching_queues(core, target):
        if queue.throttled:
            queue_unthrottle(queue)
            revived.append(f"{queue.transport.name}:{queue.name}")
            if queue.ready and queue.idle:
                queue_done(core, queue)
    return revived


def suspend(core: Core, s: Suspension) -> None:
    """Put an operator's suspension in force; the in-core queues it now covers.

    The timer at ``s.until`` ends it (:meth:`tick`), whether or not anything is
    in core for it now: mail that comes later is held too.
    """
    core.suspensions.add(s)
    core.out.timers.append(s.until)
    core.out.affected.extend(apply_target(core, s.target))
