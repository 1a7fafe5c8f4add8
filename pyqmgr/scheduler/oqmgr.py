"""oqmgr: Postfix's old queue manager scheduler, decision for decision.

Postfix ships it as ``$daemon_directory/oqmgr``; this policy follows its source
(``src/oqmgr/``), which shares stock's concurrency window, dead-site and transport
code and differs in what this module holds:

* no jobs, peers or preemption: a transport's agent takes the oldest todo entry of
  the next destination in round-robin order (``qmgr_queue_select``: the first queue
  with room and work, after which the transport's queue list is rotated so that the
  scan starts past it next time); a new destination joins the end of that list when
  oqmgr creates it, which is while qmgr_message_resolve walks the batch's recipients
  sorted by domain and address, not when entries are made after a second sort by
  queue name (the order the core hands recipients in): see :meth:`Oqmgr.add`;
* a message's recipients fill the entry the previous recipient went to, when it was
  for the same destination, up to the recipient limit (``qmgr_message_assign``);
* recipients are read by oqmgr's own limits, not by job slots: a batch of up to
  ``qmgr_message_recipient_limit`` (times ``qmgr_fudge_factor``) at once, no more
  queue files opened while that many recipients are in core, and a message with more
  recipients on file reads its next batch as soon as the in-core count falls below
  the limit less 100. That part is the scheduler core's (``bounded_reading``), since
  reading happens before a recipient has a transport.

This is the scheduler the seed's README describes as starving the busy destination of
a gateway: with round robin by destination, the inbound destination is "selected only
1/number-of-destinations of the time" however much mail it holds.

The scan over the queue list is linear in the destinations skipped, as in oqmgr:
destinations without room or work are passed over one by one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from pyqmgr.scheduler.entry import Entry, entry_select
from pyqmgr.scheduler.policy import Context, Policy
from pyqmgr.scheduler.qlist import Node, QList

if TYPE_CHECKING:
    from pyqmgr.scheduler.message import Message, Recipient
    from pyqmgr.scheduler.queue import Queue
    from pyqmgr.scheduler.transport import Transport


class Oqmgr(Policy):
    name = "oqmgr"
    bounded_reading = True

    def __init__(self, transport: Transport, ctx: Context) -> None:
        super().__init__(transport, ctx)
        #: The transport's destinations in round-robin order (``queue_list``).
        self.queue_list: QList[Queue] = QList()
        self._nodes: dict[Queue, Node[Queue]] = {}
        #: Queues created by the current batches and not yet put in their place:
        #: node -> (batch, the smallest resolve-order key of its recipients).
        self._created: dict[Node[Queue], tuple[int, tuple[int, str, str]]] = {}

    #: Counts batches (``message_assigned``), so that queues created by different
    #: batches before the next selection keep the order of their batches.
    _batch: ClassVar[int] = 0

    @staticmethod
    def resolve_key(address: str) -> tuple[int, str, str]:
        """``qmgr_message_sort_compare`` before resolving (no queue yet): domain
        (from the last @, no domain last), then address, both case-insensitive."""
        at = address.rfind("@")
        return (1, "", address.lower()) if at < 0 else (0, address[at:].lower(),
                                                         address.lower())

    def add(self, message: Message, queue: Queue, recipient: Recipient,
            last: Entry | None) -> Entry:
        """File the recipient; a queue it creates is placed as oqmgr's resolver would.

        The core creates a queue at its first entry, with the batch sorted by queue
        name; oqmgr creates it (``qmgr_queue_create``: end of the round-robin list)
        at its first recipient in domain order. Which of a batch's new queues comes
        first is settled before the next selection (:meth:`_place_created`).
        """
        new = queue not in self._nodes
        entry = super().add(message, queue, recipient, last)
        node = self._nodes.get(queue)
        if node is not None:
            key = (Oqmgr._batch, self.resolve_key(recipient.address))
            if new:
                self._created[node] = key
            elif node in self._created and key < self._created[node]:
                self._created[node] = key
        return entry

    @classmethod
    def message_assigned(cls, message: Message) -> None:
        Oqmgr._batch += 1

    def _place_created(self) -> None:
        """Reorder the not yet placed new queues, the list's tail, by resolve order."""
        created = sorted(self._created.items(), key=lambda kv: kv[1])
        self._created.clear()
        for node, _ in created:
            self.queue_list.unlink(node)
        for node, _ in created:
            self.queue_list.append(node)

    def new_entry(self, message: Message, queue: Queue) -> Entry:
        if queue not in self._nodes:
            self._nodes[queue] = self.queue_list.append(Node(queue))
        return super().new_entry(message, queue)

    def select(self) -> Entry | None:
        if self._created:
            self._place_created()
        node = self.queue_list.head
        while node is not None:
            queue = node.item
            if queue.window > queue.busy_count and queue.todo and queue.gate is None:
                self.queue_list.rotate(node)
                entry = queue.todo.first()
                assert entry is not None
                return entry_select(entry, self.ctx.clock)
            node = node.next
        return None

    def queue_done(self, queue: Queue) -> None:
        node = self._nodes.pop(queue, None)
        if node is not None:
            self._created.pop(node, None)
            self.queue_list.unlink(node)

    def describe(self) -> dict[str, object]:
        if self._created:
            self._place_created()
        return {"policy": self.name, "destinations": len(self.queue_list)}

    def jobs_report(self, now: float, limit: int | None = None) -> dict[str, object]:
        """The round-robin queue list in the order the next agent scans it.

        Queues created by batches not yet placed are shown where the next selection
        puts them (the tail, in resolve order), without moving them: asking must not
        change what the scheduler does.
        """
        created = sorted(self._created.items(), key=lambda kv: kv[1])
        order = [q for q in self.queue_list
                 if self._nodes.get(q) not in self._created]
        order += [node.item for node, _ in created]
        limit = self.transport.cfg.destination_concurrency_limit
        queues: list[dict[str, object]] = []
        chosen = False
        for queue in order:
            if limit is not None and len(queues) >= limit:
                break
            first = queue.todo.first()
            # select()'s test: the first queue with room and work gets the next agent.
            nxt = not chosen and queue.window > queue.busy_count and bool(queue.todo)
            chosen = chosen or nxt
            queues.append({
                "destination": queue.name,
                "nexthop": queue.nexthop,
                "next": nxt,
                "window": max(queue.window, 0),
                "limit": limit,
                "in_flight": queue.busy_count,
                "todo": len(queue.todo),
                "recipients": sum(len(e.recipients) for e in queue.todo),
                "oldest": first.message.queue_id if first is not None else None,
                "age": (round(now - first.message.enqueue_time, 3)
                        if first is not None else None),
            })
        return {"policy": self.name, "kind": "queues",
                "order": "round robin by destination: the next agent takes the oldest "
                         "entry of the first destination with room and work, and the "
                         "list then rotates past it",
                "total": len(order), "queues": queues}
