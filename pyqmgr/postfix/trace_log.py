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
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pyqmgr.postfix.bounce_log import LogEntry, open_log, parse

#: Most bytes read at one go; a record is at most a few kilobytes (one SMTP reply).
WINDOW = 1 << 20
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
    #: The file's size when read (0 when there is none).
    size: int = 0
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
    name that is not a regular file (the cursor does not move).
    """
    piece = TracePiece()
    opened = open_log(path)
    if opened is None:
        return piece
    fd, st = opened
    try:
        piece.size = st.st_size
        end = piece.size if stop is None else min(stop, piece.size)
        while cursor.offset < end:
            want = min(window, end - cursor.offset)
            data = os.pread(fd, want, cursor.offset)
            if not data:
                break
            full = len(data) == window
            if not _take(path, cursor, data, not full, piece):
                break
    finally:
        os.close(fd)
    return piece


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
    log = parse(whole, path, "trace")
    piece.entries.extend(log.entries)
    piece.warnings.extend(log.warnings)
    cursor.offset += len(whole)
    return not last


__all__ = ["VIA", "WINDOW", "TraceCursor", "TracePiece", "read_more", "relay_and_reply"]
