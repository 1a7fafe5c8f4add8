"""The warm-up's credits script on Debian's real redis-server (pyqmgr/fleet/warmup.py,
issue #46 item 2): two servers asking at once never get more than the allowance
together, what a server owes is added and what it gives back taken off, the key
lives under the fleet's prefix until an hour past the window, and the fleet's ACL
user may run it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from pyqmgr.fleet.acl import acl_rules
from pyqmgr.fleet.client import Endpoint, RedisClient
from pyqmgr.fleet.shared import Shared
from pyqmgr.fleet.warmup import KEEP_AFTER, WarmupCredits
from pyqmgr.testbed.redis import RedisServer

DAY = 86400.0


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 60))


def servers(redis: RedisServer, n: int = 2, **endpoint: object) -> list[WarmupCredits]:
    return [WarmupCredits(Shared(RedisClient(Endpoint(host="127.0.0.1", port=redis.port,
                                                      **endpoint),  # type: ignore[arg-type]
                                             timeout=5), "t:", f"node{i}", 60.0))
            for i in range(n)]


async def close(fleet: list[WarmupCredits]) -> None:
    for w in fleet:
        await w.shared.client.close()


def test_two_servers_asking_at_once_never_get_more_than_the_allowance(redis_server):
    redis = redis_server()

    async def main() -> None:
        a, b = servers(redis)
        now = time.time()
        window = int(now // DAY)
        # Each server asks for 3 credits again and again, as its routing spends them,
        # both at once: Redis runs each script whole, one after the other.
        answers: list[list[tuple[int, int]]] = [[], []]

        async def server(i: int, w: WarmupCredits) -> None:
            for _ in range(60):
                answers[i].append(await w.take("src1", "mx.google.com", window, DAY, 100,
                                               3, 0, now))

        await asyncio.gather(server(0, a), server(1, b))
        granted = [sum(g for g, _ in got) for got in answers]
        counts = [c for got in answers for _, c in got]
        print(f"\n60 questions of 3 credits from each of two servers at once: granted "
              f"{granted[0]} + {granted[1]}, the fleet's count at most {max(counts)}")
        assert sum(granted) == 100 and max(counts) == 100
        assert all(g > 0 for g in granted), granted
        assert all(0 <= g <= 3 for got in answers for g, _ in got)
        # Pipelined on both connections at once: still 100, never more.
        burst = await asyncio.gather(*((a if i % 2 else b).take(
            "src1", "burst", window, DAY, 100, 3, 0, now) for i in range(400)))
        assert sum(g for g, _ in burst) == 100 and max(c for _, c in burst) == 100
        # Another site, another source, another window: counts of their own.
        assert (await a.take("src1", "outlook", window, DAY, 100, 3, 0, now))[0] == 3
        assert (await a.take("src2", "mx.google.com", window, DAY, 100, 3, 0, now))[0] == 3
        assert (await b.take("src1", "mx.google.com", window + 1, DAY, 100, 3, 0,
                             now))[0] == 3
        assert (await b.take("src1", "mx.google.com", window, 3600.0, 100, 3, 0,
                             now))[0] == 3, "an hour's window is not a day's"
        await close([a, b])

    run(main)


def test_owed_is_added_given_back_taken_off_and_the_key_expires_after_the_window(
        redis_server):
    redis = redis_server()

    async def main() -> None:
        (a,) = servers(redis, 1)
        now = time.time()
        window = int(now // DAY)
        key = a.key("src1", "google", window, DAY)
        assert key.startswith("t:{") and key.endswith(f"}}:warmup:{window}/86400:src1:google")
        assert await a.take("src1", "google", window, DAY, 10, 4, 0, now) == (4, 4)
        # 8 taken without credit while Redis was away: counted, past the allowance.
        assert await a.take("src1", "google", window, DAY, 10, 4, 8, now) == (0, 12)
        assert await a.give_back("src1", "google", window, DAY, 5, now) == 7
        assert await a.take("src1", "google", window, DAY, 10, 4, 0, now) == (3, 10)
        assert await a.give_back("src1", "google", window, DAY, 50, now) == 0, "not below 0"
        ttl = redis.command("PTTL", key)
        assert isinstance(ttl, int)
        left = ((window + 1) * DAY - now + KEEP_AFTER) * 1000
        assert left - 5000 <= ttl <= left, (ttl, left)
        await close([a])

    run(main)


def test_the_fleets_acl_user_may_run_the_script(redis_server):
    redis = redis_server()
    assert redis.command("ACL", "SETUSER", "fleet", "on", ">pw-for-the-fleet",
                         *acl_rules("t:")) in ("OK", b"OK")

    async def main() -> None:
        (a,) = servers(redis, 1, user="fleet", password="pw-for-the-fleet")
        now = time.time()
        assert await a.take("src1", "google", int(now // DAY), DAY, 10, 2, 0, now) == (2, 2)
        await close([a])

    run(main)
    assert redis.command("ACL", "LOG") == [], "nothing refused"


# -- the daemon's half (pyqmgr/daemon/fleet/warmup.py) over the same real Redis ----------


class _Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def warning(self, text: str) -> None:
        self.lines.append("warning: " + text)

    def info(self, text: str) -> None:
        self.lines.append(text)


def _daemon_half(redis: RedisServer, failure: str, allowance: int = 10):
    from types import SimpleNamespace

    from pyqmgr.daemon.fleet.warmup import FleetWarmup
    from pyqmgr.scheduler.source import Pool, SourceBook, WarmupPlan

    now = time.time()
    book = SourceBook({"bulk": Pool("bulk", ("src1", "src2"), (1, 1))},
                      WarmupPlan(((0, allowance),)), {"src1": now - now % DAY})
    tasks: set[asyncio.Task[None]] = set()
    log = _Log()
    host = SimpleNamespace(log=log, spawn=lambda coro: tasks.add(
        asyncio.get_running_loop().create_task(coro)))
    shared = Shared(RedisClient(Endpoint(host="127.0.0.1", port=redis.port), timeout=0.5),
                    "pyqmgr:", "node0", 60.0)
    fleet = SimpleNamespace(shared=shared, at_exit=[], settings=SimpleNamespace(
        endpoint=redis.url, failure=failure))
    warmup = FleetWarmup(host, fleet, book, time.time)  # type: ignore[arg-type]
    return book, warmup, log, tasks, fleet


async def _route(book, warmup, n: int, tag: str, site: str = "google") -> int:
    """n recipients routed a loop turn apart (the credits' answers come between)."""
    cold = 0
    for i in range(n):
        cold += book.choose("bulk", site, time.time(), (tag, i)) == "src1"
        warmup.poke()
        await asyncio.sleep(0.005)
    return cold


def test_the_daemons_half_asks_as_routing_runs_low_and_counts_here_when_redis_is_gone(
        redis_server):
    """shared_state_failure = local: Redis gone, the server counts against its own
    plan, and what it took is added to the fleet's count when Redis is back."""
    redis = redis_server()

    async def main() -> None:
        book, warmup, log, tasks, fleet = _daemon_half(redis, "local")
        cold = await _route(book, warmup, 40, "a")
        status = warmup.status()
        print(f"\n40 recipients, allowance 10: {cold} from the cold source, "
              f"{status['credits_asked']} questions, {status['credits_granted']} granted")
        assert cold == 10 and status["credits_granted"] == 10
        assert warmup.fleet_counts[("src1", "google")] == 10
        taken = [k for k, r in book.reservations.items() if r.source == "src1"]
        for key in taken[:4]:
            book.ended(key, sent=False)  # deferred in core: credits to spend again
        redis.stop(remove=False)
        assert await _route(book, warmup, 20, "b") == 4, "the 4 credits given back"
        assert not warmup.down, "no question while the fleet has none left"
        # A site not asked for yet: no answer, so the server counts alone, once said.
        assert await _route(book, warmup, 40, "c", "outlook") == 10
        assert warmup.down and book.credits is not None and book.credits.away
        warnings = [ln for ln in log.lines if ln.startswith("warning:")]
        assert len(warnings) == 1 and "shared_state_failure = local" in warnings[0]
        assert book.credits.spent[("src1", "outlook")] >= 9
        redis.start()
        for i in range(50):  # a question each AWAY_RETRY, after the client's retry delay
            await _route(book, warmup, 1, f"d{i}", "outlook")
            await asyncio.sleep(0.1)
            if not warmup.down:
                break
        assert not warmup.down and "answering again" in log.lines[-1]
        window = int(time.time() // DAY)
        outlook = warmup.redis.key("src1", "outlook", window, DAY)
        assert redis.command("GET", outlook) == b"10", "what it took alone, now the fleet's"
        # At exit: nothing held, nothing owed; the fleet's counts stay what was taken.
        await asyncio.gather(*(part() for part in fleet.at_exit))
        assert redis.command("GET", outlook) == b"10"
        await warmup.redis.shared.client.close()
        for t in tasks:
            t.cancel()

    run(main)


def test_hold_takes_nothing_without_redis_and_exit_gives_credits_back(redis_server):
    redis = redis_server()

    async def main() -> None:
        book, warmup, log, tasks, fleet = _daemon_half(redis, "hold", allowance=100)
        cold = await _route(book, warmup, 9, "a")
        assert cold == 4, "the first warm (no answer yet), then every other one"
        assert book.credits is not None
        held = book.credits.held[("src1", "google")]
        window = int(time.time() // DAY)
        google = warmup.redis.key("src1", "google", window, DAY)
        assert int(redis.command("GET", google)) == cold + held  # type: ignore[arg-type]
        # Exit: the credits held, and the reservations never sent, go back: the
        # fleet's count keeps the 3 deliveries that left.
        for key in [k for k, r in book.reservations.items() if r.source == "src1"][:3]:
            book.started(key)
        await asyncio.gather(*(part() for part in fleet.at_exit))
        assert redis.command("GET", google) == b"3"
        redis.stop(remove=False)
        assert await _route(book, warmup, 20, "b", "outlook") == 0
        warnings = [ln for ln in log.lines if ln.startswith("warning:")]
        assert len(warnings) == 1 and "shared_state_failure = hold" in warnings[0], log.lines
        assert not book.credits.away
        await warmup.redis.shared.client.close()
        for t in tasks:
            t.cancel()

    run(main)
