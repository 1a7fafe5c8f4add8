"""A queue entry: one delivery request's worth of recipients (``qmgr_entry.c``).

An entry belongs to one message and one destination queue; it is "todo" (on the
queue's todo list) until a policy selects it for an agent, then "busy" until the
agent's reply comes back. The functions here are the halves of stock's entry
functions that every scheduler shares; a policy that keeps entries on lists of its
own (nqmgr's peers) subclasses :class:`Entry` and does its half around these.
Finishing an entry touches the whole scheduler and lives in :mod:`.core`.
"""

from __future__ import annotations

from pyqmgr.scheduler.structures import (
    DEL_REQ_FLAG_CONN_LOAD,
    DEL_REQ_FLAG_CONN_MASK,
    DEL_REQ_FLAG_CONN_STORE,
    Entry,
)

__all__ = ["DEL_REQ_FLAG_CONN_LOAD", "DEL_REQ_FLAG_CONN_MASK", "DEL_REQ_FLAG_CONN_STORE",
           "Entry", "entry_link", "entry_select", "entry_unselect"]


def entry_link(entry: Entry) -> Entry:
    """A new entry goes at the end of its queue's todo list and counts on its message."""
    queue = entry.queue
    assert not queue.throttled, f"entry_create: dead queue {queue.name}"
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


def entry_unselect(entry: Entry) -> None:
    """Put a busy entry back to todo (``qmgr_entry_unselect``): its request never left.

    At the end of the queue's todo list, as stock does.
    """
    queue = entry.queue
    assert entry.busy, f"entry_unselect: {entry!r} is not busy"
    entry.busy = False
    queue.busy_count -= 1
    queue.todo.append(entry.queue_node)
    if not queue.transport.broken:
        queue.transport.policy.unselect(entry)
    queue.transport.sync(queue)
