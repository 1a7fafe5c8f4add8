"""oqmgr: Postfix's old queue manager scheduler, decision for decision.

Postfix ships it as ``$daemon_directory/oqmgr``; this policy follows its source
(``src/oqmgr/``), which shares stock's concurrency window, dead-site and transport
code and differs in what this module holds:

* no jobs, peers or preemption: a transport's agent takes the oldest todo entry of
  the next destination in round-robin order (``qmgr_queue_select``: the first queue
  with room and work, after which the transport's queue list is rotated so that the
  scan starts past it next time); a new destination joins the end of that list;
* a message's recipients fill the entry the previous recipient went to, when it was
  for the same destination, up to the recipient limit (``qmgr_message_assign``);
* recipients are read by oqmgr's own limits, not by job slots: a batch of up to
  ``qmgr_message_recipient_limit`` (times ``qmgr_fudge_factor``) at once, no more
  queue files opened while that many recipients are in core, and a message with more
  recipients on file reads its next batch as soon as the in-core count falls below
  the limit less 100. That part is the scheduler core's (``oqmgr_reading``), since
  reading happens before a recipient has a transport.

This is the scheduler the seed's README describes as starving the busy destination of
a gateway: with round robin by destination, the inbound destination is "selected only
1/number-of-destinations of the time" however much mail it holds.

The scan over the queue list is linear in the destinations skipped, as in oqmgr:
destinations without room or work are passed over one by one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyqmgr.scheduler.entry import Entry, entry_link, entry_select
from pyqmgr.scheduler.policy import Context, Policy
from pyqmgr.scheduler.qlist import Node, QList

if TYPE_CHECKING:
    from pyqmgr.scheduler.message import Message
    from pyqmgr.scheduler.queue import Queue
    from pyqmgr.scheduler.transport import Transport


class Oqmgr(Policy):
    name = "oqmgr"

    def __init__(self, transport: Transport, ctx: Context) -> None:
        super().__init__(transport, ctx)
        #: The transport's destinations in round-robin order (``queue_list``).
        self.queue_list: QList[Queue] = QList()
        self._nodes: dict[Queue, Node[Queue]] = {}

    def new_entry(self, message: Message, queue: Queue) -> Entry:
        if queue not in self._nodes:
            self._nodes[queue] = self.queue_list.append(Node(queue))
        return entry_link(Entry(message, queue), self.transport)

    def select(self) -> Entry | None:
        node = self.queue_list.head
        while node is not None:
            queue = node.item
            if queue.window > queue.busy_count and queue.todo:
                self.queue_list.rotate(node)
                entry = queue.todo.first()
                assert entry is not None
                return entry_select(entry, self.ctx.clock)
            node = node.next
        return None

    def queue_done(self, queue: Queue) -> None:
        node = self._nodes.pop(queue, None)
        if node is not None:
            self.queue_list.unlink(node)

    def describe(self) -> dict[str, object]:
        return {"policy": self.name, "destinations": len(self.queue_list)}
