"""finch: Tony Finch's MTA scheduling design (``finch-mta-scheduling.txt`` in the seeds).

First come, first served over messages, with a per-message cap on deliveries in flight
that grows with the transport's free workers::

    def allowed_new_worker(job):
        if job.message.concurrency < max_message_concurrency: return true
        else if job.message.concurrency < scale_max_concurrency * free_workers: ...

Here a worker is one of the transport's delivery agent processes: free workers are
its master.cf process limit less its deliveries in flight and less the agent
connections already asked for (each will take a worker; counting them free would let
the first message past its cap whenever two agents are on their way). With a scale of
10 one big envelope on an otherwise idle transport can hold about 10/11 (91%) of the
agents, two can hold 10/21 (47%) each, and when a second big envelope arrives it takes
each agent the first one gives back until the two are at that equilibrium.

Knobs (pyqmgr.cf, with ``<transport>_`` forms): ``finch_max_message_concurrency``
(default 10) and ``finch_scale_max_concurrency`` (default 10).

What the design's other parts become in Postfix:

* destdb's retry records are the shared dead-site state: a destination whose
  failed cohorts reach its limit is dead until ``minimal_backoff_time`` has passed,
  and its mail goes to the retry transport meanwhile; the records are collected
  when they expire, and at once when the in-core queues crowd memory;
* pipelining down a connection, choosing among MX hosts and closing idle
  connections are the delivery agent's: smtp(8) with its connection cache, its MX
  ordering and ``smtp_connection_cache_time_limit``. The queue manager cannot reach
  into a connection, so this policy schedules messages, not connections.

The walk is first come, first served: messages that may not take another worker, or
whose destinations are all at their window, are passed over. The second kind is
tagged as nqmgr tags blocker jobs, and skipped without a look until one of those
destinations takes a delivery again, so a long run of messages waiting for one busy
destination costs one pass, not one per decision.
"""

from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING

from pyqmgr.scheduler.entry import Entry, entry_link, entry_select
from pyqmgr.scheduler.policy import Context, Policy, Reason, reason
from pyqmgr.scheduler.qlist import Node, QList

if TYPE_CHECKING:
    from pyqmgr.scheduler.message import Message
    from pyqmgr.scheduler.queue import Queue
    from pyqmgr.scheduler.transport import Transport


class FinchEntry(Entry):
    """An entry that is also on its message's job list, in the order of its recipients."""

    __slots__ = ("job", "job_node")

    def __init__(self, message: Message, queue: Queue, job: FinchJob) -> None:
        super().__init__(message, queue)
        self.job = job
        self.job_node: Node[FinchEntry] = Node(self)

    def release(self) -> None:
        super().release()
        node = self.job_node
        if node.owner is None:
            node.item = None  # type: ignore[assignment]


class FinchJob:
    """One message's work on the transport: its todo entries and its concurrency."""

    __slots__ = ("message", "seq", "todo", "concurrency", "refs", "node", "blocker_tag")

    def __init__(self, message: Message, seq: int) -> None:
        self.message = message
        #: First-come order: when the message first reached the policy.
        self.seq = seq
        self.todo: QList[FinchEntry] = QList()
        #: Deliveries of this message in flight on the transport.
        self.concurrency = 0
        #: Entries (todo and busy) that still refer to the job.
        self.refs = 0
        self.node: Node[FinchJob] = Node(self)
        #: Equal to the policy's tag while every todo entry's destination is full.
        self.blocker_tag = 0


class Finch(Policy):
    name = "finch"
    gates_allocation = True
    knobs = {
        "finch_max_message_concurrency": ("10", "int", 0, None),
        "finch_scale_max_concurrency": ("10", "number", 0, None),
    }

    def __init__(self, transport: Transport, ctx: Context) -> None:
        super().__init__(transport, ctx)
        self.max_concurrency = int(self.knob("finch_max_message_concurrency"))
        self.scale = self.knob("finch_scale_max_concurrency")
        #: Workers: the agent processes master(8) may run (0: no limit, taken as 100).
        self.workers = ctx.process_limit(transport.name) or 100
        #: Deliveries in flight on the transport.
        self.busy = 0
        #: Jobs with todo entries, in first-come order. A job whose entries are all
        #: in flight leaves the walk until it has a todo entry again, so that a
        #: decision does not step over every message that is merely being delivered.
        self.jobs: QList[FinchJob] = QList()
        self.by_message: dict[Message, FinchJob] = {}
        self._seq = 0
        #: nqmgr's trick for jobs whose destinations are all full: tag them (and those
        #: destinations) and skip them until one of the destinations takes a delivery
        #: again, when bumping the tag (it stays odd) releases them all at once.
        self.blocker_tag = 1

    def free_workers(self) -> int:
        """Workers neither delivering nor already asked for (pending agent connections).

        The worker being decided about is among them: :meth:`select` runs after the
        core has stopped counting its agent as pending, and :meth:`has_work` before it
        asks for another one.
        """
        return self.workers - self.busy - self.transport.pending

    def allowed_new_worker(self, job: FinchJob) -> bool:
        if job.concurrency < self.max_concurrency:
            return True
        return job.concurrency < self.scale * self.free_workers()

    def new_entry(self, message: Message, queue: Queue) -> Entry:
        job = self.by_message.get(message)
        if job is None:
            self._seq += 1
            job = self.by_message[message] = FinchJob(message, self._seq)
        entry = FinchEntry(message, queue, job)
        job.todo.append(entry.job_node)
        self._waiting(job)
        job.refs += 1
        return entry_link(entry)

    def _waiting(self, job: FinchJob) -> None:
        """The job has a todo entry (again): on the walk, in its first-come place.

        A new job goes last at once; a job that gets a later recipient batch walks back
        past the younger waiting jobs, once per batch, not per decision.
        """
        job.blocker_tag = 0
        if job.node.owner is not None:
            return
        nxt = None
        prev = self.jobs.tail
        while prev is not None and prev.item.seq > job.seq:
            nxt, prev = prev, prev.prev
        self.jobs.link(prev, job.node, nxt)

    def _drained(self, job: FinchJob) -> None:
        """No todo entry left: off the walk until it gets one."""
        if not job.todo and job.node.owner is not None:
            self.jobs.unlink(job.node)

    def _find(self) -> FinchEntry | None:
        """The first job allowed a new worker, and its first entry with room."""
        room = self.transport.room
        tag = self.blocker_tag
        for job in self.jobs:
            if job.blocker_tag == tag or not self.allowed_new_worker(job):
                continue
            for entry in job.todo:
                if room(entry.queue) > 0:
                    return entry
            if job.todo:
                job.blocker_tag = tag
                for entry in job.todo:
                    entry.queue.blocker_tag = tag
        return None

    def _unblock(self, queue: Queue) -> None:
        """A destination that blocked jobs may take a delivery: release all of them."""
        if queue.blocker_tag == self.blocker_tag and self.transport.room(queue) > 0:
            self.blocker_tag += 2
            queue.blocker_tag = 0

    def has_work(self) -> bool:
        return self._find() is not None

    def select(self) -> Entry | None:
        entry = self._find()
        if entry is None:
            return None
        job = entry.job
        job.todo.unlink(entry.job_node)
        job.concurrency += 1
        self.busy += 1
        self._drained(job)
        return entry_select(entry, self.ctx.clock)

    def unselect(self, entry: Entry) -> None:
        fe: FinchEntry = entry  # type: ignore[assignment]
        fe.job.todo.prepend(fe.job_node)
        fe.job.concurrency -= 1
        self._waiting(fe.job)
        self.busy -= 1
        self._unblock(entry.queue)

    def done(self, entry: Entry, busy: bool) -> None:
        fe: FinchEntry = entry  # type: ignore[assignment]
        job = fe.job
        if busy:
            job.concurrency -= 1
            self.busy -= 1
            self._unblock(entry.queue)
        else:
            job.todo.unlink(fe.job_node)
            self._drained(job)
        job.refs -= 1
        if job.refs == 0:
            del self.by_message[job.message]
            if job.node.owner is None:
                job.node.item = None  # type: ignore[assignment]  # no cycle (Entry.release)

    def resumed(self, queue: Queue) -> None:
        self._unblock(queue)

    def explain(self, queue: Queue | None, message: Message | None) -> list[Reason]:
        job = self.by_message.get(message) if message is not None else None
        if job is None or not job.todo or self.allowed_new_worker(job):
            return []
        return [reason(
            "message concurrency", f"{self.tname}_finch_scale_max_concurrency",
            f"{job.message.queue_id} has {job.concurrency} deliveries in flight; finch "
            f"allows another while it has fewer than {self.max_concurrency} "
            f"(finch_max_message_concurrency) or fewer than {self.scale:g} x "
            f"{self.free_workers()} free workers", concurrency=job.concurrency)]

    def describe(self) -> dict[str, object]:
        return {"policy": self.name, "workers": self.workers, "busy": self.busy,
                "messages": [(j.message.queue_id, j.concurrency)
                             for j in self.by_message.values()][:20]}

    def jobs_report(self, now: float, limit: int | None = None) -> dict[str, object]:
        """Every message on the transport, first come first, with its workers."""
        t = self.tname
        tag = self.blocker_tag
        messages: list[dict[str, object]] = []
        # by_message gains a job when a message first (or again) reaches the policy,
        # so its order is first-come order.
        for job in islice(self.by_message.values(), limit):
            dests = list(dict.fromkeys(e.queue.name for e in job.todo))
            messages.append({
                "queue_id": job.message.queue_id,
                "workers": job.concurrency,
                "todo": len(job.todo),
                # On the walk: has a todo entry; passed over while a blocker or capped.
                "waiting": job.node.owner is not None,
                "blocker": bool(job.todo) and job.blocker_tag == tag,
                "allowed_new_worker": self.allowed_new_worker(job),
                "age": round(now - job.message.enqueue_time, 3),
                "destinations": dests,
            })
        return {"policy": self.name, "kind": "messages",
                "order": "first come, first served: an agent takes the first message "
                         "allowed another worker that has an entry for a destination "
                         "with room",
                "settings": {f"{t}_finch_max_message_concurrency": self.max_concurrency,
                             f"{t}_finch_scale_max_concurrency": self.scale},
                "workers": self.workers, "busy": self.busy,
                "free_workers": self.free_workers(),
                "total": len(self.by_message), "messages": messages}
