"""A queue entry: one delivery request's worth of recipients (``qmgr_entry.c``).

An entry belongs to one message and one destination queue; it is "todo" (on the
queue's todo list) until a policy selects it for an agent, then "busy" until the
agent's reply comes back. The functions here are the halves of stock's entry
functions that every scheduler shares; a policy that keeps entries on lists of its
own (nqmgr's peers) subclasses :class:`Entry` and does its half around these.
Finishing an entry touches the whole scheduler and lives in :mod:`.core`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyqmgr.scheduler.queue import queue_done, queue_unthrottle
from pyqmgr.scheduler.scope import scopes_ended, scopes_settle, scopes_unselected
from pyqmgr.scheduler.structures import (
    DEL_REQ_FLAG_CONN_LOAD,
    DEL_REQ_FLAG_CONN_MASK,
    DEL_REQ_FLAG_CONN_STORE,
    THROTTLED,
    Entry,
)
from pyqmgr.scheduler.tenant_cap import made

if TYPE_CHECKING:
    from pyqmgr.scheduler.message import Message
    from pyqmgr.scheduler.state import Core
    from pyqmgr.scheduler.structures import Queue

__all__ = ["DEL_REQ_FLAG_CONN_LOAD", "DEL_REQ_FLAG_CONN_MASK", "DEL_REQ_FLAG_CONN_STORE",
           "Entry", "entry_done", "entry_link", "entry_move_todo", "entry_select", "entry_unselect",
           "message_done"]


def entry_link(entry: Entry) -> Entry:
    """A new entry goes at the end of its queue's todo list and counts on its message."""
    queue = entry.queue
    assert queue.window != THROTTLED, f"entry_create: dead queue {queue.name}"
    entry.message.refcount += 1
    queue.todo.append(entry.queue_node)
    queue.transport.sync(queue)
    return entry


def entry_select(entry: Entry, now: int) -> Entry:
    """Take a todo entry to busy (``qmgr_entry_select``).

    Also keeps the queue's connection-caching flags: caching starts once deliveries
    to the destination come back to back, and stops when they no longer overlap.
    """
    queue = entry.queue
    queue.todo.unlink(entry.queue_node)
    queue.busy_count += 1
    entry.busy = True
    back_to_back = queue.last_done + 1 >= now
    if not queue.dflags & DEL_REQ_FLAG_CONN_STORE:
        if back_to_back:
            queue.dflags |= DEL_REQ_FLAG_CONN_MASK
    elif not (queue.busy_count > 1 or back_to_back):
        queue.dflags &= ~DEL_REQ_FLAG_CONN_STORE
    queue.transport.sync(queue)
    return entry


def entry_unselect(core: Core, entry: Entry) -> None:
    """Put a busy entry back to todo (``qmgr_entry_unselect``): its request never left.

    At the end of the queue's todo list, as stock does.
    """
    queue = entry.queue
    assert entry.busy, f"entry_unselect: {entry!r} is not busy"
    entry.busy = False
    queue.busy_count -= 1
    settle = scopes_unselected(core, entry)
    queue.todo.append(entry.queue_node)
    if not queue.transport.broken:
        queue.transport.policy.unselect(entry)
    queue.transport.sync(queue)
    scopes_settle(core, entry, settle)


def entry_done(core: Core, entry: Entry, busy: bool) -> None:
    """Finish an entry, busy (a delivery came back) or todo (``qmgr_entry_done``)."""
    queue = entry.queue
    message = entry.message
    t = queue.transport
    if busy:
        entry.busy = False
        queue.busy_count -= 1
    else:
        queue.todo.unlink(entry.queue_node)
    n = len(entry.recipients)
    message.rcpt_count -= n
    core.rcpt_count -= n
    # destination_rate_delay emulates a slow channel: pause the destination after
    # each delivery; scheduling decisions wait for it to resume.
    delay = t.cfg.destination_rate_delay
    if busy and delay > 0:
        if queue.throttled:
            queue_unthrottle(queue)
        if queue.ready:
            queue.pause(core.now, delay)
            core.out.timers.append(core.now + delay)
    if not t.broken:
        try:
            t.policy.done(entry, busy)
        except Exception as exc:  # noqa: BLE001 - a policy's bug must not lose mail
            core.policy_failed(t, "done", exc)
    # Its site's and its tenant's counts, before the queue may go idle and be
    # discarded (:mod:`.scope`).
    settle = scopes_ended(core, entry, busy)
    if busy:
        queue.last_done = int(core.now)  # core.clock without a call (once per delivery)
    if queue.idle:
        # A dead site's empty queue goes too once queues crowd memory.
        if queue.throttled and core.queue_count > 2 * core.rcpt_limit:
            queue_unthrottle(queue)
        if queue.ready:
            queue_done(core, queue)
    t.sync(queue)
    scopes_settle(core, entry, settle)
    message.refcount -= 1
    entry.release()
    if (core.bounded_reading and message.more and not message.jobs
            and core.rcpt_count < core.fudge_limit - 100):
        core.realloc(message)
    if message.refcount == 0:
        message_done(core, message)


def message_done(core: Core, message: Message) -> None:
    """All in-core entries finished: tell the driver; policies drop their state."""
    core.out.finished.append(message)
    for cls in core.policy_classes:
        cls.message_done(message)


def entry_move_todo(core: Core, dst: Queue, entry: Entry) -> None:
    """Hand a todo entry's recipients to another queue (the retry transport, a
    tenant's held or staging queue and back); a capped tenant's new entry counts."""
    message = entry.message
    dst_policy = dst.transport.policy
    new = dst_policy.new_entry(message, dst)
    made(dst, new, core.now)
    new.recipients, entry.recipients = entry.recipients, []
    src = entry.queue.transport
    if not src.broken:
        src.policy.moved(entry, -len(new.recipients))
    dst_policy.moved(new, len(new.recipients))
    entry_done(core, entry, busy=False)
