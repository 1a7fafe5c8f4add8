"""Queue-file record framing (``record.c``): type byte, base-128 length, payload.

Parsing works on an in-memory copy of the file: qmgr reads thousands of files a second,
and one ``read()`` plus slicing is much cheaper than many small reads.
"""

from __future__ import annotations


class RecordError(Exception):
    """A record could not be read; the text is stock's warning."""


def read_record(data: bytes, pos: int, path: str) -> tuple[int, bytes, int]:
    """Return (type, payload, next position) of the record at ``pos``."""
    n = len(data)
    if pos >= n:
        raise EOFError
    rtype = data[pos]
    pos += 1
    length = 0
    shift = 0
    while True:
        if pos >= n:
            raise RecordError(f"{path}: unexpected EOF reading length, record type {rtype}")
        byte = data[pos]
        pos += 1
        length |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
        if shift >= 32:
            raise RecordError(f"{path}: too many length bits, record type {rtype}")
    if length > 0x7FFFFFFF:
        raise RecordError(f"{path}: illegal length {length}, record type {rtype}")
    end = pos + length
    if end > n:
        raise RecordError(
            f"{path}: unexpected EOF in data, record type {rtype} length {length}"
        )
    return rtype, data[pos:end], end


def encode_record(rtype: str | int, payload: bytes) -> bytes:
    """Frame one record; used for in-place rewrites and by tests to build queue files."""
    code = ord(rtype) if isinstance(rtype, str) else rtype
    out = bytearray([code])
    length = len(payload)
    while True:
        byte = length & 0x7F
        length >>= 7
        if length:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            break
    out += payload
    return bytes(out)
