"""The fleet's shared state on Debian's real redis-server: sessions as leases that a dead
node gives back, a fleet-wide GCRA rate, both taken in one atomic step
(pyqmgr/fleet/shared.py). Three nodes here are three clients, as three Postfix servers
would be."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from pyqmgr.fleet.client import Endpoint, RedisClient
from pyqmgr.fleet.shared import Shared
from pyqmgr.testbed.redis import RedisServer


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 60))


def nodes(server: RedisServer, n: int = 3, lease_time: float = 60.0) -> list[Shared]:
    return [Shared(RedisClient(Endpoint(host="127.0.0.1", port=server.port), timeout=2),
                   "t:", f"node{i}", lease_time) for i in range(n)]


async def close(fleet: list[Shared]) -> None:
    for node in fleet:
        await node.client.close()


def test_the_fleet_never_holds_more_sessions_than_its_limit(redis_server):
    server = redis_server()

    async def main() -> None:
        fleet = nodes(server)
        asks = [fleet[i % 3].admit("smtp", "big.example", 5) for i in range(30)]
        got = await asyncio.gather(*asks)
        admitted = [a for a in got if a.admitted]
        assert len(admitted) == 5
        assert max(a.in_use for a in got) == 5
        assert sorted(await fleet[0].holders("smtp", "big.example")) == sorted(
            a.lease for a in admitted)
        # Another destination, another count.
        assert (await fleet[1].admit("smtp", "other.example", 5)).admitted
        # A session given back is one more for anyone.
        owner = next(n for n in fleet if admitted[0].lease.startswith(n.node + "/"))
        await owner.release("smtp", "big.example", admitted[0].lease)
        again = await fleet[2].admit("smtp", "big.example", 5)
        assert again.admitted and again.in_use == 5 and again.lease.startswith("node2/")
        assert not (await fleet[0].admit("smtp", "big.example", 5)).admitted
        await close(fleet)

    run(main)


def test_a_dead_nodes_leases_expire_and_a_live_ones_are_renewed(redis_server):
    server = redis_server()

    async def main() -> None:
        dead, live, other = nodes(server, lease_time=0.6)
        held_dead = [await dead.admit("smtp", "d.example", 4) for _ in range(2)]
        held_live = [await live.admit("smtp", "d.example", 4) for _ in range(2)]
        assert all(a.admitted for a in held_dead + held_live)
        assert not (await other.admit("smtp", "d.example", 4)).admitted
        # The live node renews its two; the dead one does nothing.
        for _ in range(4):
            await asyncio.sleep(0.25)
            assert await live.renew("smtp", "d.example", [a.lease for a in held_live]) == 2
        # A second has passed: the dead node's two sessions are the fleet's again.
        holders = await other.holders("smtp", "d.example")
        assert sorted(holders) == sorted(a.lease for a in held_live)
        taken = [await other.admit("smtp", "d.example", 4) for _ in range(3)]
        assert [a.admitted for a in taken] == [True, True, False]
        # An expired lease is not renewed back into a slot someone else took.
        assert await dead.renew("smtp", "d.example", [a.lease for a in held_dead]) == 0
        await close([dead, live, other])

    run(main)


def test_a_fleet_rate_of_10_a_second_across_three_nodes(redis_server):
    server = redis_server()

    async def main() -> None:
        fleet = nodes(server)
        starts: list[float] = []

        async def sender(node: Shared) -> None:
            end = time.monotonic() + 3.0
            while time.monotonic() < end:
                a = await node.admit("smtp", "rated.example", 0, interval=0.1, burst=3)
                if a.admitted:
                    starts.append(time.monotonic())
                else:
                    assert 0 < a.wait <= 0.1 + 1e-9, a
                    await asyncio.sleep(min(a.wait, 0.02))

        await asyncio.gather(*(sender(n) for n in fleet))
        starts.sort()
        # 3 s at 10/s with a burst of 3: 30 + 3 at most, and near that.
        assert 28 <= len(starts) <= 33, len(starts)
        most = max(sum(1 for s in starts if t <= s < t + 1.0) for t in starts)
        print(f"{len(starts)} starts in 3 s; at most {most} in any second")
        assert most <= 10 + 3, most
        await close(fleet)

    run(main)


def test_a_start_refused_for_one_reason_spends_nothing_of_the_other(redis_server):
    server = redis_server()

    async def main() -> None:
        (node,) = nodes(server, 1)
        first = await node.admit("smtp", "x.example", 1, interval=10.0, burst=1)
        assert first.admitted
        # Sessions full: refused without spending the rate (wait stays 0).
        full = await node.admit("smtp", "x.example", 1, interval=10.0, burst=1)
        assert not full.admitted and full.wait == 0 and full.in_use == 1
        await node.release("smtp", "x.example", first.lease)
        # Now the rate refuses, and no session is taken for it.
        rated = await node.admit("smtp", "x.example", 1, interval=10.0, burst=1)
        assert not rated.admitted and 9 < rated.wait <= 10
        assert await node.holders("smtp", "x.example") == []
        await close([node])

    run(main)


def test_scripts_come_back_after_redis_forgets_them(redis_server):
    server = redis_server()

    async def main() -> None:
        (node,) = nodes(server, 1)
        assert (await node.admit("smtp", "s.example", 3)).admitted
        assert await node.client.call("SCRIPT", "FLUSH") == "OK"
        assert (await node.admit("smtp", "s.example", 3)).admitted
        assert len(await node.holders("smtp", "s.example")) == 2
        await close([node])

    run(main)
