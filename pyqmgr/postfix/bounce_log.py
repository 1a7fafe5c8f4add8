"""Reading a bounce, defer or trace log as Postfix's ``bounce_log.c`` reads it.

The bounce(8) daemon appends one entry per recipient to ``defer/<id>`` when a delivery
is deferred (``bounce_append_service.c``): a blank line, then ``name=value`` lines
(``recipient``, ``original_recipient``, ``offset``, ``dsn_orig_rcpt``,
``notify_flags``, ``status``, ``action``, ``diag_type``, ``diag_text``, ``mta_type``,
``mta_mname``, ``reason``), then a blank line; with
``backwards_bounce_logfile_compatibility`` (the default) each entry also starts with
an old-style ``<recipient>: reason`` line. qmgr removes the defer log each time the
message enters the active queue, so it holds the last pass's reasons only: what
``pyqmgr explain`` shows for a deferred message, as mailq shows it.

Why it looks the way it does:

* **Bounded.** The log is read through :func:`read_log`, at most :data:`MAX_LOG_BYTES`
  (a message to 10,000 recipients of one dead site writes a few megabytes); what lies
  beyond is counted, not read, and the entry cut there is left out, as stock leaves
  out an entry that no blank line ends. The file is opened
  without following a symbolic link and without blocking on a FIFO, and must be a
  regular file.
* **Tolerant as stock is.** The parser is stock's state machine (``bounce_log_read``):
  entries end at a blank line, unknown names and malformed lines are skipped with a
  warning in stock's words, missing fields get stock's place holders ("(recipient
  address unavailable)", "(description unavailable)", 4.0.0/delayed for a defer log).
  Bytes that are not printable become ``?`` as ``printable()`` makes them. Warnings
  are capped: a file of garbage gives a few, and a count.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field

from pyqmgr.postfix.config import split_nameval

#: Most bytes of a log read; the rest is counted, not read.
MAX_LOG_BYTES = 1 << 20
#: Most warnings kept for one log (the rest are counted in the last).
MAX_WARNINGS = 10
#: Most characters kept of one value (a reason is one SMTP reply, rarely 1,000).
MAX_VALUE = 4096

#: What stock fills in for a field the entry lacks (``bounce_log_read``).
NO_ADDRESS = "(recipient address unavailable)"
NO_REASON = "(description unavailable)"
#: Old-style entries carry no status: a defer log's are delayed, any other's failed.
COMPAT = {"defer": ("4.0.0", "delayed")}
COMPAT_OTHER = ("5.0.0", "failed")

#: DSN_NOTIFY_NEVER | SUCCESS | FAILURE | DELAY: the valid notify bits (dsn_mask.h).
_NOTIFY_MASK = 0x0F


@dataclass
class LogEntry:
    """One recipient's entry; a field the entry lacks holds stock's place holder."""

    recipient: str = ""
    original_recipient: str = ""
    offset: int = 0
    dsn_orig_rcpt: str = ""
    notify_flags: int = 0
    status: str = ""
    action: str = ""
    diag_type: str = ""
    diag_text: str = ""
    mta_type: str = ""
    mta_mname: str = ""
    reason: str = ""


@dataclass
class BounceLog:
    """What a log held: its entries in file order, and what was wrong with it."""

    entries: list[LogEntry] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: The file's size, and the bytes of it that were read (less when it was cut).
    size: int = 0
    read: int = 0

    @property
    def cut(self) -> bool:
        return self.read < self.size

    def last_by_offset(self) -> dict[int, LogEntry]:
        """Each recipient's last entry, by its record's offset in the queue file."""
        return {e.offset: e for e in self.entries if e.offset > 0}

    def last_by_address(self) -> dict[str, LogEntry]:
        """Each recipient's last entry, by its address (for entries with no offset)."""
        return {e.recipient: e for e in self.entries}


_STRINGS = {"recipient", "original_recipient", "dsn_orig_rcpt", "status", "action",
            "diag_type", "diag_text", "mta_type", "mta_mname", "reason"}


def _printable(line: bytes) -> str:
    """``printable(text, '?')``: UTF-8 kept, control characters and bad bytes as ``?``."""
    if line.isascii():
        text = line.decode("ascii")
        if text.isprintable():
            return text  # nearly every line: no walk over its characters
    text = line.decode("utf-8", "replace").replace("\ufffd", "?")
    return "".join(c if c >= " " and c != "\x7f" else "?" for c in text)


class _Parser:
    """``bounce_log_read``'s state machine over the lines of a log."""

    def __init__(self, path: str, queue_name: str) -> None:
        self.path = path
        self.status, self.action = COMPAT.get(queue_name, COMPAT_OTHER)
        self.log = BounceLog()
        self.entry: LogEntry | None = None
        self.dropped = 0

    def warn(self, text: str) -> None:
        if len(self.log.warnings) < MAX_WARNINGS:
            self.log.warnings.append(f"{self.path}: {text}")
        else:
            self.dropped += 1

    def line(self, raw: bytes) -> None:
        if not raw:
            self.end()
            return
        text = _printable(raw)
        if self.entry is None:
            self.entry = LogEntry()
        if text[0].isascii() and text[0].isalnum():
            self.attribute(self.entry, text)
            return
        # An old-style "<recipient>: text" line.
        close = text.find(">: ")
        if text[0] != "<" or close < 0:
            self.warn(f"malformed record: {text[:30]}...")
            return
        self.entry.recipient = text[1:close][:MAX_VALUE] or "(MAILER-DAEMON)"
        self.entry.reason = text[close + 2:].lstrip()[:MAX_VALUE]

    def attribute(self, entry: LogEntry, text: str) -> None:
        try:
            name, value = split_nameval(text)
        except ValueError as exc:
            self.warn(f"malformed record: {exc}")
            return
        value = value[:MAX_VALUE]
        if name in ("recipient", "original_recipient"):
            setattr(entry, name, value or "(MAILER-DAEMON)")
        elif name in _STRINGS:
            setattr(entry, name, value)
        elif name == "offset":
            number = _leading_int(value)
            if number > 0:
                entry.offset = number
        elif name == "notify_flags":
            number = _leading_int(value)
            if number > 0 and number & ~_NOTIFY_MASK == 0:
                entry.notify_flags = number
        else:
            self.warn(f"unknown attribute name: {name[:64]}, ignored")

    def end(self) -> None:
        """A blank line: the entry being read, if any, is complete."""
        entry, self.entry = self.entry, None
        if entry is None:
            return
        entry.recipient = entry.recipient or NO_ADDRESS
        entry.status = entry.status or self.status
        entry.action = entry.action or self.action
        entry.reason = entry.reason or NO_REASON
        self.log.entries.append(entry)

    def finish(self) -> BounceLog:
        """At the end of what was read. An entry that no blank line ended is left
        out, as stock leaves it (being written, or cut by the byte limit)."""
        if self.dropped:
            self.log.warnings.append(f"{self.path}: {self.dropped} more warnings")
        return self.log


def _leading_int(text: str) -> int:
    """``atoi``/``atol``: leading blanks, a sign, digits; 0 when there are none."""
    text = text.lstrip(" \t\n\r\v\f")
    sign = -1 if text[:1] == "-" else 1
    digits = text[1:] if text[:1] in "+-" and text else text
    n = 0
    for c in digits:
        if not "0" <= c <= "9":
            break
        n = n * 10 + ord(c) - 48
    return sign * n


def parse(data: bytes, path: str, queue_name: str = "defer") -> BounceLog:
    """The entries of a log's bytes (the whole file, or its first bytes)."""
    parser = _Parser(path, queue_name)
    lines = data.split(b"\n")
    # What follows the last newline is not a whole line (or is nothing).
    lines.pop()
    for raw in lines:
        parser.line(raw)
    log = parser.finish()
    log.size = log.read = len(data)
    return log


def open_log(path: str) -> tuple[int, os.stat_result] | None:
    """A log opened for reading, and its status; None when there is none. Without
    following a symbolic link or blocking on a FIFO; OSError for a name that is not a
    regular file (the descriptor is then closed) or a file that cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "a symbolic link, not a log", path) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", path)
    return fd, st


def read_log(path: str, queue_name: str = "defer",
             limit: int = MAX_LOG_BYTES) -> BounceLog | None:
    """The log at ``path`` (relative to the queue directory), or None when there is
    none. At most ``limit`` bytes are read. OSError for a file that cannot be read,
    or a name that is not a regular file."""
    opened = open_log(path)
    if opened is None:
        return None
    fd, st = opened
    try:
        chunks = []
        got = 0
        while got < limit:
            chunk = os.pread(fd, min(limit - got, 1 << 16), got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        # One byte more tells a file of exactly ``limit`` bytes from a longer one.
        more = got >= limit and bool(os.pread(fd, 1, got))
    finally:
        os.close(fd)
    data = b"".join(chunks)
    log = parse(data, path, queue_name)
    log.read = got
    log.size = max(st.st_size, got + (1 if more else 0))
    return log
