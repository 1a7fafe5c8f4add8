"""Reading a message's trace log (``trace/<id>``) a piece at a time, as it grows.

With ``DEL_REQ_FLAG_RECORD`` in a delivery request's flags ("record and deliver",
what ``sendmail -v`` sets), Postfix's ``sent()``, ``bounce_append()`` and
``defer_append()`` in the delivery agent append each recipient's outcome to the
trace service (the bounce daemon running as ``trace``): one record per recipient
per outcome, in the bounce log's format (:mod:`pyqmgr.postfix.bounce_log`), with the
reason prefixed ``delivery via RELAY: `` (``trace_append``). The bounce daemon
appends each record under a lock and fsyncs it before it answers the agent.

Why a cursor: the daemon reads a message's log after each delivery request's reply,
from where it stopped, so that a message to 10,000 recipients costs one small read
per request, not one whole read per request. Only whole records are taken: a record
ends at a blank line, and what follows the last ``\\n\\n`` may be a record being
written. A record larger than the read window (a corrupt or hostile log) is skipped
with a warning, up to the next record's start, so that one bad record cannot stop
the rest from being read.

Why a parser of its own (:func:`parse_records`): the queue manager reads every
delivery's records as they come, so this is a hot path, and the bounce daemon writes
them in one shape only (``name=value`` lines of known names, printable ASCII nearly
always). That shape is taken with one split a line; anything else in a piece (a byte
that is not printable ASCII, an unknown name, a malformed line) hands the whole piece
to :func:`pyqmgr.postfix.bounce_log.parse`, stock's state machine, whose result the
fast road equals field for field (tests/unit/test_delivery_events.py compares them).
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field

from pyqmgr.postfix.bounce_log import (
    COMPAT_OTHER,
    MAX_VALUE,
    NO_ADDRESS,
    NO_REASON,
    LogEntry,
    parse,
)

#: Most bytes read at one go; a record is at most a few kilobytes (one SMTP reply).
WINDOW = 1 << 20
#: The first read's size: a request's records are a few hundred bytes a recipient, so
#: one read nearly always takes them all without allocating the whole window.
FIRST_READ = 1 << 14
#: The names a record holds (``bounce_append_service.c``), the string-valued ones
#: apart; ``notify_flags`` holds DSN_NOTIFY_* bits, of which these are valid.
_STRINGS = frozenset({"recipient", "original_recipient", "dsn_orig_rcpt", "status",
                      "action", "diag_type", "diag_text", "mta_type", "mta_mname", "reason"})
_NOTIFY_MASK = 0x0F
#: What ``split_nameval`` trims from a value.
_SPACE = " \t\n\v\f\r"
#: What ``trace_append`` puts before the reason when the relay is not "none".
VIA = "delivery via "


@dataclass
class TraceCursor:
    """Where the reading of one message's trace log stands."""

    #: Bytes of the file consumed (whole records, and what was skipped).
    offset: int = 0
    #: A record too large for the window is being skipped up to its end.
    skipping: bool = False


@dataclass
class TracePiece:
    """What one read found: whole records, in file order, and what was wrong."""

    entries: list[LogEntry] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: Records skipped for their size.
    skipped: int = 0


def relay_and_reply(reason: str) -> tuple[str, str]:
    """The relay ``trace_append`` named, and the reply without its prefix.

    ``delivery via mx.example.com[192.0.2.1]:25: 250 2.0.0 Ok`` gives the relay and
    ``250 2.0.0 Ok``; a reason without the prefix (relay "none") gives "" and itself.
    """
    if reason.startswith(VIA):
        rest = reason[len(VIA):]
        at = rest.find(": ")
        if at > 0:
            return rest[:at], rest[at + 2:]
    return "", reason


def read_more(path: str, cursor: TraceCursor, window: int = WINDOW,
              stop: int | None = None) -> TracePiece:
    """The whole records added to ``path`` since ``cursor``, which moves past them;
    with ``stop``, none that ends past that many bytes of the file.

    A missing file is an empty piece. OSError for a file that cannot be read or a
    name that is not a regular file (the cursor does not move). One ``open``, one
    ``pread`` (two and an ``fstat`` for a piece past :data:`FIRST_READ`) and one
    ``close`` a call: the read's end is the file's end, and a FIFO or a directory
    fails the read itself (opened without following a link, without blocking).
    """
    piece = TracePiece()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return piece
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "a symbolic link, not a log", path) from None
        raise
    try:
        while stop is None or cursor.offset < stop:
            want = window if stop is None else min(window, stop - cursor.offset)
            data = _pread(fd, want, cursor.offset, path)
            if not data:
                break
            full = len(data) == window
            if not _take(path, cursor, data, not full, piece):
                break
    finally:
        os.close(fd)
    return piece


def _pread(fd: int, want: int, offset: int, path: str) -> bytes:
    """Up to ``want`` bytes at ``offset``: a small read first, the rest only when the
    small one came back full (a window's worth is never allocated for a few hundred
    bytes). A FIFO or a directory fails the read; a device that gives bytes without
    end fills it, and only then is the file's type looked at."""
    try:
        data = os.pread(fd, min(want, FIRST_READ), offset)
        if len(data) == FIRST_READ:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            if want > FIRST_READ:
                data += os.pread(fd, want - FIRST_READ, offset + FIRST_READ)
    except OSError as exc:
        if exc.errno in (errno.ESPIPE, errno.EISDIR):
            raise OSError(errno.EINVAL, "not a regular file", path) from None
        raise
    return data


def _take(path: str, cursor: TraceCursor, data: bytes, last: bool, piece: TracePiece) -> bool:
    """Consume the whole records of ``data`` (read at the cursor); False: stop reading."""
    if cursor.skipping:
        end = data.find(b"\n\n")
        if end < 0:
            # Still inside the oversized record: keep the last byte, it may be a "\n".
            cursor.offset += max(len(data) - 1, 0)
            return not last and len(data) > 1
        cursor.offset += end + 2
        cursor.skipping = False
        return True
    end = data.rfind(b"\n\n")
    if end < 0:
        if last:
            return False  # a record being written: read it next time
        piece.skipped += 1
        piece.warnings.append(f"{path}: a record at offset {cursor.offset} is larger than "
                              f"{len(data)} bytes: skipped")
        cursor.offset += len(data) - 1
        cursor.skipping = True
        return True
    whole = data[:end + 2]
    entries = parse_records(whole)
    if entries is None:
        log = parse(whole, path, "trace")
        entries = log.entries
        piece.warnings.extend(log.warnings)
    piece.entries.extend(entries)
    cursor.offset += len(whole)
    return not last


def parse_records(data: bytes) -> list[LogEntry] | None:
    """The records of ``data`` (whole records) as the bounce daemon writes them, or
    None when ``data`` holds anything else: then :func:`~pyqmgr.postfix.bounce_log.
    parse` reads it, with its warnings. Where this returns entries they equal that
    parser's, field for field (the placeholders of a trace log's missing fields too)."""
    if not data.isascii():
        return None
    lines = data.decode("ascii").split("\n")
    lines.pop()  # what follows the last newline is not a whole line
    entries: list[LogEntry] = []
    entry: LogEntry | None = None
    for line in lines:
        if not line:
            if entry is not None:
                entries.append(_ended(entry))
                entry = None
            continue
        if not line.isprintable():
            return None
        if entry is None:
            entry = LogEntry()
        if line[0] == "<":
            # The old-style "<recipient>: text" line (the attributes after it win).
            close = line.find(">: ")
            if close < 0:
                return None
            entry.recipient = line[1:close][:MAX_VALUE] or "(MAILER-DAEMON)"
            entry.reason = line[close + 2:].lstrip()[:MAX_VALUE]
            continue
        name, eq, value = line.partition("=")
        if not eq or not _attribute(entry, name, value.strip(_SPACE)[:MAX_VALUE]):
            return None
    return entries


def _attribute(entry: LogEntry, name: str, value: str) -> bool:
    """Set one ``name=value``; False for what the fast road does not take."""
    if name in _STRINGS:
        if not value and name in ("recipient", "original_recipient"):
            value = "(MAILER-DAEMON)"
        setattr(entry, name, value)
        return True
    if name != "offset" and name != "notify_flags":
        return False
    if not (value.isascii() and value.isdigit()):
        return False  # a sign, blanks or trailing text: stock's atoi, in the parser
    number = int(value)
    if name == "offset":
        if number > 0:
            entry.offset = number
    elif number > 0 and number & ~_NOTIFY_MASK == 0:
        entry.notify_flags = number
    return True


def _ended(entry: LogEntry) -> LogEntry:
    """A blank line ended the entry: stock's place holders for what it lacks."""
    entry.recipient = entry.recipient or NO_ADDRESS
    entry.status = entry.status or COMPAT_OTHER[0]
    entry.action = entry.action or COMPAT_OTHER[1]
    entry.reason = entry.reason or NO_REASON
    return entry


__all__ = ["VIA", "WINDOW", "TraceCursor", "TracePiece", "parse_records", "read_more",
           "relay_and_reply"]
