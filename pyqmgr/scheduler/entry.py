"""A queue entry: one delivery request's worth of recipients (``qmgr_entry.c``).

An entry belongs to one message, one destination queue and one job peer; it is "todo"
(on the queue's todo list and the peer's entry list) until the scheduler selects it for
an agent, then "busy" until the agent's reply comes back. The functions here move
entries between those states; finishing an entry (``entry_done``) touches the whole
scheduler and lives in :mod:`pyqmgr.scheduler.core`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.qlist import Node

if TYPE_CHECKING:
    from pyqmgr.scheduler.peer import Peer
    from pyqmgr.scheduler.queue import Queue

#: Delivery request flags for opportunistic connection caching (deliver_request.h).
DEL_REQ_FLAG_CONN_LOAD = 1 << 11
DEL_REQ_FLAG_CONN_STORE = 1 << 12
DEL_REQ_FLAG_CONN_MASK = DEL_REQ_FLAG_CONN_LOAD | DEL_REQ_FLAG_CONN_STORE


class Entry:
    __slots__ = ("message", "queue", "peer", "recipients", "busy", "queue_node",
                 "peer_node")

    def __init__(self, message: Message, queue: Queue, peer: Peer) -> None:
        self.message = message
        self.queue = queue
        self.peer = peer
        self.recipients: list[Recipient] = []
        self.busy = False
        self.queue_node: Node[Entry] = Node(self)
        self.peer_node: Node[Entry] = Node(self)

    @property
    def transport(self) -> str:
        return self.queue.transport.name

    def __repr__(self) -> str:
        return (f"Entry({self.message.queue_id} {self.queue.transport.name}/"
                f"{self.queue.name} x{len(self.recipients)}{' busy' if self.busy else ''})")


def entry_create(peer: Peer, message: Message) -> Entry:
    """A new todo entry at the end of the peer's and the queue's lists."""
    queue = peer.queue
    assert not queue.throttled, f"entry_create: dead queue {queue.name}"
    entry = Entry(message, queue, peer)
    message.refcount += 1
    peer.entries.append(entry.peer_node)
    peer.refcount += 1
    queue.todo.append(entry.queue_node)
    peer.job.read_entries += 1
    queue.transport.sync(queue)
    return entry


def entry_select(peer: Peer, now: int) -> Entry | None:
    """Take the peer's first entry from todo to busy (``qmgr_entry_select``).

    Also keeps the queue's connection-caching flags: caching starts once deliveries
    to the destination come back to back, and stops when they no longer overlap.
    """
    entry = peer.entries.first()
    if entry is None:
        return None
    queue = entry.queue
    queue.todo.unlink(entry.queue_node)
    queue.busy_count += 1
    entry.busy = True
    peer.entries.unlink(entry.peer_node)
    peer.job.selected_entries += 1
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

    Back at the head of the peer's list, so that select and unselect do not reorder the
    message's entries, but at the end of the queue's todo list, as stock does.
    """
    queue = entry.queue
    peer = entry.peer
    assert entry.busy, f"entry_unselect: {entry!r} is not busy"
    entry.busy = False
    queue.busy_count -= 1
    queue.todo.append(entry.queue_node)
    peer.entries.prepend(entry.peer_node)
    peer.job.selected_entries -= 1
    queue.transport.sync(queue)
