"""A message's header section, read from its queue file for a header-named class or
tenant (issue #34: ``message_class_key = header:X-Priority``, ``tenant_key =
header:X-Tenant``).

cleanup(8) writes the message content after the envelope as ``N`` records (one per
line) and ``L`` records (a piece of a line longer than ``line_length_limit``, the
rest following), starting at the size record's data offset; the header section ends
at the first empty line, and the content at the ``X`` record. A milter's or
header_checks' edits can leave pointer (``p``) records that lead elsewhere in the
file; they are followed, a bounded number of times.

Why bounded: the queue manager must never pay for a message's size (a 4 MB message
costs what a 4 KB one does). At most :data:`HEADER_BYTES` of records are looked at,
and a header that is not found by then counts as absent (the message takes the
default class or tenant, as one without the header). 64 KiB holds any header
section real mail has (Postfix's own header_size_limit, 100 KiB, is the bound of a
single header; a section that size is spam or an attack, and classifying it as
default is the right outcome).
"""

from __future__ import annotations

from pyqmgr.postfix.queue_file import FileWindow
from pyqmgr.postfix.record import (
    REC_TYPE_CONT,
    REC_TYPE_NORM,
    REC_TYPE_PTR,
    RecordError,
    c_string,
    off_cvt_string,
)

#: Bytes of records looked at, at most.
HEADER_BYTES = 64 << 10
#: Pointer records followed, at most (a loop of them must end).
MAX_POINTERS = 100
#: A header value kept at most this long (a table key, a metrics label).
MAX_VALUE = 1000
#: The first read: a typical header section in one pread.
FIRST_READ = 8192


def header_values(fd: int, data_offset: int, names: frozenset[str],
                  path: str = "") -> dict[str, str]:
    """The first value of each header in ``names`` (lower case) found in the header
    section, unfolded and trimmed; an absent header is absent from the result. A
    damaged record ends the look (what was found stands: the scan reports the
    file)."""
    found: dict[str, str] = {}
    if not names or data_offset <= 0:
        return found
    window = FileWindow(fd, FIRST_READ, FIRST_READ)
    pos = data_offset
    seen = pointers = 0
    line = b""
    current: str | None = None  # the wanted header being unfolded
    value: list[bytes] = []
    while seen < HEADER_BYTES:
        try:
            rtype, payload, nxt = window.record(pos, path)
        except (RecordError, OSError):
            break
        seen += nxt - pos
        if rtype == REC_TYPE_PTR:
            # Not rec_goto: its loop count is per file, as stock's, and the envelope
            # reader's must not see this walk.
            pointers += 1
            target = off_cvt_string(c_string(payload).lstrip(b" \t\n\r\v\f"))
            if target < 0 or pointers > MAX_POINTERS:
                break
            pos = target or nxt
            continue
        pos = nxt
        if rtype == REC_TYPE_CONT:
            line += payload
            continue
        if rtype != REC_TYPE_NORM:
            break  # the end of the content, or a record that has no place here
        line += payload
        if line[:1] in (b" ", b"\t") and current is not None:
            value.append(line)
        else:
            if current is not None:
                found.setdefault(current, _text(value))
            current = None
            if not line:
                break  # the empty line: the body begins
            head, colon, rest = line.partition(b":")
            name = head.rstrip(b" \t").decode("ascii", "replace").lower()
            if colon and name in names and name not in found:
                current, value = name, [rest]
        line = b""
        if len(found) == len(names):
            break
    if current is not None:
        found.setdefault(current, _text(value))
    return found


def _text(parts: list[bytes]) -> str:
    """A header's value unfolded (the line breaks dropped, the whitespace kept, RFC
    5322 section 2.2.3) and trimmed."""
    return b"".join(parts).strip(b" \t").decode("utf-8", "replace")[:MAX_VALUE]
