"""What qmgr reads from a queue file, and the few bytes it writes back.

:func:`read_batch` is stock's ``qmgr_message_read`` (queue_files_lifecycle.md §3.2),
record for record: the logical walk follows ``p`` pointers into the heap after ``E``,
the content is skipped with one jump at ``data_offset``, recipients are read in batches
that resume at ``rcpt_offset``, and every malformation yields stock's warning text.

Why it looks the way it does:

* The daemon's files are read through a :class:`FileWindow`: the part of the file the
  walk is in, read on demand with ``pread``, so that the content is never read (the
  walk jumps over it) and a later recipient batch reads from where the last one
  stopped. A file of one line or of 4 MB costs the same; a small file is one read.
  Offsets are physical file offsets, so a recipient's ``offset`` is the byte a
  delivery agent later overwrites with ``D``. Tools and tests may pass the whole
  file as bytes instead.
* Payloads are handled as C strings (cut at the first NUL) and numbers are parsed the way
  glibc's ``atol``/``atoi``/``sscanf`` do, because odd files must be accepted, refused and
  reported exactly as stock does; a replacement qmgr that is stricter or laxer moves
  different files to ``corrupt/``.
* Nothing is logged here. Warnings come back, in order, as the text after ``warning: ``;
  the caller logs them and moves a refused file to ``corrupt/``. Stock's message output
  replaces unprintable bytes with ``?`` when it logs (``printable()``), which is the
  logger's job, not the reader's.

Deliberate differences from stock, all on paths where stock qmgr dies (``msg_fatal``)
rather than refusing the file: a pre-1.0 file that stock's old-style rescan cannot make
sense of, and a content skip so large that ``lseek`` would fail. Both are refused here
with the fatal's text as a warning, so the file goes to ``corrupt/`` instead of crashing
the daemon in a loop.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import BinaryIO, NamedTuple, Protocol

from pyqmgr.postfix.deliver_request import ClientAttributes
from pyqmgr.postfix.expand import LONG_MAX, strtol
from pyqmgr.postfix.record import (
    REC_TYPE_ATTR,
    REC_TYPE_CTIME,
    REC_TYPE_DONE,
    REC_TYPE_DRCP,
    REC_TYPE_DSN_ENVID,
    REC_TYPE_DSN_NOTIFY,
    REC_TYPE_DSN_ORCPT,
    REC_TYPE_DSN_RET,
    REC_TYPE_DTXT,
    REC_TYPE_END,
    REC_TYPE_ERROR,
    REC_TYPE_FILT,
    REC_TYPE_FROM,
    REC_TYPE_INSP,
    REC_TYPE_MESG,
    REC_TYPE_ORCP,
    REC_TYPE_PTR,
    REC_TYPE_RCPT,
    REC_TYPE_RDR,
    REC_TYPE_SIZE,
    REC_TYPE_TIME,
    REC_TYPE_VERP,
    REC_TYPE_WARN,
    RecordError,
    encode_record,
    rec_get_buf,
    rec_goto,
)
from pyqmgr.postfix.shared_strings import shared

# The scheduler's recipient is exactly what an R record carries; the reader builds it
# directly so the daemon never copies recipients between layers.
from pyqmgr.scheduler.message import Recipient

__all__ = [
    "Batch",
    "FileWindow",
    "Message",
    "Opened",
    "QueueFileError",
    "Recipient",
    "kill_record",
    "mark_done",
    "read_batch",
    "read_message",
    "update_warn",
]

# qmgr_user.h / qmgr.h
READ_FLAG_MIXED_RCPT_OTHER = 1 << 0
READ_FLAG_USER = 0x1F
READ_FLAG_SEEN_ALL_NON_RCPT = 1 << 16

# deliver_request.h
DEL_REQ_FLAG_MTA_VRFY = 1 << 8
DEL_REQ_FLAG_USR_VRFY = 1 << 9
DEL_REQ_FLAG_RECORD = 1 << 10
DEL_REQ_FLAG_REC_DLY_SENT = 1 << 13
DEL_REQ_TRACE_FLAGS_MASK = (DEL_REQ_FLAG_MTA_VRFY | DEL_REQ_FLAG_USR_VRFY
                            | DEL_REQ_FLAG_RECORD | DEL_REQ_FLAG_REC_DLY_SENT)

# dsn_mask.h
DSN_NOTIFY_NEVER = 1
DSN_NOTIFY_ANY = 2 | 4 | 8
DSN_RET_FULL = 1
DSN_RET_HDRS = 2

#: ``verp_delimiter_filter`` default (mail_params.h).
DEF_VERP_FILTER = "-=+"
#: Stock caps one batch at this many recipients to keep the event loop responsive.
BATCH_CAP = 5000

_ENVELOPE_TYPES = frozenset(b"MCTcFILSDRO/WVA>K<ion" + b"EDRO/PreAFIL>Kon")
_XTRA_TYPES = frozenset(b"X")

_SPACES = b" \t\n\r\v\f"  # C isspace() in the C locale

#: ``name=value`` with optional blanks around the name (split_nameval's happy path).
_NAMEVAL = re.compile(rb"[ \t\n\r\v\f]*([^ \t\n\r\v\f=]+)[ \t\n\r\v\f]*=")

# rec_attr_map.c: attributes that stand for native record types.
_ATTR_MAP = {
    b"dsn_orig_rcpt": REC_TYPE_DSN_ORCPT,
    b"notify_flags": REC_TYPE_DSN_NOTIFY,
    b"envelope_id": REC_TYPE_DSN_ENVID,
    b"ret_flags": REC_TYPE_DSN_RET,
    b"create_time": REC_TYPE_CTIME,
}
# Legacy (pre-2.3) logging attribute names: used only while no log_* name was seen.
_LEGACY_ATTRS = {
    b"client_name": "client_name",
    b"client_address": "client_address",
    b"client_port": "client_port",
    b"protocol_name": "protocol_name",
    b"helo_name": "helo_name",
}
_LOG_ATTRS = {
    b"log_client_name": "client_name",
    b"log_client_address": "client_address",
    b"log_client_port": "client_port",
    b"log_protocol_name": "protocol_name",
    b"log_helo_name": "helo_name",
}
_SINGLE_ATTRS = {
    b"sasl_method": "sasl_method",
    b"sasl_username": "sasl_username",
    b"sasl_sender": "sasl_sender",
    b"log_ident": "log_ident",
    b"rewrite_context": "rewrite_context",
}
#: One bit of :attr:`Message.seen_attrs` for each attribute set first-wins.
_ATTR_BIT = {attr: 1 << i for i, attr in enumerate(
    dict.fromkeys([*_LOG_ATTRS.values(), *_LEGACY_ATTRS.values(), *_SINGLE_ATTRS.values()]))}


class Opened(NamedTuple):
    """What stock's ``opened()`` logs when the sender record is first read.

    The values are those at the moment the ``S`` record was read, as stock logs them:
    ``<qid>: from=<sender>, size=<size>, nrcpt=<nrcpt> (queue active)``.
    """

    sender: str
    size: int
    nrcpt: int


@dataclass(eq=False, slots=True)
class Message(ClientAttributes):
    """Envelope state of one queue file; persists across recipient batches.

    Create it with just the queue id for the first batch; pass the same object to later
    :func:`read_batch` calls, which resume at :attr:`rcpt_offset`. The client and SASL
    attributes (:class:`ClientAttributes`) are what a delivery request passes on.
    """

    queue_id: str
    # The size record's six fields, in its order (``%ld %ld %d %d %ld %d``).
    data_size: int = 0
    data_offset: int = 0
    #: C field 3 as written by cleanup: the ``nrcpt=`` of the log.
    rcpt_count: int = 0
    rflags: int = READ_FLAG_MIXED_RCPT_OTHER
    #: Content length for delivery requests and ``size=`` (C field 5, or data_size).
    cont_length: int = 0
    smtputf8: int = 0
    #: Recipients promised by the size record and not read yet (scheduler estimate).
    rcpt_unread: int = 0
    arrival_time: tuple[int, int] = (0, 0)
    #: Basis for expiry and backoff; falls back to the arrival seconds.
    create_time: int = 0
    sender: str | None = None
    warn_time: int = 0
    #: Offset of the W record (0: none), for :func:`update_warn`.
    warn_offset: int = 0
    #: Two VERP delimiter characters, or "" when VERP is off.
    verp_delims: str = ""
    filter: str | None = None
    redirect: str | None = None
    inspector: str | None = None
    envelope_id: str = ""
    ret_flags: int = 0
    encoding: str = ""
    #: DEL_REQ trace flags from the first non-zero ``trace_flags`` attribute.
    trace_flags: int = 0
    #: Offset of that attribute when its value is exactly RECORD, for :func:`kill_record`.
    trace_offset: int = 0
    #: Where the next batch starts (just after the last R read); 0 when all are read.
    rcpt_offset: int = 0
    #: Attributes already set once (stock's "field != NULL"): first-wins bookkeeping,
    #: one bit each (``_ATTR_BIT``): a set here cost 728 bytes a message in core.
    seen_attrs: int = field(default=0, repr=False)

    @property
    def seen_all_non_rcpt(self) -> bool:
        return bool(self.rflags & READ_FLAG_SEEN_ALL_NON_RCPT)

    @property
    def mixed(self) -> bool:
        """Recipient records are interleaved with others (no early stop possible)."""
        return bool(self.rflags & READ_FLAG_MIXED_RCPT_OTHER)


@dataclass(eq=False)
class Batch:
    """The result of one :func:`read_batch` call."""

    recipients: list[Recipient]
    #: Stock's warning texts, in order (log each as ``warning: <text>``).
    warnings: list[str]
    #: False: the file is refused (stock moves it to ``corrupt/``).
    ok: bool
    #: Set when the S record was first read in this call, even if the file was then
    #: refused: stock logs the "(queue active)" line before it finds the damage.
    opened: Opened | None = None
    #: How many of ``warnings`` came before the sender record: stock logs the
    #: ``(queue active)`` line right there, between them.
    opened_after: int = 0

    @property
    def sender_seen_now(self) -> bool:
        return self.opened is not None


class QueueFileError(Exception):
    """A refused queue file; ``warnings`` are stock's texts, ``batch`` the full result."""

    def __init__(self, warnings: list[str], batch: Batch | None = None) -> None:
        super().__init__("; ".join(warnings) or "queue file refused")
        self.warnings = warnings
        self.batch = batch


class _Fatal(Exception):
    """A condition on which stock qmgr calls msg_fatal; reported as a refusal here."""


# -- C library number parsing ---------------------------------------------------------------


def _strtol(s: bytes, i: int = 0) -> tuple[int, int, bool]:
    """glibc ``strtol(s + i, &end, 10)``: (value clamped to long, end index, converted).

    The one strtol of :mod:`pyqmgr.postfix.expand`, on the bytes as Latin-1 text: one
    character a byte, so indexes carry over, and no byte outside ASCII is a digit or
    C whitespace there either.
    """
    value, end, _erange = strtol(s.decode("latin-1"), i)
    return value, end, end != i


def _int32(value: int) -> int:
    """Store a long into a C ``int`` (two's complement truncation, as gcc does)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value & 0x80000000 else value


def _atol(s: bytes) -> int:
    if s[:1].isdigit() and s.isdigit() and len(s) < 19:  # the usual case, fast
        return int(s)
    return _strtol(s)[0]


def _atoi(s: bytes) -> int:
    return _int32(_atol(s))


def _scan_size(s: bytes) -> list[int]:
    """``sscanf(s, "%ld %ld %d %d %ld %d")``: the values converted, in order."""
    fields = s.split()
    if (0 < len(fields) <= 6 and all(f.isdigit() and len(f) < 10 for f in fields)):
        # What cleanup writes: plain decimal fields, small enough that neither the
        # long clamp nor the int truncation can apply. bytes.split() splits on
        # exactly C's isspace() set, so this is what the scan below would find.
        return [int(f) for f in fields]
    values: list[int] = []
    pos = 0
    for index in range(6):
        value, pos, ok = _strtol(s, pos)
        if not ok:
            break
        values.append(value if index in (0, 1, 4) else _int32(value))
    return values


def _alldig(s: bytes) -> bool:
    return s.isdigit()  # bytes.isdigit: ASCII only and False when empty, like alldig()


def _text(b: bytes) -> str:
    return b.decode("utf-8", "surrogateescape")


#: The attributes whose values messages share (:mod:`.shared_strings`): most messages
#: of a queue have the same client, protocol and helo names (ten strings, 600 bytes a
#: message in core); log_ident and client_port are each message's own.
_SHARED_ATTRS = frozenset({"client_name", "client_address", "protocol_name", "helo_name",
                           "sasl_method", "sasl_username", "sasl_sender",
                           "rewrite_context"})


def _attr_text(attr: str, b: bytes) -> str:
    return shared(_text(b)) if attr in _SHARED_ATTRS else _text(b)


def _split_nameval(buf: bytes) -> tuple[str | None, bytes, bytes]:
    """Stock's ``split_nameval``: (error text or None, name, value)."""
    name, eq, value = buf.partition(b"=")
    if eq and name.replace(b"_", b"a").isalnum():
        # What Postfix writes: ``name=value`` with a plain ASCII name (no whitespace
        # in or around it), which is all the pattern below would take as the name.
        return None, name, value.strip(_SPACES)
    m = _NAMEVAL.match(buf)
    if m is None:
        stripped = buf.lstrip(_SPACES)
        if not stripped or stripped[0] == 0x3D:
            return "missing attribute name", b"", b""
        return "missing '=' after attribute name", b"", b""
    return None, m.group(1), buf[m.end():].strip(_SPACES)


#: The first read of a file whose size is not known, and every later one: a whole
#: small message, or the envelope of a few hundred recipients.
READ_CHUNK = 1 << 16


class RecordSource(Protocol):
    """Where :func:`read_batch` gets records: ``record(pos, path)`` is
    :func:`~pyqmgr.postfix.record.rec_get_buf` at physical offset ``pos``."""

    def record(self, pos: int, path: str) -> tuple[int, bytes, int]: ...


class _Whole:
    """A file given whole, as bytes (tools and tests)."""

    __slots__ = ("record",)

    def __init__(self, data: bytes) -> None:
        self.record = partial(rec_get_buf, data)


class FileWindow:
    """The part of an open queue file the record walk is in, read on demand.

    Stock reads a queue file through a VSTREAM buffer and seeks: past the content at
    ``data_offset``, and to ``rcpt_offset`` for a later recipient batch. Reading the
    whole file instead made a 4 MB message cost 10x the CPU of a small one, and read
    it again for each batch (issue #30). This window is one ``pread`` at the offset
    asked for; a record that runs past its end is read again from its start with a
    window twice as large, and an offset outside it is a new read there. So a record
    is refused for truncation only where the file really ends, and the result is
    exactly what the whole file would give (the tests compare both on every sample).
    """

    __slots__ = ("fd", "buf", "start", "eof", "first", "chunk", "bytes_read")

    def __init__(self, fd: int, size_hint: int = 0, chunk: int = READ_CHUNK) -> None:
        self.fd = fd
        self.buf = b""
        self.start = 0
        #: The window reaches the end of the file.
        self.eof = False
        self.chunk = chunk
        #: The first read: the whole file when it is small (the usual single read).
        self.first = min(size_hint + 4096, chunk) if size_hint > 0 else chunk
        #: What the reads brought in, in all (what the content's size must not change).
        self.bytes_read = 0

    def record(self, pos: int, path: str) -> tuple[int, bytes, int]:
        rel = pos - self.start
        if rel >= 0 and (rel < len(self.buf) or self.eof):
            try:
                rtype, payload, end = rec_get_buf(self.buf, rel, path)
                return rtype, payload, end + self.start
            except RecordError:
                if self.eof:
                    raise
        # Outside the window, or the record runs past its end: read from here.
        size = self.first
        self.first = self.chunk
        while True:
            self.buf = buf = os.pread(self.fd, size, pos)
            self.bytes_read += len(buf)
            self.start = pos
            self.eof = len(buf) < size
            try:
                rtype, payload, end = rec_get_buf(buf, 0, path)
                return rtype, payload, end + pos
            except RecordError:
                if self.eof:
                    raise
            size *= 2


def _source(source: bytes | bytearray | memoryview | BinaryIO | FileWindow) -> RecordSource:
    if isinstance(source, FileWindow):
        return source
    if isinstance(source, bytes):
        return _Whole(source)
    if isinstance(source, (bytearray, memoryview)):
        return _Whole(bytes(source))
    source.seek(0)
    return _Whole(source.read())


# -- the read loop ------------------------------------------------------------------------

#: What :func:`_next_record` returns for a pointer it cannot follow: stock's rec_goto()
#: failure, which ends qmgr's read without the "missing end record" warning.
_BAD_POINTER = REC_TYPE_ERROR - 1


def _next_record(data: RecordSource, pos: int, path: str,
                 warnings: list[str]) -> tuple[int, bytes, int]:
    """The record at ``pos`` as both of stock's read loops take it: (type, payload, next).

    A damaged record is ``REC_TYPE_ERROR``, with stock's warning added. A pointer record
    is followed here: ``REC_TYPE_PTR`` comes back with the offset it leads to (the same
    offset for a dummy pointer) and the caller goes round again, because qmgr checks
    for the content skip before every record, a pointer's target included. A pointer
    that cannot be followed is :data:`_BAD_POINTER`, its warning added.
    """
    try:
        rtype, payload, pos = data.record(pos, path)
    except RecordError as exc:
        warnings.append(str(exc))
        return REC_TYPE_ERROR, b"", pos
    if rtype == REC_TYPE_PTR:
        try:
            target = rec_goto(payload, path)
        except RecordError as exc:
            warnings.append(str(exc))
            return _BAD_POINTER, b"", pos
        if target:
            pos = target
    return rtype, payload, pos


def read_batch(source: bytes | bytearray | memoryview | BinaryIO | FileWindow,
               msg: Message, limit: int,
               *, path: str | None = None, verp_filter: str = DEF_VERP_FILTER,
               count_check: bool = True) -> Batch:
    """Read the next recipient batch of a queue file into ``msg``.

    ``source`` is a :class:`FileWindow` on the open file (the daemon: only the
    envelope is read), the whole file as bytes, or a binary file object (read whole
    from offset 0). The first call, with a fresh ``msg``, reads the envelope and up to
    ``limit`` recipients; later calls resume at ``msg.rcpt_offset`` and read only
    recipients. ``limit`` is what the caller computed (stock: recipient limit minus
    in-core recipients, at least the per-message minimum); it is capped at 5000 here as
    in stock, and must be positive (stock panics otherwise). ``path`` is the name that
    prefixes record-level warnings (stock's stream path, default ``active/<id>``);
    ``verp_filter`` is ``verp_delimiter_filter``. ``count_check`` False skips the
    "rcpt count mismatch" check, which oqmgr does not make (it keeps no unread count).

    Bad input never raises: ``ok`` is False and the warnings say why. On failure
    ``rcpt_offset``/``rcpt_unread`` are restored and no recipients are returned.
    """
    if limit <= 0:
        raise ValueError(f"{msg.queue_id}: no recipient slots available")
    if path is None:
        path = f"active/{msg.queue_id}"
    reader = _BatchReader(msg, _source(source), min(limit, BATCH_CAP), path,
                          verp_filter)
    save_offset = msg.rcpt_offset
    save_unread = msg.rcpt_unread
    try:
        ok = reader.finish(reader.walk(), count_check)
    except _Fatal as exc:
        reader.warnings.append(str(exc))
        ok = False
    if not ok:
        msg.rcpt_offset = save_offset
        msg.rcpt_unread = save_unread
        reader.recipients = []
    return Batch(reader.recipients, reader.warnings, ok, reader.opened, reader.opened_after)


class _BatchReader:
    """One :func:`read_batch` call: what its record walk carries from record to record.

    Stock's ``qmgr_message_read`` keeps this in locals of one long loop; here each kind
    of record has its own small method, and this object is what they share.
    """

    __slots__ = ("msg", "data", "limit", "path", "filter_set", "warnings", "recipients",
                 "opened", "opened_after", "have_log_client_attr", "orig_rcpt",
                 "dsn_orcpt", "dsn_notify")

    def __init__(self, msg: Message, data: RecordSource, limit: int, path: str,
                 verp_filter: str) -> None:
        self.msg = msg
        self.data = data
        self.limit = limit
        self.path = path
        self.filter_set = frozenset(verp_filter.encode("utf-8", "surrogateescape"))
        self.warnings: list[str] = []
        self.recipients: list[Recipient] = []
        #: The "(queue active)" values, and how many warnings came before them.
        self.opened: Opened | None = None
        self.opened_after = 0
        self.have_log_client_attr = False
        #: The O, DSN original recipient and notify records waiting for their R.
        self.orig_rcpt: bytes | None = None
        self.dsn_orcpt: bytes | None = None
        self.dsn_notify = 0

    def walk(self) -> int:
        """The record loop; returns stock's rec_type after it (<= 0: failed, reported)."""
        msg = self.msg
        data = self.data
        path = self.path
        warnings = self.warnings
        pos = msg.rcpt_offset
        msg.rcpt_offset = 0
        while True:
            cur = pos
            allowed = _ENVELOPE_TYPES
            if cur == msg.data_offset and cur > 0:
                cur += msg.data_size
                if cur > LONG_MAX:
                    raise _Fatal(f"seek file {path}: Invalid argument")
                pos = cur
                allowed = _XTRA_TYPES
            rtype, payload, pos = _next_record(data, pos, path, warnings)
            if rtype == REC_TYPE_PTR:
                continue
            if rtype <= 0 or rtype not in allowed or rtype == REC_TYPE_END:
                return self._loop_end(rtype, allowed, cur)
            nul = payload.find(b"\0")
            start = payload if nul < 0 else payload[:nul]
            name = value = b""
            if rtype == REC_TYPE_ATTR:
                error, name, value = _split_nameval(start)
                if error is not None:
                    warnings.append(f"{msg.queue_id}: bad attribute record: {error}: "
                                    f"{_text(start[:200])}")
                    return REC_TYPE_ERROR
                mapped = _ATTR_MAP.get(name)
                if mapped is not None:
                    start = value
                    rtype = mapped
            if rtype == REC_TYPE_RCPT:
                after = self._recipient(start, cur, pos)
                if after is None:
                    return rtype
                pos = after
            elif rtype in _RCPT_RECORDS:
                _RCPT_RECORDS[rtype](self, start)
            elif msg.rflags & READ_FLAG_SEEN_ALL_NON_RCPT:
                continue  # non-recipient records: read on the first batch only
            elif rtype == REC_TYPE_ATTR:
                self.have_log_client_attr = _attribute(
                    msg, name, value, cur, self.have_log_client_attr, warnings)
            elif rtype == REC_TYPE_SIZE:
                if not _size_record(msg, start, data, path, warnings):
                    return REC_TYPE_ERROR
            elif rtype in _TEXT_RECORDS:
                setattr(msg, _TEXT_RECORDS[rtype], _text(start))
            else:
                handler = _ENVELOPE_RECORDS.get(rtype)
                if handler is not None:
                    handler(self, start, cur)

    def _loop_end(self, rtype: int, allowed: frozenset[int], cur: int) -> int:
        """The rec_type the loop ends with at a record it does not read."""
        if rtype == _BAD_POINTER:
            return REC_TYPE_ERROR
        if rtype <= 0:
            self.warnings.append(f"{self.msg.queue_id}: message rejected: missing end record")
            return rtype if rtype < 0 else 0
        if rtype not in allowed:
            # The raw byte, as stock's %c puts it in the message (a high byte stays
            # a single surrogate-escaped byte, not a two-byte UTF-8 character).
            self.warnings.append(f"Unexpected record type '{_text(bytes((rtype,)))}' "
                                 f"at offset {cur}")
            return REC_TYPE_ERROR
        self.msg.rflags |= READ_FLAG_SEEN_ALL_NON_RCPT  # the E record: all was read
        return rtype

    # -- recipient records ------------------------------------------------------------

    def _recipient(self, start: bytes, cur: int, pos: int) -> int | None:
        """An ``R`` record: where to read on, or None when the batch ends with it."""
        msg = self.msg
        if msg.rcpt_offset:
            return pos  # the batch is full: this one is for a later batch
        msg.rcpt_unread -= 1
        address = _text(start)
        orig = _text(self.orig_rcpt) if self.orig_rcpt else ""
        if orig == address:
            orig = address  # one string for both: big messages stay smaller
        self.recipients.append(Recipient(
            cur, address, orig, _text(self.dsn_orcpt) if self.dsn_orcpt else "",
            self.dsn_notify))
        self.orig_rcpt = self.dsn_orcpt = None
        self.dsn_notify = 0
        if len(self.recipients) < self.limit:
            return pos
        msg.rcpt_offset = pos
        if msg.rflags & READ_FLAG_SEEN_ALL_NON_RCPT:
            return None
        if msg.rflags & READ_FLAG_MIXED_RCPT_OTHER:
            return pos
        # A pure recipient section: nothing else to learn before data.
        if cur > msg.data_offset:
            msg.rflags |= READ_FLAG_SEEN_ALL_NON_RCPT
            return None
        # Skip the remaining envelope recipients; the content skip at data_offset then
        # leads to the extracted segment.
        return msg.data_offset

    def _done(self, start: bytes) -> None:
        """A recipient already delivered (``D``, ``/``): counted, not read."""
        if self.msg.rcpt_offset == 0:
            self.msg.rcpt_unread -= 1
            self.orig_rcpt = self.dsn_orcpt = None
            self.dsn_notify = 0

    def _dsn_orcpt(self, start: bytes) -> None:
        self.dsn_orcpt = self._waiting(self.dsn_orcpt, start, "DSN original recipient address")

    def _dsn_notify(self, start: bytes) -> None:
        qid = self.msg.queue_id
        if self.dsn_notify:
            self.warnings.append(f"{qid}: ignoring out-of-order DSN notify flags "
                                 f"<{self.dsn_notify}>")
            self.dsn_notify = 0
        if self.msg.rcpt_offset == 0:
            n = _atoi(start) if _alldig(start) else 0
            if n == 0 or not (n == DSN_NOTIFY_NEVER or n == n & DSN_NOTIFY_ANY):
                self.warnings.append(f"{qid}: ignoring malformed DSN notify flags "
                                     f"<{_text(start[:200])}>")
            else:
                self.dsn_notify = n

    def _orcpt(self, start: bytes) -> None:
        self.orig_rcpt = self._waiting(self.orig_rcpt, start, "original recipient")

    def _waiting(self, waiting: bytes | None, start: bytes, what: str) -> bytes | None:
        """An ``O`` or DSN original recipient record: what now waits for the next R.

        One of the kind still waiting was not followed by its R: stock warns and drops
        it. The new one is kept on the first batch only (later batches skip it).
        """
        if waiting is not None:
            self.warnings.append(f"{self.msg.queue_id}: ignoring out-of-order {what} "
                                 f"<{_text(waiting[:200])}>")
        return start if self.msg.rcpt_offset == 0 else None

    # -- envelope records (first batch only) ------------------------------------------

    def _time(self, start: bytes, cur: int) -> None:
        msg = self.msg
        if msg.arrival_time[0] == 0:
            sec = _atol(start)
            digits = 0
            while digits < len(start) and 0x30 <= start[digits] <= 0x39:
                digits += 1
            msg.arrival_time = (sec, _atol(start[digits:]))

    def _create_time(self, start: bytes, cur: int) -> None:
        if self.msg.create_time == 0:
            self.msg.create_time = _atol(start)

    def _sender(self, start: bytes, cur: int) -> None:
        msg = self.msg
        if msg.sender is None:
            msg.sender = shared(_text(start))
            self.opened = Opened(msg.sender, msg.cont_length, msg.rcpt_unread)
            self.opened_after = len(self.warnings)

    def _ret_flags(self, start: bytes, cur: int) -> None:
        n = _atoi(start) if _alldig(start) else 0
        if n not in (DSN_RET_FULL, DSN_RET_HDRS):
            self.warnings.append(f"{self.msg.queue_id}: ignoring malformed DSN RET flags in "
                                 f"queue file record:{_text(start[:100])}")
        else:
            self.msg.ret_flags = n

    def _warn_time(self, start: bytes, cur: int) -> None:
        msg = self.msg
        if msg.warn_offset == 0:
            msg.warn_offset = cur
            msg.warn_time = _atol(start)

    def _verp(self, start: bytes, cur: int) -> None:
        msg = self.msg
        if msg.verp_delims:
            return
        qid = msg.queue_id
        filter_set = self.filter_set
        if not msg.sender:
            self.warnings.append(f"{qid}: ignoring VERP request for null sender")
        elif len(start) != 2 or start[0] not in filter_set or start[1] not in filter_set:
            self.warnings.append(f"{qid}: ignoring bad VERP request: "
                                 f"\"{_text(start[:100])}\"")
        else:
            msg.verp_delims = _text(start)

    # -- after the loop ---------------------------------------------------------------

    def finish(self, end_type: int, count_check: bool) -> bool:
        """Stock's checks after the loop: True when the batch is good."""
        msg = self.msg
        qid = msg.queue_id
        warnings = self.warnings
        if self.dsn_orcpt is not None and end_type > 0:
            warnings.append(f"{qid}: ignoring out-of-order DSN original recipient "
                            f"<{_text(self.dsn_orcpt[:200])}>")
        if self.orig_rcpt is not None and end_type > 0:
            warnings.append(f"{qid}: ignoring out-of-order original recipient "
                            f"<{_text(self.orig_rcpt[:200])}>")
        if msg.create_time == 0:
            msg.create_time = msg.arrival_time[0]
        if msg.rcpt_unread < 0 or (msg.rcpt_offset == 0 and msg.rcpt_unread != 0):
            if count_check:
                warnings.append(f"{qid}: rcpt count mismatch ({msg.rcpt_unread})")
            msg.rcpt_unread = 0
        if end_type <= 0:
            return False  # already reported
        if msg.arrival_time[0] == 0:
            warnings.append(f"{qid}: message rejected: missing arrival time record")
        elif msg.sender is None:
            warnings.append(f"{qid}: message rejected: missing sender record")
        elif msg.data_offset == 0:
            warnings.append(f"{qid}: message rejected: missing size record")
        else:
            return True
        return False


_RCPT_RECORDS: dict[int, Callable[[_BatchReader, bytes], None]] = {
    REC_TYPE_DONE: _BatchReader._done,
    REC_TYPE_DRCP: _BatchReader._done,
    REC_TYPE_DSN_ORCPT: _BatchReader._dsn_orcpt,
    REC_TYPE_DSN_NOTIFY: _BatchReader._dsn_notify,
    REC_TYPE_ORCP: _BatchReader._orcpt,
}
#: Records that set one text field of the message, last one wins.
_TEXT_RECORDS = {
    REC_TYPE_FILT: "filter",
    REC_TYPE_INSP: "inspector",
    REC_TYPE_RDR: "redirect",
    REC_TYPE_DSN_ENVID: "envelope_id",
}
_ENVELOPE_RECORDS: dict[int, Callable[[_BatchReader, bytes, int], None]] = {
    REC_TYPE_TIME: _BatchReader._time,
    REC_TYPE_CTIME: _BatchReader._create_time,
    REC_TYPE_FROM: _BatchReader._sender,
    REC_TYPE_DSN_RET: _BatchReader._ret_flags,
    REC_TYPE_WARN: _BatchReader._warn_time,
    REC_TYPE_VERP: _BatchReader._verp,
}


def _attribute(msg: Message, name: bytes, value: bytes, offset: int,
               have_log_client_attr: bool, warnings: list[str]) -> bool:
    """An ``A`` record that is not a pseudo type; returns the updated log-attr flag.

    Stock lets a ``log_*`` attribute override, and a legacy ``client_*`` name fill in
    only while no ``log_*`` name was seen in this read (first one wins).
    """
    attr = _LOG_ATTRS.get(name)
    if attr is not None:
        setattr(msg, attr, _attr_text(attr, value))
        msg.seen_attrs |= _ATTR_BIT[attr]
        return True
    attr = _LEGACY_ATTRS.get(name)
    if attr is not None:
        bit = _ATTR_BIT[attr]
        if not have_log_client_attr and not msg.seen_attrs & bit:
            setattr(msg, attr, _attr_text(attr, value))
            msg.seen_attrs |= bit
        return have_log_client_attr
    attr = _SINGLE_ATTRS.get(name)
    if attr is not None:
        bit = _ATTR_BIT[attr]
        if msg.seen_attrs & bit:
            warnings.append(f"{msg.queue_id}: ignoring multiple {attr} attribute: "
                            f"{_text(value)}")
        else:
            setattr(msg, attr, _attr_text(attr, value))
            msg.seen_attrs |= bit
    elif name == b"encoding":
        msg.encoding = shared(_text(value))  # last wins: the extracted segment may override
    elif name == b"trace_flags":
        if msg.trace_flags == 0:
            msg.trace_flags = _atoi(value) & DEL_REQ_TRACE_FLAGS_MASK
            msg.trace_offset = offset if msg.trace_flags == DEL_REQ_FLAG_RECORD else 0
    return have_log_client_attr


def _size_record(msg: Message, start: bytes, data: RecordSource, path: str,
                 warnings: list[str]) -> bool:
    """The ``C`` record; False means the file is refused (warning already added)."""
    qid = msg.queue_id
    if msg.data_offset == 0:
        values = _scan_size(start)
        count = len(values)
        # sscanf stores each converted field before anything is checked, so a refused
        # record still shapes the "rcpt count mismatch" warning that follows.
        if count >= 1:
            msg.data_size = values[0]
        if count >= 2:
            msg.data_offset = values[1]
        if count >= 3:
            msg.rcpt_unread = msg.rcpt_count = values[2]
        if count >= 4:
            msg.rflags = values[3]
        if count >= 5:
            msg.cont_length = values[4]
        if count >= 6:
            msg.smtputf8 = values[5]
        if count >= 3:
            if msg.data_offset <= 0 or msg.data_size <= 0:
                warnings.append(f"{qid}: invalid size record: {_text(start[:100])}")
                return False
            if msg.rflags & ~READ_FLAG_USER:
                warnings.append(f"{qid}: invalid flags in size record: {_text(start[:100])}")
                return False
        elif count == 1:
            _oldstyle_scan(msg, data, path, warnings)
        else:
            warnings.append(f"{qid}: message rejected: weird size record")
            return False
    if msg.cont_length == 0:
        msg.cont_length = msg.data_size
    elif msg.cont_length < 0:
        warnings.append(f"{qid}: invalid size record: {_text(start[:100])}")
        return False
    return True


def _oldstyle_scan(msg: Message, data: RecordSource, path: str,
                   warnings: list[str]) -> None:
    """A pre-1.0 file (one-field size record): find the offsets by a full rescan.

    Stock's ``qmgr_message_oldstyle_scan``: read the file in logical order (pointers
    followed, padding skipped), count every R/D/``/`` record, and take ``data_offset``
    from the position after ``M`` and the extracted segment's offset from ``M``'s
    payload. Where stock gives up with msg_fatal this raises :class:`_Fatal`.
    """
    msg.rcpt_unread = 0
    pos = 0
    rtype = 0
    while True:
        rtype, payload, pos = _next_record(data, pos, path, warnings)
        if rtype == REC_TYPE_PTR or rtype == REC_TYPE_DTXT:
            continue
        if rtype <= 0 or rtype == REC_TYPE_END:
            break
        if rtype in (REC_TYPE_DONE, REC_TYPE_RCPT, REC_TYPE_DRCP):
            msg.rcpt_unread += 1
        elif rtype == REC_TYPE_MESG and msg.data_offset == 0:
            msg.data_offset = pos
            nul = payload.find(b"\0")
            start = payload if nul < 0 else payload[:nul]
            extra_offset = _atol(start)
            if extra_offset <= msg.data_offset:
                raise _Fatal(f"bad extra offset {_text(start)} file {path}")
            pos = extra_offset
            msg.data_size = extra_offset - msg.data_offset
    if msg.data_offset == 0 or rtype != REC_TYPE_END:
        raise _Fatal(f"{msg.queue_id}: envelope records out of order")


def read_message(source: bytes | bytearray | memoryview | BinaryIO, queue_id: str,
                 limit: int = BATCH_CAP, *, path: str | None = None,
                 verp_filter: str = DEF_VERP_FILTER) -> tuple[Message, Batch]:
    """Read the first batch of a file; raise :class:`QueueFileError` if it is refused.

    A convenience for tools and tests; the daemon uses :func:`read_batch` directly
    because it must log the "(queue active)" line even for a refused file.
    """
    msg = Message(queue_id=queue_id)
    batch = read_batch(source, msg, limit, path=path, verp_filter=verp_filter)
    if not batch.ok:
        raise QueueFileError(batch.warnings, batch)
    return msg, batch


# -- in-place updates ----------------------------------------------------------------------


def _write_at(f: int | BinaryIO, data: bytes, offset: int) -> None:
    if isinstance(f, int):
        if os.pwrite(f, data, offset) != len(data):
            raise OSError(f"short write at offset {offset}")
    else:
        f.seek(offset)
        f.write(data)
        f.flush()


def mark_done(f: int | BinaryIO, offset: int) -> None:
    """Overwrite a recipient's type byte with ``D`` (``deliver_completed``).

    Offset -1 means "nothing to mark", as for stock's local delivery agent.
    """
    if offset == -1:
        return
    if offset < 0:
        raise ValueError(f"bad recipient offset {offset}")
    _write_at(f, b"D", offset)


def kill_record(f: int | BinaryIO, offset: int) -> None:
    """Overwrite a record's type byte with ``K``: the ``trace_flags`` record after the
    trace report was sent, so a later pass does not send it again."""
    if offset <= 0:
        raise ValueError(f"bad offset {offset:#x}")  # stock panics
    _write_at(f, b"K", offset)


def update_warn(f: int | BinaryIO, offset: int, value: int) -> None:
    """Rewrite the ``W`` record in place; ``-1`` means the delay warning was sent.

    The payload is always ``%15ld``, so the record keeps its size and nothing else in
    the file moves.
    """
    payload = b"%15d" % value
    if len(payload) != 15:
        raise ValueError(f"warning time {value} does not fit the W record")
    if offset <= 0:
        raise ValueError(f"bad W record offset {offset}")
    _write_at(f, encode_record(REC_TYPE_WARN, payload), offset)
