"""Delivery events in the daemon: from each request's trace records to the writer.

How it fits stock's flow (verified in Postfix 3.7.11's source, see docs/events.md):
every delivery request of a message that did not ask for a trace itself carries
``DEL_REQ_FLAG_RECORD``; the agent's ``sent()``, ``defer_append()`` and
``bounce_append()`` then append the recipient's outcome to ``trace/QUEUEID``, and
after each request's reply :meth:`DeliveryEvents.after_reply` reads the records
added since the last read and queues their events. The trace log lives as long as
the message: across deferrals the records keep their ordinals (the attempt number
and the key's last part), and when the message leaves the queue, the log is removed
once its events were written and fsynced (:meth:`message_left`), never before.

A message that asked for a trace itself (``sendmail -v``: RECORD in its trace_flags,
or a recipient with NOTIFY=SUCCESS) is left exactly as stock handles it: no flag is
added (the sender's report is made from that very log and would list every deferred
and bounced recipient otherwise), its log is read as it grows, and stock's trace
flush at the end of each pass mails the report and removes the log. Its events are
those its log holds: all of them for ``sendmail -v``, the NOTIFY=SUCCESS recipients'
deliveries for DSN.

A read may meet records of the message's other requests still out (their agents
wrote them before this reply was read): each request is noted as out from its flag
to its reply, and such a record gets its own request's transport, next hop and site.

Hot path: one ``open``/``pread``/``close`` of a few hundred bytes per delivery
request, and one dict entry per message in the active queue (and per deferred
message whose log was read, its read offset: a qmgr that reads a log again after
its restart repeats what it read before, with the same keys). What a message's
requests share is worked out once per message (its trace log's path, the encoded
fields of its delivery), a message that arrived after this process started is not
looked for a log an earlier qmgr wrote, and whether a message left for good costs
four ``faccessat`` when its events are on disk.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pyqmgr.events.record import Context, EventLine
from pyqmgr.events.stream import StreamStats
from pyqmgr.events.writer import EventWriter, Paced
from pyqmgr.postfix import mail_queue, queue_file
from pyqmgr.postfix.deliver_request import (
    DEL_REQ_FLAG_MTA_VRFY,
    DEL_REQ_FLAG_REC_DLY_SENT,
    DEL_REQ_FLAG_RECORD,
    DEL_REQ_FLAG_USR_VRFY,
)
from pyqmgr.postfix.trace_log import TraceCursor, TracePiece, read_more

if TYPE_CHECKING:
    from pyqmgr.daemon.active import ActiveMessage
    from pyqmgr.scheduler.entry import Entry

#: Size-record flag: some recipient asked for NOTIFY=SUCCESS (``qmgr_user.h``).
READ_FLAG_NOTIFY_SUCCESS = 1 << 2
#: Trace flags with which stock mails a report made from the trace log.
OWN_TRACE = DEL_REQ_FLAG_USR_VRFY | DEL_REQ_FLAG_RECORD | DEL_REQ_FLAG_REC_DLY_SENT
#: Seconds before the events file's last change within which a queued message's trace
#: log is read again at start-up: a record is read and queued well within this of its
#: writing, and written with the next batch (FIFO) after that.
SUSPECT = 10.0
#: The queues whose files a queue manager reads: a message in none is gone.
QUEUES = ("incoming", "active", "deferred", "hold")


@dataclass
class EventStats:
    """The reading side's counts (the writer keeps its own)."""

    records: int = 0
    events: int = 0
    #: Events read again from a trace log older than this process (after a restart).
    repeated: int = 0
    #: Trace records that were the second copy sent() writes for NOTIFY=SUCCESS.
    doubles: int = 0
    bad_records: int = 0
    read_errors: int = 0
    logs_removed: int = 0
    leftovers: int = 0

    def as_json(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Log:
    """One message's trace log as read so far."""

    #: ``trace/QUEUEID`` (hashed as the queue is).
    path: str
    cursor: TraceCursor = field(default_factory=TraceCursor)
    #: Records read per recipient (offset or address): the next ordinal is one more.
    counts: dict[str, int] = field(default_factory=dict)
    #: The last record's fields per recipient, to drop sent()'s second copy.
    last: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: Bytes of the file that predate this process (their events are repeats).
    old_bytes: int = -1
    #: Some events were not queued (the writer's queue was full): keep the log.
    held: bool = False
    #: The last request's encoded fields, and what they were made of (its queue and
    #: that queue's site, compared by identity, the message's class rank and tenant).
    line: EventLine | None = None
    scope: tuple[object, object, int, str] = (None, None, -1, "")
    #: The message's requests out with agents (their flag asked for, no reply read
    #: yet): a read may meet their records before their replies.
    out: list[Entry] | None = None


class NoEvents:
    """Delivery events off (no ``delivery_events_file``): every call does nothing and
    no flag is added, so that the daemon calls its three hooks without a test."""

    def flags(self, entry: Entry) -> int:
        return 0

    def record_flags(self, am: ActiveMessage) -> int:
        return 0

    def after_reply(self, am: ActiveMessage, entry: Entry | None) -> None:
        pass

    def message_left(self, am: ActiveMessage) -> None:
        pass

    def status(self) -> dict[str, object] | None:
        return None


class DeliveryEvents(NoEvents):
    """What the daemon calls: :meth:`flags` (each request), :meth:`after_reply`,
    :meth:`message_left` and, at start-up, :meth:`leftovers`."""

    def __init__(self, writer: EventWriter, hash_queue_names: Sequence[str] | str,
                 hash_queue_depth: int,
                 warn: Callable[[str], None], info: Callable[[str], None],
                 categorize: Callable[[str, str], str] | None = None,
                 class_names: Callable[[int], str] | None = None,
                 stream: StreamStats | None = None) -> None:
        self.writer = writer
        #: The Redis stream's counts (None: no stream).
        self.stream = stream
        self.hash_names = hash_queue_names
        self.hash_depth = hash_queue_depth
        self.warn = Paced(warn)
        self.info = info
        self.categorize = categorize
        self.class_name = class_names or (lambda rank: "")
        self.stats = EventStats()
        self.logs: dict[str, _Log] = {}
        self.started = time.time()
        #: Which of the trace directory and the queues are hashed (hash_queue_names).
        self._hashed = {name: mail_queue.is_hashed(name, hash_queue_names)
                        for name in ("trace", *QUEUES)}

    # -- the request -----------------------------------------------------------------------

    @staticmethod
    def own_trace(am: ActiveMessage) -> bool:
        """The message asked for a trace itself: stock's trace flush owns its log."""
        return bool(am.tflags & OWN_TRACE or am.qf.rflags & READ_FLAG_NOTIFY_SUCCESS)

    def flags(self, entry: Entry) -> int:
        """The flag the daemon adds to a delivery request (of ``entry``'s message).

        A message's first request in this process also notes how long its trace log
        already is: what another qmgr wrote before this one started, whose events a
        reading now repeats (they carry the keys they had).
        A message that arrived after this process started has no such bytes (no
        earlier qmgr delivered it): its log is not looked for.
        The request is noted as out until its reply is read (:meth:`_owners`).
        """
        am: ActiveMessage = entry.message.owner
        flags = self.record_flags(am)
        log = self.logs.get(am.queue_id)
        if log is not None:
            if log.out is None:
                log.out = [entry]
            elif entry not in log.out:
                log.out.append(entry)
        return flags

    def record_flags(self, am: ActiveMessage) -> int:
        """:meth:`flags` for the records qmgr writes itself, with no delivery request
        (a recipient it defers when even the retry transport is dead, the
        double-bounce discard): it appends them to the trace service when this flag
        is set, as the agents do, and then calls :meth:`after_reply` with no entry."""
        if am.tflags & DEL_REQ_FLAG_MTA_VRFY:
            return 0
        qid = am.queue_id
        if qid not in self.logs:
            log = self.logs[qid] = _Log(self._path(qid))
            log.old_bytes = 0
            if am.qf.arrival_time[0] <= self.started:
                with contextlib.suppress(OSError):
                    log.old_bytes = os.stat(log.path).st_size
        return 0 if self.own_trace(am) else DEL_REQ_FLAG_RECORD

    def _path(self, qid: str, queue: str = "trace") -> str:
        """``mail_queue_path`` with the hashing looked up once, not per call."""
        if self._hashed[queue]:
            return mail_queue.queue_path(queue, qid, self.hash_names, self.hash_depth)
        if not mail_queue.mail_queue_id_ok(qid):
            raise ValueError(f"mail_queue_dir: bad queue id: {qid}")
        return f"{queue}/{qid}"

    # -- the reply ---------------------------------------------------------------------------

    def after_reply(self, am: ActiveMessage, entry: Entry | None) -> None:
        """A request's reply came: queue the events of the records it added. With no
        entry: qmgr appended records itself (:meth:`record_flags`), whose events carry
        no transport, next hop or site (no agent was asked)."""
        if am.tflags & DEL_REQ_FLAG_MTA_VRFY:
            return
        lines = self._read(am, entry, am.queue_id)
        if lines and not self.writer.submit(lines):
            self._held(am.queue_id)

    def _held(self, qid: str) -> None:
        log = self.logs.get(qid)
        if log is not None:
            log.held = True
        self.warn(f"{qid}: events held back (the writer's queue is full): its trace log "
                  "is kept and read again by the next qmgr")

    def _read(self, am: ActiveMessage | None, entry: Entry | None, qid: str,
              ctx: Context | None = None,
              by_rcpt: dict[str, EventLine] | None = None) -> list[bytes]:
        """The events of the records added to ``qid``'s log since the last read. With
        ``ctx`` (a log read at start-up): that context for every record, but one of
        ``by_rcpt`` for a recipient that has one (its last event written)."""
        log = self.logs.get(qid)
        if log is None:
            log = self.logs[qid] = _Log(self._path(qid))
        path = log.path
        line = self._line(log, am, entry, qid) if ctx is None else EventLine(ctx)
        owners = self._owners(log, am, entry) if log.out is not None else None
        lines: list[bytes] = []
        try:
            if log.cursor.offset < log.old_bytes:
                lines = self._events(line, log, read_more(path, log.cursor, stop=log.old_bytes),
                                     owners, by_rcpt)
                self.stats.repeated += len(lines)
            lines += self._events(line, log, read_more(path, log.cursor), owners, by_rcpt)
        except OSError as exc:
            self.stats.read_errors += 1
            self.warn(f"{qid}: {path}: {exc.strerror or exc}; its events wait")
        return lines

    def _owners(self, log: _Log, am: ActiveMessage | None,
                entry: Entry | None) -> dict[int, Entry] | None:
        """The other requests of the message still out, by their recipients' offsets:
        a record of theirs that this read meets (their agent wrote it before this
        reply was read) gets their transport, next hop and site, not this request's.
        None, the common case, when no other request is out."""
        out = log.out
        assert out is not None
        if entry is not None and entry in out:
            out.remove(entry)
        # An entry no longer busy is back in its queue or done: its reply will not come.
        others = [e for e in out if e.busy]
        log.out = others or None
        if not others or am is None:
            return None
        owners: dict[int, Entry] = {}
        for other in others:
            for rcpt in other.recipients:
                owners[rcpt.offset] = other
        if entry is not None:
            for rcpt in entry.recipients:
                owners.pop(rcpt.offset, None)
        return owners or None

    def _events(self, line: EventLine, log: _Log, piece: TracePiece,
                owners: dict[int, Entry] | None = None,
                by_rcpt: dict[str, EventLine] | None = None) -> list[bytes]:
        for text in piece.warnings:
            self.stats.bad_records += 1
            self.warn(text)
        now = time.time()
        lines = []
        made: dict[int, EventLine] | None = None
        for rec in piece.entries:
            self.stats.records += 1
            rkey = str(rec.offset) if rec.offset > 0 else rec.recipient
            fields = (rec.status, rec.action, rec.reason, rec.mta_mname, rec.diag_text)
            if rec.action == "delivered" and log.last.get(rkey) == fields:
                # sent() appends twice for a NOTIFY=SUCCESS recipient with RECORD.
                self.stats.doubles += 1
                continue
            log.last[rkey] = fields
            ordinal = log.counts.get(rkey, 0) + 1
            log.counts[rkey] = ordinal
            category = ""
            if self.categorize is not None:
                category = self.categorize(rec.status, rec.reason)
            own = line
            if owners is not None and (other := owners.get(rec.offset)) is not None:
                if made is None:
                    made = {}
                own = self._other_line(other, made)
            elif by_rcpt:
                own = by_rcpt.get(rec.recipient, line)
            lines.append(own.line(rec, ordinal, now, category))
        self.stats.events += len(lines)
        return lines

    def _other_line(self, other: Entry, made: dict[int, EventLine]) -> EventLine:
        """Another request's encoded fields, made once a read."""
        line = made.get(id(other))
        if line is None:
            am: ActiveMessage = other.message.owner
            line = made[id(other)] = EventLine(self._context(am, other, am.queue_id))
        return line

    def _line(self, log: _Log, am: ActiveMessage | None, entry: Entry | None,
              qid: str) -> EventLine:
        """The message's encoded fields for this request: made again only when the
        request's queue, class or tenant differ from the last request's."""
        if am is None:
            return EventLine(Context(qid, "", 0.0))
        sched = am.sched
        queue = entry.queue if entry is not None else None
        site = queue.site if queue is not None else None
        scope = log.scope
        if (log.line is None or scope[0] is not queue or scope[1] is not site
                or scope[2] != sched.rank or scope[3] != sched.tenant):
            log.line = EventLine(self._context(am, entry, qid))
            log.scope = (queue, site, sched.rank, sched.tenant)
        return log.line

    def _context(self, am: ActiveMessage, entry: Entry | None, qid: str) -> Context:
        qf = am.qf
        sched = am.sched
        transport = nexthop = site = ""
        if entry is not None:
            queue = entry.queue
            transport, nexthop = queue.transport.name, queue.nexthop
            site = queue.site.name if queue.site is not None else ""
        return Context(qid, qf.sender or "", qf.arrival_time[0] + qf.arrival_time[1] / 1e6,
                       transport, nexthop, site, self.class_name(sched.rank), sched.tenant)

    # -- the message's end ---------------------------------------------------------------------

    def message_left(self, am: ActiveMessage) -> None:
        """The message left the active queue (removed, deferred, held...). Once the
        events queued before are on disk, :meth:`_settle` removes its log if the
        message is gone.

        Each reply's read took what its request added (a message leaves after its
        last reply), but a message older than this process may have records no reply
        here announced: an agent of the last qmgr, still delivering when this one
        started (its file "still being delivered"), appends its outcome after this
        qmgr's start-up read and replies to the dead process; this qmgr then finds the
        recipient done and the message with nothing left to deliver. Its log is read
        once more here (one ``open``/``pread``, for such messages only), so that the
        removal below never takes unread records with it."""
        qid = am.queue_id
        if self.own_trace(am):
            # Stock's trace flush removed the log (or keeps it for the next pass).
            self.logs.pop(qid, None)
            return
        if am.qf.arrival_time[0] <= self.started and not am.tflags & DEL_REQ_FLAG_MTA_VRFY:
            lines = self._read(am, None, qid)
            if lines and not self.writer.submit(lines):
                self._held(qid)
        log = self.logs.get(qid)
        if log is not None and log.held:
            # Some of its events were not queued (the writer's queue was full): the log
            # stays, read again in whole by the next qmgr (or at its start-up).
            self.logs.pop(qid, None)
            return
        if not self.writer.submit([], lambda: self._settle(qid)):
            self.logs.pop(qid, None)

    def queued(self, qid: str) -> bool:
        """The message is in one of the queues a queue manager reads."""
        return self._queue_file(qid) is not None

    def _queue_file(self, qid: str) -> str | None:
        for queue in QUEUES:
            path = self._path(qid, queue)
            # lexists without the exception a missing name costs: one faccessat.
            if os.access(path, os.F_OK, follow_symlinks=False):
                return path
        return None

    def _settle(self, qid: str) -> None:
        """Its events are on disk: a message still queued (deferred, held) keeps its
        log and read offset for its next pass; a gone one's log goes."""
        if self.queued(qid):
            return
        log = self.logs.pop(qid, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(log.path if log is not None else self._path(qid))
            self.stats.logs_removed += 1

    # -- start-up ------------------------------------------------------------------------------

    def leftovers(self) -> int:
        """At start-up, the trace logs whose events may not all be on disk.

        A log whose message is gone from every queue (a kill -9 between the message's
        removal and its log's) is read, its events written and the log removed after;
        what the message was (its arrival: the keys' part, its sender) comes from its
        last event in the events file when there is one (so that repeats carry the keys
        they had), else the log alone says it (no event of it was written before); a
        recipient with an event of its own there gets that event's transport, next hop
        and site (a message to two destinations: each its own request's).

        A log of a queued message changed less than :data:`SUSPECT` seconds before the
        events file last was (or after it) may hold records whose events were queued
        and not yet written when the last qmgr died: it is read now, with the message's
        sender and arrival from its queue file, and its read offset kept, so that its
        next delivery here goes on from there. A deferred message waits its backoff,
        and its events would otherwise wait with it. Returns how many logs were read.
        """
        since = self.writer.mtime() - SUSPECT
        gone: list[str] = []
        suspects: list[tuple[str, str]] = []
        for qid in mail_queue.scan_all("trace"):
            where = self._queue_file(qid)
            if where is None:
                gone.append(qid)
                continue
            with contextlib.suppress(OSError):
                if os.stat(self._path(qid)).st_mtime >= since:
                    suspects.append((qid, where))
        last = self.writer.recent(set(gone)) if gone else {}
        for qid in gone:
            self.logs[qid] = _Log(self._path(qid), old_bytes=1 << 62)
            seen = last.get(qid, {})
            mine = {rcpt: EventLine(_context_of(qid, event))
                    for rcpt, event in seen.items() if rcpt}
            lines = self._read(None, None, qid, _context_of(qid, seen.get("")), mine)
            self.writer.submit(lines, lambda q=qid: self._settle(q))  # type: ignore[misc]
        for qid, where in suspects:
            self.logs[qid] = _Log(self._path(qid), old_bytes=1 << 62)
            lines = self._read(None, None, qid, _envelope_context(qid, where))
            if lines and not self.writer.submit(lines):
                self._held(qid)
        self.stats.leftovers += len(gone)
        if gone or suspects:
            self.info(f"delivery events: {len(gone)} trace logs of messages no longer "
                      f"queued and {len(suspects)} changed since the events file last was: "
                      "their events written again (the former's logs then removed)")
        return len(gone) + len(suspects)

    def status(self) -> dict[str, object]:
        reply: dict[str, object] = {
            "reading": self.stats.as_json(), "writing": self.writer.stats.as_json(),
            "logs_open": len(self.logs)}
        if self.stream is not None:
            reply["stream"] = self.stream.as_json()
        return reply


def _envelope_context(qid: str, path: str) -> Context:
    """A queued message's sender and arrival, read from its queue file's envelope."""
    try:
        with open(path, "rb") as f:
            qf = queue_file.Message(queue_id=qid)
            queue_file.read_batch(queue_file.FileWindow(f.fileno()), qf, 1)
    except OSError:
        return Context(qid, "", 0.0)
    return Context(qid, qf.sender or "", qf.arrival_time[0] + qf.arrival_time[1] / 1e6)


def _context_of(qid: str, event: dict[str, object] | None) -> Context:
    """A gone message's context, from an event of it written before (None: none was)."""
    if event is None:
        return Context(qid, "", 0.0)

    def text(name: str) -> str:
        value = event.get(name)
        return value if isinstance(value, str) else ""

    arrival = event.get("arrival")
    return Context(qid, text("sender"),
                   float(arrival) if isinstance(arrival, (int, float)) else 0.0,
                   text("transport"), text("nexthop"), text("site"), text("class"),
                   text("tenant"))


__all__ = ["OWN_TRACE", "DeliveryEvents", "EventStats", "NoEvents"]
