"""The trivial-rewrite client: where does each recipient go (``resolve_clnt.c``)?

Requests are strictly lock-step per connection (trivial-rewrite only looks at a socket
when it becomes readable, so a pipelined second request would sit unseen), so this
client keeps a small pool of persistent connections and runs one request per connection
at a time. Connections idle for ``ipc_idle`` or older than ``ipc_ttl`` are closed, as
stock's clnt_stream does, so that trivial-rewrite's own restarts on table changes are
picked up. Answers are cached for 30 s, the validity stock gives its one-entry cache.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pyqmgr.postfix.attr import AttrError, encode, expect, to_int
from pyqmgr.postfix.mail_connect import AttrConnection, PrematureDisconnect, ServiceUnavailable

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
_CACHE_MAX = 4096


class ResolverFailure(Exception):
    """trivial-rewrite could not be reached or answered nonsense for too long."""


@dataclass(frozen=True, slots=True)
class Resolved:
    transport: str
    nexthop: str
    recipient: str
    flags: int


class _Conn:
    __slots__ = ("conn", "opened", "used")

    def __init__(self, conn: AttrConnection, now: float) -> None:
        self.conn = conn
        self.opened = now
        self.used = now


class ResolveClient:
    """A pool of persistent connections to ``private/rewrite``."""

    def __init__(
        self,
        path: str = "private/rewrite",
        *,
        ipc_timeout: float = 60.0,
        ipc_idle: float = 5.0,
        ipc_ttl: float = 1000.0,
        pool_size: int = 4,
        give_up_after: float = 60.0,
        warn: object = None,
    ) -> None:
        self.path = path
        self.ipc_timeout = ipc_timeout
        self.ipc_idle = ipc_idle
        self.ipc_ttl = ipc_ttl
        self.give_up_after = give_up_after
        self._idle: list[_Conn] = []
        self._slots = asyncio.Semaphore(pool_size)
        self._cache: dict[tuple[str, str, str], tuple[float, Resolved]] = {}
        self._warn = warn

    async def resolve(self, sender: str, address: str, verify: bool = False) -> Resolved:
        """Resolve one recipient; retry through server restarts, as stock does.

        Stock retries forever while blocking the whole qmgr; here a resolve that keeps
        failing for ``give_up_after`` seconds raises ResolverFailure so that the caller
        can defer the message instead of stalling every other delivery.
        """
        request = "verify" if verify else "resolve"
        key = (request, sender, address)
        now = time.monotonic()
        if address:
            hit = self._cache.get(key)
            if hit is not None and now - hit[0] < _CACHE_TTL:
                return hit[1]
        payload = encode((("request", request), ("sender", sender), ("address", address)))
        deadline = now + self.give_up_after
        tries = 0
        async with self._slots:
            while True:
                tries += 1
                try:
                    result = await self._exchange(payload)
                    break
                except (ServiceUnavailable, PrematureDisconnect, AttrError, TimeoutError,
                        OSError) as exc:
                    if tries > 1 and callable(self._warn):
                        self._warn(f"problem talking to service rewrite: {exc}")
                    if time.monotonic() >= deadline:
                        raise ResolverFailure(str(exc)) from exc
                    await asyncio.sleep(1.0)
        if address:
            if len(self._cache) >= _CACHE_MAX:
                self._cache.clear()
            self._cache[key] = (time.monotonic(), result)
        return result

    async def _exchange(self, payload: bytes) -> Resolved:
        slot = await self._checkout()
        try:
            slot.conn.write(payload)
            attrs = await slot.conn.read_list(self.ipc_timeout)
            server_flags, transport, nexthop, recipient, flags = expect(
                attrs, _REPLY_NAMES, "resolve reply"
            )
            if not transport:
                raise AttrError("resolve reply: empty transport")
        except BaseException:
            slot.conn.close()
            raise
        slot.used = time.monotonic()
        if to_int(server_flags, "flags") != 0:
            slot.conn.close()
        else:
            self._idle.append(slot)
        return Resolved(transport, nexthop, recipient, to_int(flags, "flags"))

    async def _checkout(self) -> _Conn:
        now = time.monotonic()
        while self._idle:
            slot = self._idle.pop()
            if (slot.conn.peer_closed or now - slot.used > self.ipc_idle
                    or now - slot.opened > self.ipc_ttl):
                slot.conn.close()
                continue
            return slot
        conn = await AttrConnection.open(self.path, PROTOCOL, self.ipc_timeout)
        return _Conn(conn, now)

    def expire_idle(self) -> None:
        """Close connections unused for ipc_idle; call this from a periodic timer."""
        now = time.monotonic()
        keep = []
        for slot in self._idle:
            if slot.conn.peer_closed or now - slot.used > self.ipc_idle:
                slot.conn.close()
            else:
                keep.append(slot)
        self._idle = keep

    def close(self) -> None:
        for slot in self._idle:
            slot.conn.close()
        self._idle = []
