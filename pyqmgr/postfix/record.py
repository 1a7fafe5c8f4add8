"""Queue-file record framing, as stock's ``global/record.c`` reads and writes it.

A record is ``[type byte][length, base-128 little-endian, 1..5 bytes][payload]``.

The daemon parses queue files from one in-memory copy (:func:`rec_get_buf`): qmgr reads
thousands of files a second, and one ``read()`` plus slicing is far cheaper than many
small reads. :func:`rec_get_raw` does the same on a file object at its current position
for tools and tests that walk a file record by record.

Malformed framing produces stock's warning texts, prefixed with the stream path as
stock's ``VSTREAM_PATH`` would be (qmgr opens ``active/<id>``). The reader never logs:
it raises :class:`RecordError` carrying the text, and the caller decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO

# Pseudo types returned instead of a record (``rec_type.h``).
REC_TYPE_EOF = -1
REC_TYPE_ERROR = -2

# The record types qmgr cares about (``rec_type.h``), as byte values.
REC_TYPE_SIZE = ord("C")
REC_TYPE_TIME = ord("T")
REC_TYPE_CTIME = ord("c")
REC_TYPE_FULL = ord("F")
REC_TYPE_INSP = ord("I")
REC_TYPE_FILT = ord("L")
REC_TYPE_FROM = ord("S")
REC_TYPE_DONE = ord("D")
REC_TYPE_DRCP = ord("/")
REC_TYPE_RCPT = ord("R")
REC_TYPE_ORCP = ord("O")
REC_TYPE_DSN_ORCPT = ord("o")
REC_TYPE_DSN_NOTIFY = ord("n")
REC_TYPE_DSN_ENVID = ord("i")
REC_TYPE_DSN_RET = ord("<")
REC_TYPE_WARN = ord("W")
REC_TYPE_VERP = ord("V")
REC_TYPE_ATTR = ord("A")
REC_TYPE_RDR = ord(">")
REC_TYPE_KILL = ord("K")
REC_TYPE_MESG = ord("M")
REC_TYPE_NORM = ord("N")
REC_TYPE_CONT = ord("L")
REC_TYPE_DTXT = ord("w")
REC_TYPE_XTRA = ord("X")
REC_TYPE_PTR = ord("p")
REC_TYPE_END = ord("E")

#: Stock's loop guard in ``rec_goto``.
REVERSE_JUMP_LIMIT = 10000


class RecordError(Exception):
    """A record could not be read; ``str(exc)`` is stock's warning text."""


@dataclass(frozen=True, slots=True)
class Record:
    """One raw record: its type (or REC_TYPE_EOF), payload and physical start offset."""

    type: int
    payload: bytes
    offset: int


def _length_term(byte: int, shift: int) -> int:
    """One length byte's contribution, computed as stock's C code does.

    ``(len_byte & 0177) << shift`` is evaluated in a 32-bit ``int`` and then ORed into a
    64-bit ``ssize_t``: at shift 28 bits above 31 fall off and bit 31 becomes a sign bit
    that is extended. That is why a fifth length byte with 0x08 set yields stock's
    "illegal length" (negative) rather than a huge positive length.
    """
    term = ((byte & 0x7F) << shift) & 0xFFFFFFFF
    return term - (1 << 32) if term & 0x80000000 else term


def rec_get_buf(data: bytes, pos: int, path: str, maxsize: int = 0) -> tuple[int, bytes, int]:
    """Read the record at physical offset ``pos`` of an in-memory file.

    Returns ``(type, payload, next_offset)``; at end of data ``(REC_TYPE_EOF, b"", pos)``.
    Raises RecordError with stock's text for a malformed length or truncated payload.
    ``maxsize`` 0 means no limit (what qmgr passes).
    """
    n = len(data)
    if pos >= n:
        return REC_TYPE_EOF, b"", pos
    rtype = data[pos]
    pos += 1
    if pos < n and data[pos] < 0x80 and not maxsize:  # the common case: one length byte
        length = data[pos]
        pos += 1
    else:
        length = 0
        shift = 0
        while True:
            if shift >= 32:
                raise RecordError(f"{path}: too many length bits, record type {rtype}")
            if pos >= n:
                raise RecordError(f"{path}: unexpected EOF reading length, record type {rtype}")
            byte = data[pos]
            pos += 1
            length |= _length_term(byte, shift)
            if not byte & 0x80:
                break
            shift += 7
        if length < 0 or (maxsize > 0 and length > maxsize):
            raise RecordError(f"{path}: illegal length {length}, record type {rtype}")
    end = pos + length
    if end > n:
        raise RecordError(
            f"{path}: unexpected EOF in data, record type {rtype} length {length}"
        )
    return rtype, data[pos:end], end


def rec_get_raw(f: BinaryIO, path: str, maxsize: int = 0) -> Record:
    """Read one record from a binary file object at its current position.

    The file position ends up just after the record, as with stock's VSTREAM reader.
    """
    offset = f.tell()
    head = f.read(1)
    if not head:
        return Record(REC_TYPE_EOF, b"", offset)
    rtype = head[0]
    length = 0
    shift = 0
    while True:
        if shift >= 32:
            raise RecordError(f"{path}: too many length bits, record type {rtype}")
        b = f.read(1)
        if not b:
            raise RecordError(f"{path}: unexpected EOF reading length, record type {rtype}")
        length |= _length_term(b[0], shift)
        if not b[0] & 0x80:
            break
        shift += 7
    if length < 0 or (maxsize > 0 and length > maxsize):
        raise RecordError(f"{path}: illegal length {length}, record type {rtype}")
    payload = f.read(length)
    if len(payload) != length:
        raise RecordError(
            f"{path}: unexpected EOF in data, record type {rtype} length {length}"
        )
    return Record(rtype, payload, offset)


def c_string(payload: bytes) -> bytes:
    """The payload as C code sees it: everything after an embedded NUL is invisible."""
    nul = payload.find(b"\0")
    return payload if nul < 0 else payload[:nul]


def off_cvt_string(text: bytes) -> int:
    """Stock's ``off_cvt_string``: all ASCII digits, no overflow of off_t; else -1."""
    if not text.isdigit():
        return 0 if not text else -1
    value = int(text)
    return value if value <= 0x7FFFFFFFFFFFFFFF else -1


class _GotoState:
    """The static variables of stock's ``rec_goto``.

    Stock keeps the reverse-jump count per *stream path*, in static storage: it resets
    only when a pointer record of a different path is followed, so later recipient
    batches of the same file keep counting. A "reverse" jump is one to an offset at or
    before the previous jump target (not the current position). Mirrored exactly.
    """

    __slots__ = ("path", "saved_offset", "reverse_count")

    def __init__(self) -> None:
        self.path: str | None = None
        self.saved_offset = 0
        self.reverse_count = 0


_goto = _GotoState()


def reset_goto_state() -> None:
    """Forget the pointer-loop bookkeeping (tests; stock never does this)."""
    _goto.path = None
    _goto.saved_offset = 0
    _goto.reverse_count = 0


def rec_goto(payload: bytes, path: str) -> int:
    """Decode a ``p`` record: the offset to continue at, or 0 for a dummy pointer.

    Raises RecordError with stock's text for a malformed value or a pointer loop.
    """
    state = _goto
    if state.path != path:
        state.path = path
        state.reverse_count = 0
        state.saved_offset = 0
    text = c_string(payload).lstrip(b" \t\n\r\v\f")
    offset = off_cvt_string(text)
    if offset < 0:
        raise RecordError(
            f"{path}: malformed pointer record value: "
            f"{text.decode('utf-8', 'surrogateescape')}"
        )
    if offset == 0:
        return 0
    if offset <= state.saved_offset:
        state.reverse_count += 1
        if state.reverse_count > REVERSE_JUMP_LIMIT:
            raise RecordError(f"{path}: too many reverse jump records")
    state.saved_offset = offset
    return offset


def encode_length(length: int) -> bytes:
    """Base-128 little-endian length, continuation bit 0x80 (``rec_put``)."""
    if length < 0:
        raise ValueError(f"negative record length {length}")
    out = bytearray()
    while True:
        byte = length & 0x7F
        length >>= 7
        if length:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_record(rtype: str | int, payload: bytes | str) -> bytes:
    """Frame one record; used for in-place rewrites and by tests to build queue files."""
    code = ord(rtype) if isinstance(rtype, str) else rtype
    if not 0 <= code <= 255:
        raise ValueError(f"bad record type {code}")
    if isinstance(payload, str):
        payload = payload.encode("utf-8", "surrogateescape")
    return bytes((code,)) + encode_length(len(payload)) + payload


def put_record(f: BinaryIO, rtype: str | int, payload: bytes | str) -> None:
    """Write one record at the file's current position."""
    f.write(encode_record(rtype, payload))
