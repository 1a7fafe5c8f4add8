"""The policy client against a real, unmodified Postfix policy server: Debian's postfwd2,
started on loopback with a rate rule.

What the delivery policy integration will rely on: postfwd's ``rate()`` limits one
destination to N requests per T seconds and answers the rest with its 450 reply while
another destination flows, through one reused connection (counted by the client and,
independently, by the kernel at postfwd's port); the limit holds across the pool's
concurrent connections; and a postfwd stopped mid-run costs errors of the one type,
quickly and without blocking the event loop, until it is back."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from pyqmgr.postfix.policy_delegation import (
    DeliveryRequest,
    PolicyClient,
    PolicyError,
    Verdict,
)
from pyqmgr.testbed.instance import TestbedError
from pyqmgr.testbed.postfwd import Postfwd, find_postfwd2, group_members

pytestmark = pytest.mark.skipif(find_postfwd2() is None,
                                reason="needs Debian's postfwd package (postfwd2)")

LIMITED = "limited.example"
FREE = "free.example"
REPLY = "450 4.7.1 too many deliveries"


def rate_rule(count: int, seconds: int) -> str:
    return (f"id=LIMIT; protocol_state==DELIVERY; recipient_domain=={LIMITED}; "
            f"action=rate(recipient_domain/{count}/{seconds}/{REPLY})")


def request(n: int, domain: str) -> DeliveryRequest:
    return DeliveryRequest(queue_id=f"Q{n}{domain[0].upper()}", sender="s@example.org",
                           recipient=f"user{n}@{domain}", recipient_count=1, size=1000,
                           instance=f"Q{n}.1", transport="smtp", nexthop=domain,
                           destination_window=5, destination_in_flight=0, attempt=1)


@pytest.fixture
def postfwd() -> Iterator[Callable[..., Postfwd]]:
    made: list[Postfwd] = []

    def make(*rules: str, **kw: Any) -> Postfwd:
        server = Postfwd(list(rules), **kw)
        made.append(server)
        return server.start()

    yield make
    for server in made:
        server.close()


def run(body: Callable[[], Awaitable[Any]]) -> tuple[Any, float]:
    """Run ``body`` beside a 10 ms ticker; return its result and the ticker's longest gap."""

    async def main() -> tuple[Any, float]:
        loop = asyncio.get_running_loop()
        gaps = [0.0]
        done = asyncio.Event()

        async def tick() -> None:
            last = loop.time()
            while not done.is_set():
                await asyncio.sleep(0.01)
                gaps.append(loop.time() - last)
                last = loop.time()

        ticker = asyncio.create_task(tick())
        try:
            result = await asyncio.wait_for(body(), 60)
        finally:
            done.set()
            await ticker
        return result, max(gaps)

    return asyncio.run(main())


def test_postfwd_limits_one_domain_to_n_per_t_while_another_flows(postfwd):
    server = postfwd(rate_rule(3, 10))

    async def body() -> tuple[list[Any], list[Any], PolicyClient, int]:
        client = PolicyClient(server.endpoint, timeout=5.0)
        limited, free = [], []
        for n in range(6):
            limited.append(await client.ask(request(n, LIMITED)))
            free.append(await client.ask(request(n, FREE)))
        established = server.established()  # while the client still holds it
        client.close()
        return limited, free, client, established

    start = time.monotonic()
    (limited, free, client, established), gap = run(body)
    assert time.monotonic() - start < 10, "the rate window must not have run out"
    assert [d.verdict for d in limited] == [Verdict.DELIVER] * 3 + [Verdict.DEFER] * 3
    fourth = limited[3]
    assert (fourth.code, fourth.dsn, fourth.text) == (450, "4.7.1", "too many deliveries")
    assert fourth.action == REPLY
    assert [d.verdict for d in free] == [Verdict.DELIVER] * 6
    # Twelve requests, one connection: counted by the client and by the kernel at
    # postfwd's end of it.
    assert client.stats.connections_opened == 1 and client.stats.reused == 11
    assert established == 1
    assert gap < 0.3


def test_postfwd_lets_the_destination_go_again_when_its_window_ends(postfwd):
    server = postfwd(rate_rule(2, 2))

    async def body() -> tuple[list[Verdict], float]:
        client = PolicyClient(server.endpoint, timeout=5.0)
        first = time.monotonic()
        verdicts = [(await client.ask(request(n, LIMITED))).verdict for n in range(4)]
        await asyncio.sleep(max(0.0, first + 2.5 - time.monotonic()))
        verdicts += [(await client.ask(request(n, LIMITED))).verdict for n in range(4, 7)]
        client.close()
        return verdicts, time.monotonic() - first

    verdicts, elapsed = run(body)[0]
    deliver, defer = Verdict.DELIVER, Verdict.DEFER
    assert verdicts == [deliver, deliver, defer, defer, deliver, deliver, defer], elapsed


def test_postfwd_holds_the_limit_across_the_pools_concurrent_connections(postfwd):
    server = postfwd(rate_rule(3, 10))

    async def body() -> tuple[list[Verdict], list[Verdict], int, PolicyClient]:
        client = PolicyClient(server.endpoint, timeout=5.0, max_connections=4)
        limited = await asyncio.gather(*(client.ask(request(n, LIMITED)) for n in range(8)))
        free = await asyncio.gather(*(client.ask(request(n, FREE)) for n in range(8)))
        established = server.established()
        client.close()
        return ([d.verdict for d in limited], [d.verdict for d in free], established,
                client)

    limited, free, established, client = run(body)[0]
    # postfwd2 keeps rate counters in its cache daemon, one for all its processes.
    assert limited.count(Verdict.DELIVER) == 3 and limited.count(Verdict.DEFER) == 5
    assert free == [Verdict.DELIVER] * 8
    assert 1 <= client.stats.connections_opened <= 4
    assert established == client.stats.connections_opened


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_postfwd_stopped_mid_run_costs_quick_errors_until_it_is_back(postfwd, how):
    server = postfwd(rate_rule(1000, 60))
    timeout = 2.0

    async def body() -> tuple[list[str], list[float], PolicyClient]:
        client = PolicyClient(server.endpoint, timeout=timeout)
        seen = [(await client.ask(request(n, FREE))).verdict.value for n in range(3)]
        # Stopping postfwd takes the calling thread a moment: let the loop run on.
        await asyncio.to_thread(server.stop if how == "stop" else server.kill)
        spent = []
        for n in range(3, 6):
            start = time.monotonic()
            try:
                seen.append((await client.ask(request(n, FREE))).verdict.value)
            except PolicyError as exc:
                seen.append(exc.reason)
            spent.append(time.monotonic() - start)
        await asyncio.to_thread(server.start)
        seen += [(await client.ask(request(n, FREE))).verdict.value for n in range(6, 9)]
        client.close()
        return seen, spent, client

    (seen, spent, client), gap = run(body)
    assert seen[:3] == ["deliver"] * 3
    # The pooled connection is found closed, then nothing listens: refused at once.
    assert seen[3:6] == ["unreachable"] * 3, seen
    assert max(spent) < timeout, spent
    assert seen[6:] == ["deliver"] * 3
    assert client.stats.errors == 3
    assert gap < 0.3, f"event loop blocked for {gap:.3f}s"


def test_the_harness_leaves_nothing_behind(postfwd):
    server = postfwd(rate_rule(3, 10))
    pgid = server._pgid
    assert pgid is not None and len(group_members(pgid)) >= 3  # master, cache, policy
    server.close()
    assert group_members(pgid) == []
    assert not os.path.exists(server.root)


def test_a_rule_postfwd_would_ignore_is_an_error_not_a_silent_server():
    with pytest.raises(TestbedError, match="ignoring invalid"):
        Postfwd(["id=OK; action=DUNNO", "this is not a rule"])
