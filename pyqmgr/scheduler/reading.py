"""A message's recipients into core: how many to read, and filing them (``qmgr_message.c``).

Stock reads a message's recipients in batches so that one huge message cannot fill
memory: the first batch may fill the global pool (qmgr_message_recipient_limit) but
gets at least the message's own reserve, later batches exactly the slots its nqmgr jobs
were given, never more than :data:`MAX_READ` at once; oqmgr reads by its fudge factor.
The reading itself is the driver's, through the port the core declares
(:data:`~pyqmgr.scheduler.state.Refill`): the daemon reads queue files, the simulator
its scenario. :func:`assign` files a batch into entries through each transport's policy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from pyqmgr.scheduler import recovery, tenant_cap, tenant_hold, throttling
from pyqmgr.scheduler.decisions import DeferRecipient
from pyqmgr.scheduler.defer import POLICY_DSN
from pyqmgr.scheduler.message import Message, Route
from pyqmgr.scheduler.queue import clog_warning, error_queue, queue_obtain, queue_unthrottle
from pyqmgr.scheduler.structures import RETRY, Dsn

if TYPE_CHECKING:
    from pyqmgr.scheduler.state import Core
    from pyqmgr.scheduler.structures import Entry, Queue

#: Stock reads at most this many recipients at once, to keep event latency in check.
MAX_READ = 5000


def admit(core: Core, message: Message) -> None:
    """A new message gets its own recipient slot reserve (qmgr_message_recipient_minimum)."""
    if message.rcpt_limit <= 0 and not message.jobs and message.refcount == 0:
        message.rcpt_limit = core.msg_rcpt_limit


def read_limit(core: Core, message: Message) -> int:
    """How many recipients to read into core for this message now.

    The first batch may fill the global pool (qmgr_message_recipient_limit) but
    gets at least the message's own reserve; later batches get exactly the slots
    the message's jobs were given. Never more than 5000 at once.
    """
    admit(core, message)
    if core.slotless and not message.jobs:
        # No nqmgr job holds slots for this message: oqmgr's per-batch limit.
        return min(fudge_limit(core), MAX_READ)
    if message.more:
        return min(message.rcpt_limit - message.rcpt_count, MAX_READ)
    return min(max(core.rcpt_limit - core.rcpt_count, message.rcpt_limit), MAX_READ)


def fudge_limit(core: Core) -> int:
    """oqmgr's batch size: FUDGE(qmgr_message_recipient_limit)."""
    return max(1, core.rcpt_limit * core.fudge_factor // 100)


def may_feed(core: Core) -> bool:
    """May the driver open another queue file? (oqmgr: not at the recipient limit.)"""
    return not core.bounded_reading or core.rcpt_count < core.rcpt_limit


def first_read_limit(core: Core) -> int:
    """:meth:`read_limit` for a message not created yet (the driver reads first)."""
    if core.bounded_reading:
        return min(fudge_limit(core), MAX_READ)
    return min(max(core.rcpt_limit - core.rcpt_count, core.msg_rcpt_limit), MAX_READ)


def realloc(core: Core, message: Message) -> None:
    """Read the message's next recipient batch now (``qmgr_message_realloc``)."""
    if core.refill is None or not message.more:
        return
    limit = read_limit(core, message)
    if limit <= 0:
        return
    routes = core.refill(message, limit)
    if routes is not None:
        assign(core, message, routes, False)


def assign(core: Core, message: Message, routes: Iterable[Route], flush_each: bool) -> None:
    """File a batch of routed recipients into entries (``qmgr_message_assign``)."""
    admit(core, message)
    message.refill_time = core.clock
    last: Entry | None = None
    last_queue: Queue | None = None
    for route in routes:
        t = core.transport(route.transport)
        queue: Queue | None
        dsn: Dsn | None
        if flush_each and t.throttled:
            core.transport_unthrottle(t)
        if flush_each and not t.throttled:
            named = t.queues.get(route.queue_name)
            if named is not None and named.throttled:
                queue_unthrottle(named)
        if t.throttled:
            assert t.dsn is not None
            queue = error_queue(core, RETRY, t.dsn)
            dsn = t.dsn
            if core.recovery_watch is not None:
                recovery.wait(core, message, t.name, route.queue_name, recovery.why(dsn))
        else:
            queue = queue_obtain(core, t, route.queue_name, route.nexthop)
            if core.fleet_heard:
                throttling.arrived(core, t, queue)
            dsn = queue.dsn if queue.throttled else None
            if dsn is not None:
                queue = error_queue(core, RETRY, dsn)
                if core.recovery_watch is not None:
                    recovery.wait(core, message, t.name, route.queue_name, recovery.why(dsn))
            elif message.tenant:
                if core.suspensions.tenants:
                    queue = tenant_hold.held_queue(core, message, queue)
                if queue.transport.tenant_caps is not None:
                    queue = tenant_cap.capped_queue(core, message, queue)
        if queue is None:
            assert dsn is not None
            message.deferred = True
            core.out.deferrals.append(DeferRecipient(message, route.recipient, dsn))
            continue
        if queue is not last_queue:
            last = None
            last_queue = queue
        refs = message.refcount
        try:
            last = queue.transport.policy.add(message, queue, route.recipient, last)
        except Exception as exc:  # noqa: BLE001 - a policy's bug must not lose mail
            core.policy_failed(queue.transport, "add", exc)
            message.deferred = True
            core.out.deferrals.append(DeferRecipient(message, route.recipient, POLICY_DSN))
            last = last_queue = None
            continue
        if message.refcount != refs:
            if queue.transport.tenant_caps is not None:
                tenant_cap.made(queue, last, core.now)
            if core.helpful_warnings and core.clog_warn_time > 0:
                clog_warning(core, queue)
        message.rcpt_count += 1
        core.rcpt_count += 1
    for cls in core.policy_classes:
        cls.message_assigned(message)
