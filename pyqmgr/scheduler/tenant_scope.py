"""A tenant's scope at a destination and at a site (issue #34's caps, issue #44's road).

:mod:`.tenant_cap` keeps the counts and the staging of a capped tenant's mail; what
happens when one of its deliveries ends (one fewer there, its oldest staged entry for
the destination, or for another destination of the site, takes the place; a dead
destination sends the staged ones to the retry transport) moves entries, so it lives
here, beside :data:`TENANT_KIND`, the scope kind that :mod:`.scope`'s walk reaches
(a transport with tenant caps carries it in its chain).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyqmgr.scheduler.entry import entry_move_todo
from pyqmgr.scheduler.held import HELD, held_queue_name
from pyqmgr.scheduler.queue import error_queue
from pyqmgr.scheduler.scope import ScopeKind, nothing, nothing_to_settle
from pyqmgr.scheduler.structures import RETRY
from pyqmgr.scheduler.tenant_cap import (
    TenantLimitTable,
    caps_for,
    destination,
    ended,
    next_release,
    site_release,
)

if TYPE_CHECKING:
    from pyqmgr.scheduler.state import Core
    from pyqmgr.scheduler.structures import Entry, Queue, Transport


def tenant_ended(core: Core, entry: Entry, busy: bool) -> bool:
    """An entry of a limited tenant ended at its queue, sent or not."""
    if entry.message.tenant:
        _cap_ended(core, entry)
    return False


TENANT_KIND = ScopeKind("tenant", nothing, nothing_to_settle, tenant_ended, nothing)


def tenant_caps(t: Transport, table: TenantLimitTable | None) -> None:
    """A new transport's tenant caps (issue #34), and the scope its deliveries then
    count in."""
    t.tenant_caps = caps_for(table, t.name)
    t.chain = (TENANT_KIND,) if t.tenant_caps is not None else ()


def _cap_ended(core: Core, entry: Entry) -> None:
    """An entry of a limited tenant ended at its queue (:mod:`.tenant_cap`): one
    fewer there, and its oldest staged entry for the queue (or for another of the
    site's destinations) takes the place; a dead queue sends the staged ones to the
    retry transport."""
    queue = entry.queue
    caps = queue.transport.tenant_caps
    assert caps is not None
    tenant = entry.message.tenant
    scope = ended(caps, entry)
    held = core.transports.get(HELD)
    staging = held.queues.get(held_queue_name(tenant, queue, staged=True)) \
        if held is not None else None
    if staging is not None and staging.todo:
        if queue.throttled:
            assert queue.dsn is not None
            retry = error_queue(core, RETRY, queue.dsn)
            if retry is not None:
                for staged in list(staging.todo):
                    entry_move_todo(core, retry, staged)
        elif tenant_release(core, staging, queue):
            return
    if scope is not None:
        site_release(caps, tenant, scope, lambda other: _released(core, other))


def _released(core: Core, staging: Queue) -> bool:
    """Did the staging queue's destination take some of its mail?"""
    dest = destination(core, staging)
    return dest is not None and tenant_release(core, staging, dest) > 0


def tenant_release(core: Core, staging: Queue, dest: Queue) -> int:
    """Move a tenant's staged entries into their destination while its limits let
    them (:func:`.tenant_cap.next_release`); how many went."""
    moved = 0
    while (oldest := next_release(core, staging, dest)) is not None:
        entry_move_todo(core, dest, oldest)
        moved += 1
    return moved
