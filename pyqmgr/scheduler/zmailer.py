"""zmailer: ZMailer's scheduler (``zmailer-scheduler-notes.txt`` in the seeds).

ZMailer groups recipient vertices into threads (everything one transport agent could
take at once: here a transport and next hop, i.e. a destination queue) and threads
into thread rings (everything one kind of agent can serve: here the transport). This
policy keeps its rules:

* at most one agent on a thread at a time (:attr:`Zmailer.dest_cap` is 1), while
  several threads of a ring run in parallel up to the transport's process limit;
* a thread starts when an agent is free, oldest waiting thread first (threads are
  kept in wake-up order: the age of their first vertex);
* at the start, the thread's vertices are put in age order (``zmailer_ageorder =
  yes``, the default) or shuffled (``no``), and every vertex of a started thread is
  attempted in that run: when its agent comes back, the next agent continues the
  same thread before any waiting thread starts;
* a thread that met a resource limit (its destination's window closed, or the
  destination died and its vertices went to the retry transport) is rescheduled:
  it goes back to wait, behind the threads already waiting.

ZMailer's idle pool (agents that finished keep waiting for a new thread of the same
ring, and are killed after ``idlemax``) is master(8)'s agent reuse in Postfix: a
delivery agent serves up to ``max_use`` requests and exits after ``max_idle``.

Vertices that arrive while their thread runs join the end of the run.
"""

from __future__ import annotations

import random
from collections import deque
from typing import TYPE_CHECKING

from pyqmgr.scheduler.entry import Entry, entry_select
from pyqmgr.scheduler.policy import Context, Policy, Reason, reason
from pyqmgr.scheduler.qlist import Node, QList

if TYPE_CHECKING:
    from pyqmgr.scheduler.message import Message
    from pyqmgr.scheduler.queue import Queue
    from pyqmgr.scheduler.transport import Transport


class Thread:
    """One destination's vertices, and the run in progress when it has started."""

    __slots__ = ("queue", "run", "running", "node")

    def __init__(self, queue: Queue) -> None:
        self.queue = queue
        #: The current run's vertices in the order they are attempted.
        self.run: deque[Entry] = deque()
        self.running = False
        self.node: Node[Thread] = Node(self)


def _todo(entry: Entry) -> bool:
    """Still waiting in its queue (not delivered, moved to retry or deferred)."""
    return not entry.busy and entry.queue_node.owner is not None


class Zmailer(Policy):
    name = "zmailer"
    dest_cap = 1
    knobs = {"zmailer_ageorder": ("yes", "bool", 0, None)}

    def __init__(self, transport: Transport, ctx: Context) -> None:
        super().__init__(transport, ctx)
        self.ageorder = bool(self.knob("zmailer_ageorder"))
        #: A fixed seed keeps a simulation repeatable; shuffling is not security.
        self.rng = random.Random(0x5A4D)
        self.threads: dict[Queue, Thread] = {}
        #: Threads waiting to start, in wake-up order.
        self.waiting: QList[Thread] = QList()
        #: Started threads whose agent came back while vertices remain.
        self.continuing: QList[Thread] = QList()

    def new_entry(self, message: Message, queue: Queue) -> Entry:
        thread = self.threads.get(queue)
        if thread is None:
            thread = self.threads[queue] = Thread(queue)
        entry = super().new_entry(message, queue)
        if thread.running:
            thread.run.append(entry)
        elif thread.node.owner is None:
            self.waiting.append(thread.node)
        return entry

    def _start(self, thread: Thread) -> None:
        """Fix the run: every vertex waiting now, in age order or shuffled."""
        vertices = list(thread.queue.todo)
        if self.ageorder:
            vertices.sort(key=lambda e: e.message.enqueue_time)
        else:
            self.rng.shuffle(vertices)
        thread.run = deque(vertices)
        thread.running = True

    def _next_vertex(self, thread: Thread) -> Entry | None:
        return thread.run.popleft() if self._runs_on(thread) else None

    @staticmethod
    def _runs_on(thread: Thread) -> bool:
        """Drop vertices that left meanwhile from the front; is anything left?"""
        run = thread.run
        while run and not _todo(run[0]):
            run.popleft()
        return bool(run)

    def select(self) -> Entry | None:
        room = self.transport.room
        for thread in self.continuing:
            if room(thread.queue) > 0:
                entry = self._next_vertex(thread)
                self.continuing.unlink(thread.node)
                if entry is not None:
                    return entry_select(entry, self.ctx.clock)
                self._end_run(thread)
        for thread in self.waiting:
            if room(thread.queue) > 0 and thread.queue.todo:
                self.waiting.unlink(thread.node)
                self._start(thread)
                entry = self._next_vertex(thread)
                assert entry is not None
                return entry_select(entry, self.ctx.clock)
        return None

    def _end_run(self, thread: Thread) -> None:
        """The run is over; vertices that came since wait for the next one."""
        thread.running = False
        thread.run.clear()
        if thread.node.owner is not None:
            thread.node.owner.unlink(thread.node)
        if thread.queue.todo:
            self.waiting.append(thread.node)

    def unselect(self, entry: Entry) -> None:
        thread = self.threads.get(entry.queue)
        if thread is not None and thread.running:
            thread.run.appendleft(entry)
            if thread.node.owner is None:
                self.continuing.append(thread.node)

    def done(self, entry: Entry, busy: bool) -> None:
        thread = self.threads.get(entry.queue)
        if thread is None or not busy or not thread.running:
            return
        # The thread's agent is back: the run goes on, or ends when nothing is left.
        if self._runs_on(thread) and not entry.queue.throttled:
            if thread.node.owner is None:
                self.continuing.append(thread.node)
        else:
            self._end_run(thread)

    def resumed(self, queue: Queue) -> None:
        thread = self.threads.get(queue)
        if thread is not None and thread.node.owner is None and queue.todo:
            if thread.running:
                self.continuing.append(thread.node)
            else:
                self.waiting.append(thread.node)

    def explain(self, queue: Queue | None, message: Message | None) -> list[Reason]:
        thread = self.threads.get(queue) if queue is not None else None
        if thread is None or thread.node.owner is not self.waiting:
            return []
        ahead = 0
        for other in self.waiting:
            if other is thread:
                break
            ahead += 1
        return [reason(
            "thread waiting", f"master.cf {self.tname} maxproc",
            f"the thread for {queue.nexthop if queue else '?'} waits for a free agent "
            f"behind {ahead} older threads", ahead=ahead)]

    def queue_done(self, queue: Queue) -> None:
        thread = self.threads.pop(queue, None)
        if thread is not None:
            if thread.node.owner is not None:
                thread.node.owner.unlink(thread.node)
            thread.node.item = None  # type: ignore[assignment]  # no cycle (Entry.release)

    def describe(self) -> dict[str, object]:
        return {"policy": self.name, "threads": len(self.threads),
                "waiting": len(self.waiting), "continuing": len(self.continuing)}

    def jobs_report(self, now: float, limit: int | None = None) -> dict[str, object]:
        """The threads, in the order free agents go to them.

        Continuing threads first (their agent came back and the run has vertices
        left), then waiting ones oldest first; a running thread has its one agent
        out, an idle one nothing to do.
        """
        rows: list[dict[str, object]] = []
        nxt = 0
        for state, threads in (("continuing", list(self.continuing)),
                               ("waiting", list(self.waiting)),
                               ("running", [th for th in self.threads.values()
                                            if th.running and th.node.owner is None]),
                               ("idle", [th for th in self.threads.values()
                                         if not th.running and th.node.owner is None])):
            for thread in threads:
                if limit is not None and len(rows) >= limit:
                    break
                queue = thread.queue
                first = queue.todo.first()
                if state in ("continuing", "waiting"):
                    nxt += 1
                rows.append({
                    "destination": queue.name,
                    "nexthop": queue.nexthop,
                    "state": state,
                    "turn": nxt if state in ("continuing", "waiting") else None,
                    "run_left": sum(1 for e in thread.run if _todo(e)),
                    "todo": len(queue.todo),
                    "in_flight": queue.busy_count,
                    "oldest_age": (round(now - first.message.enqueue_time, 3)
                                   if first is not None else None),
                })
        return {"policy": self.name, "kind": "threads",
                "order": "continuing threads first, then waiting threads in wake-up "
                         "order (the age of their first vertex); one agent per thread",
                "settings": {f"{self.tname}_zmailer_ageorder": self.ageorder},
                "total": len(self.threads), "threads": rows}
