"""The scheduler core: events in, decisions out, no I/O.

Events are method calls: a message's recipients were routed (:meth:`Scheduler.assign`),
an agent of a transport is ready for work (:meth:`select`), a delivery finished
(:meth:`done`), a transport's agent could not be reached (:meth:`throttle_transport`),
time passed (:meth:`tick`), the admin asked for a flush (:meth:`enable_all`). What the
daemon must do in return comes back as values: the entry to deliver, the messages that
are finished, recipients that must be deferred through the defer service because even
the retry transport is dead, and log lines (``self.log``) for the daemon to write.

Selection in this version is oqmgr-like: round robin over a transport's destination
queues, oldest entry first within a queue. The job and peer structures are kept up to
date so that nqmgr's preemptive job selection can replace :meth:`select` (issue #3).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from pyqmgr.scheduler.entry import Entry
from pyqmgr.scheduler.feedback import parse_or_warn
from pyqmgr.scheduler.job import Job
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.peer import Peer
from pyqmgr.scheduler.queue import Dsn, Queue
from pyqmgr.scheduler.transport import Transport, TransportParams

RETRY = "retry"
ERROR = "error"

SUSPENDED = "delivery temporarily suspended: "
_DSN_RE = re.compile(r"[245]\.\d{1,3}\.\d{1,3}$")


class FullTransportParams(TransportParams, Protocol):
    positive_feedback: str
    positive_feedback_name: str
    negative_feedback: str
    negative_feedback_name: str


@dataclass(frozen=True, slots=True)
class Route:
    """Where trivial-rewrite (and qmgr's own rules) sent one recipient."""

    transport: str
    queue_name: str
    nexthop: str
    recipient: Recipient


@dataclass(frozen=True, slots=True)
class DeferRecipient:
    """Decision: write a defer-log record for this recipient now (retry is dead too)."""

    message: Message
    recipient: Recipient
    dsn: Dsn


def dsn_valid(status: str) -> bool:
    return bool(_DSN_RE.match(status))


class Scheduler:
    def __init__(
        self,
        params_for: Callable[[str], FullTransportParams],
        *,
        min_backoff_time: float = 300.0,
        transport_retry_time: float = 60.0,
        initial_concurrency: int = 5,
        feedback_debug: bool = False,
        active_limit: int = 20000,
        clog_warn_time: float = 300.0,
        helpful_warnings: bool = True,
    ) -> None:
        self.params_for = params_for
        self.min_backoff_time = min_backoff_time
        self.transport_retry_time = transport_retry_time
        self.initial_concurrency = initial_concurrency
        self.feedback_debug = feedback_debug
        self.active_limit = active_limit
        self.clog_warn_time = clog_warn_time
        self.helpful_warnings = helpful_warnings
        #: Messages in the active queue; the daemon keeps it current (clog warnings).
        self.message_count = 0
        #: The scheduler clock as of the latest event that carried a time.
        self.now = 0.0
        self.transports: dict[str, Transport] = {}
        #: (severity, text) lines for the daemon to log, in order.
        self.log: list[tuple[str, str]] = []
        #: Recipients the daemon must defer synchronously (decisions, drained by it).
        self.deferrals: list[DeferRecipient] = []
        #: Messages whose last entry finished (decisions, drained by the daemon).
        self.finished: list[Message] = []
        #: Times at which :meth:`tick` has work (decisions: arm a timer for each).
        self.timers: list[float] = []
        # Queues with todo entries, per transport, in round-robin order.
        self._ready: dict[str, deque[Queue]] = {}

    # -- transports and queues ----------------------------------------------------

    def transport(self, name: str) -> Transport:
        t = self.transports.get(name)
        if t is None:
            cfg = self.params_for(name)
            pos, pos_warn = parse_or_warn(cfg.positive_feedback, cfg.positive_feedback_name)
            neg, neg_warn = parse_or_warn(cfg.negative_feedback, cfg.negative_feedback_name)
            debug = self.feedback_debug and name not in (RETRY, ERROR)
            t = Transport(name, cfg, pos, neg, self._info, feedback_debug=debug)
            for warn in (pos_warn, neg_warn):
                if warn:
                    self.log.append(("warning", warn))
            if debug:
                for fb, fb_name in ((pos, cfg.positive_feedback_name),
                                    (neg, cfg.negative_feedback_name)):
                    self._info(
                        f"{name}: {fb_name} feedback type {fb.index} value at "
                        f"{self.initial_concurrency}: {fb.value(self.initial_concurrency):g}"
                    )
            self.transports[name] = t
            self._ready[name] = deque()
        return t

    def _info(self, text: str) -> None:
        self.log.append(("info", text))

    def _error_queue(self, service: str, dsn: Dsn) -> Queue | None:
        """The retry/error queue for ``dsn``, or None when that is dead too."""
        t = self.transport(service)
        if t.throttled:
            return None
        q = t.queue(dsn.nexthop, dsn.nexthop)
        return None if q.throttled else q

    # -- events -------------------------------------------------------------------

    def assign(self, message: Message, routes: Iterable[Route], flush_each: bool = False,
               now: float | None = None) -> None:
        """Bundle routed recipients into entries (``qmgr_message_assign``).

        Recipients must come sorted by transport and queue, so that consecutive
        recipients for the same destination share a delivery request up to the
        transport's recipient limit. Dead transports and destinations send their
        recipients to the retry transport, as stock's resolver step does, unless the
        message is being flushed (``flush_each``: ``postqueue -i``/``-s``), which
        brings them back to life first.
        """
        if now is not None:
            self.now = now
        job: Job | None = None
        peer: Peer | None = None
        for route in routes:
            t = self.transport(route.transport)
            queue: Queue | None
            if flush_each and t.throttled:
                self._unthrottle_transport(t)
            if flush_each and not t.throttled:
                named = t.queues.get(route.queue_name)
                if named is not None and named.throttled:
                    named.unthrottle()
            if t.throttled:
                assert t.dsn is not None
                queue = self._error_queue(RETRY, t.dsn)
                dsn = t.dsn
            else:
                queue = t.queue(route.queue_name, route.nexthop)
                dsn = queue.dsn if queue.throttled else None
                if dsn is not None:
                    queue = self._error_queue(RETRY, dsn)
            if queue is None:
                assert dsn is not None
                message.deferred = True
                self.deferrals.append(DeferRecipient(message, route.recipient, dsn))
                continue
            if job is None or job.transport is not queue.transport:
                job = self._job(message, queue.transport)
                peer = None
            if peer is None or peer.queue is not queue:
                peer = self._peer(job, queue)
            limit = queue.transport.recipient_limit
            entry = peer.entries[-1] if peer.entries else None
            if (message.single_rcpt or entry is None or entry.busy
                    or (limit != 0 and len(entry.recipients) >= limit)):
                entry = self._new_entry(message, queue, peer)
            entry.recipients.append(route.recipient)
            job.rcpt_count += 1
            message.rcpt_count += 1

    def _job(self, message: Message, transport: Transport) -> Job:
        job = message.jobs.get(transport.name)
        if job is None:
            job = Job(message, transport)
            message.jobs[transport.name] = job
            transport.jobs[job] = None
        return job

    def _peer(self, job: Job, queue: Queue) -> Peer:
        peer = job.peers.get(queue)
        if peer is None:
            peer = Peer(job, queue)
            job.peers[queue] = peer
        return peer

    def _new_entry(self, message: Message, queue: Queue, peer: Peer) -> Entry:
        entry = Entry(message, queue, peer)
        peer.entries.append(entry)
        peer.job.read_entries += 1
        if not queue.todo:
            self._ready[queue.transport.name].append(queue)
        queue.todo.append(entry)
        queue.transport.todo_count += 1
        message.refcount += 1
        if self.helpful_warnings and self.clog_warn_time > 0:
            self._clog_warning(queue)
        return entry

    def _clog_warning(self, queue: Queue) -> None:
        """One destination filling the active queue: stock's advice, at most so often."""
        length = len(queue.todo) + queue.busy_count
        if length <= self.active_limit // 5 or self.now < queue.clog_time_to_warn:
            return
        count = max(self.message_count, 1)
        share = length / count
        t = queue.transport
        warn = [f"mail for {queue.nexthop} is using up {length} of {count} active queue "
                "entries"]
        if share < 0.9:
            warn.append("this may slow down other mail deliveries")
        limit = t.cfg.destination_concurrency_limit
        if 0 < limit <= queue.busy_count + 1:
            warn.append(f"you may need to increase the main.cf {t.name}"
                        f"_destination_concurrency_limit from {limit}")
        elif queue.window > self.active_limit * share:
            warn.append("you may need to increase the main.cf qmgr_message_active_limit "
                        f"from {self.active_limit}")
        elif len(t.queues) > 1:
            warn.append(f"you may need a separate master.cf transport for {queue.nexthop}")
        else:
            warn += [
                f"you may need to reduce {t.name} connect and helo timeouts",
                "so that Postfix quickly skips unavailable hosts",
                "you may need to increase the main.cf minimal_backoff_time and "
                "maximal_backoff_time",
                "so that Postfix wastes less time on undeliverable mail",
                f"you may need to increase the master.cf {t.name} process limit",
            ]
        warn += [
            "please avoid flushing the whole queue when you have",
            "lots of deferred mail, that is bad for performance",
            "to turn off these warnings specify: qmgr_clog_warn_time = 0",
        ]
        self.log.extend(("warning", w) for w in warn)
        queue.clog_time_to_warn = self.now + self.clog_warn_time

    def has_work(self, name: str) -> bool:
        """Would an agent of this transport get an entry now? (Worth connecting one.)"""
        t = self.transports.get(name)
        if t is None or t.throttled or t.todo_count == 0:
            return False
        return any(q.ready and q.has_room() for q in self._ready[name])

    def select(self, name: str) -> Entry | None:
        """An agent of transport ``name`` is ready: pick the entry it delivers."""
        t = self.transports.get(name)
        if t is None or t.throttled:
            return None
        ready = self._ready[name]
        for _ in range(len(ready)):
            queue = ready[0]
            ready.rotate(-1)
            if not queue.todo:
                ready.remove(queue)
                continue
            if not (queue.ready and queue.has_room()):
                continue
            entry = queue.todo.popleft()
            if not queue.todo:
                ready.remove(queue)
            t.todo_count -= 1
            entry.busy = True
            queue.busy_count += 1
            entry.peer.entries.remove(entry)
            entry.peer.job.selected_entries += 1
            return entry
        return None

    def done(self, entry: Entry, status: int, hop: Dsn | None, crashed: bool, now: float) -> None:
        """A delivery finished (``qmgr_deliver_update``).

        ``status`` is the agent's final status (0 all final, else retry needed);
        ``hop`` is the agent's hop-level DSN when it reported one; ``crashed`` means
        no usable reply at all (3.7.11 behaviour: defer the message, leave the
        transport's state alone).
        """
        self.now = now
        queue = entry.queue
        t = queue.transport
        message = entry.message
        if crashed or status != 0:
            message.deferred = True
            if hop is not None and hop.status:
                dsn = Dsn(
                    hop.status if dsn_valid(hop.status) else "4.0.0",
                    SUSPENDED + (hop.reason or "unknown error"),
                )
                if queue.ready and queue.throttle(dsn, now, self.min_backoff_time):
                    self.timers.append(now + self.min_backoff_time)
                    self._defer_todo(queue, dsn)
        if not crashed:
            self._unthrottle_transport(t)
            if hop is None or not hop.reason:
                queue.unthrottle()
        entry.busy = False
        queue.busy_count -= 1
        self._entry_done(entry, now)

    def _entry_done(self, entry: Entry, now: float | None = None) -> None:
        """``now`` is given when a busy entry (a finished delivery) is done."""
        queue = entry.queue
        delay = queue.transport.cfg.destination_rate_delay
        if now is not None and delay > 0:
            if queue.throttled:
                queue.unthrottle()
            if queue.ready:
                queue.suspend(now, delay)
                self.timers.append(now + delay)
        peer = entry.peer
        job = peer.job
        message = entry.message
        if not peer.entries and job.peers.get(queue) is peer:
            del job.peers[queue]
        if not job.peers:
            message.jobs.pop(job.transport.name, None)
            job.transport.jobs.pop(job, None)
        if queue.ready and not queue.todo and queue.busy_count == 0:
            queue.transport.queues.pop(queue.name, None)
        message.refcount -= 1
        if message.refcount == 0:
            self.finished.append(message)

    def _remove_todo(self, entry: Entry) -> None:
        queue = entry.queue
        queue.todo.remove(entry)
        if not queue.todo:
            ready = self._ready[queue.transport.name]
            if queue in ready:
                ready.remove(queue)
        queue.transport.todo_count -= 1
        entry.peer.entries.remove(entry)

    def _defer_todo(self, queue: Queue, dsn: Dsn) -> None:
        """A dead destination: move its waiting entries to retry, or defer them."""
        retry = self._error_queue(RETRY, dsn)
        for entry in list(queue.todo):
            self._remove_todo(entry)
            if retry is not None:
                moved = self._new_entry(entry.message, retry,
                                        self._peer(self._job(entry.message, retry.transport),
                                                   retry))
                moved.recipients = entry.recipients
            else:
                entry.message.deferred = True
                for rcpt in entry.recipients:
                    self.deferrals.append(DeferRecipient(entry.message, rcpt, dsn))
            self._entry_done(entry)

    def throttle_transport(self, name: str, dsn: Dsn, now: float) -> None:
        """The agent could not be reached: the transport is dead for a while."""
        t = self.transport(name)
        if not t.throttled:
            t.dsn = dsn
            t.revive_at = now + self.transport_retry_time
            self.timers.append(t.revive_at)
        for queue in list(t.queues.values()):
            if queue.todo:
                self._defer_todo(queue, dsn)

    def _unthrottle_transport(self, t: Transport) -> None:
        t.dsn = None
        t.revive_at = None

    def tick(self, now: float) -> None:
        """Time passed: revive dead transports and destinations whose timers expired."""
        for t in self.transports.values():
            if t.revive_at is not None and now >= t.revive_at:
                self._unthrottle_transport(t)
            for queue in list(t.queues.values()):
                if queue.revive_at is not None and now >= queue.revive_at:
                    queue.unthrottle()
                    if not queue.todo and queue.busy_count == 0:
                        t.queues.pop(queue.name, None)
                elif queue.resume_at is not None and now >= queue.resume_at:
                    queue.resume()
                    if not queue.todo and queue.busy_count == 0:
                        t.queues.pop(queue.name, None)

    def enable_all(self) -> None:
        """``F`` trigger: forget dead transports and destinations now."""
        for t in self.transports.values():
            self._unthrottle_transport(t)
            for queue in list(t.queues.values()):
                if queue.throttled:
                    queue.unthrottle()
