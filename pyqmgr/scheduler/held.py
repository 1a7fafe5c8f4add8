"""The transport that holds tenants' mail: a suspended tenant's (:mod:`.tenant_hold`)
and a capped tenant's beyond its cap (:mod:`.tenant_cap`), issue #34.

``pyqmgr-held`` never gets an agent (an operator suspension of its own, in force for
good); its queues are named after the tenant and the queue the mail is for:
``TENANT TRANSPORT:QUEUE`` for a suspension, ``+TENANT TRANSPORT:QUEUE`` for a cap.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pyqmgr.scheduler.queue import queue_obtain
from pyqmgr.scheduler.suspension import Suspension, Target

if TYPE_CHECKING:
    from pyqmgr.scheduler.state import Core
    from pyqmgr.scheduler.structures import Queue, Transport

#: The transport that holds tenants' mail (no master.cf service has it).
HELD = "pyqmgr-held"
#: Its own suspension: in force for good, so that it never asks for an agent.
HELD_FOR_GOOD = Suspension(Target(HELD, None), "mail of suspended tenants (pyqmgr status "
                           "lists the suspensions)", "pyqmgr", 0.0, math.inf, math.inf)
#: A capped tenant's staging queue's name starts with this.
STAGED = "+"


def held_transport(core: Core) -> Transport:
    t = core.transport(HELD)
    t.suspension = HELD_FOR_GOOD
    return t


def held_queue_name(tenant: str, queue: Queue, staged: bool = False) -> str:
    return f"{STAGED if staged else ''}{tenant} {queue.transport.name}:{queue.name}"


def held_queue_for(core: Core, tenant: str, queue: Queue, staged: bool = False) -> Queue:
    """The held transport's queue for the tenant's mail to ``queue`` (made if new)."""
    return queue_obtain(core, held_transport(core), held_queue_name(tenant, queue, staged),
                        queue.nexthop)


def covers(target: Target, queue: Queue) -> bool:
    """Does a tenant suspension's target reach this (ordinary) destination queue?"""
    if target.transport is not None and target.transport != queue.transport.name:
        return False
    if target.site is not None:
        return queue.site is not None and queue.site.name == target.site
    dest = target.destination
    return dest is None or queue.name.lower() == dest or queue.nexthop.lower() == dest


def holding(core: Core, tenant: str, queue: Queue) -> Suspension | None:
    """The suspension of ``tenant`` that holds its mail for ``queue``, if any."""
    for s in core.suspensions.tenants.get(tenant, ()):
        if covers(s.target, queue):
            return s
    return None
