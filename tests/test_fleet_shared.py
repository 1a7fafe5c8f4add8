"""The fleet's shared state on Debian's real redis-server: sessions as leases that a dead
node gives back, a fleet-wide GCRA rate, both taken in one atomic step
(pyqmgr/fleet/shared.py). Three nodes here are three clients, as three Postfix servers
would be."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from pyqmgr.fleet.client import Endpoint, RedisClient, Subscriber
from pyqmgr.fleet.shared import HANDED, KEPT, RELEASED, TOLD, Shared
from pyqmgr.testbed.redis import RedisServer


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 60))


def nodes(server: RedisServer, n: int = 3, lease_time: float = 60.0,
          counted: bool = True) -> list[Shared]:
    """``n`` nodes of one fleet; ``counted``: the fleet counted its sessions already
    (else its first start meets the recount of a Redis without an epoch)."""
    if counted:
        assert server.command("SET", "t:epoch", f"{run_id(server)} 0") == "OK"
    return [Shared(RedisClient(Endpoint(host="127.0.0.1", port=server.port), timeout=2),
                   "t:", f"node{i}", lease_time) for i in range(n)]


def run_id(server: RedisServer) -> str:
    info = server.command("INFO", "server")
    assert isinstance(info, bytes)
    return info.decode().split("run_id:", 1)[1].split()[0]


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
            assert await live.renew("smtp", "d.example", [a.lease for a in held_live]) == 0
        # A second has passed: the dead node's two sessions are the fleet's again.
        holders = await other.holders("smtp", "d.example")
        assert sorted(holders) == sorted(a.lease for a in held_live)
        taken = [await other.admit("smtp", "d.example", 4) for _ in range(3)]
        assert [a.admitted for a in taken] == [True, True, False]
        # A node that comes back renews its expired leases: its deliveries are still
        # under way, so they count again, over the limit for a while: nobody starts.
        assert await dead.renew("smtp", "d.example", [a.lease for a in held_dead]) == 2
        assert len(await other.holders("smtp", "d.example")) == 6
        assert not (await live.admit("smtp", "d.example", 4)).admitted
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
        assert await node.client.call("SCRIPT", "FLUSH") == b"OK"
        assert (await node.admit("smtp", "s.example", 3)).admitted
        assert len(await node.holders("smtp", "s.example")) == 2
        await close([node])

    run(main)


def listen(server: RedisServer, node: Shared, heard: list[bytes]) -> tuple[
        asyncio.Task[None], Subscriber]:
    """Subscribe ``node``'s channel as the daemon does; what it hears goes to ``heard``."""
    sub = Subscriber(RedisClient(Endpoint(host="127.0.0.1", port=server.port)), node.channel,
                     heard.append, timeout=2)
    return asyncio.get_running_loop().create_task(sub.run()), sub


def test_a_session_given_back_is_handed_to_the_longest_waiter(redis_server):
    """One round trip gives a session back and hands it on: a lease in the waiter's
    name, published to it, so the delivery it starts asks nothing; the giver, with
    more to send, queues behind. Nobody waiting: kept for the giver's next delivery."""
    server = redis_server()

    async def main() -> None:
        a, b, c = nodes(server)
        heard_b: list[bytes] = []
        task, sub = listen(server, b, heard_b)
        await asyncio.wait_for(sub.subscribed.wait(), 5)
        first, second = [await a.admit("smtp", "h.example", 2) for _ in range(2)]
        assert first.admitted and second.admitted
        refused = await b.admit("smtp", "h.example", 2)
        assert not refused.admitted and refused.in_use == 2
        # c waits too, but nobody listens for it (its process died): skipped.
        assert not (await c.admit("smtp", "h.example", 2)).admitted
        outcome, lease, in_use = await a.release("smtp", "h.example", first.lease, 2,
                                                 more=True)
        assert (outcome, in_use) == (HANDED, 2) and lease.startswith(f"node1/{b.instance}/h")
        await asyncio.sleep(0.2)
        assert heard_b == [f"smtp\nh.example\n{lease}".encode()]
        assert sorted(await a.holders("smtp", "h.example")) == sorted([second.lease, lease])
        # b's delivery ends with nothing more to send there: the session goes to a,
        # which queued behind b when it gave its session away; a does not listen
        # here, so nobody is handed it and it is simply free.
        outcome, made, in_use = await b.release("smtp", "h.example", lease, 2, more=False)
        assert (outcome, made, in_use) == (RELEASED, "", 1)
        # a with more to send and nobody waiting: kept for a's next delivery.
        outcome, kept, in_use = await a.release("smtp", "h.example", second.lease, 2,
                                                more=True)
        assert (outcome, in_use) == (KEPT, 1) and kept.startswith(f"node0/{a.instance}/k")
        assert await a.holders("smtp", "h.example") == [kept]
        task.cancel()
        await close([a, b, c])

    run(main)


def test_with_a_fleet_rate_the_waiter_is_only_told(redis_server):
    """A start must take its own rate slot: the session is freed and the longest
    waiter told to ask (limit 0), not handed a lease."""
    server = redis_server()

    async def main() -> None:
        a, b = nodes(server, 2)
        heard_b: list[bytes] = []
        task, sub = listen(server, b, heard_b)
        await asyncio.wait_for(sub.subscribed.wait(), 5)
        held = await a.admit("smtp", "r.example", 1, interval=0.001)
        assert not (await b.admit("smtp", "r.example", 1, interval=0.001)).admitted
        assert await a.release("smtp", "r.example", held.lease, 0, more=True) == (TOLD, "", 0)
        await asyncio.sleep(0.2)
        assert heard_b == [b"smtp\nr.example"]
        assert await a.holders("smtp", "r.example") == []
        task.cancel()
        await close([a, b])

    run(main)


def test_redis_losing_its_data_never_loosens_the_session_limit(redis_server):
    """Redis flushed (or restarted empty) while deliveries are under way: the next
    start finds no epoch, asks every node to count again and refuses every start for
    the recount; the nodes renew, counting their leases again; then the limit holds
    over what is really under way (issue #31: the count once restarted at zero)."""
    server = redis_server()

    async def main() -> None:
        fleet = nodes(server)
        held = {n.node: [] for n in fleet}  # type: dict[str, list[str]]
        for i in range(5):
            node = fleet[i % 3]
            answer = await node.admit("smtp", "big.example", 5)
            assert answer.admitted
            held[node.node].append(answer.lease)
        heard: list[bytes] = []
        sub = Subscriber(RedisClient(Endpoint(host="127.0.0.1", port=server.port)), "t:recount",
                         heard.append, timeout=2)
        task = asyncio.get_running_loop().create_task(sub.run())
        await asyncio.sleep(0.3)
        assert await fleet[0].client.call("FLUSHALL") == b"OK"
        t0 = time.monotonic()
        first = await fleet[1].admit("smtp", "big.example", 5)
        assert not first.admitted and first.recount and 2.9 <= first.wait <= 3.0, first
        again = await fleet[2].admit("smtp", "big.example", 5)
        assert not again.admitted and again.recount and again.wait <= first.wait
        await asyncio.sleep(0.3)
        assert heard == [b"recount"]
        # Every node counts its deliveries again, as the daemon does on the recount.
        missing = [await n.renew("smtp", "big.example", held[n.node]) for n in fleet]
        assert sum(missing) == 5
        await asyncio.sleep(max(0.0, 3.05 - (time.monotonic() - t0)))
        after = await fleet[1].admit("smtp", "big.example", 5)
        assert not after.admitted and not after.recount and after.in_use == 5, after
        await fleet[0].release("smtp", "big.example", held["node0"][0])
        assert (await fleet[1].admit("smtp", "big.example", 5)).admitted
        task.cancel()
        await close(fleet)

    run(main)


def test_a_new_fleet_counts_once_before_its_first_start(redis_server):
    server = redis_server()

    async def main() -> None:
        (node,) = nodes(server, 1, counted=False)
        first = await node.admit("smtp", "s.example", 3)
        assert first.recount and not first.admitted
        await asyncio.sleep(first.wait + 0.05)
        assert (await node.admit("smtp", "s.example", 3)).admitted
        await close([node])

    run(main)


def test_the_suspensions_table_forgets_only_what_did_not_change(redis_server):
    """An ended record is taken out only when it is still the one read (a server may
    have written a new one meanwhile); a lost one is written back only when the
    table has none (issue #31: the table never dropped expired records)."""
    server = redis_server()

    async def main() -> None:
        (node,) = nodes(server, 1)
        await node.set_suspension("x.example", '{"old": 1}', "{}")
        await node.set_suspension("x.example", '{"new": 2}', "{}")
        await node.forget_suspension("x.example", b'{"old": 1}')
        assert await node.suspensions() == {"x.example": b'{"new": 2}'}
        await node.forget_suspension("x.example", b'{"new": 2}')
        assert await node.suspensions() == {}
        await node.restore_suspension("y.example", '{"lost": 1}')
        await node.restore_suspension("y.example", '{"stale": 1}')
        assert await node.suspensions() == {"y.example": b'{"lost": 1}'}
        await close([node])

    run(main)


def test_another_redis_process_means_a_recount(redis_server):
    """Redis restarted from a snapshot (or a replica promoted) brings back an epoch
    and counts older than the deliveries under way: the epoch names the Redis process
    that wrote it, and another process's epoch is a recount too."""
    server = redis_server()

    async def main() -> None:
        (node,) = nodes(server, 1)
        assert (await node.admit("smtp", "s.example", 3)).admitted
        assert server.command("SET", "t:epoch", "0123abcd 0") == "OK"
        again = await node.admit("smtp", "s.example", 3)
        assert again.recount and not again.admitted
        epoch = server.command("GET", "t:epoch")
        assert isinstance(epoch, bytes) and epoch.startswith(run_id(server).encode())
        await close([node])

    run(main)


def test_a_rate_key_set_far_ahead_holds_for_one_interval_at_most(redis_server):
    """The GCRA's key says when the next start may be; damage or another writer could
    put it a week ahead. A start of the rate never sets it more than a burst ahead, so
    that is as far as it is believed: one interval's wait, not a week's."""
    server = redis_server()

    async def main() -> None:
        (node,) = nodes(server, 1)
        key = node.key("rate", "smtp", "r.example")
        week = 7 * 86400 * 1000
        t = server.command("TIME")
        assert isinstance(t, list)
        now_ms = int(t[0]) * 1000 + int(t[1]) // 1000
        assert server.command("SET", key, str(now_ms + week)) in ("OK", b"OK")
        answer = await node.admit("smtp", "r.example", 0, interval=0.5, burst=2)
        assert not answer.admitted and 0 < answer.wait <= 0.5, answer
        await close([node])

    run(main)
