"""A message's header section, read from its queue file for a header-named class or
tenant (issue #34: ``message_class_key = header:X-Priority``, ``tenant_key =
header:X-Tenant``).

What cleanup(8) writes (cleanup_out.c, checked on Postfix 3.7.11 queue files in
tests/data/queue_samples/headers_*.bin): the content starts at the size record's data
offset; each header line is one ``N`` record, a line longer than
``line_length_limit`` is ``L`` pieces and a last ``N``; a folded header's lines are
records of their own. With milters configured, a header's first line shorter than
a pointer record is followed by a ``w`` padding record (so that a milter's edit can
overwrite it with a ``p``), and milters' added or changed headers sit elsewhere in
the file, reached by ``p`` records: both are taken as the delivery agents take them
(padding skipped, pointers followed, a bounded number of times). header_checks'
REPLACE, PREPEND and IGNORE are applied before the file is written, so the file
holds the result. The header section ends at the first empty line or the first line
that is not a header (RFC 5322), or at the ``X`` record of a message without a body.

Why bounded: the queue manager must never pay for a message's size (a 4 MB message
costs what a 4 KB one does). At most :data:`HEADER_BYTES` of records are looked at
and :data:`READ_BUDGET` bytes read, and a header not found by then counts as absent
(the message takes the default class or tenant, as one without the header). 64 KiB
holds any header section real mail has; a single header may be longer in Postfix
(header_size_limit, 100 KiB), but a class or tenant name of that size is a mistake
or an attack, and the default is the right outcome for it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from pyqmgr.postfix.record import (
    REC_TYPE_CONT,
    REC_TYPE_DTXT,
    REC_TYPE_EOF,
    REC_TYPE_NORM,
    REC_TYPE_PTR,
    REC_TYPE_XTRA,
    RecordError,
    c_string,
    off_cvt_string,
    rec_get_buf,
)

#: Bytes of records looked at, at most.
HEADER_BYTES = 64 << 10
#: The first read: a typical header section (a few Received: lines) in one pread.
FIRST_READ = 8192
#: Bytes read at most in one look: the records looked at and the rest of the last
#: read (each byte is read once, but for a pointer's target read again).
READ_BUDGET = HEADER_BYTES + FIRST_READ
#: Pointer records followed, at most (a loop of them must end).
MAX_POINTERS = 100
#: A header value kept at most this long (a table key, a metrics label).
MAX_VALUE = 1000
#: A header line's start: a field name (printable ASCII but the colon), optional
#: blanks, the colon (RFC 5322 section 3.6.8, with the obsolete blanks of 4.5.8).
_HEADER_LINE = re.compile(rb"([!-9;-~]+)[ \t]*:")


@dataclass
class HeaderSection:
    """What one look at a queue file's header section found."""

    #: The first value of each header asked for (lower-case name) that was found.
    values: dict[str, str] = field(default_factory=dict)
    #: Why the look ended before the section did (a damaged record, the bound); ""
    #: when it reached the section's end or found every header asked for.
    problem: str = ""
    #: What the reads brought in (the bound's proof in the tests).
    bytes_read: int = 0


class _Spent(Exception):
    """The look read :data:`READ_BUDGET` bytes."""


class _Window:
    """Records from an open file by ``pread``, never more than a budget of bytes.

    Not :class:`~pyqmgr.postfix.queue_file.FileWindow`: that one reads any record
    whole, however long its length field says it is, as stock's envelope reader
    must; here a record that claims more than :data:`HEADER_BYTES` is damage, and a
    run of them cannot read more than the budget.
    """

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path
        self.buf = b""
        self.start = 0
        self.eof = False
        self.read = 0

    def record(self, pos: int) -> tuple[int, bytes, int]:
        rel = pos - self.start
        if not 0 <= rel <= len(self.buf):  # elsewhere (a pointer's target): start there
            self.buf, self.start, self.eof, rel = b"", pos, False, 0
        while True:
            try:
                rtype, payload, end = rec_get_buf(self.buf, rel, self.path, HEADER_BYTES)
                if rtype != REC_TYPE_EOF or self.eof:
                    return rtype, payload, end + self.start
            except RecordError:
                if self.eof:
                    raise
            # The record runs past what was read: keep its start, read what follows,
            # so that no byte is read twice.
            size = min(FIRST_READ, READ_BUDGET - self.read)
            if size <= 0:
                raise _Spent
            more = os.pread(self.fd, size, self.start + len(self.buf))
            self.read += len(more)
            self.eof = len(more) < size
            self.buf = self.buf[rel:] + more
            self.start += rel
            rel = 0


class _Walk:
    """The header lines in the file's logical order, unfolded into wanted values."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.found: dict[str, str] = {}
        self.current: str | None = None  # the wanted header being unfolded
        self.value: list[bytes] = []

    def line(self, line: bytes) -> bool:
        """One whole header line; False when the section has ended (or nothing is
        left to find)."""
        if line[:1] in (b" ", b"\t"):
            if self.current is not None:
                self.value.append(line)
            return True
        self.close()
        head = _HEADER_LINE.match(line)
        if head is None:
            return False  # the empty line, or body text: the header section is over
        name = head.group(1).decode("ascii").lower()
        if name in self.names and name not in self.found:
            self.current, self.value = name, [line[head.end():]]
        return len(self.found) < len(self.names)

    def close(self) -> None:
        if self.current is not None:
            value = b"".join(self.value).strip(b" \t\r\n")
            self.found[self.current] = value.decode("utf-8", "replace")[:MAX_VALUE]
            self.current = None


def header_section(fd: int, data_offset: int, names: frozenset[str],
                   path: str = "") -> HeaderSection:
    """The first value of each header in ``names`` (lower case) in the header section
    of the queue file open at ``fd``, unfolded (the line breaks dropped, RFC 5322
    section 2.2.3) and trimmed. A header absent, or not found within the bounds, is
    absent from the values; ``problem`` says why a look ended early. A value cut off
    by damage or the bound is dropped, never guessed at."""
    if not names or data_offset <= 0:
        return HeaderSection()
    window = _Window(fd, path)
    walk = _Walk(names)
    problem = _walk(window, walk, data_offset, path)
    if problem:
        walk.current = None
    else:
        walk.close()
    return HeaderSection(walk.found, problem, window.read)


def _walk(window: _Window, walk: _Walk, pos: int, path: str) -> str:
    """Feed the header lines from ``pos`` to ``walk``; the problem that ended it, or
    "" at the section's end."""
    seen = pointers = 0
    line = b""
    while True:
        cur = pos
        if seen >= HEADER_BYTES:
            return f"the header section is longer than {HEADER_BYTES} bytes"
        try:
            rtype, payload, nxt = window.record(pos)
        except RecordError as exc:
            return f"a damaged record at offset {cur} ({exc})"
        except _Spent:
            return f"{READ_BUDGET} bytes read and the header section goes on"
        except OSError as exc:
            return f"read error at offset {cur}: {exc.strerror or exc}"
        seen += nxt - cur
        if rtype == REC_TYPE_PTR:
            pointers += 1
            target = off_cvt_string(c_string(payload).lstrip(b" \t\n\r\v\f"))
            if target < 0:
                return f"a bad pointer record at offset {cur}"
            if pointers > MAX_POINTERS:
                return f"more than {MAX_POINTERS} pointer records"
            pos = target or nxt
            continue
        pos = nxt
        if rtype == REC_TYPE_DTXT:
            continue  # a milter's room to put a pointer in, not text
        if rtype == REC_TYPE_CONT:
            line += payload
            continue
        if rtype == REC_TYPE_NORM:
            if not walk.line(line + payload):
                return ""
            line = b""
            continue
        if rtype == REC_TYPE_XTRA and not line:
            return ""  # a message of headers only
        if rtype == REC_TYPE_EOF:
            return f"the file ends at offset {cur}, in the content"
        return f"a record of type {rtype} at offset {cur} in the content"


def header_values(fd: int, data_offset: int, names: frozenset[str],
                  path: str = "") -> dict[str, str]:
    """:func:`header_section`'s values only."""
    return header_section(fd, data_offset, names, path).values
