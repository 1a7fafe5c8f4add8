"""A tenant's suspension: only its mail waits, only where the suspension says (issue #34).

``pyqmgr suspend tenant:acme@site:yahoo`` (or a response rule's ``suspend_tenant``)
holds one tenant's mail at one site, destination or transport, or everywhere
(``tenant:acme``), while every other tenant's mail to the same place flows. A
destination's gate cannot say that (it holds the destination for everyone), and
leaving the tenant's entries in the destination's todo list would make the core ask
for agents that then find nothing to deliver. So the tenant's todo entries there
move to the transport :data:`HELD`, which never gets an agent (its own operator
suspension, in force for good), one queue per tenant and original queue, named
``TENANT TRANSPORT:QUEUE`` with the original next hop; its new mail routed there
goes there too (:func:`held_queue`, from reading.assign). When the suspension ends
(resumed, run out, replaced by one that covers less) the entries go back through the
same routing as new mail: a destination that died meanwhile sends them to the retry
transport, as it would new mail.

Deliveries already under way finish normally. Moving a queue's entries is
O(its todo list), once, when a suspension starts or ends; routing a new recipient
costs one dict test while any tenant is suspended, none otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyqmgr.durations import duration
from pyqmgr.scheduler import site, tenant_cap
from pyqmgr.scheduler.decisions import DeferRecipient
from pyqmgr.scheduler.entry import entry_done, entry_move_todo
from pyqmgr.scheduler.held import HELD, STAGED, covers, held_queue_for, holding
from pyqmgr.scheduler.queue import error_queue, queue_obtain
from pyqmgr.scheduler.structures import ERROR, RETRY, Dsn
from pyqmgr.scheduler.suspension import Suspension, Target
from pyqmgr.scheduler.tenant_scope import tenant_release

__all__ = ["HELD", "apply", "covers", "held_queue", "holding", "rule_holds"]

#: Longest reason a rule's suspension keeps (the operators' limit, daemon/suspensions).
MAX_REASON = 200

if TYPE_CHECKING:
    from pyqmgr.scheduler.message import Message
    from pyqmgr.scheduler.shaping import Rule
    from pyqmgr.scheduler.state import Core
    from pyqmgr.scheduler.structures import Entry, Queue

def held_queue(core: Core, message: Message, queue: Queue) -> Queue:
    """Where a new recipient of ``message`` for ``queue`` goes: ``queue``, or its
    tenant's held queue while a suspension of the tenant covers ``queue``."""
    if message.tenant and queue.transport.name not in (RETRY, ERROR, HELD) and (
            holding(core, message.tenant, queue) is not None):
        return _held(core, message.tenant, queue)
    return queue


def _held(core: Core, tenant: str, queue: Queue) -> Queue:
    return held_queue_for(core, tenant, queue)


def rule_holds(core: Core, tenant: str, queue: Queue, rule: Rule, hop: Dsn,
               now: float, site_wide: bool = True) -> None:
    """A reply to the tenant's mail matched a rule with ``suspend_tenant``: hold the
    tenant at the destination's site (or the destination, and so when the reply
    came from a host that is not the site's own: ``site_wide`` False), unless that
    is so now."""
    assert rule.suspend_tenant is not None
    if holding(core, tenant, queue) is not None:
        return
    site = queue.site if site_wide else None
    target = (Target(None, None, site.name, tenant=tenant) if site is not None
              else Target(queue.transport.name, queue.name.lower(), tenant=tenant))
    until = now + rule.suspend_tenant
    text = f"{hop.status} {hop.reason}"[:MAX_REASON]
    s = Suspension(target, text, f"response rule {rule.where}", now, until,
                   until + core.suspensions.wall_offset)
    core.suspensions.add(s)
    core.out.timers.append(until)  # its end, as controls.suspend does
    apply(core, target)
    core.out.log.append(("info", f"shaping: {target} held {duration(rule.suspend_tenant)}: "
                                 f"reply \"{text}\" matched {rule.where}"))


def apply(core: Core, target: Target) -> list[str]:
    """A suspension of ``target.tenant`` started or ended: move the tenant's todo
    entries to its held queues or back. What moved, for the control's reply."""
    tenant = target.tenant
    assert tenant is not None
    if target.key in core.suspensions.by_key:
        return [_hold(core, tenant, target)]
    return [_release(core, tenant)]


def _hold(core: Core, tenant: str, target: Target) -> str:
    moved = 0
    for t in list(core.transports.values()):
        if t.name in (RETRY, ERROR, HELD):
            continue
        for queue in list(t.queues.values()):
            if not covers(target, queue):
                continue
            mine = [e for e in queue.todo if e.message.tenant == tenant]
            if mine:
                held = _held(core, tenant, queue)
                for entry in mine:
                    entry_move_todo(core, held, entry)
                moved += len(mine)
    return f"tenant {tenant}: {moved} deliveries held"


def _release(core: Core, tenant: str) -> str:
    t = core.transports.get(HELD)
    moved = 0
    if t is not None:
        for held in list(t.queues.values()):
            name, _, origin = held.name.partition(" ")
            if name == tenant:
                moved += _send_back(core, held, origin)
            elif name == STAGED + tenant:
                moved += _unstage(core, held)
    return f"tenant {tenant}: {moved} deliveries released"


def site_learnt(core: Core, domain: str, name: str, until: float) -> None:
    """A domain's MX lookup answered (:func:`.site.site_learnt`): its queues move to
    the site found, and its tenants' entries made while the lookup ran, counted at the
    domain's own site, count at the real one; those over a tenant's site limit there
    go back to staging (found at once by a real run: 14 sessions at a site whose two
    tenants were capped at 2 each)."""
    for queue in site.site_learnt(core, domain, name, until):
        # The queues that moved, not every member of the site found (a provider's
        # site of 10,000 domains was walked at each new domain's answer: issue #44).
        caps = queue.transport.tenant_caps
        if caps is None or not caps.site_limit or queue.site is None:
            continue
        for entry in tenant_cap.recount(caps, queue):
            staging = tenant_cap.staging_queue(core, caps, entry.message.tenant, queue)
            entry_move_todo(core, staging, entry)


def _unstage(core: Core, staging: Queue) -> int:
    """A limited tenant's staged mail, held with it, fills its limits again (nothing of
    it ended while it was held, so nothing brought staged mail back)."""
    dest = tenant_cap.destination(core, staging)
    return tenant_release(core, staging, dest) if dest is not None else 0


def _send_back(core: Core, held: Queue, origin: str) -> int:
    """The held queue's entries to their original queue, unless another suspension of
    the tenant still covers it; routed as new mail is (reading.assign)."""
    transport, _, name = origin.partition(":")
    t = core.transport(transport)
    moved = 0
    for entry in list(held.todo):
        dst: Queue | None
        dsn: Dsn | None
        if t.throttled:
            assert t.dsn is not None
            dst, dsn = error_queue(core, RETRY, t.dsn), t.dsn
        else:
            dst = queue_obtain(core, t, name, held.nexthop)
            if holding(core, entry.message.tenant, dst) is not None:
                continue  # still held by another of its suspensions
            dsn = dst.dsn if dst.throttled else None
            if dsn is not None:
                dst = error_queue(core, RETRY, dsn)
            else:
                dst = tenant_cap.capped_queue(core, entry.message, dst)
        if dst is None:
            assert dsn is not None
            _defer(core, entry, dsn)
        else:
            entry_move_todo(core, dst, entry)
        moved += 1
    return moved


def _defer(core: Core, entry: Entry, dsn: Dsn) -> None:
    """No retry queue to send it to: its recipients are deferred, as assign does."""
    entry.message.deferred = True
    for recipient in entry.recipients:
        core.out.deferrals.append(DeferRecipient(entry.message, recipient, dsn))
    entry_done(core, entry, busy=False)
