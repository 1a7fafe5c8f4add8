"""The fleet's Redis client (redis-py's, with the fleet's deadlines and bounds) against
Debian's real redis-server, and against servers that misbehave: gone, frozen, refusing
the password, speaking garbage, answering too much, dripping a reply byte by byte
(pyqmgr/fleet/client.py).

What must hold in every case (issues #23, #35): no call waits longer than its deadline,
a failure is a RedisUnavailable that says why, no reply over the bound is buffered, and
the client comes back by itself once the server does.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable

import pytest

from pyqmgr.fleet.client import (
    MAX_REPLY,
    UNIX,
    Endpoint,
    RedisClient,
    RedisError,
    RedisUnavailable,
    Subscriber,
)
from pyqmgr.testbed.instance import TestbedError
from pyqmgr.testbed.redis import RedisServer


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 60))


def tcp(server: RedisServer, **kw: object) -> Endpoint:
    return Endpoint(host="127.0.0.1", port=server.port, **kw)  # type: ignore[arg-type]


def test_commands_pipelines_and_concurrent_callers(redis_server):
    server = redis_server()

    async def main() -> None:
        client = RedisClient(tcp(server))
        assert await client.call("SET", "k", "v") == b"OK"
        assert await client.call("GET", "k") == b"v"
        assert await client.call("GET", "missing") is None
        assert await client.pipeline([("INCR", "n"), ("INCR", "n"), ("GET", "n")]) == [
            1, 2, b"2"]
        # An error reply is a value, and the connection goes on.
        err = await client.call("INCR", "k")
        assert isinstance(err, RedisError) and err.kind == "ERR"
        # Many callers at once on the client's few connections: each gets its own reply.
        got = await asyncio.gather(*(client.call("INCRBY", "c", i) for i in range(1, 201)))
        assert sorted(got)[-1] == sum(range(1, 201)) and len(set(got)) == 200
        assert await client.call("EVAL", "return {KEYS[1], ARGV[1]}", 1, "a", "b") == [
            b"a", b"b"]
        await client.close()

    run(main)


def test_unix_socket_database_and_password(redis_server):
    server = redis_server(password="s3cret pass")

    async def main() -> None:
        client = RedisClient(Endpoint(path=server.socket_path, db=3, password="s3cret pass",
                                   kind=UNIX))
        assert await client.call("SET", "where", "db3") == b"OK"
        await client.close()
        other = RedisClient(Endpoint(path=server.socket_path, db=0, password="s3cret pass",
                                  kind=UNIX))
        assert await other.call("GET", "where") is None
        await other.close()
        wrong = RedisClient(tcp(server, password="nope"))
        with pytest.raises(RedisUnavailable) as exc:
            await wrong.call("PING")
        assert "invalid username-password pair" in str(exc.value), exc.value
        assert "nope" not in str(exc.value)
        # No password where one is needed: unavailable (the failure mode), not an answer.
        none = RedisClient(tcp(server))
        with pytest.raises(RedisUnavailable, match="Authentication required"):
            await none.call("PING")
        await none.close()

    run(main)


def test_redis_gone_fails_fast_and_comes_back(redis_server):
    server = redis_server()

    async def main() -> None:
        client = RedisClient(tcp(server), timeout=0.5, retry_delay=0.3)
        assert await client.call("PING") == b"PONG"
        await asyncio.to_thread(server.stop, False)
        started = time.monotonic()
        with pytest.raises(RedisUnavailable):
            await client.call("PING")
        # Within the retry delay: refused without touching the network.
        with pytest.raises(RedisUnavailable):
            await client.call("PING")
        assert time.monotonic() - started < 0.5
        await asyncio.to_thread(server.start)
        await asyncio.sleep(0.35)
        assert await client.call("PING") == b"PONG"
        await client.close()

    run(main)


def test_a_frozen_redis_costs_one_deadline_then_fails_fast(redis_server):
    server = redis_server()

    async def main() -> None:
        client = RedisClient(tcp(server), timeout=0.3, retry_delay=5)
        assert await client.call("PING") == b"PONG"
        server.freeze()
        try:
            started = time.monotonic()
            results = await asyncio.gather(*(client.call("PING") for _ in range(20)),
                                           return_exceptions=True)
            took = time.monotonic() - started
            assert all(isinstance(r, RedisUnavailable) for r in results), results
            assert "no reply within 0.3 s" in str(results[0])
            assert 0.25 < took < 1.0, took
            started = time.monotonic()
            with pytest.raises(RedisUnavailable):
                await client.call("PING")
            assert time.monotonic() - started < 0.05
        finally:
            server.thaw()
        await client.close()

    run(main)


async def fake_server(handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                        Awaitable[None]]) -> tuple[asyncio.Server, int]:
    srv = await asyncio.start_server(handler, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


@pytest.mark.parametrize("reply, says", [
    (b"%garbage\r\n", "Protocol error|Bad multi-bulk length"),
    # A length claimed, and the bytes to match streamed: cut at the bound.
    (b"$99999999\r\n" + b"x" * (MAX_REPLY + 100_000), f"more than {MAX_REPLY} bytes"),
    (b"", "closed the connection"),
])
def test_a_server_that_is_not_redis(reply, says):
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(100)
            writer.write(reply)
            await writer.drain()
            if not reply:
                writer.close()
            await asyncio.sleep(2)
            writer.close()

        srv, port = await fake_server(handler)
        client = RedisClient(Endpoint(host="127.0.0.1", port=port), timeout=1)
        try:
            with pytest.raises(RedisUnavailable, match=says):
                await client.call("PING")
            assert not client.connected
        finally:
            await client.close()
            srv.close()

    run(main)


def test_a_reply_dripping_slower_than_the_deadline():
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(100)
            for byte in b"$10\r\n0123456789\r\n":
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.05)
            await asyncio.sleep(2)
            writer.close()

        srv, port = await fake_server(handler)
        client = RedisClient(Endpoint(host="127.0.0.1", port=port), timeout=0.3)
        started = time.monotonic()
        with pytest.raises(RedisUnavailable, match="no reply within 0.3 s"):
            await client.call("GET", "x")
        assert time.monotonic() - started < 0.6
        await client.close()
        srv.close()

    run(main)


def test_nothing_listening_is_unavailable_at_once():
    async def main() -> None:
        from pyqmgr.testbed.instance_base import free_port
        client = RedisClient(Endpoint(host="127.0.0.1", port=free_port()), timeout=1)
        started = time.monotonic()
        with pytest.raises(RedisUnavailable, match="Connection refused|connecting to"):
            await client.call("PING")
        assert time.monotonic() - started < 0.5

    run(main)


# -- the subscription (a session given back is announced on it) --------------------------


def test_a_subscription_hears_what_is_published_and_comes_back_after_a_restart(
        redis_server):
    server = redis_server(password="pw")

    async def main() -> None:
        heard: list[bytes] = []
        ep = tcp(server, password="pw")
        sub = Subscriber(RedisClient(ep), "t:freed:node/1", heard.append, timeout=1,
                         retry_delay=0.2)
        task = asyncio.ensure_future(sub.run())
        publisher = RedisClient(ep)
        try:
            await asyncio.wait_for(sub.subscribed.wait(), 10)
            assert await publisher.call("PUBLISH", "t:freed:node/1", "smtp\nq.example") == 1
            assert await publisher.call("PUBLISH", "t:freed:other", "not for us") == 0
            await asyncio.sleep(0.2)
            assert heard == [b"smtp\nq.example"]
            await publisher.close()
            await asyncio.to_thread(server.stop, False)
            await asyncio.sleep(0.3)
            assert not sub.subscribed.is_set() and sub.last_error
            await asyncio.to_thread(server.start)
            await asyncio.wait_for(sub.subscribed.wait(), 10)
            publisher = RedisClient(ep)
            assert await publisher.call("PUBLISH", "t:freed:node/1", "again") == 1
            await asyncio.sleep(0.2)
            assert heard[-1] == b"again"
        finally:
            task.cancel()
            await publisher.close()

    run(main)


@pytest.mark.parametrize("reply, says", [
    (b"%garbage\r\n", "Protocol error|Bad multi-bulk length"),
    (b"*3\r\n$9\r\nsubscribe\r\n$1\r\nc\r\n:1\r\n*3\r\n$7\r\nmessage\r\n$1\r\nc\r\n$99999999\r\n"
     + b"x" * (MAX_REPLY + 100_000), "more than"),
    (b"-NOPERM no\r\n", "no"),
])
def test_a_subscription_to_a_server_that_is_not_redis(reply, says):
    """Garbage or an oversized message: the connection is dropped with the reason and
    tried again; nothing reaches the caller."""

    async def main() -> None:
        connections = 0

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            await reader.read(100)
            writer.write(reply)
            await writer.drain()
            await asyncio.sleep(2)
            writer.close()

        srv, port = await fake_server(handler)
        heard: list[bytes] = []
        sub = Subscriber(RedisClient(Endpoint(host="127.0.0.1", port=port)), "c",
                         heard.append, timeout=1, retry_delay=0.1)
        task = asyncio.ensure_future(sub.run())
        try:
            await asyncio.sleep(0.5)
            assert re.search(says, sub.last_error), sub.last_error
            assert connections >= 2 and heard == []
        finally:
            task.cancel()
            srv.close()

    run(main)


def test_a_subscription_that_drips_or_stays_silent_costs_nothing_else():
    """A server that accepts and says nothing: the subscription just waits (nothing is
    asked of it), and the event loop goes on."""

    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(100)
            for byte in b"*3\r\n$9\r\nsubscribe\r\n$1\r\nc\r\n:1\r\n":
                writer.write(bytes([byte]))
                await asyncio.sleep(0.01)
            await asyncio.sleep(5)

        srv, port = await fake_server(handler)
        sub = Subscriber(RedisClient(Endpoint(host="127.0.0.1", port=port)), "c",
                         lambda b: None)
        task = asyncio.ensure_future(sub.run())
        ticks = 0
        for _ in range(60):
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks == 60 and sub.subscribed.is_set()
        task.cancel()
        srv.close()

    run(main)


def test_the_test_beds_server_refuses_a_second_start(redis_server):
    """A second start would leave the first redis-server running with nobody to stop it."""
    server = redis_server()
    with pytest.raises(TestbedError, match="runs already"):
        server.start()
    assert server.command("PING") == "PONG"


@pytest.mark.parametrize("hiredis", [True, False], ids=["hiredis", "python-parser"])
def test_an_oversized_reply_is_cut_with_either_parser(monkeypatch, hiredis):
    """Without hiredis (the ``fleet`` extra installs it; a bare redis-py does not)
    redis-py's own parser reads the reply: the bound holds there too."""
    import redis.utils

    monkeypatch.setattr(redis.utils, "HIREDIS_AVAILABLE", hiredis)

    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(100)
            writer.write(b"$%d\r\n" % (4 * MAX_REPLY))
            try:
                for _ in range(8):
                    writer.write(b"y" * MAX_REPLY)
                    await writer.drain()
            except OSError:
                pass
            writer.close()

        srv, port = await fake_server(handler)
        client = RedisClient(Endpoint(host="127.0.0.1", port=port), timeout=2)
        with pytest.raises(RedisUnavailable, match="more than"):
            await client.call("GET", "x")
        await client.close()
        srv.close()

    run(main)
