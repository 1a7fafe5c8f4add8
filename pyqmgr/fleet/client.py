"""An asyncio Redis client for the fleet's shared state: one connection, pipelined,
every call bounded by a deadline.

Why its own and not a library's: the daemon must never stall its event loop on Redis
(issue #23: "all Redis calls asynchronous with deadlines"), must tell a slow or gone
server from an answer in the same way every time, and needs four commands (AUTH,
SELECT, EVALSHA, EVAL). A codec (:mod:`.resp`) and this small transport do that with
nothing to install.

How it behaves:

* **Pipelined.** Commands from any number of callers go out on one connection as
  they come; the replies come back in order and each resolves its caller's future,
  so concurrent deliveries share round trips.
* **Deadlines.** Each call waits at most ``timeout`` seconds. A call that times out
  closes the connection: replies after it would still arrive in order, but a server
  that is that slow is treated as gone, and every caller gets
  :class:`RedisUnavailable` at once instead of queueing behind it.
* **Gone means fail fast.** After a failure the client does not reconnect for
  ``retry_delay`` seconds; calls in that time raise :class:`RedisUnavailable` without
  touching the network. The fleet layer then applies ``shared_state_failure``.
* **Bounded input.** A reply that is not RESP, or over the codec's bounds, is a
  :class:`RedisUnavailable` with the reason, and the connection is closed.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pyqmgr.fleet.resp import Arg, Parser, ProtocolError, RedisError, Reply, encode

#: Bytes read at a time.
READ_SIZE = 65536


class RedisUnavailable(Exception):
    """Redis did not answer in time, could not be reached, or broke the protocol."""


@dataclass(frozen=True)
class Endpoint:
    """Where the shared state lives: TCP (host, port) or a unix socket path."""

    host: str = ""
    port: int = 0
    path: str = ""
    db: int = 0
    password: str | None = None

    def __str__(self) -> str:
        where = f"unix:{self.path}" if self.path else f"redis://{self.host}:{self.port}"
        return f"{where}/{self.db}" if self.db else where


class RedisClient:
    def __init__(self, endpoint: Endpoint, timeout: float = 1.0,
                 retry_delay: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.retry_delay = retry_delay
        self.clock = clock
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: deque[asyncio.Future[Reply]] = deque()
        self._read_task: asyncio.Task[None] | None = None
        self._connecting: asyncio.Future[None] | None = None
        #: Monotonic time before which no new connection is tried, and why.
        self._down_until = 0.0
        self.last_error = ""
        #: Which connection is current: a reader of an older one must not close it.
        self._generation = 0

    @property
    def connected(self) -> bool:
        return self._writer is not None

    async def call(self, *args: Arg) -> Reply:
        """One command's reply (an error reply is returned as a RedisError value)."""
        (reply,) = await self.pipeline([args])
        return reply

    async def pipeline(self, commands: Sequence[Sequence[Arg]]) -> list[Reply]:
        """Several commands written at once; their replies, in order."""
        await self._ensure_connected()
        assert self._writer is not None
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in commands]
        self._pending.extend(futures)
        self._writer.write(b"".join(encode(*c) for c in commands))
        try:
            async with asyncio.timeout(self.timeout):
                return list(await asyncio.gather(*futures))
        except TimeoutError:
            self._fail(f"no reply within {self.timeout:g} s")
            raise RedisUnavailable(self.last_error) from None

    async def close(self) -> None:
        self._fail("closed", down=False)
        if self._read_task is not None:
            self._read_task.cancel()
            try:
                await self._read_task
            except (asyncio.CancelledError, Exception):
                pass
            self._read_task = None

    # -- the connection -------------------------------------------------------------

    async def _ensure_connected(self) -> None:
        if self._writer is not None:
            return
        if self.clock() < self._down_until:
            raise RedisUnavailable(self.last_error or "not connected")
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        connecting = self._connecting
        try:
            await asyncio.shield(connecting)
        finally:
            if connecting.done():
                self._connecting = None

    async def _connect(self) -> None:
        ep = self.endpoint
        try:
            async with asyncio.timeout(self.timeout):
                if ep.path:
                    reader, writer = await asyncio.open_unix_connection(ep.path)
                else:
                    reader, writer = await asyncio.open_connection(ep.host, ep.port)
        except (OSError, TimeoutError) as exc:
            reason = str(exc) or f"no connection within {self.timeout:g} s"
            self._fail(f"cannot connect to {ep}: {reason}")
            raise RedisUnavailable(self.last_error) from None
        self._reader, self._writer = reader, writer
        self._generation += 1
        self._read_task = asyncio.ensure_future(self._read_replies(reader, self._generation))
        setup: list[tuple[str, Arg]] = []
        if ep.password is not None:
            setup.append(("AUTH", ep.password))
        if ep.db:
            setup.append(("SELECT", ep.db))
        if not setup:
            return
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in setup]
        self._pending.extend(futures)
        writer.write(b"".join(encode(*c) for c in setup))
        try:
            async with asyncio.timeout(self.timeout):
                replies = list(await asyncio.gather(*futures))
        except TimeoutError:
            self._fail(f"{ep}: no reply to AUTH/SELECT within {self.timeout:g} s")
            raise RedisUnavailable(self.last_error) from None
        for command, reply in zip(setup, replies, strict=True):
            if isinstance(reply, RedisError):
                # Never the password in a message.
                self._fail(f"{ep}: {command[0]} refused: {reply.message}")
                raise RedisUnavailable(self.last_error)

    async def _read_replies(self, reader: asyncio.StreamReader, generation: int) -> None:
        parser = Parser()

        def fail(reason: str) -> None:
            if generation == self._generation and self._writer is not None:
                self._fail(reason)

        try:
            while True:
                data = await reader.read(READ_SIZE)
                if generation != self._generation or self._writer is None:
                    return
                if not data:
                    fail(f"{self.endpoint} closed the connection")
                    return
                parser.feed(data)
                for reply in parser.replies():
                    if not self._pending:
                        fail(f"{self.endpoint} sent a reply nobody asked for")
                        return
                    future = self._pending.popleft()
                    if not future.done():
                        future.set_result(reply)
        except ProtocolError as exc:
            fail(f"{self.endpoint} broke the protocol: {exc}")
        except OSError as exc:
            fail(f"{self.endpoint}: {exc}")

    def _fail(self, reason: str, down: bool = True) -> None:
        """Close the connection; every caller waiting on it gets RedisUnavailable."""
        self.last_error = reason
        if down:
            self._down_until = self.clock() + self.retry_delay
        writer, self._writer, self._reader = self._writer, None, None
        if writer is not None:
            writer.close()
        pending, self._pending = self._pending, deque()
        for future in pending:
            if not future.done():
                future.set_exception(RedisUnavailable(reason))


@dataclass
class Subscriber:
    """One channel's messages, on a connection of their own (Redis's pub/sub mode
    allows nothing else on it), for as long as it runs.

    The fleet uses it to hear, without asking, that a session it waits for was given
    back. A lost connection is tried again every ``retry_delay`` seconds; messages
    published meanwhile are lost, so ``on_subscribed`` is called at every
    (re)subscription for the caller to read the state afresh.
    """

    endpoint: Endpoint
    channel: str
    on_message: Callable[[bytes], None]
    timeout: float = 1.0
    retry_delay: float = 1.0
    on_subscribed: Callable[[], None] | None = None
    #: Set once the server confirmed the subscription (tests wait for it).
    subscribed: asyncio.Event = field(default_factory=asyncio.Event)
    last_error: str = ""

    async def run(self) -> None:
        while True:
            try:
                await self._session()
            except (OSError, TimeoutError, ProtocolError, RedisUnavailable) as exc:
                self.last_error = str(exc) or type(exc).__name__
            self.subscribed.clear()
            await asyncio.sleep(self.retry_delay)

    async def _session(self) -> None:
        ep = self.endpoint
        async with asyncio.timeout(self.timeout):
            if ep.path:
                reader, writer = await asyncio.open_unix_connection(ep.path)
            else:
                reader, writer = await asyncio.open_connection(ep.host, ep.port)
        try:
            commands: list[tuple[str, ...]] = []
            if ep.password is not None:
                commands.append(("AUTH", ep.password))
            commands.append(("SUBSCRIBE", self.channel))
            writer.write(b"".join(encode(*c) for c in commands))
            parser = Parser()
            while True:
                data = await reader.read(READ_SIZE)
                if not data:
                    raise RedisUnavailable(f"{ep} closed the subscription")
                parser.feed(data)
                for reply in parser.replies():
                    self._reply(reply)
        finally:
            writer.close()

    def _reply(self, reply: Reply) -> None:
        if isinstance(reply, RedisError):
            raise RedisUnavailable(f"{self.endpoint}: {reply.message}")
        if not isinstance(reply, list) or len(reply) != 3:
            return  # AUTH's +OK
        kind, _channel, payload = reply
        if kind == b"subscribe":
            self.subscribed.set()
            if self.on_subscribed is not None:
                self.on_subscribed()
        elif kind == b"message" and isinstance(payload, bytes):
            self.on_message(payload)
