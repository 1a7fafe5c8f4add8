"""Postfix's attribute protocol, "attr0" encoding, with no I/O.

Every internal socket qmgr talks to (trivial-rewrite, delivery agents, bounce/defer/trace)
carries lists of ``name NUL value NUL`` pairs ended by an empty name. The receiving side
in Postfix matches attributes by *position*, not by name (the resolve reply carries
``flags`` twice, the delivery reply ``status`` twice), so a list here is an ordered
sequence of pairs, never a dict. Sending exactly the expected attributes in the expected
order matters: Postfix servers scan with ATTR_FLAG_STRICT and treat an extra attribute
as a malformed request.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Sequence

AttrValue = str | int | bytes
AttrList = list[tuple[str, str]]

#: Highest value of a C ``unsigned``; negative ints go out as their two's complement
#: because Postfix prints ints with ``%u`` (so -1 is ``4294967295``).
_UINT_MOD = 1 << 32


class AttrError(Exception):
    """The peer sent bytes that do not form the attribute list we expect."""


def encode(attrs: Iterable[tuple[str, AttrValue]]) -> bytes:
    """Encode one attribute list, terminator included.

    ``int`` values are printed unsigned as Postfix does; ``bytes`` values are DATA
    attributes and go out base64-encoded (the only one qmgr sends is the ``time``
    statistics blob).
    """
    out = bytearray()
    for name, value in attrs:
        if isinstance(value, bool):
            raise TypeError(f"attribute {name}: bool is not an attribute type")
        if isinstance(value, int):
            text = str(value % _UINT_MOD if value < 0 else value).encode()
        elif isinstance(value, bytes):
            text = base64.b64encode(value)
        else:
            text = value.encode("utf-8", "surrogateescape")
        if b"\0" in text:
            raise ValueError(f"attribute {name}: value contains NUL")
        out += name.encode()
        out += b"\0"
        out += text
        out += b"\0"
    out += b"\0"
    return bytes(out)


#: The most bytes one attribute list may take: what qmgr reads (a resolve reply, a
#: delivery status) is a few KiB; a peer that sends more without ending the list is
#: refused before it takes the daemon's memory (issue #31).
MAX_LIST = 1 << 20


class AttrParser:
    """Incremental parser: feed bytes as they arrive, collect complete lists.

    Stream sockets split and merge writes arbitrarily, so the parser keeps partial
    tokens between feeds. Values are decoded as UTF-8 with surrogateescape so that a
    non-UTF-8 address survives a round trip unchanged. A list longer than ``limit``
    bytes is an AttrError.
    """

    __slots__ = ("_buf", "_current", "_held", "_name", "limit", "lists")

    def __init__(self, limit: int = MAX_LIST) -> None:
        self._buf = bytearray()
        self._current: AttrList = []
        self._name: str | None = None
        #: Bytes of the unfinished list already decoded into ``_current``.
        self._held = 0
        self.limit = limit
        self.lists: list[AttrList] = []

    def feed(self, data: bytes) -> None:
        """Consume ``data``; every list completed by it is appended to ``self.lists``.

        Everything up to the last NUL is decoded and split in one go: NUL never occurs
        inside a UTF-8 sequence, so this decodes exactly as token by token would.
        """
        buf = self._buf
        buf += data
        end = buf.rfind(b"\0")
        if end < 0:
            if self._held + len(buf) > self.limit:
                raise AttrError(f"attribute list longer than {self.limit} bytes")
            return
        tokens = buf[:end].decode("utf-8", "surrogateescape").split("\0")
        del buf[:end + 1]
        name = self._name
        current = self._current
        held = self._held
        try:
            for token in tokens:
                held += len(token) + 1
                if held > self.limit:
                    raise AttrError(f"attribute list longer than {self.limit} bytes")
                if name is None:
                    if not token:
                        self.lists.append(current)
                        current = []
                        held = 0
                    elif token == "{" or token == "}":
                        # Hash tables never occur in qmgr's protocols; refuse them
                        # loudly instead of mis-pairing every following name and value.
                        raise AttrError(f"unexpected attribute table marker {token!r}")
                    else:
                        name = token
                else:
                    current.append((name, token))
                    name = None
        finally:
            self._name = name
            self._current = current
            self._held = held

    def pop(self) -> AttrList | None:
        """Return the oldest complete list, or None when none is complete yet."""
        if self.lists:
            return self.lists.pop(0)
        return None

    @property
    def pending(self) -> bool:
        """True when bytes of an unfinished list are buffered."""
        return bool(self._buf) or bool(self._current) or self._name is not None


def expect(attrs: AttrList, names: Sequence[str], what: str) -> list[str]:
    """Check a received list against the exact names Postfix's strict scan wants.

    Returns the values in order. Raises AttrError with a message in the style of
    Postfix's ``unexpected attribute X (expecting: Y)`` warnings.
    """
    if len(attrs) < len(names):
        missing = names[len(attrs)]
        raise AttrError(f"{what}: missing attribute {missing}")
    values = []
    for i, want in enumerate(names):
        got = attrs[i][0]
        if got != want:
            raise AttrError(f"{what}: unexpected attribute {got} (expecting: {want})")
        values.append(attrs[i][1])
    if len(attrs) > len(names):
        raise AttrError(f"{what}: unexpected attribute {attrs[len(names)][0]}")
    return values


def to_int(value: str, what: str) -> int:
    """Parse an int attribute the way Postfix's ``%u`` scan does, as a signed C int.

    ASCII digits only (``str.isdigit`` takes "²", which ``int`` refuses with a
    ValueError no caller expects), and the length checked before ``int`` (which
    refuses 4,300 digits, also with a ValueError): a peer's bad number is an
    AttrError like any other malformed reply (issue #31)."""
    if not (value.isascii() and value.isdigit()):
        raise AttrError(f"{what}: bad integer value {value[:40]!r}")
    if len(value.lstrip("0")) > 10:
        raise AttrError(f"{what}: integer value out of range {value[:40]!r}")
    number = int(value.lstrip("0") or "0")
    if number >= _UINT_MOD:
        raise AttrError(f"{what}: integer value out of range {value!r}")
    return number - _UINT_MOD if number >= 1 << 31 else number


def check_announcement(attrs: AttrList, protocol: str) -> None:
    """Verify a server's ``protocol`` announcement, sent before any request."""
    if len(attrs) != 1 or attrs[0][0] != "protocol":
        raise AttrError(f"bad protocol announcement {attrs!r}")
    if attrs[0][1] != protocol:
        raise AttrError(f"unexpected protocol {attrs[0][1]!r} (expecting {protocol!r})")
