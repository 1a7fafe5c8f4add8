"""A fleet's warm-up credits seen in the metrics and in ``pyqmgr top`` (issue #46 item 4).

The book is the real core (:class:`SourceBook` sharing its counts as credits) and the
asking is the daemon's own :class:`FleetWarmup` on a real event loop, poked after each
choice as :meth:`Sources.route` pokes it; only Redis is a stand-in here that grants
as the fleet's script does (``min(want, allowance - count)``) or does not answer. The
real servers on a real Redis are tests/test_sources_fleet_real.py, whose scrape is
checked against ``pyqmgr status`` too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pyqmgr.control.top import frame
from pyqmgr.daemon.fleet.warmup import FleetWarmup
from pyqmgr.daemon.metrics_sources import SourcesCollector
from pyqmgr.fleet.client import RedisUnavailable
from pyqmgr.scheduler.source import DAY, HOUR, Pool, SourceBook, WarmupPlan
from pyqmgr.settings.sources import parse_start

START = parse_start("2026-11-20")
NOW = START + 12 * HOUR
PLAN = 100  # a chunk is 2 credits


class Fleet:
    """Redis's side of the warm-up credits: one count per (source, site)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        self.down = False

    async def take(self, source: str, site: str, window: int, seconds: float,
                   allowance: int, want: int, owed: int, now: float) -> tuple[int, int]:
        if self.down:
            raise RedisUnavailable("connection refused")
        pair = (source, site)
        count = self.counts.get(pair, 0) + owed
        granted = max(0, min(want, allowance - count))
        self.counts[pair] = count + granted
        return granted, self.counts[pair]


class Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, text: str) -> None:
        self.lines.append(text)

    warning = info


def fleet_book() -> tuple[SourceBook, FleetWarmup, Fleet, list[asyncio.Task[Any]]]:
    """src1 and src2 cold (each its own series), src3 warm; the daemon's FleetWarmup."""
    book = SourceBook({"bulk": Pool("bulk", ("src1", "src2", "src3"), (1, 1, 1))},
                      WarmupPlan(((0, PLAN),), DAY), {"src1": START, "src2": START})
    tasks: list[asyncio.Task[Any]] = []

    def spawn(coro: Coroutine[Any, Any, None]) -> None:
        tasks.append(asyncio.ensure_future(coro))

    host = SimpleNamespace(spawn=spawn, log=Log())
    node = SimpleNamespace(shared=None, at_exit=[],
                           settings=SimpleNamespace(endpoint="redis://127.0.0.1:6379",
                                                    failure="local"))
    warmup = FleetWarmup(host, node, book, lambda: NOW)  # type: ignore[arg-type]
    redis = Fleet()
    warmup.redis = redis  # type: ignore[assignment]
    return book, warmup, redis, tasks


async def route(book: SourceBook, warmup: FleetWarmup, tasks: list[asyncio.Task[Any]],
                n: int, tag: str, site: str = "google") -> None:
    """``n`` recipients, each chosen and then the credits poked for, as the daemon
    does; the questions answered before the next recipient (a busy loop's worst)."""
    for i in range(n):
        book.choose("bulk", site, NOW, (tag, site, i))
        warmup.poke()
        await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        tasks.clear()


def scrape(sources: object) -> dict[str, float]:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(SourcesCollector(sources))  # type: ignore[arg-type]
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def fleet_series(got: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in got.items() if k.startswith("pyqmgr_source_fleet_")}


def test_the_fleets_credits_in_the_metrics_equal_the_status() -> None:
    book, warmup, redis, tasks = fleet_book()
    sources = SimpleNamespace(book=book, clock=lambda: NOW, warmup=warmup)

    async def run() -> None:
        await route(book, warmup, tasks, 40, "a")
        await route(book, warmup, tasks, 20, "b", site="yahoo")

    asyncio.run(run())
    credits = warmup.credits
    status = {**book.status(NOW), **warmup.status()}
    got = fleet_series(scrape(sources))
    held = {s: sum(n for (src, _), n in credits.held.items() if src == s)
            for s in ("src1", "src2")}
    assert sum(held.values()) > 0, credits.held
    assert got == {
        'pyqmgr_source_fleet_credits_held{source="src1"}': held["src1"],
        'pyqmgr_source_fleet_credits_held{source="src2"}': held["src2"],
        'pyqmgr_source_fleet_credits_owed{source="src1"}': 0,
        'pyqmgr_source_fleet_credits_owed{source="src2"}': 0,
        "pyqmgr_source_fleet_credits_asked_total": status["credits_asked"],
        "pyqmgr_source_fleet_credits_granted_total": status["credits_granted"],
        "pyqmgr_source_fleet_credits_given_back_total": 0,
        "pyqmgr_source_fleet_credits_errors_total": 0,
        "pyqmgr_source_fleet_unavailable": 0,
    }, got
    assert status["credits_held"] == sum(held.values())
    # What the fleet granted is what was spent here plus what is held: nothing lost.
    assert status["credits_granted"] == sum(redis.counts.values()) == \
        sum(book.counts.values()) + sum(held.values()) > 0
    assert int(status["credits_asked"]) >= 4  # type: ignore[call-overload]

    # Redis stops answering (shared_state_failure = local): counted here, owed.
    redis.down = True
    asyncio.run(route(book, warmup, tasks, 40, "c"))
    got = fleet_series(scrape(sources))
    assert warmup.down and got["pyqmgr_source_fleet_unavailable"] == 1
    assert got["pyqmgr_source_fleet_credits_errors_total"] >= 1
    owed = sum(credits.spent.values())
    assert owed > 0 and got['pyqmgr_source_fleet_credits_owed{source="src1"}'] + \
        got['pyqmgr_source_fleet_credits_owed{source="src2"}'] == owed


def test_without_a_fleet_nothing_new_is_scraped() -> None:
    book = SourceBook({"bulk": Pool("bulk", ("src1", "src2"), (1, 1))},
                      WarmupPlan(((0, PLAN),), DAY), {"src1": START})
    for i in range(10):
        book.choose("bulk", "google", NOW, i)
    got = scrape(SimpleNamespace(book=book, clock=lambda: NOW, warmup=None))
    assert got['pyqmgr_source_warmup_counted{source="src1"}'] == 5
    assert fleet_series(got) == {}


def test_top_shows_the_fleets_credits_and_whether_redis_answers() -> None:
    book, warmup, redis, tasks = fleet_book()

    async def run(n: int, tag: str) -> dict[str, object]:
        await route(book, warmup, tasks, n, tag)
        return {"sources": {**book.status(NOW), **warmup.status()}}

    first = asyncio.run(run(1, "a"))
    lines = [text for text, _ in frame(first, None, "name")]
    (line,) = [ln for ln in lines if ln.startswith("fleet credits:")]
    # Both cold sources asked for a chunk (2) at the first recipient, which went warm.
    assert line == ("fleet credits: 4 held here, 0 owed; 2 asked, 4 granted, 0 given "
                    "back; Redis answers"), line
    second = asyncio.run(run(1, "b"))
    got = dict(frame(second, first, "name"))
    (line,) = [ln for ln in got if ln.startswith("fleet credits:")]
    # One credit spent, and both pairs held a chunk or fewer: each asked for another.
    assert line.startswith("fleet credits: 7 held here (+3), 0 owed; 4 asked, 8 granted"), line
    assert got[line] is True, "the held credits changed: the line is bold"

    redis.down = True
    third = asyncio.run(run(20, "c"))  # past the 7 credits held
    (line,) = [ln for ln, _ in frame(third, second, "name")
               if ln.startswith("fleet credits:")]
    owed = warmup.credits.status()["owed"]
    assert isinstance(owed, int) and owed > 0
    assert f", {owed} owed;" in line and line.endswith(
        "fleet UNAVAILABLE (shared_state_failure = local: counting here alone)"), line
    # Without a fleet, no such line.
    plain = SourceBook({"bulk": Pool("bulk", ("src1", "src2"), (1, 1))},
                       WarmupPlan(((0, PLAN),), DAY), {"src1": START})
    assert not any(ln.startswith("fleet credits:") for ln, _ in
                   frame({"sources": plain.status(NOW)}, None, "name"))
