"""The fleet's Redis client: redis-py's asyncio client behind the few calls the fleet
makes, every call bounded by a deadline (issue #35).

Why redis-py and not a client of our own (issue #23 had one): operators run Redis as
Sentinel sets and Clusters, over TLS, with ACL users, and as Valkey; a maintained
client follows all of that (failover discovery, MOVED/ASK redirections, the cluster's
slot map) where a hand-written one would trail it. hiredis parses the replies in C
where it is installed (the ``fleet`` extra).

What this module adds around it, the fleet's own terms:

* **Deadlines.** Each call waits at most ``timeout`` seconds, connection included. A
  call that times out or finds the server gone raises :class:`RedisUnavailable`, and
  for ``retry_delay`` seconds after that every call raises it at once without
  touching the network: the fleet layer then applies ``shared_state_failure``
  instead of queueing deliveries behind a dead server.
* **Replies as values.** A command's reply comes back raw (bytes, int, None, lists;
  redis-py's per-command conversions are switched off for the commands the fleet
  sends), and an error reply as a :class:`RedisError` value, so a pipeline's other
  replies are not lost with it.
* **Bounded input.** A reply over :data:`MAX_REPLY` bytes (the fleet's are a few
  dozen) closes the connection and is a :class:`RedisUnavailable`: a broken or
  hostile server cannot make the qmgr buffer without end (:class:`_BoundedParser`).
* **Secrets read once, as root.** The password, the TLS client key and the CA are
  read at start-up (:mod:`.settings`), before the queue manager drops its
  privileges; the TLS context is built then and every connection reuses it.

Where the shared state lives (:class:`Endpoint`): one server by TCP (``redis://``,
``rediss://`` with TLS) or unix socket, a Sentinel set's primary
(``redis+sentinel://``), or a Redis Cluster (``redis+cluster://``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    import ssl

    import redis.asyncio

#: A command's arguments.
Arg = bytes | str | int | float
Reply: TypeAlias = "bytes | str | int | None | RedisError | list[Reply]"

#: The largest reply read (bytes buffered for one reply): the fleet's scripts answer
#: with a few integers; a roster record (``pyqmgr status --fleet``) is at most 64 KiB.
MAX_REPLY = 1 << 20
#: Connections one process keeps to a server: calls from many deliveries share them.
MAX_CONNECTIONS = 4

#: Where the shared state lives.
STANDALONE, UNIX, SENTINEL, CLUSTER = "redis", "unix", "sentinel", "cluster"

#: On a Cluster (whose client reads its slot map through its own conversions), the
#: commands whose replies redis-py would otherwise convert (a dict for HGETALL, a bool
#: for SET...): the fleet reads them raw.
RAW_COMMANDS = ("EVAL", "EVALSHA", "GET", "SET", "DEL", "HGETALL", "HGET", "HSET", "PING",
                "PUBLISH", "ZADD", "ZRANGEBYSCORE", "ZREMRANGEBYSCORE", "ZCARD", "TIME",
                "EXPIRE", "PEXPIRE", "SCRIPT LOAD", "SCRIPT EXISTS", "MGET", "INFO",
                "FLUSHALL", "FLUSHDB", "SCRIPT FLUSH", "KEYS", "ZSCORE", "LRANGE")


class RedisUnavailable(Exception):
    """Redis did not answer in time, could not be reached, or broke the protocol."""


@dataclass(frozen=True)
class RedisError:
    """An error reply (``-ERR ...``, ``-NOSCRIPT ...``): a value, not an exception,
    so a pipeline's other replies are not lost with it."""

    message: str

    @property
    def kind(self) -> str:
        """The first word, by Redis's convention the error's class: ERR, NOSCRIPT."""
        return self.message.split(" ", 1)[0]


@dataclass(frozen=True)
class Endpoint:
    """Where the shared state lives, and how to speak to it. Built from pyqmgr.cf by
    :func:`pyqmgr.fleet.settings.parse_shared_state`; its text (``str``) never holds a
    secret, since it is in every warning."""

    host: str = ""
    port: int = 0
    path: str = ""
    db: int = 0
    password: str | None = field(default=None, repr=False)
    #: :data:`STANDALONE` (one server by TCP), :data:`UNIX`, :data:`SENTINEL`, :data:`CLUSTER`.
    kind: str = STANDALONE
    #: A Sentinel set's sentinels, or a Cluster's seed nodes.
    nodes: tuple[tuple[str, int], ...] = ()
    #: A Sentinel set's service (its primary's name in ``sentinel monitor``).
    service: str = ""
    tls: bool = False
    #: An ACL user (None: Redis's ``default`` user).
    user: str | None = None
    #: The sentinels' own password (``requirepass`` in sentinel.conf), if they have one.
    sentinel_password: str | None = field(default=None, repr=False)
    #: The TLS context (CA, client certificate and key loaded at start-up).
    ssl_context: ssl.SSLContext | None = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        if self.kind == UNIX:
            where = f"unix:{self.path}"
        elif self.kind == SENTINEL:
            where = f"{scheme}+sentinel://{_hosts(self.nodes)}/{self.service}"
        elif self.kind == CLUSTER:
            return f"{scheme}+cluster://{_hosts(self.nodes)}"
        else:
            where = f"{scheme}://{_host(self.host)}:{self.port}"
        return f"{where}/{self.db}" if self.db else where


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _hosts(nodes: Sequence[tuple[str, int]]) -> str:
    return ",".join(f"{_host(h)}:{p}" for h, p in nodes)


def _bounded_parser() -> type:
    """redis-py's parser (hiredis's where installed), refusing a reply that buffers
    more than :data:`MAX_REPLY` bytes: redis-py itself reads whatever length a reply
    claims."""
    from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser
    from redis.exceptions import InvalidResponse
    from redis.utils import HIREDIS_AVAILABLE

    if HIREDIS_AVAILABLE:
        class Hiredis(_AsyncHiredisParser):  # type: ignore[misc]
            _fed = 0

            async def read_from_socket(self) -> bool:
                assert self._stream is not None and self._reader is not None
                buffer = await self._stream.read(self._read_size)
                if not buffer or not isinstance(buffer, bytes):
                    raise ConnectionError("the server closed the connection")
                self._fed += len(buffer)
                if self._fed > MAX_REPLY:
                    raise InvalidResponse(f"a reply of more than {MAX_REPLY} bytes")
                self._reader.feed(buffer)
                return True

            async def read_response(self, disable_decoding: bool = False,
                                    push_request: bool = False) -> Any:
                response = await super().read_response(disable_decoding, push_request)
                self._fed = 0
                return response

        return Hiredis

    class Resp2(_AsyncRESP2Parser):  # type: ignore[misc]
        async def _read(self, length: int) -> bytes:
            if length > MAX_REPLY:
                raise InvalidResponse(f"a reply of {length} bytes, more than {MAX_REPLY}")
            return await super()._read(length)  # type: ignore[no-any-return]

    return Resp2


def _tls_class(base: type, context: ssl.SSLContext) -> type:
    """``base`` (a redis-py connection class) speaking TLS with the context built at
    start-up, not one of its own that would read the key files again after the
    queue manager dropped its privileges."""

    parent: Any = base

    def _connection_arguments(self: Any) -> Any:
        return {**parent._connection_arguments(self), "ssl": context}

    return type(f"Tls{base.__name__}", (base,), {"_connection_arguments": _connection_arguments})


class RedisClient:
    """The fleet's calls to its Redis, wherever it lives (:class:`Endpoint`).

    Calls go out in batches: those made while the previous batch is on its way (or in
    the same turn of the event loop) are written together as one pipeline and read
    back in order, so the deliveries that start and end together share a round trip.
    On one server (TCP, unix socket, a Sentinel set's primary) a batch goes over one
    connection held for the purpose, with redis-py's connection doing the protocol;
    on a Cluster through redis-py's cluster pipeline, each command to its slot's node.
    Measured against the hand-written client of issue #23 (benchmarks/README.md).
    """

    def __init__(self, endpoint: Endpoint, timeout: float = 1.0,
                 retry_delay: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.endpoint = endpoint
        #: A client that only subscribes holds one connection per channel.
        self.max_connections = max_connections
        self.timeout = timeout
        self.retry_delay = retry_delay
        self.clock = clock
        self._redis: Any = None
        #: The connection batches go over (not on a Cluster).
        self._connection: Any = None
        #: Monotonic time before which no call is tried, and why.
        self._down_until = 0.0
        self.last_error = ""
        #: Whether the last call had an answer (status shows it).
        self._answered = False
        #: Calls waiting for the next batch; the task sending batches, while it runs.
        self._batch: list[tuple[Sequence[Arg], asyncio.Future[Reply]]] = []
        self._sender: asyncio.Task[None] | None = None

    @property
    def connected(self) -> bool:
        return self._answered and self.clock() >= self._down_until

    async def call(self, *args: Arg) -> Reply:
        """One command's reply (an error reply is returned as a RedisError value)."""
        (reply,) = await self.pipeline([args])
        return reply

    async def pipeline(self, commands: Sequence[Sequence[Arg]]) -> list[Reply]:
        """Several commands sent at once (on a Cluster, each to its key's node); their
        replies, in order."""
        if self.clock() < self._down_until:
            raise RedisUnavailable(self.last_error or "not connected")
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Reply]] = []
        for command in commands:
            future: asyncio.Future[Reply] = loop.create_future()
            self._batch.append((command, future))
            futures.append(future)
        if self._sender is None:
            self._sender = asyncio.ensure_future(self._send())
        return list(await asyncio.gather(*futures))

    async def _send(self) -> None:
        """Send what is waiting, batch after batch, until nothing is."""
        try:
            # One turn first: the other deliveries of this turn join the batch.
            await asyncio.sleep(0)
            while self._batch:
                batch, self._batch = self._batch, []
                try:
                    if self.clock() < self._down_until:
                        raise RedisUnavailable(self.last_error or "not connected")
                    replies = await self._guarded(self._exchange([a for a, _ in batch]))
                except Exception as exc:  # noqa: BLE001 - no caller may wait for ever
                    why = str(exc) if isinstance(exc, RedisUnavailable) else \
                        f"{self.endpoint}: internal error: {type(exc).__name__}: {exc}"
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(RedisUnavailable(why))
                    continue
                for (_, future), reply in zip(batch, replies, strict=True):
                    if not future.done():
                        future.set_result(reply)
        finally:
            self._sender = None

    async def close(self) -> None:
        redis, self._redis, self._connection = self._redis, None, None
        self._answered = False
        if redis is not None:
            try:
                await redis.aclose()
            except Exception:  # noqa: BLE001 - a dead connection has nothing to give back
                pass

    async def pubsub(self) -> Any:
        """A redis-py PubSub on this endpoint (on a Cluster, any node hears every
        channel's messages; the cluster's slot map is read first, which redis-py's
        cluster pub/sub needs to pick its node)."""
        redis = self.redis()
        if self.endpoint.kind == CLUSTER:
            await redis.initialize()
        return redis.pubsub(ignore_subscribe_messages=False)

    # -- the connection ---------------------------------------------------------------

    def redis(self) -> Any:
        """The redis-py client, made on first use (inside the event loop)."""
        if self._redis is None:
            self._redis = make_redis(self.endpoint, self.timeout, self.max_connections)
        return self._redis

    async def _exchange(self, commands: Sequence[Sequence[Arg]]) -> list[Reply]:
        from redis.exceptions import ResponseError

        if self.endpoint.kind == CLUSTER:
            return await self._cluster_pipeline(commands)
        connection = self._connection
        if connection is None:
            connection = self._connection = \
                await self.redis().connection_pool.get_connection()
        await connection.send_packed_command(connection.pack_commands(commands),
                                             check_health=False)
        out: list[Reply] = []
        for _ in commands:
            try:
                out.append(_raw(await connection.read_response()))
            except ResponseError as exc:
                out.append(_error(exc))
        return out

    async def _cluster_pipeline(self, commands: Sequence[Sequence[Arg]]) -> list[Reply]:
        from redis.exceptions import ResponseError

        if len(commands) == 1:
            try:
                return [_raw(await self.redis().execute_command(*commands[0]))]
            except ResponseError as exc:
                return [_error(exc)]
        pipe = self.redis().pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        replies = await pipe.execute(raise_on_error=False)
        out: list[Reply] = []
        for reply in replies:
            if isinstance(reply, ResponseError):
                out.append(_error(reply))
            elif isinstance(reply, Exception):
                raise reply
            else:
                out.append(_raw(reply))
        return out

    async def _guarded(self, work: Any) -> Any:
        """``work`` within the deadline; RedisUnavailable for a server slow, gone or
        broken (and for ``retry_delay`` after, without a try)."""
        from redis.exceptions import RedisError as Failure
        from redis.exceptions import ResponseError

        try:
            async with asyncio.timeout(self.timeout):
                reply = await work
        except TimeoutError:
            self._fail(f"no reply within {self.timeout:g} s")
        except ResponseError as exc:
            # Not an answer to the command: an error before it ran (a refused AUTH,
            # a cluster without its slots).
            self._fail(f"{exc}")
        except (Failure, OSError, ValueError) as exc:
            self._fail(f"{type(exc).__name__}: {exc}" if not str(exc) else str(exc))
        else:
            self._answered = True
            return reply
        raise RedisUnavailable(self.last_error)

    def _fail(self, reason: str) -> None:
        """Fail fast for ``retry_delay``; the connections are dropped (new ones are
        made at the next call)."""
        self.last_error = f"{self.endpoint}: {reason}"
        self._down_until = self.clock() + self.retry_delay
        self._answered = False
        redis, self._redis, self._connection = self._redis, None, None
        if redis is not None:
            asyncio.ensure_future(_quietly_close(redis))


async def _quietly_close(redis: Any) -> None:
    try:
        await redis.aclose()
    except Exception:  # noqa: BLE001 - it is being thrown away
        pass


def error_text(exc: Exception) -> str:
    """An error reply's text as Redis sent it (``NOPERM this user has no...``), for
    another thread's client (the delivery events' stream)."""
    return str(_error(exc))


def _error(exc: Exception) -> RedisError:
    """An error reply as Redis sent it: redis-py turns its first word (the error's
    class, NOSCRIPT, READONLY...) into an exception class and drops it from the text."""
    from redis._parsers.base import BaseParser

    for code, cls in BaseParser.EXCEPTION_CLASSES.items():
        if isinstance(cls, type) and type(exc) is cls:
            return RedisError(f"{code} {exc}")
    text = str(exc)
    return RedisError(text if text.split(" ", 1)[0].isupper() else f"ERR {text}")


def _raw(reply: Any) -> Reply:
    """A reply as the fleet reads it: redis-py hands back a few types of its own."""
    if isinstance(reply, (bytes, int, str)) or reply is None:
        return reply
    if isinstance(reply, (list, tuple)):
        return [_raw(x) for x in reply]
    if isinstance(reply, bool):
        return int(reply)
    return str(reply)


def make_redis(endpoint: Endpoint, timeout: float,
               max_connections: int = MAX_CONNECTIONS) -> redis.asyncio.Redis | Any:
    """The redis-py client for ``endpoint``: RESP2 (every Redis and Valkey speaks it),
    the bounded parser, no retries of its own (the fleet decides what a failure
    means), replies raw."""
    from redis.asyncio import BlockingConnectionPool, Redis
    from redis.asyncio.connection import Connection, UnixDomainSocketConnection

    common: dict[str, Any] = {
        "username": endpoint.user, "password": endpoint.password,
        "socket_timeout": timeout, "socket_connect_timeout": timeout,
        "protocol": 2, "parser_class": _bounded_parser(),
        # No CLIENT SETINFO on connect: one command fewer for the ACL to allow.
        "driver_info": None,
    }
    if endpoint.kind == CLUSTER:
        return _make_cluster(endpoint, common)
    if endpoint.kind == SENTINEL:
        return _make_sentinel(endpoint, common)
    if endpoint.kind == UNIX:
        pool = BlockingConnectionPool(
            connection_class=UnixDomainSocketConnection, path=endpoint.path,
            db=endpoint.db, max_connections=max_connections, timeout=timeout, **common)
    else:
        cls: type = Connection
        if endpoint.tls:
            assert endpoint.ssl_context is not None
            cls = _tls_class(Connection, endpoint.ssl_context)
        pool = BlockingConnectionPool(
            connection_class=cls, host=endpoint.host, port=endpoint.port, db=endpoint.db,
            max_connections=max_connections, timeout=timeout, **common)
    client = Redis(connection_pool=pool)
    # Nothing of the client's own reads a reply through these: all raw.
    client.response_callbacks.clear()
    return client


def _make_sentinel(endpoint: Endpoint, common: dict[str, Any]) -> Any:
    from redis.asyncio import ConnectionPool, Redis
    from redis.asyncio.connection import Connection
    from redis.asyncio.sentinel import Sentinel, SentinelManagedConnection

    sentinel_kwargs: dict[str, Any] = {
        "password": endpoint.sentinel_password,
        "socket_timeout": common["socket_timeout"],
        "socket_connect_timeout": common["socket_connect_timeout"], "protocol": 2,
        "driver_info": None}
    primary: dict[str, Any] = dict(common)
    sentinel = Sentinel(list(endpoint.nodes), sentinel_kwargs=sentinel_kwargs)
    if endpoint.tls:
        assert endpoint.ssl_context is not None
        primary["connection_class"] = _tls_class(SentinelManagedConnection,
                                                 endpoint.ssl_context)
        # The sentinels' clients take no connection class of their own: made again
        # here on pools that speak TLS with the start-up context.
        tls = _tls_class(Connection, endpoint.ssl_context)
        sentinel.sentinels = [
            Redis(connection_pool=ConnectionPool(connection_class=tls, host=host, port=port,
                                                 **sentinel_kwargs))
            for host, port in endpoint.nodes]
    client = sentinel.master_for(endpoint.service, db=endpoint.db, **primary)
    # The primary's address comes from the sentinels' own clients: all raw here.
    client.response_callbacks.clear()
    return client


def _make_cluster(endpoint: Endpoint, common: dict[str, Any]) -> Any:
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    parser = common.pop("parser_class")
    cluster = RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in endpoint.nodes], **common)
    # RedisCluster takes neither a parser nor a connection class; every node it meets
    # is made from connection_kwargs, the seed nodes already were.
    cluster.connection_kwargs["parser_class"] = parser
    nodes = list(cluster.nodes_manager.startup_nodes.values())
    if endpoint.tls:
        assert endpoint.ssl_context is not None
        cls = _tls_class(cluster.connection_kwargs["connection_class"], endpoint.ssl_context)
        cluster.connection_kwargs["connection_class"] = cls
        for node in nodes:
            node.connection_class = cls
    for node in nodes:
        node.connection_kwargs["parser_class"] = parser
    _raw_replies(cluster.connection_kwargs.get("response_callbacks") or {})
    for node in nodes:
        _raw_replies(node.response_callbacks)
    return cluster


def _raw_replies(callbacks: Any) -> None:
    for name in RAW_COMMANDS:
        callbacks.pop(name, None)


class Subscriber:
    """A channel's messages (or several channels'), for as long as it runs.

    The fleet uses it to hear, without asking, that a session it waits for was given
    back. A lost connection is tried again every ``retry_delay`` seconds; messages
    published meanwhile are lost, so ``on_subscribed`` is called at every
    (re)subscription for the caller to read the state afresh. A message over
    :data:`MAX_REPLY` closes the connection (the parser's bound). ``sharded``: the
    channels are a Cluster's shard channels (SSUBSCRIBE), each heard from the node
    that serves its slot, one reader per node.
    """

    def __init__(self, client: RedisClient, channel: str | Sequence[str],
                 on_message: Callable[[bytes], None], timeout: float = 1.0,
                 retry_delay: float = 1.0,
                 on_subscribed: Callable[[], None] | None = None,
                 sharded: bool = False) -> None:
        self.client = client
        self.channels = [channel] if isinstance(channel, str) else list(channel)
        self.on_message = on_message
        self.timeout = timeout
        self.retry_delay = retry_delay
        self.on_subscribed = on_subscribed
        self.sharded = sharded
        #: Set once the server confirmed the subscription (tests wait for it).
        self.subscribed = asyncio.Event()
        self.last_error = ""

    async def run(self) -> None:
        while True:
            pubsub = None
            try:
                async with asyncio.timeout(self.timeout):
                    pubsub = await self.client.pubsub()
                if self.sharded:
                    await self._shards(pubsub)
                else:
                    await self._session(pubsub)
            except Exception as exc:  # noqa: BLE001 - a subscription must outlive anything
                # Whatever broke it (a server gone, garbage, a library's own error), the
                # subscription is tried again: a task that ended here would leave the
                # server deaf to the fleet for the rest of its life.
                self.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else \
                    type(exc).__name__
            finally:
                self.subscribed.clear()
                if pubsub is not None:
                    try:
                        await pubsub.aclose()
                    except Exception:  # noqa: BLE001 - it is being thrown away
                        pass
            await asyncio.sleep(self.retry_delay)

    async def _session(self, pubsub: Any) -> None:
        async with asyncio.timeout(self.timeout):
            await pubsub.subscribe(*self.channels)
        await self._read(pubsub, "subscribe", "message", [len(self.channels)])

    async def _shards(self, pubsub: Any) -> None:
        async with asyncio.timeout(self.timeout):
            await pubsub.ssubscribe(*self.channels)
        left = [len(self.channels)]
        readers = [asyncio.ensure_future(self._read(node, "ssubscribe", "smessage", left))
                   for node in pubsub.node_pubsub_mapping.values()]
        try:
            # The first reader to fail (its node gone, the slots moved) ends them all:
            # run() subscribes afresh, from the cluster's current slot map.
            done, _ = await asyncio.wait(readers, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
        finally:
            for task in readers:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)

    async def _read(self, pubsub: Any, confirmation: str, kind: str,
                    left: list[int]) -> None:
        """One connection's messages until it fails; ``left``: confirmations still
        to come before the subscription is whole (shared by a Cluster's readers)."""
        while True:
            message = await pubsub.get_message(timeout=None)
            if message is None:
                continue
            data = message.get("data")
            if message.get("type") == confirmation:
                left[0] -= 1
                if left[0] == 0:
                    self._subscribed()
            elif message.get("type") == kind and isinstance(data, bytes):
                self.on_message(data)

    def _subscribed(self) -> None:
        self.subscribed.set()
        if self.on_subscribed is not None:
            self.on_subscribed()
