"""The trivial-rewrite client: where does each recipient go (``resolve_clnt.c``)?

Like stock's client this is synchronous over one persistent connection: trivial-rewrite
answers in microseconds, and a blocking round trip costs far less than scheduling it
through the event loop. Requests are strictly lock-step (trivial-rewrite only looks at a
socket when it becomes readable, so a pipelined second request would sit unseen). The
connection is closed after ``ipc_idle`` unused or ``ipc_ttl`` old, so trivial-rewrite's
own restarts on table changes are picked up. Answers are cached for 30 s, the validity
stock gives its one-entry cache.

Unlike stock, which retries forever while the whole qmgr waits, a resolve that keeps
failing for ``give_up_after`` seconds raises :class:`ResolverFailure`, so the caller can
defer the message and keep delivering everything else.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from pyqmgr.postfix.attr import AttrError, AttrParser, check_announcement, encode, expect, to_int
from pyqmgr.postfix.shared_strings import shared

RESOLVE_FLAG_FINAL = 0x1
RESOLVE_FLAG_ROUTED = 0x2
RESOLVE_FLAG_ERROR = 0x4
RESOLVE_FLAG_FAIL = 0x8
RESOLVE_CLASS_LOCAL = 0x100
RESOLVE_CLASS_ALIAS = 0x200
RESOLVE_CLASS_VIRTUAL = 0x400
RESOLVE_CLASS_RELAY = 0x800
RESOLVE_CLASS_DEFAULT = 0x1000

PROTOCOL = "trivial_rewrite_protocol"
_REPLY_NAMES = ("flags", "transport", "nexthop", "recipient", "flags")
_CACHE_TTL = 30.0


_SPECIALS = set('()<>@,;:\\".[] \t')


def quote_822_local(address: str) -> str:
    """Quote the local part when it needs it (``quote_822_local``), simply."""
    local, at, domain = address.rpartition("@")
    if not at:
        local, domain = address, ""
    if local and (any(c in _SPECIALS for c in local) or local.startswith(".")
                  or local.endswith(".") or ".." in local):
        escaped = local.replace("\\", "\\\\").replace('"', '\\"')
        local = f'"{escaped}"'
    return f"{local}@{domain}" if at else local


def unquote_822_local(address: str) -> str:
    local, at, domain = address.rpartition("@")
    if not at:
        local, domain = address, ""
    if len(local) >= 2 and local[0] == '"' and local[-1] == '"':
        local = local[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    return f"{local}@{domain}" if at else local


#: Stock's mail_connect_wait sleeps this long between connection attempts.
CONNECT_RETRY_DELAY = 10.0


class ConnectFailure(OSError):
    """The service's socket refused the connection (not an exchange that broke)."""


class ResolverFailure(Exception):
    """trivial-rewrite could not be reached or answered nonsense for too long."""


@dataclass(frozen=True, slots=True)
class Resolved:
    transport: str
    nexthop: str
    recipient: str
    flags: int


class ResolveClient:
    def __init__(
        self,
        path: str = "private/rewrite",
        *,
        ipc_timeout: float = 60.0,
        ipc_idle: float = 5.0,
        ipc_ttl: float = 1000.0,
        give_up_after: float = 60.0,
        warn: Callable[[str], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.path = path
        #: Stock's ipc_timeout, ipc_idle and ipc_ttl: one exchange, one unused
        #: connection, one connection's whole life (seconds).
        self.ipc_timeout, self.ipc_idle, self.ipc_ttl = ipc_timeout, ipc_idle, ipc_ttl
        self.give_up_after = give_up_after
        self._warn = warn
        self._sleep = sleep
        self._sock: socket.socket | None = None
        self._parser = AttrParser()
        self._opened = 0.0
        self._used = 0.0
        self._last_key: tuple[str, str, str] | None = None
        self._last_result: Resolved | None = None
        self._last_expire = 0.0

    def resolve(self, sender: str, address: str, verify: bool = False) -> Resolved:
        request = "verify" if verify else "resolve"
        key = (request, sender, address)
        now = time.monotonic()
        # Stock's one-entry cache: the same lookup again within 30 s is not sent.
        if address and key == self._last_key and now < self._last_expire:
            assert self._last_result is not None
            return self._last_result
        payload = encode((("request", request), ("sender", sender), ("address", address)))
        deadline = now + self.give_up_after
        tries = 0
        connects = 0
        while True:
            tries += 1
            try:
                result = self._exchange(payload)
                break
            except ConnectFailure as exc:
                # Stock's mail_connect_wait: warn with a count, wait 10 s, try again.
                connects += 1
                if self._warn is not None:
                    self._warn(f"connect #{connects} to subsystem {self.path}: "
                               f"{exc.strerror or exc}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ResolverFailure(str(exc)) from exc
                self._sleep(min(CONNECT_RETRY_DELAY, left))
            except (AttrError, OSError, EOFError) as exc:
                self.close()
                if tries == 1:
                    # A kept connection may have been closed by trivial-rewrite since
                    # its last use (it restarts when tables change): reconnect at once.
                    continue
                if tries > 2 and self._warn is not None:
                    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                    self._warn(f"problem talking to service rewrite: {text}")
                if time.monotonic() >= deadline:
                    raise ResolverFailure(str(exc)) from exc
                self._sleep(1.0)
        self._last_key = key
        self._last_result = result
        self._last_expire = time.monotonic() + _CACHE_TTL
        return result

    def rewrite(self, rule: str, address: str) -> str:
        """Canonicalise an address (``rewrite_clnt_internal``), e.g. for REDIRECT.

        The request carries the external (quoted) form; the answer is unquoted again.
        Shares the connection with resolve requests, as stock's client does.
        """
        payload = encode((("request", "rewrite"), ("rule", rule),
                          ("address", quote_822_local(address))))
        deadline = time.monotonic() + self.give_up_after
        tries = 0
        while True:
            tries += 1
            try:
                sock = self._sock if self._sock is not None else self._connect()
                sock.sendall(payload)
                server_flags, result = expect(self._read_list(), ("flags", "address"),
                                              "rewrite reply")
                self._used = time.monotonic()
                if to_int(server_flags, "flags") != 0:
                    self.close()
                return unquote_822_local(result)
            except (AttrError, OSError, EOFError) as exc:
                self.close()
                if tries > 1 and time.monotonic() >= deadline:
                    raise ResolverFailure(str(exc)) from exc
                if tries > 1:
                    self._sleep(1.0)

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # The kernel's own send/receive timeouts rather than settimeout(): Python
        # implements the latter with a poll() before every send and recv, two extra
        # system calls per resolve. A timeout then fails the call with EAGAIN.
        sec = int(self.ipc_timeout)
        usec = int((self.ipc_timeout - sec) * 1e6)
        timeval = struct.pack("ll", sec, usec)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise ConnectFailure(exc.errno, exc.strerror) from exc
        self._sock = sock
        self._parser = AttrParser()
        self._opened = time.monotonic()
        check_announcement(self._read_list(), PROTOCOL)
        return sock

    def _read_list(self) -> list[tuple[str, str]]:
        assert self._sock is not None
        parser = self._parser
        while True:
            attrs = parser.pop()
            if attrs is not None:
                return attrs
            data = self._sock.recv(4096)
            if not data:
                raise EOFError("premature end-of-input")
            parser.feed(data)

    def _exchange(self, payload: bytes) -> Resolved:
        now = time.monotonic()
        sock = self._sock
        if sock is not None and (now - self._used > self.ipc_idle
                                 or now - self._opened > self.ipc_ttl):
            self.close()
            sock = None
        if sock is None:
            sock = self._connect()
        sock.sendall(payload)
        server_flags, transport, nexthop, recipient, flags = expect(
            self._read_list(), _REPLY_NAMES, "resolve reply"
        )
        if not transport:
            raise AttrError("resolve reply: empty transport")
        self._used = time.monotonic()
        if to_int(server_flags, "flags") != 0:
            self.close()
        # A batch of 5,000 routes to one domain holds one copy of these, not 5,000.
        return Resolved(shared(transport), shared(nexthop), recipient,
                        to_int(flags, "flags"))

    def expire_idle(self) -> None:
        """Close an idle connection; called from the daemon's periodic timer."""
        if self._sock is not None and time.monotonic() - self._used > self.ipc_idle:
            self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
