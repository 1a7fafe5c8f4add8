"""Metrics bounded at any size (issue #44): activity, the top N and ``_other``, pacing.

Without Postfix: the scheduler is built and driven through its public events, replies
are counted as the daemon counts them, the exposition is read back with
prometheus_client's own parser, and the HTTP listener's pacing is met by real sockets
on loopback. The real daemon scraped by a real Prometheus is tests/test_metrics_real.py.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pyqmgr.daemon.metrics import OTHER, Activity, DeliveryStats
from pyqmgr.daemon.metrics_census import Census, take, walk
from pyqmgr.daemon.metrics_exporter import RENDER_INTERVAL, WALK_SPACING, Pacer, registry_for
from pyqmgr.daemon.metrics_http import MetricsHttpServer
from pyqmgr.postfix.maillog_client import MailLog
from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.entry import Entry
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.structures import SiteLimits, SiteTable
from tests.unit.params import Params

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def samples(s: Scheduler, stats: DeliveryStats, limit: int = 100,
            site_limit: int = 100) -> Samples:
    source = SimpleNamespace(scheduler=s, message_count=0)
    registry = registry_for(source, stats, limit, process=False, site_limit=site_limit)
    out: Samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def series(found: Samples, name: str, label: str) -> dict[str, float]:
    return {dict(labels)[label]: v for (n, labels), v in found.items() if n == name}


def routes(n: int, dest: str, transport: str = "smtp") -> list[Route]:
    return [Route(transport, dest, dest, Recipient(i, f"r{i}@{dest}")) for i in range(n)]


# -- activity ----------------------------------------------------------------------------


def test_activity_counts_the_last_minute_and_forgets_older_slices():
    clock = Clock()
    a: Activity[str] = Activity(span=60.0, parts=6)
    a.advance(clock())
    for _ in range(3):
        a.add("x")
    clock.now += 30
    a.advance(clock())
    a.add("y")
    assert (a.get("x"), a.get("y"), a.get("z")) == (3, 1, 0)
    clock.now += 35  # x's slice is now older than the minute; y's is not
    a.advance(clock())
    assert (a.get("x"), a.get("y")) == (0, 1)
    assert "x" not in a.counts  # nothing kept for a scope gone quiet
    clock.now += 3600  # a quiet hour: everything goes at once
    a.advance(clock())
    assert a.counts == {} and len(a.parts) == 1


def test_activity_memory_is_the_last_minutes_scopes_however_many_came_before():
    clock = Clock()
    a: Activity[int] = Activity()
    for second in range(600):
        clock.now += 1
        a.advance(clock())
        for k in range(100):
            a.add(second * 100 + k)  # 100 new scopes a second, 60,000 over ten minutes
    assert len(a.counts) <= 70 * 100
    assert sum(len(p) for p in a.parts) == len(a.counts)


# -- the top N and _other ----------------------------------------------------------------


def reply(stats: DeliveryStats, entry: Entry, status: int = 0) -> None:
    stats.delivery_done(entry, status, 0.01)


def deliver_all(s: Scheduler, stats: DeliveryStats, n: int) -> None:
    for _ in range(n):
        entry = s.select("smtp", 0.0).deliver
        assert entry is not None
        reply(stats, entry)
        s.done(entry, 0, None, False, 0.0)


def test_destinations_rank_by_activity_queued_and_in_flight_and_other_sums_right():
    """big.example has most waiting; fast.example one waiting, but most answered in
    the last minute: both get series, the rest sums into _other, and every sum over a
    transport's series is its total."""
    stats = DeliveryStats(clock=Clock())
    s = Scheduler(lambda n: Params(destination_recipient_limit=1))
    s.assign(Message("F", 0.0), routes(13, "fast.example"), now=0.0)
    deliver_all(s, stats, 12)
    s.assign(Message("Q1", 0.0), routes(9, "big.example") + routes(2, "mid.example")
             + routes(1, "small.example"), now=0.0)
    assert s.select("smtp", 0.0).deliver is not None  # one in flight somewhere
    found = samples(s, stats, limit=2)
    queued = series(found, "pyqmgr_destination_queued_recipients", "destination")
    assert set(queued) == {"big.example", "fast.example", OTHER}, queued
    totals = {name: value for (name, labels), value in found.items()
              if name.startswith("pyqmgr_transport_") and labels == (("transport", "smtp"),)}
    for gauge in ("queued_recipients", "in_flight", "window"):
        by_dest = series(found, f"pyqmgr_destination_{gauge}", "destination")
        assert sum(by_dest.values()) == totals[f"pyqmgr_transport_{gauge}"], gauge
    assert totals["pyqmgr_transport_queued_recipients"] == 12
    assert found[("pyqmgr_destination_series_folded", (("transport", "smtp"),))] == 2


def test_without_activity_the_largest_backlogs_get_the_series():
    stats = DeliveryStats(clock=Clock())
    s = Scheduler(lambda n: Params(destination_recipient_limit=1))
    s.assign(Message("Q1", 0.0), routes(3, "slow.example") + routes(40, "quick.example")
             + routes(1, "tiny.example"), now=0.0)
    found = samples(s, stats, limit=1)
    assert set(series(found, "pyqmgr_destination_window", "destination")) == {
        "quick.example", OTHER}


def sited(n: int, limit: int = 2) -> Scheduler:
    table = SiteTable(lambda t: SiteLimits(limit, "site_concurrency_limit in pyqmgr.cf"),
                      pinned={f"d{i}.example": f"site{i % 7}" for i in range(n)})
    s = Scheduler(lambda x: Params(destination_recipient_limit=1), sites=table)
    for i in range(n):
        s.assign(Message(f"Q{i}", 0.0), routes(1 + i % 3, f"d{i}.example"), now=0.0)
    return s


def test_sites_beyond_the_limit_sum_into_other_and_the_sums_stay_right():
    s = sited(30)
    while s.select("smtp", 0.0).deliver is not None:
        pass
    stats = DeliveryStats()
    found = samples(s, stats, site_limit=3)
    in_flight = series(found, "pyqmgr_site_in_flight", "site")
    members = series(found, "pyqmgr_site_destinations", "site")
    held = series(found, "pyqmgr_site_held", "site")
    assert len(in_flight) == 4 and OTHER in in_flight
    assert sum(in_flight.values()) == found[("pyqmgr_transport_in_flight",
                                             (("transport", "smtp"),))] == 14
    assert sum(members.values()) == 30
    assert sum(held.values()) == 7  # every site is full
    assert OTHER not in series(found, "pyqmgr_site_limit", "site")
    assert found[("pyqmgr_site_series_folded", (("transport", "smtp"),))] == 4
    everything = samples(s, stats, site_limit=100)
    assert OTHER not in series(everything, "pyqmgr_site_in_flight", "site")
    assert everything[("pyqmgr_site_series_folded", (("transport", "smtp"),))] == 0


def test_100000_sites_and_destinations_make_a_scrape_under_1_mb():
    """Issue #44: 4 series a site made 100,000 sites a 30 MB scrape; now the limit."""
    n = 100_000
    table = SiteTable(lambda t: SiteLimits(10, "site_concurrency_limit in pyqmgr.cf"),
                      pinned={f"d{i}.example": f"mx{i}.example" for i in range(n)})
    s = Scheduler(lambda x: Params(), sites=table)
    for k in range(10):
        part = range(k * n // 10, (k + 1) * n // 10)
        s.assign(Message(f"Q{k}", 0.0), [Route("smtp", f"d{i}.example", f"d{i}.example",
                                               Recipient(i, f"r@d{i}.example"))
                                         for i in part], now=0.0)
    assert s.queue_count == n and len(table.sites) == n
    source = SimpleNamespace(scheduler=s, message_count=10)
    text = generate_latest(registry_for(source, DeliveryStats(), 100, process=False))
    lines = text.count(b"\n")
    print(f"100,000 sites and destinations: {len(text)} bytes, {lines} lines")
    assert len(text) < 100_000
    assert text.count(b'pyqmgr_site_in_flight{') == 101
    assert text.count(b'pyqmgr_destination_window{') == 101


# -- tenants -------------------------------------------------------------------------------


def tenant_entries(s: Scheduler, tenants: list[str]) -> list[Entry]:
    for i, tenant in enumerate(tenants):
        m = Message(f"T{i}", 0.0)
        m.tenant = tenant
        s.assign(m, routes(1, f"t{i}.example"), now=0.0)
    out = []
    while (entry := s.select("smtp", 0.0).deliver) is not None:
        out.append(entry)
    return out


def test_tenants_the_most_active_get_series_and_other_only_grows():
    clock = Clock()
    stats = DeliveryStats(clock=clock, tenant_limit=2)
    s = Scheduler(lambda n: Params(destination_recipient_limit=1))
    entries = tenant_entries(s, ["a", "b"] + ["c"] * 5 + ["d"])
    for e in entries:
        reply(stats, e)
    # a and b came first and took the two places; c's five went to _other meanwhile.
    assert set(stats.tenants) == {"a", "b"}
    other = stats.tenant_other
    assert other is not None and other.deliveries[0] == 6
    clock.now += 11  # a slice later the ranking is made again: c is the most active
    stats.advance()
    assert set(stats.tenants) == {"c", "a"} or set(stats.tenants) == {"c", "b"}
    assert stats.tenants["c"].deliveries == [0, 0, 0]  # a new series starts at 0
    assert other.deliveries[0] == 6  # _other keeps what it counted: it never drops
    found = samples(s, stats)
    assert ("pyqmgr_tenant_deliveries_total", (("outcome", "final"), ("tenant", OTHER))) \
        in found


def test_equally_active_tenants_keep_their_series():
    clock = Clock()
    stats = DeliveryStats(clock=clock, tenant_limit=3)
    s = Scheduler(lambda n: Params(destination_recipient_limit=1))
    for e in tenant_entries(s, [f"t{i}" for i in range(10)] * 2):
        reply(stats, e)
    first = set(stats.tenants)
    for _ in range(5):
        clock.now += 11
        stats.advance()
        assert set(stats.tenants) == first


def test_10000_tenants_keep_the_limit_of_series():
    clock = Clock()
    stats = DeliveryStats(clock=clock, tenant_limit=100)
    s = Scheduler(lambda n: Params(destination_recipient_limit=1))
    for e in tenant_entries(s, [f"tenant{i}" for i in range(10_000)]):
        reply(stats, e)
    clock.now += 11
    stats.advance()
    assert len(stats.tenants) == 100
    found = samples(s, stats)
    tenants = {dict(labels)["tenant"] for name, labels in found
               if name == "pyqmgr_tenant_deliveries_total"}
    assert len(tenants) == 101


# -- the census in slices ------------------------------------------------------------------


def test_a_census_taken_in_slices_passes_over_queues_that_left_the_core():
    s = Scheduler(lambda n: Params())
    s.assign(Message("Q1", 0.0), [r for i in range(600) for r in routes(1, f"d{i}.example")],
             now=0.0)
    steps = walk(s, 10, 10, lambda key: 0, lambda key: 0)
    next(steps)  # the first 256 destinations are walked
    for _ in range(600):  # every destination's mail goes; the rest leave the core
        entry = s.select("smtp", 0.0).deliver
        assert entry is not None
        s.done(entry, 0, None, False, 0.0)
    census = None
    while census is None:
        try:
            next(steps)
        except StopIteration as done:
            census = done.value
    assert census.transports["smtp"][4] == 256
    assert take(s, 10, 10, lambda k: 0, lambda k: 0).transports["smtp"] == [0, 0, 0, 0, 0]


# -- pacing --------------------------------------------------------------------------------


class FakeWalk:
    """A walk of ``slices`` slices, each taking ``cost`` seconds of the clock."""

    def __init__(self, clock: Clock, slices: int, cost: float) -> None:
        self.clock, self.slices, self.cost = clock, slices, cost
        self.started = 0

    def __call__(self) -> Generator[None, None, Census]:
        self.started += 1
        return self._run()

    def _run(self) -> Generator[None, None, Census]:
        for _ in range(self.slices - 1):
            self.clock.now += self.cost
            yield
        self.clock.now += self.cost
        return Census()


def pacer(clock: Clock, fake: FakeWalk,
          timers: list[tuple[float, Callable[[], None]]]) -> Pacer:
    def later(delay: float, callback: Callable[[], None]) -> object:
        timers.append((delay, callback))
        return None

    return Pacer(fake, lambda census: f"rendering of census {id(census)}".encode(),
                 clock=clock, later=later, slice_=0.002, pause=0.008)


def test_a_rendering_is_served_again_within_the_interval():
    clock, timers = Clock(), []
    fake = FakeWalk(clock, 1, 0.0001)
    p = pacer(clock, fake, timers)
    first = p.body()
    assert first is not None and p.renders == 1 and fake.started == 1
    for _ in range(100):  # a client in a loop
        clock.now += RENDER_INTERVAL / 200
        assert p.body() == first
    assert (p.renders, p.reused, fake.started) == (1, 100, 1)
    clock.now += RENDER_INTERVAL
    assert p.body() is not None and p.renders == 2 and fake.started == 2
    assert not timers  # a small core's walk ends within its first slice


def test_a_long_census_runs_in_slices_and_waits_its_cost_a_hundred_times():
    clock, timers = Clock(), []
    fake = FakeWalk(clock, 40, 0.0025)  # 0.1 s of walking, no step shorter than a slice
    p = pacer(clock, fake, timers)
    woken = []
    assert p.body() is None  # the first census is under way: the scraper waits
    p.when_ready(lambda: woken.append(p.body()))
    while timers:
        delay, step = timers.pop(0)
        clock.now += delay
        step()
    assert woken and woken[0] is not None
    census = p.census
    assert census is not None and census.turns == 40
    assert census.longest == pytest.approx(0.0025) and census.cpu == pytest.approx(0.1)
    # Renderings keep coming once a second, from that census, until a hundred times
    # its CPU has passed: the walks take 1% of the loop at most.
    for _ in range(int(WALK_SPACING * 0.1 / RENDER_INTERVAL) - 1):
        clock.now += RENDER_INTERVAL
        assert p.body() is not None
        assert fake.started == 1 and not timers
    clock.now += 2 * RENDER_INTERVAL
    before = clock.now
    assert p.body() is not None  # served from the old census while the new one runs
    assert fake.started == 2 and timers
    # The scrape's turn was the rendering alone: the walk's first slice is a turn
    # of its own, timed at once.
    assert clock.now == before and timers[0][0] == 0.0


def test_a_walk_that_raises_answers_500_and_mail_is_untouched():
    clock = Clock()

    def broken() -> Generator[None, None, Census]:
        raise RuntimeError("a bug")
        yield  # pragma: no cover

    p = Pacer(broken, lambda c: b"", clock=clock, later=lambda d, f: None)
    with pytest.raises(RuntimeError):
        p.body()


class Body:
    def body(self) -> bytes:
        return b"x" * 1000

    def when_ready(self, callback: Callable[[], None]) -> None:
        callback()


def test_clients_in_a_loop_get_at_most_the_accept_rate():
    """16 clients connecting in a loop for a second: the listener accepts its burst and
    then ACCEPT_RATE a second; the rest wait in the kernel's backlog, not on the loop."""

    async def run() -> tuple[int, int, float]:
        log = MailLog("pyqmgr-test")
        server = MetricsHttpServer(Body(), log, rate=20.0, burst=8)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        sock.setblocking(False)
        server.serve(sock)
        port = sock.getsockname()[1]
        loop = asyncio.get_running_loop()
        stop = time.monotonic() + 1.0
        answered = 0

        def client() -> int:
            got = 0
            while time.monotonic() < stop:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=2) as c:
                        c.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                        while c.recv(65536):
                            pass
                    got += 1
                except OSError:
                    pass
            return got

        started = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            results = await asyncio.gather(*(loop.run_in_executor(pool, client)
                                             for _ in range(16)))
        answered = sum(results)
        elapsed = time.monotonic() - started
        server.close()
        return answered, server.accepted, elapsed

    answered, accepted, elapsed = asyncio.run(run())
    print(f"16 clients in a loop for {elapsed:.2f} s: {accepted} accepted, "
          f"{answered} answered")
    assert accepted <= 8 + 20 * elapsed + 1
    assert answered >= 8
