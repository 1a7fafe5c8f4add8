"""sender_classes: small senders are never stuck behind large ones.

An example of a scheduling policy of one's own (``scheduler_policy =
module:/etc/postfix/sender_classes.py`` in pyqmgr.cf; see README.md, "Your own
scheduling policy"). It is the "sender classes" idea from postfix-devel, reduced to
what a queue manager can see:

* Each message is classified by its backlog on the transport: the recipients it has
  in core there (read, not yet finished). Fewer than ``sender_classes_small_limit``
  (10) is *small*, fewer than ``sender_classes_medium_limit`` (100) *medium*, the
  rest *large*. The backlog, not the envelope size, because it is what the message
  still asks of the transport: a large list that is nearly done competes as small.
* Each class is a first-come, first-served queue of delivery requests (entries).
* Agents are handed out by weighted round robin over the classes, small : medium :
  large = 4 : 2 : 1 by default (``sender_classes_small_weight``, ``_medium_weight``,
  ``_large_weight``). A class with nothing deliverable is skipped, so the transport
  is never idle while any class has work, and a large sender alone gets every agent.
  When a mailing list of 50,000 recipients is being delivered, a one-recipient
  message waits for at most two agents handed to other classes (what is left of the
  current turn), plus any small messages ahead of it, instead of waiting behind the
  list (first come, first served) or behind every other destination (oqmgr's round
  robin by destination).

The per-destination concurrency window, dead sites and the retry transport are the
shared machinery's; this policy only says which todo entry goes next.

Cost per decision: entries whose destination is at its window are not skipped over and
over. The first time one reaches the head of its class while its destination has no
room, it is *parked* with that destination (O(1)); when a delivery to the destination
ends (or a rate-delayed destination resumes), as many parked entries of each class as
it has room for go back to the head of their class, oldest first. Each entry is
therefore looked at a bounded number of times per delivery that frees its
destination, and a decision is O(1) amortized whatever the backlog: it never walks
the destinations or the messages.

A message's class is looked at when one of its entries reaches the head of a class
queue: an entry filed while its message was small and found there after the message
grew moves to its new class then, at the tail (a newcomer there); one found in a
bigger class after its message shrank moves to the head of the smaller class (it has
waited longest). This is lazy on purpose: moving every entry of a message each time
its backlog crosses a limit would cost a walk over the message's entries.

Knobs (pyqmgr.cf, each also as ``<transport>_<name>``; checked at start-up):
``sender_classes_small_limit`` (10), ``sender_classes_medium_limit`` (100, taken as
at least the small limit), ``sender_classes_small_weight`` (4),
``sender_classes_medium_weight`` (2), ``sender_classes_large_weight`` (1); weights are
at least 1, so no class ever starves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyqmgr.scheduler.entry import Entry, entry_link, entry_select
from pyqmgr.scheduler.policy import Context, Policy
from pyqmgr.scheduler.qlist import Node, QList

if TYPE_CHECKING:
    from pyqmgr.scheduler.message import Message, Recipient
    from pyqmgr.scheduler.queue import Queue
    from pyqmgr.scheduler.transport import Transport

#: Class indexes, also the order of the round robin.
SMALL, MEDIUM, LARGE = 0, 1, 2
CLASS_NAMES = ("small", "medium", "large")


class SenderJob:
    """One message's work on the transport: its backlog (recipients in core here)."""

    __slots__ = ("message", "rcpts", "refs")

    def __init__(self, message: Message) -> None:
        self.message = message
        #: Recipients of the message in core on this transport (todo and busy).
        self.rcpts = 0
        #: Entries (todo and busy) that still refer to the job.
        self.refs = 0


class SenderEntry(Entry):
    """An entry with its job, its creation order and its place in a class or parking."""

    __slots__ = ("job", "seq", "node")

    def __init__(self, message: Message, queue: Queue, job: SenderJob, seq: int) -> None:
        super().__init__(message, queue)
        self.job = job
        #: Creation order on the transport: first come, first served within a class.
        self.seq = seq
        #: On one class queue, or parked with its destination, while todo.
        self.node: Node[SenderEntry] = Node(self)


class SenderClasses(Policy):
    name = "sender_classes"
    knobs = {
        "sender_classes_small_limit": ("10", "int", 1, None),
        "sender_classes_medium_limit": ("100", "int", 1, None),
        "sender_classes_small_weight": ("4", "int", 1, 1000),
        "sender_classes_medium_weight": ("2", "int", 1, 1000),
        "sender_classes_large_weight": ("1", "int", 1, 1000),
    }

    def __init__(self, transport: Transport, ctx: Context) -> None:
        super().__init__(transport, ctx)
        self.small_limit = int(self.knob("sender_classes_small_limit"))
        self.medium_limit = max(self.small_limit, int(self.knob("sender_classes_medium_limit")))
        self.weights = tuple(int(self.knob(f"sender_classes_{c}_weight")) for c in CLASS_NAMES)
        #: Per class: todo entries in first-come order (parked ones are elsewhere).
        self.classes: list[QList[SenderEntry]] = [QList() for _ in CLASS_NAMES]
        #: Per destination, per class: entries that found the destination at its window.
        self.parked: dict[Queue, list[QList[SenderEntry]]] = {}
        self.jobs: dict[Message, SenderJob] = {}
        #: The class whose turn it is, and how many more agents it gets this turn.
        self.turn = LARGE
        self.credit = 0
        self.seq = 0
        #: Entries moved to another class by the latest :meth:`_take`.
        self.reclassified = 0
        #: Agents handed out per class (for describe()).
        self.served = [0, 0, 0]

    def klass(self, job: SenderJob) -> int:
        if job.rcpts < self.small_limit:
            return SMALL
        return MEDIUM if job.rcpts < self.medium_limit else LARGE

    # -- recipients in ----------------------------------------------------------------

    def new_entry(self, message: Message, queue: Queue) -> Entry:
        job = self.jobs.get(message)
        if job is None:
            job = self.jobs[message] = SenderJob(message)
        job.refs += 1
        self.seq += 1
        entry = SenderEntry(message, queue, job, self.seq)
        self.classes[self.klass(job)].append(entry.node)
        return entry_link(entry)

    def add(self, message: Message, queue: Queue, recipient: Recipient,
            last: Entry | None) -> Entry:
        entry = super().add(message, queue, recipient, last)
        entry.job.rcpts += 1  # type: ignore[attr-defined]
        return entry

    def moved(self, entry: Entry, count: int) -> None:
        entry.job.rcpts += count  # type: ignore[attr-defined]

    # -- deliveries -------------------------------------------------------------------

    def select(self) -> Entry | None:
        # The current class may have credit left; then each class with a fresh turn
        # (the current one again last), so a lone class gets every agent. A miss that
        # moved entries to another class (their message changed class) starts the
        # count again: that class may have been passed already. Each entry moves at
        # most once per select, so this ends.
        misses = 0
        while misses <= len(CLASS_NAMES):
            if self.credit <= 0:
                self.turn = (self.turn + 1) % len(CLASS_NAMES)
                self.credit = self.weights[self.turn]
            self.reclassified = 0
            entry = self._take(self.turn)
            if entry is not None:
                self.credit -= 1
                self.served[self.turn] += 1
                return entry_select(entry, self.ctx.clock)
            self.credit = 0
            misses = 0 if self.reclassified else misses + 1
        return None

    def _take(self, k: int) -> SenderEntry | None:
        """The oldest entry of class ``k`` whose destination has room; park the others."""
        fifo = self.classes[k]
        room = self.transport.room
        while fifo.head is not None:
            node = fifo.head
            entry = node.item
            fifo.unlink(node)
            now_k = self.klass(entry.job)
            if now_k != k:
                # Its message changed class since it was filed: it goes there now,
                # at the head when it moves down (it has waited longest).
                self.reclassified += 1
                if now_k < k:
                    self.classes[now_k].prepend(node)
                else:
                    self.classes[now_k].append(node)
                continue
            if room(entry.queue) > 0:
                return entry
            self._park(entry, k)
        return None

    def _park(self, entry: SenderEntry, k: int) -> None:
        """Keep ``entry`` with its full destination, oldest first."""
        lists = self.parked.get(entry.queue)
        if lists is None:
            lists = self.parked[entry.queue] = [QList() for _ in CLASS_NAMES]
        parked = lists[k]
        tail = parked.tail
        if tail is None or tail.item.seq < entry.seq:
            parked.append(entry.node)
            return
        # It was unparked and found no room again: back in front of younger ones
        # (only entries unparked with it can be older, so this walk is short).
        node = parked.head
        while node is not None and node.item.seq < entry.seq:
            node = node.next
        assert node is not None
        parked.link(node.prev, entry.node, node)

    def _unpark(self, queue: Queue) -> None:
        """The destination has room again: that many parked entries of each class return."""
        lists = self.parked.get(queue)
        if lists is None:
            return
        room = self.transport.room(queue)
        if room > 0:
            for k, parked in enumerate(lists):
                back: list[Node[SenderEntry]] = []
                while parked.head is not None and len(back) < room:
                    node = parked.head
                    parked.unlink(node)
                    back.append(node)
                for node in reversed(back):
                    self.classes[k].prepend(node)
        if not any(lists):
            del self.parked[queue]

    def unselect(self, entry: Entry) -> None:
        se: SenderEntry = entry  # type: ignore[assignment]
        self.classes[self.klass(se.job)].prepend(se.node)

    def done(self, entry: Entry, busy: bool) -> None:
        se: SenderEntry = entry  # type: ignore[assignment]
        job = se.job
        job.rcpts -= len(se.recipients)
        job.refs -= 1
        if job.refs == 0:
            del self.jobs[job.message]
        if not busy and se.node.owner is not None:
            se.node.owner.unlink(se.node)
        self._unpark(se.queue)

    def resumed(self, queue: Queue) -> None:
        self._unpark(queue)

    def queue_done(self, queue: Queue) -> None:
        self.parked.pop(queue, None)

    def describe(self) -> dict[str, object]:
        return {
            "policy": self.name,
            "todo": {c: len(q) for c, q in zip(CLASS_NAMES, self.classes, strict=True)},
            "parked destinations": len(self.parked),
            "served": dict(zip(CLASS_NAMES, self.served, strict=True)),
            "messages": len(self.jobs),
        }
