"""The policy client against a fake server on loopback that answers well or badly.

Each misbehaviour must end in the one error type within the client's timeout, while a
ticker on the same event loop keeps ticking (the loop is never blocked), and the pool
must serve again as soon as the server behaves. No Postfix is needed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from pyqmgr.postfix.policy_delegation import (
    DeliveryRequest,
    PolicyClient,
    PolicyError,
    Verdict,
    parse_endpoint,
)
from pyqmgr.testbed.instance import free_port
from pyqmgr.testbed.policy_server import FakePolicyServer

#: The client's timeout in these tests, and how far past it an error may come.
TIMEOUT = 0.5
SLACK = 0.5
#: Longest pause allowed between two ticks of a 10 ms ticker: a client that blocked
#: the loop for its timeout would show a gap of at least TIMEOUT.
MAX_GAP = 0.3


def request(n: int = 1, domain: str = "example.com") -> DeliveryRequest:
    return DeliveryRequest(queue_id=f"Q{n}", sender="s@example.org",
                           recipient=f"r{n}@{domain}", recipient_count=1, size=100,
                           instance=f"Q{n}.1", transport="smtp", nexthop=domain,
                           destination_window=5, destination_in_flight=0, attempt=1)


@pytest.fixture
def server() -> Iterator[Callable[..., FakePolicyServer]]:
    made: list[FakePolicyServer] = []

    def make(*args: Any, **kw: Any) -> FakePolicyServer:
        srv = FakePolicyServer(*args, **kw).start()
        made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.stop()


def run(body: Callable[[], Awaitable[Any]]) -> tuple[Any, float]:
    """Run ``body`` with a 10 ms ticker beside it; return its result and the longest gap."""

    async def main() -> tuple[Any, float]:
        loop = asyncio.get_running_loop()
        gaps = [0.0]
        done = asyncio.Event()

        async def tick() -> None:
            last = loop.time()
            while not done.is_set():
                await asyncio.sleep(0.01)
                now = loop.time()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        try:
            result = await asyncio.wait_for(body(), 30)
        finally:
            done.set()
            await ticker
        return result, max(gaps)

    return asyncio.run(main())


# -- well-behaved ------------------------------------------------------------------------


def test_one_connection_serves_request_after_request(server):
    srv = server(action="DUNNO")

    async def body() -> PolicyClient:
        client = PolicyClient(srv.endpoint, timeout=TIMEOUT)
        for n in range(20):
            assert (await client.ask(request(n))).verdict is Verdict.DELIVER
        client.close()
        return client

    client, gap = run(body)
    assert srv.connections == 1
    assert client.stats.connections_opened == 1 and client.stats.reused == 19
    assert srv.request_count() == 20
    assert srv.requests[0]["request"] == "smtpd_access_policy"
    assert srv.requests[0]["protocol_state"] == "DELIVERY"
    assert srv.requests[7]["recipient"] == "r7@example.com"
    assert gap < MAX_GAP


def test_concurrent_requests_share_at_most_max_connections(server):
    srv = server(action="DUNNO", delay=0.2)

    async def body() -> tuple[list[Verdict], float, PolicyClient]:
        client = PolicyClient(srv.endpoint, timeout=5.0, max_connections=4)
        start = time.monotonic()
        decisions = await asyncio.gather(*(client.ask(request(n)) for n in range(10)))
        elapsed = time.monotonic() - start
        assert client.open_connections() == 4
        client.close()
        return [d.verdict for d in decisions], elapsed, client

    verdicts, elapsed, client = run(body)[0]
    assert verdicts == [Verdict.DELIVER] * 10
    # 10 requests, 4 at a time, 0.2 s each: three rounds, not ten and not one.
    assert srv.connections == 4 and client.stats.connections_opened == 4
    assert 0.55 <= elapsed < 2.0, elapsed


def test_the_decision_comes_back_classified_with_its_delay(server):
    srv = server(action="450 4.7.1 slow down", extra=[("delay", "90")])

    async def body() -> Any:
        client = PolicyClient(srv.endpoint, timeout=TIMEOUT)
        try:
            return await client.ask(request())
        finally:
            client.close()

    decision = run(body)[0]
    assert (decision.verdict, decision.code, decision.dsn, decision.text, decision.delay) == (
        Verdict.DEFER, 450, "4.7.1", "slow down", 90.0)


def test_a_unix_endpoint_relative_to_the_working_directory(server, tmp_path, monkeypatch):
    srv = server(unix_path=str(tmp_path / "policy"), action="HOLD")
    monkeypatch.chdir(tmp_path)  # the daemon's working directory is the queue directory

    async def body() -> Verdict:
        client = PolicyClient("unix:policy", timeout=TIMEOUT)
        try:
            return (await client.ask(request())).verdict
        finally:
            client.close()

    assert run(body)[0] is Verdict.HOLD
    assert srv.request_count() == 1
    assert parse_endpoint("unix:policy").path == "policy"


# -- misbehaving ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode, delay, reason", [
    ("garbage", 0.0, PolicyError.MALFORMED),
    ("oversized", 0.0, PolicyError.MALFORMED),
    ("binary", 0.0, PolicyError.MALFORMED),
    ("noaction", 0.0, PolicyError.MALFORMED),
    ("partial", 0.0, PolicyError.TIMEOUT),
    ("silent", 0.0, PolicyError.TIMEOUT),
    ("reply", 3.0, PolicyError.TIMEOUT),  # slow: answers long after the timeout
    ("hangup", 0.0, PolicyError.CLOSED),
    ("close", 0.0, PolicyError.CLOSED),
])
def test_a_misbehaving_server_costs_one_error_within_the_timeout_and_the_pool_recovers(
        server, mode, delay, reason):
    srv = server(action="DUNNO")

    async def body() -> tuple[PolicyError, float, Verdict, PolicyClient]:
        client = PolicyClient(srv.endpoint, timeout=TIMEOUT)
        assert (await client.ask(request(0))).verdict is Verdict.DELIVER  # a pooled conn
        srv.set_mode(mode, delay=delay)
        start = time.monotonic()
        with pytest.raises(PolicyError) as info:
            await client.ask(request(1))
        elapsed = time.monotonic() - start
        srv.set_mode("reply", delay=0.0)
        after = (await client.ask(request(2))).verdict
        client.close()
        return info.value, elapsed, after, client

    (error, elapsed, after, client), gap = run(body)
    assert error.reason == reason, error
    assert str(client.endpoint) in str(error)
    assert elapsed < TIMEOUT + SLACK, elapsed
    if reason != PolicyError.TIMEOUT:
        assert elapsed < TIMEOUT, elapsed  # refused at once, not by running out of time
    assert gap < MAX_GAP, f"event loop blocked for {gap:.3f}s"
    assert after is Verdict.DELIVER
    assert client.stats.errors == 1


def test_a_second_reply_for_one_request_retires_the_connection(server):
    srv = server("stray", action="DUNNO")

    async def body() -> list[Verdict]:
        client = PolicyClient(srv.endpoint, timeout=TIMEOUT)
        verdicts = [(await client.ask(request(n))).verdict for n in range(3)]
        client.close()
        return verdicts

    assert run(body)[0] == [Verdict.DELIVER] * 3
    # The first reply is good; the extra one makes the connection unusable, never
    # read as the answer to the next request.
    assert srv.connections == 3


def test_a_reused_connection_found_dead_is_retried_once_on_a_fresh_one(server):
    srv = server(action="DUNNO")

    async def body() -> tuple[PolicyError, PolicyClient]:
        client = PolicyClient(srv.endpoint, timeout=TIMEOUT)
        await client.ask(request(0))
        srv.set_mode("hangup")  # reads the request, closes without a word
        with pytest.raises(PolicyError) as info:
            await client.ask(request(1))
        client.close()
        return info.value, client

    error, client = run(body)[0]
    assert error.reason == PolicyError.CLOSED
    assert client.stats.retries == 1
    # Sent on the pooled connection, then once more on a fresh one, and no more.
    assert [r["queue_id"] for r in srv.requests] == ["Q0", "Q1", "Q1"]
    assert srv.connections == 2


def test_a_server_restart_costs_nothing(server):
    srv = server(action="DUNNO")

    async def body() -> PolicyClient:
        client = PolicyClient(srv.endpoint, timeout=TIMEOUT)
        await client.ask(request(0))
        srv.close_connections()  # the server restarted, closing its end
        await asyncio.sleep(0.05)
        assert (await client.ask(request(1))).verdict is Verdict.DELIVER
        client.close()
        return client

    client = run(body)[0]
    assert client.stats.errors == 0 and client.stats.connections_opened == 2


def test_a_timeout_is_never_retried(server):
    srv = server(action="DUNNO")

    async def body() -> None:
        client = PolicyClient(srv.endpoint, timeout=TIMEOUT)
        await client.ask(request(0))
        srv.set_mode("silent")
        with pytest.raises(PolicyError, match="no reply within 0.5s"):
            await client.ask(request(1))
        client.close()

    run(body)
    assert [r["queue_id"] for r in srv.requests] == ["Q0", "Q1"]


def test_nothing_listening_is_unreachable_at_once():
    endpoint = f"inet:127.0.0.1:{free_port()}"

    async def body() -> tuple[PolicyError, float]:
        client = PolicyClient(endpoint, timeout=TIMEOUT)
        start = time.monotonic()
        with pytest.raises(PolicyError) as info:
            await client.ask(request())
        return info.value, time.monotonic() - start

    error, elapsed = run(body)[0]
    assert error.reason == PolicyError.UNREACHABLE
    assert "Connection refused" in str(error)
    assert elapsed < TIMEOUT


def test_a_service_that_goes_away_and_comes_back(server):
    srv = server(action="DUNNO")

    async def body() -> list[str]:
        client = PolicyClient(srv.endpoint, timeout=TIMEOUT)
        seen = [(await client.ask(request(0))).verdict.value]
        srv.refuse()
        await asyncio.sleep(0.05)
        for n in range(3):
            with pytest.raises(PolicyError) as info:
                await client.ask(request(n))
            seen.append(info.value.reason)
        srv.start()
        seen.append((await client.ask(request(9))).verdict.value)
        client.close()
        return seen

    assert run(body)[0] == ["deliver", "unreachable", "unreachable", "unreachable",
                            "deliver"]


def test_the_timeout_covers_waiting_for_a_busy_pool(server):
    srv = server("silent")

    async def body() -> list[str]:
        client = PolicyClient(srv.endpoint, timeout=TIMEOUT, max_connections=1)
        results = await asyncio.gather(*(client.ask(request(n)) for n in range(3)),
                                       return_exceptions=True)
        client.close()
        return [r.reason if isinstance(r, PolicyError) else repr(r) for r in results]

    start = time.monotonic()
    assert run(body)[0] == ["timeout"] * 3
    # All three gave up after one timeout each, counted from their own start.
    assert time.monotonic() - start < TIMEOUT + SLACK + 0.5
    assert srv.connections <= 2


def test_a_cancelled_request_gives_its_connection_back_closed(server):
    srv = server("silent")

    async def body() -> Verdict:
        client = PolicyClient(srv.endpoint, timeout=5.0, max_connections=1)
        task = asyncio.create_task(client.ask(request(0)))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert client.open_connections() == 0
        srv.set_mode("reply")
        verdict = (await client.ask(request(1))).verdict  # the one slot is free again
        client.close()
        return verdict

    assert run(body)[0] is Verdict.DELIVER
    assert srv.connections == 2


def test_idle_and_old_connections_are_closed(server):
    srv = server(action="DUNNO")
    now = [1000.0]

    async def body() -> PolicyClient:
        client = PolicyClient(srv.endpoint, timeout=TIMEOUT, max_idle=300, max_ttl=1000,
                              clock=lambda: now[0])
        await client.ask(request(0))
        now[0] += 299
        await client.ask(request(1))  # reused: idle 299 s
        now[0] += 301
        await client.ask(request(2))  # idle 301 s: a new connection
        for n in range(3, 6):
            now[0] += 250
            await client.ask(request(n))  # reused, idle 250 s each
        now[0] += 290  # idle 290 s, but opened 1040 s ago: over max_ttl
        await client.ask(request(6))
        assert client.open_connections() == 1
        now[0] += 301
        client.expire_idle()
        assert client.open_connections() == 0
        client.close()
        return client

    client = run(body)[0]
    assert client.stats.connections_opened == 3
    assert srv.connections == 3


def test_close_fails_requests_under_way(server):
    srv = server("silent")

    async def body() -> PolicyError:
        client = PolicyClient(srv.endpoint, timeout=5.0)
        task = asyncio.create_task(client.ask(request()))
        await asyncio.sleep(0.1)
        client.close()
        with pytest.raises(PolicyError) as info:
            await task
        return info.value

    assert run(body)[0].reason == PolicyError.CLOSED
