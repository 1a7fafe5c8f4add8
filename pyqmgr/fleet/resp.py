"""Redis's wire protocol (RESP2), with no I/O: commands out, replies in.

The fleet's shared state lives in a real Redis server; this is how pyqmgr speaks to
it. Like :mod:`pyqmgr.postfix.attr`, it is a codec and a parser with no sockets, so
its every case is tested without a server and the client (:mod:`.client`) only moves
bytes. Written for this project from the protocol's published description: a command
is an array of bulk strings; a reply is a simple string (``+OK``), an error
(``-ERR ...``), an integer (``:5``), a bulk string (``$3 abc``, ``$-1`` for none) or
an array of replies (``*2 ...``, ``*-1`` for none).

A reply is bounded before it is believed: a bulk string over :data:`MAX_BULK`, an
array over :data:`MAX_ARRAY` elements, a line over :data:`MAX_LINE` or arrays nested
deeper than :data:`MAX_DEPTH` are a :class:`ProtocolError`, as is any byte that is not
RESP. The fleet's scripts return small replies (a few integers), so these limits are
generous; a server that sends more is broken or not Redis, and the connection is
closed rather than buffered without end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

#: The largest bulk string accepted (the fleet's replies are a few bytes).
MAX_BULK = 1 << 20
#: The most elements in one array reply.
MAX_ARRAY = 1 << 16
#: The longest line (a simple string, an error, a length) before its CRLF.
MAX_LINE = 1 << 16
#: The deepest nesting of arrays.
MAX_DEPTH = 8

Arg = bytes | str | int | float
Reply: TypeAlias = "bytes | str | int | None | RedisError | list[Reply]"


class ProtocolError(Exception):
    """The peer's bytes are not a RESP reply, or one over this module's bounds."""


@dataclass(frozen=True)
class RedisError:
    """An error reply (``-ERR ...``, ``-NOSCRIPT ...``): a value, not an exception,
    so a pipeline's other replies are not lost with it."""

    message: str

    @property
    def kind(self) -> str:
        """The first word, by Redis's convention the error's class: ERR, NOSCRIPT."""
        return self.message.split(" ", 1)[0]


def _arg(value: Arg) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bool):
        raise TypeError("a bool is not a Redis argument")
    if isinstance(value, float):
        return repr(value).encode()
    return str(value).encode()


def encode(*args: Arg) -> bytes:
    """One command as RESP: an array of bulk strings."""
    if not args:
        raise ValueError("a Redis command needs at least its name")
    out = [b"*%d\r\n" % len(args)]
    for value in args:
        data = _arg(value)
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class Parser:
    """Bytes in (:meth:`feed`), whole replies out (:meth:`replies`).

    Incremental: a reply split over many reads comes out once its last byte is in.
    After a :class:`ProtocolError` the parser is useless (the stream has lost its
    framing); the client closes the connection.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0

    def feed(self, data: bytes) -> None:
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes received and not yet part of a reply taken out."""
        return len(self._buf) - self._pos

    def replies(self) -> list[Reply]:
        """Every complete reply buffered so far, in order."""
        out: list[Reply] = []
        while True:
            start = self._pos
            try:
                reply = self._reply(0)
            except _Incomplete:
                self._pos = start
                break
            out.append(reply)
        if self._pos:
            del self._buf[:self._pos]
            self._pos = 0
        return out

    def _line(self) -> bytes:
        end = self._buf.find(b"\r\n", self._pos, self._pos + MAX_LINE + 2)
        if end < 0:
            if len(self._buf) - self._pos > MAX_LINE + 1:
                raise ProtocolError(f"a line longer than {MAX_LINE} bytes")
            raise _Incomplete
        line = bytes(self._buf[self._pos:end])
        self._pos = end + 2
        return line

    def _length(self, text: bytes, what: str, most: int) -> int:
        if not text or not (text.isdigit() or (text[:1] == b"-" and text[1:].isdigit())):
            raise ProtocolError(f"bad {what} length {text[:40]!r}")
        n = int(text)
        if n < -1:
            raise ProtocolError(f"bad {what} length {n}")
        if n > most:
            raise ProtocolError(f"a {what} of {n} is over the limit of {most}")
        return n

    def _reply(self, depth: int) -> Reply:
        if self._pos >= len(self._buf):
            raise _Incomplete
        kind = self._buf[self._pos]
        self._pos += 1
        line = self._line()
        if kind == 0x2B:  # +
            return line.decode("utf-8", "replace")
        if kind == 0x2D:  # -
            return RedisError(line.decode("utf-8", "replace"))
        if kind == 0x3A:  # :
            if not line or not (line.isdigit() or (line[:1] == b"-" and line[1:].isdigit())):
                raise ProtocolError(f"bad integer {line[:40]!r}")
            return int(line)
        if kind == 0x24:  # $
            n = self._length(line, "bulk string", MAX_BULK)
            if n == -1:
                return None
            if len(self._buf) - self._pos < n + 2:
                raise _Incomplete
            data = bytes(self._buf[self._pos:self._pos + n])
            if self._buf[self._pos + n:self._pos + n + 2] != b"\r\n":
                raise ProtocolError("a bulk string not ended by CRLF")
            self._pos += n + 2
            return data
        if kind == 0x2A:  # *
            n = self._length(line, "array", MAX_ARRAY)
            if n == -1:
                return None
            if depth >= MAX_DEPTH:
                raise ProtocolError(f"arrays nested deeper than {MAX_DEPTH}")
            return [self._reply(depth + 1) for _ in range(n)]
        raise ProtocolError(f"unknown reply type byte {bytes([kind])!r}")


class _Incomplete(Exception):
    """More bytes are needed for the reply under way."""
