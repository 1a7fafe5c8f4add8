"""Dead and paused transports and destinations deliver again (``qmgr_enable.c``).

As time passes (:func:`enable_due`), operators' suspensions run out, dead transports
and sites reach their retry time and rate-delayed destinations resume; a flush
(``postqueue -f``, the ``F`` trigger) revives all of them at once (:func:`enable_all`).
An idle queue that is live again leaves the core.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from pyqmgr.scheduler import controls, tenant_cap
from pyqmgr.scheduler.queue import queue_done, queue_unthrottle
from pyqmgr.scheduler.site import site_due
from pyqmgr.scheduler.tenant_scope import tenant_release

if TYPE_CHECKING:
    from pyqmgr.scheduler.state import Core
    from pyqmgr.scheduler.structures import Transport


def enable_due(core: Core, now: float) -> None:
    """Time passed: revive dead transports and sites, resume rate-delayed ones."""
    core.now = now
    if core.sites is not None and core.sites.due:
        site_due(core, now)
    if core.suspensions:
        for s in core.suspensions:
            if now >= s.until:
                controls.resume(core, s.target)
                core.out.ended.append(s)
    for t in list(core.transports.values()):
        if t.revive_at is not None and now >= t.revive_at:
            core.transport_unthrottle(t)
        if t.tenant_caps is not None and t.tenant_caps.timed:
            _rate_slots(core, t, now)
        timed = t.timed
        while timed and timed[0][0] <= now:
            queue = heapq.heappop(timed)[2]
            if t.queues.get(queue.name) is not queue:
                continue  # it left the core (idle and live again, or discarded)
            if queue.revive_at is not None and now >= queue.revive_at:
                queue_unthrottle(queue)
                if queue.ready and queue.idle:
                    queue_done(core, queue)
            elif queue.paused_until is not None and now >= queue.paused_until:
                queue.unpause()
                t.sync(queue)
                if queue.ready and queue.idle:
                    queue_done(core, queue)
                elif not t.broken:
                    t.policy.resumed(queue)


def _rate_slots(core: Core, t: Transport, now: float) -> None:
    """A tenant's rate slot has come (tenant_rate, :mod:`.tenant_cap`): its staged
    mail for there follows."""
    for staging in tenant_cap.due(core, t, now):
        dest = tenant_cap.destination(core, staging)
        if dest is not None:
            tenant_release(core, staging, dest)


def enable_all(core: Core) -> None:
    """``F`` trigger: forget dead transports and destinations now."""
    for t in list(core.transports.values()):
        if t.throttled:
            core.transport_unthrottle(t)
        for queue in list(t.queues.values()):
            if queue.throttled:
                queue_unthrottle(queue)
            if queue.ready and queue.idle:
                queue_done(core, queue)
