"""The active queue: bringing a queue file in, routing its recipients, and finishing it.

This is stock's ``qmgr_active.c`` plus the message half of ``qmgr_message.c``: a file
moves from incoming or deferred into ``active/``, is locked, read in recipient batches,
its recipients are resolved through trivial-rewrite and handed to the scheduler; when the
scheduler says the message's last delivery finished, the bounce/trace/defer services are
asked for notices and the file is removed or moved to ``deferred/`` with its next retry
time as mtime. Every failure path leaves the file on disk (deferred or corrupt): a
queue manager may lose time, never mail.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from pyqmgr.daemon.host import Fatal, QmgrCore
from pyqmgr.postfix import bounce, mail_queue, queue_file, sent
from pyqmgr.postfix.deliver_request import (
    DEL_REQ_FLAG_BOUNCE,
    DEL_REQ_FLAG_DEFLT,
    DEL_REQ_FLAG_MTA_VRFY,
    DEL_REQ_FLAG_REC_DLY_SENT,
    DEL_REQ_FLAG_RECORD,
    DEL_REQ_FLAG_USR_VRFY,
    RequestMessage,
    msg_stats,
)
from pyqmgr.postfix.log_adhoc import log_adhoc_line
from pyqmgr.postfix.resolve import (
    RESOLVE_CLASS_LOCAL,
    RESOLVE_FLAG_ERROR,
    RESOLVE_FLAG_FAIL,
    ResolverFailure,
    quote_822_local,
)
from pyqmgr.postfix.shared_strings import shared
from pyqmgr.scheduler.core import ERROR, RETRY, Route
from pyqmgr.scheduler.message import Message, Recipient

if TYPE_CHECKING:
    from pyqmgr.daemon.sources import Sources
    from pyqmgr.postfix.config import QmgrConfig
    from pyqmgr.postfix.maillog_client import MailLog
    from pyqmgr.postfix.resolve import ResolveClient
    from pyqmgr.scheduler.entry import Entry


class RetryPort(Protocol):
    """What the active queue asks of the deferred-retry controls (daemon/retry.py)."""

    def fed(self, qid: str) -> None: ...

    def retry_time(self, when: float, backoff: float) -> float: ...

    def deferred(self, am: ActiveMessage) -> None: ...


class TraceRecords(Protocol):
    """What qmgr's own records ask of delivery events (events/tracker.py's classes):
    the flag to append them to the trace log with, and the read after."""

    def record_flags(self, am: ActiveMessage) -> int: ...

    def after_reply(self, am: ActiveMessage, entry: Entry | None) -> None: ...


class ActiveHost(QmgrCore, Protocol):
    """What the active queue needs of the daemon that holds it (daemon/qmgr.py's Qmgr).

    Declared here, by the part that needs it, so that this module does not import the
    daemon that imports it.
    """

    @property
    def resolver(self) -> ResolveClient: ...

    @property
    def retry(self) -> RetryPort | None: ...

    @property
    def events(self) -> TraceRecords: ...

    def next_batch(self, am: ActiveMessage) -> None: ...

    def message_left(self, am: ActiveMessage) -> None: ...

    def deferred(self, am: ActiveMessage, when: float) -> None: ...

# Scan and per-message flags (``qmgr.h``).
SCAN_START = 1 << 0
SCAN_ALL = 1 << 1
FLUSH_ONCE = 1 << 2
FLUSH_DFXP = 1 << 3
FLUSH_EACH = 1 << 4
FORCE_EXPIRE = 1 << 5

#: Stock caps one recipient batch at this size to keep the event loop responsive.
MAX_BATCH = 5000
#: Size-record flag bit: some recipient asked for NOTIFY=SUCCESS (``qmgr_user.h``).
READ_FLAG_NOTIFY_SUCCESS = 1 << 2
#: A file whose lock is busy goes back to incoming this far in the future.
LOCKED_RETRY_DELAY = 60


#: Why reading a message's next batch failed: the file would not open, it was
#: corrupt, or trivial-rewrite could not be reached.
ReadFailure = Literal["open", "corrupt", "resolve"]


class Appends:
    """The defer and trace appends qmgr makes itself for a message, in flight
    (daemon/applier.py): how many, and a future done with the last. Stock makes them
    before it goes on; the message's end waits for them, as it reads the logs they go
    to (the defer log for a delay warning, the trace log for a report and events)."""

    __slots__ = ("count", "done")

    def __init__(self, done: asyncio.Future[None]) -> None:
        self.count = 0
        self.done = done


@dataclass(eq=False, slots=True)
class ActiveMessage:
    """The daemon's half of a message: the queue file and its disposition."""

    queue_id: str
    qf: queue_file.Message
    sched: Message
    scan_flags: int
    active_time: tuple[int, int]
    request: RequestMessage
    tflags: int
    #: Stock's message->flags: non-zero when something must be tried again.
    flags: int = 0
    in_core: int = 0
    #: The queue it was taken from ("incoming", "deferred"...): delegation's attempt.
    source: str = ""
    #: Recipients read and not yet routed (the first batch, between open and load).
    pending: list[Recipient] | None = None
    # What other parts note on a message now and then: each its own slot, None for
    # most messages in core (four slots cost 32 bytes; the dict of anything they
    # replace was 64 bytes empty, and what each held was known only by its key).
    #: Why the last read of a batch failed (``qmgr.py``): the message waits for its
    #: in-core deliveries, then the next batch ends it ("open", "corrupt") or tries
    #: the read again ("resolve").
    read_failed: ReadFailure | None = None
    #: Delegation's HOLD reply, as logged: the message goes to hold/ when done.
    hold: str | None = None
    #: Delegation's attempt number for this activation, once it was asked for.
    policy_attempt: int | None = None
    #: The destinations (transport, queue name) the deferred recovery saw this
    #: message wait for (``retry.py``): remembered when it goes to deferred/.
    waits: set[tuple[str, str]] | None = None
    #: qmgr's own defer and trace appends for it in flight (``applier.py``).
    appends: Appends | None = None

    @property
    def path(self) -> str:
        return f"active/{self.queue_id}"

    def take_pending(self) -> list[Recipient]:
        """The first batch's recipients, once: routing takes them from here."""
        recipients, self.pending = self.pending, None
        assert recipients is not None, "a message loaded twice"
        return recipients


def _now_tv() -> tuple[int, int]:
    t = time.time()
    sec = int(t)
    return sec, int((t - sec) * 1_000_000)


def _lower_domain_key(address: str) -> str:
    at = address.rfind("@")
    return address[at:].lower() if at >= 0 else ""


def sort_key(route: Route) -> tuple[str, str, int, str, str]:
    """Stock's recipient order: transport, queue, domain (no domain last), address."""
    address = route.recipient.address
    has_at = 0 if "@" in address else 1
    return (route.transport, route.queue_name, has_at, _lower_domain_key(address), address)


def queue_name(cfg: QmgrConfig, transport: str, nexthop: str, address: str) -> str:
    """A recipient's queue: its next hop's, or its own where the transport delivers
    one recipient a request (``destination_recipient_limit = 1``)."""
    if transport not in (ERROR, RETRY):
        params = cfg.transport(transport)
        if params.destination_recipient_limit == 1:
            return per_recipient_queue_name(
                address, nexthop, cfg.recipient_delimiter,
                cfg.owner_request_special, cfg.double_bounce_sender,
            )
    return shared(nexthop.lower())


def _open_active(path: str, qid: str, log: MailLog) -> int:
    """The file's descriptor, or -1 (a warning) when it is gone. Any other error is
    fatal, as in stock's qmgr_message_open: master starts a new qmgr, whose start-up
    recovery finds the file still in active/."""
    try:
        return os.open(path, os.O_RDWR)
    except FileNotFoundError:
        log.warning(f"{qid}: open {path}: No such file or directory")
        return -1
    except OSError as exc:
        raise Fatal(f"open active {qid}: {exc.strerror or exc}") from None


class ActiveQueue:
    """Moves files in and out of ``active/`` and drives each message's life cycle."""

    def __init__(self, qmgr: ActiveHost) -> None:
        self.qmgr = qmgr
        self.cfg = qmgr.cfg
        self.log = qmgr.log
        self.messages: dict[str, ActiveMessage] = {}
        self.in_core_recipients = 0
        #: Source pools (#46): a recipient may move to a member; None unless set.
        self.sources: Sources | None = None

    # -- start-up ---------------------------------------------------------------------

    def recover(self) -> None:
        """Move everything left in ``active/`` back to incoming (``qmgr_move``).

        A previous qmgr (killed, or restarted by reload) may have left files there;
        they are retried at once, and any still locked by a surviving delivery agent
        is noticed when it is opened again.
        """
        now = time.time()
        for qid in mail_queue.scan_all("active"):
            if not mail_queue.queue_id_ok(qid):
                self.log.info(f"qmgr_move: ignored: queue active id {qid}")
                continue
            src = f"active/{qid}"
            try:
                os.utime(src, (now, now))
            except FileNotFoundError:
                continue
            self._move(src, "incoming", qid)

    def _move(self, src: str, queue: str, qid: str) -> bool:
        dst = mail_queue.queue_path(queue, qid, self.cfg.hash_queue_names,
                                    self.cfg.hash_queue_depth)
        try:
            mail_queue.rename_path(src, dst)
            return True
        except FileNotFoundError:
            self.log.warning(f"{qid}: rename {src} to {dst}: No such file or directory")
            return False

    # -- feeding ------------------------------------------------------------------------

    def feed(self, queue: str, qid: str, scan_flags: int) -> ActiveMessage | None:
        """Try to bring one file from ``queue`` into the active queue.

        Returns the message when it was read (resolution still to come), or None when
        the file was skipped, requeued or found corrupt.
        """
        cfg = self.cfg
        if not mail_queue.queue_id_ok(qid):
            return None
        src = mail_queue.queue_path(queue, qid, cfg.hash_queue_names, cfg.hash_queue_depth)
        st = mail_queue.mail_open_ok(src)
        if st is None:
            return None
        if st.st_mtime > time.time() + 1 and not (scan_flags & SCAN_ALL):
            return None
        try:
            os.rename(src, f"active/{qid}")
        except FileNotFoundError:
            self.log.warning(f"{qid}: rename {src} to active/{qid}: No such file or directory")
            return None
        if self.qmgr.retry is not None:
            self.qmgr.retry.fed(qid)
        flags = scan_flags
        if st.st_mode & stat.S_IRGRP:
            flags |= FLUSH_EACH | FLUSH_DFXP
        if st.st_mode & stat.S_IXGRP:
            flags |= FORCE_EXPIRE
        am = self._open(qid, flags, st.st_mode, st.st_size)
        if am is not None:
            # Where it came from (delivery policy delegation's attempt number).
            am.source = queue
        return am

    def _open(self, qid: str, flags: int, mode: int, size: int) -> ActiveMessage | None:
        path = f"active/{qid}"
        fd = _open_active(path, qid, self.log)
        if fd < 0:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.log.info(f"{qid}: skipped, still being delivered")
                os.close(fd)
                fd = -1
                later = time.time() + LOCKED_RETRY_DELAY
                os.utime(path, (later, later))
                self._move(path, "incoming", qid)
                return None
            qf = queue_file.Message(queue_id=qid)
            limit = self.qmgr.scheduler.first_read_limit()
            batch = queue_file.read_batch(  # the envelope only, never the content
                queue_file.FileWindow(fd, size), qf, min(limit, MAX_BATCH),
                verp_filter=self.cfg.verp_delimiter_filter,
                count_check=not self.qmgr.scheduler.bounded_reading)
            # Stock logs as it reads: warnings before the sender record come first.
            split = batch.opened_after if batch.opened is not None else len(batch.warnings)
            for text in batch.warnings[:split]:
                self.log.warning(text)
            if batch.opened is not None:
                self.log.info(opened_line(qid, batch.opened))
            for text in batch.warnings[split:]:
                self.log.warning(text)
            if not batch.ok:
                os.close(fd)
                fd = -1
                self.corrupt(qid)
                return None
            if flags & FLUSH_EACH:
                os.fchmod(fd, stat.S_IMODE(mode) & ~stat.S_IRGRP)
        finally:
            if fd >= 0:
                os.close(fd)
        return self._activate(qid, qf, flags, batch.recipients)

    def _activate(self, qid: str, qf: queue_file.Message, flags: int,
                  recipients: list[Recipient]) -> ActiveMessage:
        cfg = self.cfg
        active_time = _now_tv()
        tflags = qf.trace_flags
        if cfg.confirm_delay_cleared and qf.warn_time < 0:
            tflags |= DEL_REQ_FLAG_REC_DLY_SENT
        request = RequestMessage(
            queue_id=qid,
            data_offset=qf.data_offset,
            cont_length=qf.cont_length,
            encoding=qf.encoding,
            sendopts=cfg.postfix_version.options(qf.smtputf8),
            sender=qf.sender or "",
            envelope_id=qf.envelope_id,
            ret_flags=qf.ret_flags,
            stats=msg_stats(qf.arrival_time, active_time),
            client_name=qf.client_name,
            client_address=qf.client_address,
            client_port=qf.client_port,
            protocol_name=qf.protocol_name,
            helo_name=qf.helo_name,
            sasl_method=qf.sasl_method,
            sasl_username=qf.sasl_username,
            sasl_sender=qf.sasl_sender,
            log_ident=qf.log_ident,
            rewrite_context=qf.rewrite_context,
        )
        sched = Message(qid, time.monotonic(), rcpt_unread=qf.rcpt_unread,
                        single_rcpt=bool(qf.verp_delims), more=qf.rcpt_offset > 0)
        am = ActiveMessage(qid, qf, sched, flags, active_time, request, tflags)
        sched.owner = am
        am.pending = recipients
        self.messages[qid] = am
        return am

    def prepare(self, am: ActiveMessage) -> bool:
        """Before resolution: the force-expire shortcut, else reset the defer log.

        Returns False when the message needs no resolution (force-expired with an
        existing defer log: go straight to completion).
        """
        cfg = self.cfg
        defer_log = mail_queue.queue_path("defer", am.queue_id, cfg.hash_queue_names,
                                          cfg.hash_queue_depth)
        if am.scan_flags & FORCE_EXPIRE:
            try:
                if os.stat(defer_log).st_size > 0:
                    am.flags = 1
                    am.pending = []
                    return False
            except FileNotFoundError:
                pass
        try:
            os.unlink(defer_log)
        except FileNotFoundError:
            pass
        return True

    # -- routing ----------------------------------------------------------------------

    def route(self, am: ActiveMessage,
              recipients: list[Recipient]) -> list[Route] | None:
        """Route each recipient in ``qmgr_message_resolve``'s order; None = resolver down.

        First where the message says it goes (REDIRECT, then content filter, else
        trivial-rewrite), then qmgr's own overrides in stock's order: resolver
        failure or bad syntax, null address, forced expiry, the double-bounce
        discard, ``defer_transports``.
        """
        qf = am.qf
        cfg = self.cfg
        sender = qf.sender or ""
        verify = bool(am.tflags & DEL_REQ_FLAG_MTA_VRFY)
        probe = bool(am.tflags & (DEL_REQ_FLAG_MTA_VRFY | DEL_REQ_FLAG_USR_VRFY))
        resolver = self.qmgr.resolver
        routes: list[Route] = []
        try:
            for i, rcpt in enumerate(recipients):
                if qf.redirect is not None:
                    # Redirect overrides all else, once per message: the first
                    # recipient goes to the redirect address, the others are dropped
                    # unmarked and no further batch is read.
                    if i > 0:
                        continue
                    qf.rcpt_offset = 0
                    am.sched.rcpt_unread = qf.rcpt_unread = 0
                    am.sched.more = False
                    rcpt.address = resolver.rewrite("local", qf.redirect)
                    res = resolver.resolve(sender, rcpt.address, verify=verify)
                    transport, nexthop, flags = res.transport, res.nexthop, res.flags
                    if res.recipient != rcpt.address:
                        rcpt.address = res.recipient
                elif qf.filter and not probe:
                    transport, _, nexthop = qf.filter.partition(":")
                    if not nexthop:
                        nexthop = (cfg.default_filter_nexthop or _domain(rcpt.address)
                                   or cfg.myhostname)
                    flags = 0
                else:
                    res = resolver.resolve(sender, rcpt.address, verify=verify)
                    transport, nexthop, flags = res.transport, res.nexthop, res.flags
                    if res.recipient != rcpt.address:
                        rcpt.address = res.recipient
                if flags & RESOLVE_FLAG_FAIL:
                    transport, nexthop, flags = RETRY, "4.3.0 address resolver failure", 0
                elif flags & RESOLVE_FLAG_ERROR:
                    transport, nexthop, flags = ERROR, "5.1.3 bad address syntax", 0
                if not rcpt.address:
                    transport, nexthop, flags = ERROR, "5.1.3 null recipient address", 0
                if am.scan_flags & FORCE_EXPIRE:
                    transport, nexthop, flags = (RETRY,
                                                 "4.7.0 message is administratively expired", 0)
                if flags & RESOLVE_CLASS_LOCAL:
                    local = rcpt.address.rpartition("@")[0] if "@" in rcpt.address \
                        else rcpt.address
                    if local.lower() == cfg.double_bounce_sender.lower():
                        discard_double_bounce(self, am, rcpt)
                        continue
                if transport in cfg.defer_transports and not am.scan_flags & FLUSH_DFXP:
                    transport, nexthop = RETRY, "4.3.2 deferred transport"
                if self.sources is not None:
                    transport, nexthop = self.sources.route(am.sched, rcpt, transport, nexthop)
                routes.append(Route(transport,
                                    queue_name(cfg, transport, nexthop, rcpt.address),
                                    nexthop, rcpt))
        except ResolverFailure:
            return None
        routes.sort(key=sort_key)
        return routes

    # -- completion ---------------------------------------------------------------------

    def _needs_trace(self, am: ActiveMessage) -> bool:
        return bool(am.tflags & (DEL_REQ_FLAG_USR_VRFY | DEL_REQ_FLAG_RECORD
                                 | DEL_REQ_FLAG_REC_DLY_SENT)
                    or am.qf.rflags & READ_FLAG_NOTIFY_SUCCESS)

    def try_quick_finish(self, am: ActiveMessage) -> bool:
        """The common case needs no bounce, defer or trace service: finish right away.

        Returns False when :meth:`finish` must run (asynchronously) instead.
        """
        if am.flags or am.sched.deferred or am.qf.rcpt_offset > 0 or self._needs_trace(am):
            return False
        cfg = self.cfg
        bounce_log = mail_queue.queue_path("bounce", am.queue_id, cfg.hash_queue_names,
                                           cfg.hash_queue_depth)
        try:
            size = os.stat(bounce_log).st_size
        except FileNotFoundError:
            size = -1
        if size > 0:
            return False
        if size == 0:
            _unlink_quiet(bounce_log)
        self._forget(am)
        self.remove(am.queue_id)
        return True

    async def finish(self, am: ActiveMessage) -> None:
        """The message's last delivery finished (``qmgr_active_done``)."""
        while am.appends is not None:
            await am.appends.done
        cfg = self.cfg
        qid = am.queue_id
        qf = am.qf
        if am.sched.deferred:
            am.flags |= 1
        bounce_log = mail_queue.queue_path("bounce", qid, cfg.hash_queue_names,
                                           cfg.hash_queue_depth)
        try:
            size = os.stat(bounce_log).st_size
        except FileNotFoundError:
            size = -1
        if size == 0:
            _unlink_quiet(bounce_log)
        elif size > 0:
            status = await self._notify(am, "bounce", _bounce_cmd(am, cfg), 0)
            am.flags |= status != 0

        if am.flags and mail_queue.mail_open_ok(am.path) is None:
            self._forget(am)
            self.corrupt(qid)
            return

        if qf.rcpt_offset > 0:
            self.qmgr.next_batch(am)
            return

        if self._needs_trace(am):
            status = await self._notify(am, "trace", bounce.BOUNCE_CMD_TRACE, am.tflags)
            if status == 0 and qf.trace_offset > 0:
                self._update_file(am, lambda fd: queue_file.kill_record(fd, qf.trace_offset))
            am.flags |= status != 0

        if am.flags:
            lifetime = cfg.maximal_queue_lifetime if qf.sender else cfg.bounce_queue_lifetime
            expired = None
            if am.scan_flags & FORCE_EXPIRE:
                expired = "force-expired"
            elif time.time() >= qf.create_time + lifetime:
                expired = "expired"
            if expired:
                self.log.info(f"{qid}: from=<{log_address(qf.sender or '')}>, "
                              f"status={expired}, returned to sender")
                cmd = bounce.BOUNCE_CMD_VERP if _use_verp(am, cfg) else bounce.BOUNCE_CMD_FLUSH
                am.flags = await self._notify(am, "defer", cmd, bounce.BOUNCE_FLAG_DELRCPT) != 0
            elif qf.warn_time > 0 and time.time() >= qf.warn_time - 1:
                if await self._notify(am, "defer", bounce.BOUNCE_CMD_WARN, 0) == 0:
                    self._update_file(am, lambda fd: queue_file.update_warn(fd, qf.warn_offset, -1))

        self._forget(am)
        if am.flags:
            self.defer(am)
        else:
            self.remove(qid)

    async def _notify(self, am: ActiveMessage, service: str, command: int, flags: int) -> int:
        qf = am.qf
        verp = qf.verp_delims if command == bounce.BOUNCE_CMD_VERP else None
        release = self.cfg.postfix_version
        status = await bounce.notify(
            service, command, flags, am.queue_id, qf.encoding, am.request.sendopts,
            qf.sender or "", qf.envelope_id, qf.ret_flags, verp, release.options_attribute,
        )
        if status != 0:
            what = {"bounce": "bounce failed", "trace": "trace failed"}.get(service)
            if command == bounce.BOUNCE_CMD_WARN:
                what = "delay warning failed"
            elif command == bounce.BOUNCE_CMD_VERP:
                what = release.verp_failed
            elif what is None:
                what = "bounce failed"
            self.log.info(f"{am.queue_id}: status=deferred ({what})")
        return status

    def _update_file(self, am: ActiveMessage, action: Callable[[int], None]) -> None:
        try:
            fd = os.open(am.path, os.O_RDWR)
        except OSError as exc:
            self.log.warning(f"{am.queue_id}: open {am.path}: {exc.strerror}")
            return
        try:
            action(fd)
        finally:
            os.close(fd)

    def _forget(self, am: ActiveMessage) -> None:
        if self.messages.pop(am.queue_id, None) is not None:
            self.qmgr.message_left(am)
        am.sched.owner = None  # no cycle left for the garbage collector (issue #30)

    def defer(self, am: ActiveMessage) -> None:
        """Move to deferred/ with the next retry time as mtime (``qmgr_active_done_3``).

        pyqmgr.cf's retry jitter, if on, is added to stock's time, never taken from it
        (:mod:`pyqmgr.daemon.retry`), and the file is remembered for recovery.
        """
        cfg = self.cfg
        now = time.time()
        create = am.qf.create_time
        delay = float(cfg.minimal_backoff_time)
        if create > 0:
            delay = min(max(now - create, delay), cfg.maximal_backoff_time)
        when = float(int(now) + int(delay))
        retry = self.qmgr.retry
        if retry is not None:
            when = retry.retry_time(when, int(delay))
        # Stock ignores a vanished file here and lets the rename report it.
        with contextlib.suppress(FileNotFoundError):
            os.utime(am.path, (when, when))
        if not self._file_to(am, "deferred", f"qmgr_active_defer: rename {am.queue_id} from "
                                          "active to deferred"):
            return
        self.qmgr.deferred(am, when)

    def _file_to(self, am: ActiveMessage, queue: str, what: str) -> bool:
        """Rename the message's file into ``queue``; a vanished file is logged as
        ``what`` (stock's words differ by caller) and False is returned."""
        dst = mail_queue.queue_path(queue, am.queue_id, self.cfg.hash_queue_names,
                                    self.cfg.hash_queue_depth)
        try:
            mail_queue.rename_path(am.path, dst)
        except FileNotFoundError:
            self.log.warning(what.replace("{dst}", dst) + ": No such file or directory")
            return False
        return True

    def hold(self, am: ActiveMessage) -> None:
        """To hold/, as ``postsuper -h`` leaves a message (a policy service said HOLD).

        Its last delivery under way has finished; its waiting recipients stay in the
        file as they are, with no defer or bounce notice: ``postsuper -H`` releases it
        to deferred/ and the next queue run delivers it as usual.
        """
        self._forget(am)
        if self._file_to(am, "hold", f"{am.queue_id}: rename {am.path} to {{dst}}"):
            self.log.info(f"{am.queue_id}: placed on hold")

    def remove(self, qid: str) -> None:
        path = f"active/{qid}"
        try:
            if self.cfg.dont_remove:
                mail_queue.save_removed(path, qid)
            else:
                os.unlink(path)
        except FileNotFoundError:
            self.log.warning(f"{qid}: remove {path}: No such file or directory")
            return
        self.log.info(f"{qid}: removed")

    def corrupt(self, qid: str) -> None:
        self.log.warning(f'saving corrupt file "{qid}" from queue "active" to queue "corrupt"')
        try:
            mail_queue.rename_path(f"active/{qid}", f"corrupt/{qid}")
        except FileNotFoundError:
            pass

    def abandon(self, am: ActiveMessage) -> None:
        """A message we cannot route now (resolver down): defer it untouched."""
        self._forget(am)
        self.defer(am)


def discard_double_bounce(aq: ActiveQueue, am: ActiveMessage, rcpt: Recipient) -> None:
    """Mail to the local double-bounce address is logged as sent and marked done.

    Stock calls ``sent()`` for it: recorded in the trace log first when the message
    asked for a trace or delivery events are on (:func:`sent.trace_appends`), and
    deferred instead if that fails. Synchronous as stock's, and as the resolver calls
    around it are; only a traced discard makes the calls.
    """
    events = aq.qmgr.events
    flags = am.tflags | events.record_flags(am)
    traces = sent.trace_appends(flags, rcpt.dsn_notify)
    reason = "undeliverable postmaster notification discarded"
    if traces:
        recorded = _record(aq, am, rcpt, flags, traces, reason)
        events.after_reply(am, None)
        if not recorded:
            return
    _log_rcpt(aq, am, rcpt, "2.0.0", "sent", reason)
    try:
        fd = os.open(am.path, os.O_RDWR)
    except OSError:
        return
    try:
        queue_file.mark_done(fd, rcpt.offset)
    finally:
        os.close(fd)


def _log_rcpt(aq: ActiveQueue, am: ActiveMessage, rcpt: Recipient, dsn: str, status: str,
              reason: str) -> None:
    aq.log.info(log_adhoc_line(
        am.queue_id, rcpt.address, rcpt.orig_addr, bounce.NO_RELAY, am.qf.arrival_time,
        am.active_time, _now_tv(), dsn, status, reason, aq.cfg.delay_logging_resolution_limit,
    ))


def _record(aq: ActiveQueue, am: ActiveMessage, rcpt: Recipient, flags: int, traces: int,
            reason: str) -> bool:
    """``sent()``'s trace appends; when one fails, ``defer_append()`` of the recipient
    instead ("trace service failed") and False."""
    qid = am.queue_id
    timeout = float(aq.cfg.ipc_timeout)
    fields = (qid, rcpt.orig_addr, rcpt.address, rcpt.offset, rcpt.dsn_orcpt,
              rcpt.dsn_notify)
    for _ in range(traces):
        if bounce.append_now("trace", flags, *fields, "2.0.0", "delivered",
                             bounce.trace_reason(bounce.NO_RELAY, reason), timeout) != 0:
            break
    else:
        return True
    why = sent.trace_failed_reason(qid)
    am.flags |= 1
    if bounce.append_now("defer", flags, *fields, "4.3.0", "delayed", why, timeout) != 0:
        aq.log.warning(f"{qid}: defer service failure")
    _log_rcpt(aq, am, rcpt, "4.3.0", "deferred", why)
    if flags & DEL_REQ_FLAG_RECORD and bounce.append_now(
            "trace", flags, *fields, "4.3.0", "delayed", why, timeout) != 0:
        aq.log.warning(f"{qid}: trace service failure")
    return False


def opened_line(qid: str, opened: queue_file.Opened) -> str:
    """Stock logs this when it meets the sender record, with the counts of then."""
    return (f"{qid}: from=<{log_address(opened.sender or '')}>, size={opened.size}, "
            f"nrcpt={opened.nrcpt} (queue active)")


def log_address(address: str) -> str:
    """Addresses in log lines use the external (quoted) form, as stock's default
    ``info_log_address_format = external`` does; the null sender stays empty."""
    return quote_822_local(address) if address else ""


def split_localpart(local: str, delimiters: str, owner_request_special: bool,
                    double_bounce: str) -> str:
    """Strip the address extension as ``split_addr_internal`` does, with its exceptions."""
    low = local.lower()
    if low in ("postmaster", "mailer-daemon", double_bounce.lower()):
        return local
    if "-" in delimiters and owner_request_special:
        if low.startswith("owner-") or (len(low) > 8 and low.endswith("-request")):
            return local
    for i, ch in enumerate(local):
        if ch in delimiters:
            return local if i == 0 else local[:i]
    return local


def per_recipient_queue_name(address: str, nexthop: str, delimiters: str,
                             owner_request_special: bool, double_bounce: str) -> str:
    """``localpart@nexthop`` for transports that deliver one recipient per request.

    With a destination recipient limit of 1, stock turns per-destination concurrency
    into per-recipient concurrency by naming the queue after the recipient.
    """
    at = address.rfind("@")
    local = address[:at] if at >= 0 else address
    if delimiters:
        local = split_localpart(local, delimiters, owner_request_special, double_bounce)
    return f"{local}@{nexthop}".lower()


def read_more(am: ActiveMessage, limit: int, verp_filter: str,
              count_check: bool) -> queue_file.Batch:
    """The next recipient batch of an active message: from where the last batch
    stopped (``rcpt_offset``), never the content. OSError: the file did not open."""
    fd = os.open(am.path, os.O_RDONLY)
    try:
        return queue_file.read_batch(queue_file.FileWindow(fd), am.qf, limit,
                                     verp_filter=verp_filter, count_check=count_check)
    finally:
        os.close(fd)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise


def _domain(address: str) -> str:
    return address.rpartition("@")[2] if "@" in address else ""


def _use_verp(am: ActiveMessage, cfg: object) -> bool:
    return bool(am.qf.verp_delims) and not getattr(cfg, "disable_verp_bounces", False)


def _bounce_cmd(am: ActiveMessage, cfg: object) -> int:
    return bounce.BOUNCE_CMD_VERP if _use_verp(am, cfg) else bounce.BOUNCE_CMD_FLUSH


def request_flags(am: ActiveMessage, dflags: int) -> int:
    base = DEL_REQ_FLAG_BOUNCE if am.qf.inspector else DEL_REQ_FLAG_DEFLT
    return am.tflags | dflags | base
