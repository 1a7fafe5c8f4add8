"""The Prometheus exporter: the scheduler's own numbers, paced so that no scraper costs mail.

Imported only when pyqmgr.cf sets ``metrics_listen`` (start-up imports it before the
chroot, after :func:`pyqmgr.daemon.metrics.import_exporter`); with metrics off,
neither this module nor prometheus_client is ever loaded.

Nothing here runs on the delivery path. Counters come from plain ints that the core
(:class:`~pyqmgr.scheduler.transport.Transport`: feedback steps, deaths, preemptions)
and the daemon (:class:`~pyqmgr.daemon.metrics.DeliveryStats`) raise in O(1); gauges
come from a census of the core (:mod:`.metrics_census`), taken by a walk in slices of
at most :data:`SLICE` seconds of the event loop, so that no gauge is kept up to date on
every event and no scrape holds deliveries up, however large the core.

**Paced** (issue #44). The exposition is rendered at most once every
:data:`RENDER_INTERVAL` seconds, and every scrape in between gets those bytes again;
a census is taken at most that often, and, when the last one took longer,
:data:`WALK_SPACING` times its CPU after it (:class:`Pacer`). With the accept pacing
of :mod:`.metrics_http`, what scrapers can cost the loop is bounded whatever they do.

**Label cardinality is bounded.** ``transport`` takes master.cf's services (and only
those that were used). ``destination`` and ``site`` are given only to in-core ones (the
core discards idle ones, so a destination with nothing queued or in flight has no
series at all), and only to the ``metrics_destination_limit`` and
``metrics_site_limit`` most active of them (100 each; the census's docstring defines
activity); every other one of a transport is summed into one series labelled
``_other``. ``tenant`` goes to the ``metrics_tenant_limit`` most active tenants
(:meth:`.metrics.DeliveryStats.rank_tenants`). So a server with 100,000 destinations
and as many sites in core exports a few hundred lines, and a scrape costs the same as
with a few hundred (benchmarks/metrics_scale.py).
"""

from __future__ import annotations

import asyncio
import errno
import math
import socket
import time
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

from pyqmgr.daemon.fleet.metrics import FleetCollector
from pyqmgr.daemon.host import QmgrCore
from pyqmgr.daemon.metrics import (
    DEFAULT_SITE_LIMIT,
    OTHER,
    OUTCOMES,
    DeliveryStats,
    MetricsSettings,
    TransportStats,
)
from pyqmgr.daemon.metrics_census import Census, take, walk
from pyqmgr.daemon.metrics_http import MetricsHttpServer
from pyqmgr.daemon.metrics_sources import SourcesCollector
from pyqmgr.events.metrics import EventsCollector
from pyqmgr.events.tracker import DeliveryEvents
from pyqmgr.postfix.maillog_client import MailLog
from pyqmgr.scheduler.core import Scheduler

if TYPE_CHECKING:
    from pyqmgr.daemon.fleet import Fleet
    from pyqmgr.daemon.sources import Sources

__all__ = ["OTHER", "Exporter", "Exposition", "Pacer", "SchedulerCollector", "registry_for",
           "start"]

#: Seconds a rendering is served again before a new one is made.
RENDER_INTERVAL = 1.0
#: Seconds of the loop a census's walk takes at most in one turn, and the pause
#: between two of its turns (so that a long walk takes at most a fifth of the loop).
SLICE = 0.002
PAUSE = 0.008
#: A new census waits at least this many times the last one's CPU after it ended:
#: the walks take at most 1% of a core, however many scopes are in core.
WALK_SPACING = 100.0

#: Quiet retries of a bind that failed (a reloaded qmgr's predecessor may still hold
#: the port for a moment), then one warning and a retry every BIND_RETRY_INTERVAL.
BIND_QUIET_FOR = 5.0
BIND_QUIET_STEP = 0.25
BIND_RETRY_INTERVAL = 10.0

#: The per-transport gauges (name, help), in the order their values are computed.
TRANSPORT_GAUGES = (
    ("pyqmgr_transport_window",
     "Sum of the concurrency windows of the transport's in-core destinations."),
    ("pyqmgr_transport_in_flight", "Deliveries out with the transport's agents."),
    ("pyqmgr_transport_agents_pending",
     "Agent connections asked for and not yet announced."),
    ("pyqmgr_transport_queued_recipients", "Recipients in core waiting for an agent."),
    ("pyqmgr_transport_destinations",
     "In-core destinations (all, not only those with a series)."),
    ("pyqmgr_transport_dead", "1 while the transport is dead (transport_retry_time)."),
    ("pyqmgr_transport_process_limit",
     "master.cf's process limit of the transport (0: none)."),
    ("pyqmgr_transport_destination_concurrency_limit",
     "The transport's destination concurrency limit (0: none)."),
)
#: The per-destination gauges (name, help), in a row's order of values.
DESTINATION_GAUGES = (
    ("pyqmgr_destination_window",
     "The destination's concurrency window (0 while dead); _other: the sum."),
    ("pyqmgr_destination_in_flight", "Deliveries to the destination out with agents."),
    ("pyqmgr_destination_queued_recipients",
     "Recipients for the destination waiting for an agent."),
    ("pyqmgr_destination_dead", "1 while the destination is dead; _other: how many are."),
)


class Source(QmgrCore, Protocol):
    """What the collector reads of the daemon (:class:`~pyqmgr.daemon.qmgr.Qmgr`)
    beyond the core: the active queue's message count."""

    @property
    def message_count(self) -> int: ...


class SchedulerCollector:
    """A prometheus_client collector over the scheduler and the delivery counts.

    ``source.scheduler`` is read on every scrape, not kept: the daemon may replace its
    scheduler at start-up (pyqmgr.cf's policies). The gauges are those of
    :attr:`census` when the exporter set one (:class:`Pacer`), else of a census taken
    at once.
    """

    def __init__(self, source: Source, stats: DeliveryStats,
                 destination_limit: int, site_limit: int = DEFAULT_SITE_LIMIT) -> None:
        self.source = source
        self.stats = stats
        self.destination_limit = destination_limit
        self.site_limit = site_limit
        self.census: Census | None = None

    def walk(self) -> Generator[None, None, Census]:
        """A census's walk, to be run in slices."""
        stats = self.stats
        return walk(self.source.scheduler, self.destination_limit, self.site_limit,
                    stats.destination_activity.get, stats.site_activity.get)

    def collect(self) -> Iterator[Metric]:
        sched = self.source.scheduler
        census = self.census
        if census is None:
            stats = self.stats
            census = take(sched, self.destination_limit, self.site_limit,
                          stats.destination_activity.get, stats.site_activity.get)
        yield from self._deliveries(sched)
        yield from self._core_counters(sched)
        yield from self._histograms()
        yield from self._gauges(sched, census)
        tenants = dict(self.stats.tenants)
        if self.stats.tenant_other is not None:
            tenants[OTHER] = self.stats.tenant_other
        for label, table in (("class", self.stats.classes), ("tenant", tenants)):
            if table:
                yield from self._kind(label, table)
        # The daemon's classifier, when classes or tenants are on (issue #45).
        classes = getattr(self.source, "classifier", None)
        if classes is not None and classes.sender_keys:
            yield CounterMetricFamily(
                "pyqmgr_untrusted_sender_keys_messages", "Messages from clients that "
                "sender_keys_trusted_clients does not trust, whose sender address or "
                "headers were therefore not used for class or tenant.",
                value=classes.untrusted)
        if classes is not None and classes.unlisted_limit:
            yield CounterMetricFamily(
                "pyqmgr_unlisted_tenant_folded_messages", "Messages made tenant _other "
                "because unlisted_tenant_limit tenants already had mail in the active "
                "queue.", value=classes.folded)

    @staticmethod
    def _kind(label: str, table: dict[str, TransportStats]) -> Iterator[Metric]:
        """Per message class or tenant (issue #34): replies by outcome, and the age at
        a final reply (a class's delay is what priority is for)."""
        deliveries = CounterMetricFamily(
            f"pyqmgr_{label}_deliveries", f"Delivery requests answered, by the message's "
            f"{label} and outcome.", labels=[label, "outcome"])
        age = HistogramMetricFamily(
            f"pyqmgr_{label}_message_age_at_delivery_seconds", f"The message's age at a "
            f"final reply, by its {label}.", labels=[label])
        for name in sorted(table):
            stats = table[name]
            for i, outcome in enumerate(OUTCOMES):
                deliveries.add_metric([name, outcome], stats.deliveries[i])
            if stats.age.count:
                age.add_metric([name], [(floatToGoString(le), count)
                                        for le, count in stats.age.cumulative()],
                               stats.age.total)
        yield deliveries
        yield age

    def _deliveries(self, sched: Scheduler) -> Iterator[Metric]:
        deliveries = CounterMetricFamily(
            "pyqmgr_deliveries", "Delivery requests answered by the transport's agents, "
            "by outcome: final (every recipient sent or bounced), deferred (some "
            "recipient deferred), crashed (no usable reply).", labels=["transport", "outcome"])
        recipients = CounterMetricFamily(
            "pyqmgr_delivery_recipients", "Recipients carried by those delivery requests, "
            "by the request's outcome.", labels=["transport", "outcome"])
        # Every transport known (master.cf's delivery services, and any the scheduler
        # routed to) gets every outcome, zeros included, so that rate() and increase()
        # see a series before its first increment.
        names = sorted(set(sched.transports) | set(self.stats.transports))
        idle = TransportStats()
        for name in names:
            stats = self.stats.transports.get(name, idle)
            for i, outcome in enumerate(OUTCOMES):
                deliveries.add_metric([name, outcome], stats.deliveries[i])
                recipients.add_metric([name, outcome], stats.recipients[i])
        yield deliveries
        yield recipients
        yield CounterMetricFamily("pyqmgr_metrics_errors", "Agent replies the exporter "
                                  "failed to count (a bug; deliveries are unaffected).",
                                  value=self.stats.errors)

    def _core_counters(self, sched: Scheduler) -> Iterator[Metric]:
        steps = CounterMetricFamily(
            "pyqmgr_feedback_steps", "Concurrency window steps taken by the feedback, up "
            "(positive) or down (negative).", labels=["transport", "direction"])
        dead = CounterMetricFamily(
            "pyqmgr_destinations_declared_dead", "Destinations declared dead (failed "
            "cohorts reached the limit).", labels=["transport"])
        transport_dead = CounterMetricFamily(
            "pyqmgr_transport_declared_dead", "Times the transport was declared dead "
            "(agent unreachable, or its scheduler policy failed).", labels=["transport"])
        preemptions = CounterMetricFamily(
            "pyqmgr_preemptions", "nqmgr preemptions: a job delivered ahead of the "
            "current one.", labels=["transport"])
        for name in sorted(sched.transports):
            t = sched.transports[name]
            steps.add_metric([name, "up"], t.feedback_up)
            steps.add_metric([name, "down"], t.feedback_down)
            dead.add_metric([name], t.destinations_died)
            transport_dead.add_metric([name], t.times_died)
            preemptions.add_metric([name], t.preemptions)
        yield from (steps, dead, transport_dead, preemptions)

    def _histograms(self) -> Iterator[Metric]:
        latency = HistogramMetricFamily(
            "pyqmgr_delivery_latency_seconds", "From the entry's selection for an agent "
            "to the agent's reply, every outcome.", labels=["transport"])
        age = HistogramMetricFamily(
            "pyqmgr_message_age_at_delivery_seconds", "The message's age (since its "
            "arrival) at a final reply; buckets are qshape's columns.",
            labels=["transport"])
        for name in sorted(self.stats.transports):
            stats = self.stats.transports[name]
            if not stats.latency.count:
                continue  # a transport known in advance, no reply yet: 19 lines saved
            for family, hist in ((latency, stats.latency), (age, stats.age)):
                buckets = [(floatToGoString(le), count) for le, count in hist.cumulative()]
                family.add_metric([name], buckets, hist.total)
        yield latency
        yield age

    def _gauges(self, sched: Scheduler, census: Census) -> Iterator[Metric]:
        yield from self._transport_gauges(sched, census.transports)
        yield from self._destination_gauges(census)
        if sched.sites is not None:
            yield from self._site_gauges(census)
        yield GaugeMetricFamily("pyqmgr_active_messages", "Messages in the active queue.",
                                value=self.source.message_count)
        yield GaugeMetricFamily("pyqmgr_active_recipients", "Recipients in core, all "
                                "messages.", value=sched.rcpt_count)

    @staticmethod
    def _site_gauges(census: Census) -> Iterator[Metric]:
        """Per provider site (site_grouping; only while sites are on): deliveries in
        flight, the limit in force (0: none), its destinations in core, and whether
        it is held (full, backing off, spaced by its rate, waiting for a lookup); for
        the ``metrics_site_limit`` most active, the rest of each transport summed as
        ``site="_other"`` (every MX host set is a site: 100,000 of them are no
        rarity at a provider)."""
        labels = ["transport", "site"]
        in_flight = GaugeMetricFamily("pyqmgr_site_in_flight", "Deliveries under way to "
                                      "the site, all its destinations.", labels=labels)
        limit = GaugeMetricFamily("pyqmgr_site_limit", "The site's limit in force "
                                  "(site_concurrency_limit or a response rule's cap; 0: "
                                  "none); no _other series.", labels=labels)
        members = GaugeMetricFamily("pyqmgr_site_destinations", "The site's destinations "
                                    "in core.", labels=labels)
        held = GaugeMetricFamily("pyqmgr_site_held", "1 while the site takes no delivery "
                                 "(full, backing off, rate-spaced or waiting for its "
                                 "lookup); _other: how many are.", labels=labels)
        folded = GaugeMetricFamily("pyqmgr_site_series_folded", "Sites summed into the "
                                   "_other series (metrics_site_limit).",
                                   labels=["transport"])
        rest = {transport: [busy, count, stop, n]
                for transport, (busy, count, stop, n) in census.sites.items()}
        for _rank, _order, transport, name, busy, bound, count, stop in sorted(
                census.site_rows, key=lambda row: row[2:4]):
            key = [transport, name]
            in_flight.add_metric(key, busy)
            limit.add_metric(key, bound)
            members.add_metric(key, count)
            held.add_metric(key, stop)
            left = rest[transport]
            left[0] -= busy
            left[1] -= count
            left[2] -= stop
            left[3] -= 1
        for transport in sorted(rest):
            busy, count, stop, n = rest[transport]
            folded.add_metric([transport], n)
            if n > 0:
                in_flight.add_metric([transport, OTHER], busy)
                members.add_metric([transport, OTHER], count)
                held.add_metric([transport, OTHER], stop)
        yield from (in_flight, limit, members, held, folded)

    @staticmethod
    def _transport_gauges(sched: Scheduler,
                          totals: dict[str, list[int]]) -> list[GaugeMetricFamily]:
        families = [GaugeMetricFamily(name, doc, labels=["transport"])
                    for name, doc in TRANSPORT_GAUGES]
        for name in sorted(sched.transports):
            t = sched.transports[name]
            window, busy, rcpts, _dead, count = totals.get(name, (0, 0, 0, 0, 0))
            values = (window, busy, t.pending, rcpts, count, 1 if t.throttled else 0,
                      sched.process_limit(name), t.cfg.destination_concurrency_limit)
            for family, value in zip(families, values, strict=True):
                family.add_metric([name], value)
        return families

    @staticmethod
    def _destination_gauges(census: Census) -> list[GaugeMetricFamily]:
        """A series for each of the census's highest-ranked destinations; the rest of
        a transport's summed into its ``_other`` series."""
        families = [GaugeMetricFamily(name, doc, labels=["transport", "destination"])
                    for name, doc in DESTINATION_GAUGES]
        d_count = GaugeMetricFamily("pyqmgr_destination_series_folded", "Destinations "
                                    "summed into the _other series "
                                    "(metrics_destination_limit).", labels=["transport"])
        rest = {name: [window, busy, rcpts, dead, n]
                for name, (window, busy, rcpts, dead, n) in census.transports.items()}
        for _rank, _order, tname, label, *values in sorted(census.destinations,
                                                           key=lambda row: row[2:4]):
            for family, value in zip(families, values, strict=True):
                family.add_metric([tname, label], value)
            left = rest[tname]
            for i, value in enumerate(values):
                left[i] -= value
            left[4] -= 1
        if any(n for *_values, n in rest.values()):
            for tname in sorted(rest):
                *values, n = rest[tname]
                d_count.add_metric([tname], n)
                if n > 0:
                    for family, value in zip(families, values, strict=True):
                        family.add_metric([tname, OTHER], value)
        return [*families, d_count]


def registry_for(source: Source, stats: DeliveryStats, destination_limit: int,
                 process: bool = True, fleet: Fleet | None = None,
                 site_limit: int = DEFAULT_SITE_LIMIT) -> CollectorRegistry:
    """A registry of our own: the scheduler's collector, the fleet's (with
    ``shared_state``) and, optionally, the process's.

    Not prometheus_client's global REGISTRY: its platform and GC collectors would add
    series nobody asked for, and tests build several registries in one process.
    The process collector reads /proc/self; chrooted it finds nothing and exports
    nothing.
    """
    return _registry(SchedulerCollector(source, stats, destination_limit, site_limit),
                     process, fleet)


def _registry(collector: SchedulerCollector, process: bool,
              fleet: Fleet | None, events: object = None,
              sources: Sources | None = None) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    if fleet is not None:
        registry.register(FleetCollector(fleet))
    if isinstance(events, DeliveryEvents):  # delivery events on (NoEvents: off)
        registry.register(EventsCollector(events))
    if sources is not None:
        registry.register(SourcesCollector(sources))
    if process:
        ProcessCollector(registry=registry)
    return registry


class Exposition:
    """The registry and the scheduler's collector in it: what renders a census."""

    def __init__(self, source: Source, stats: DeliveryStats, destination_limit: int,
                 site_limit: int = DEFAULT_SITE_LIMIT, process: bool = True,
                 fleet: Fleet | None = None, events: object = None,
                 sources: Sources | None = None) -> None:
        self.collector = SchedulerCollector(source, stats, destination_limit, site_limit)
        self.registry = _registry(self.collector, process, fleet, events, sources)

    def walk(self) -> Generator[None, None, Census]:
        return self.collector.walk()

    def render(self, census: Census) -> bytes:
        """The text exposition, with ``census``'s gauges and the counters as they
        are now; old activity let go first."""
        self.collector.stats.advance()
        self.collector.census = census
        try:
            return generate_latest(self.registry)
        finally:
            self.collector.census = None


def _call_later(delay: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
    return asyncio.get_running_loop().call_later(delay, callback)


class Pacer:
    """What a scrape gets: the last rendering while it is younger than
    :data:`RENDER_INTERVAL`, else a new one from the last census, whose walk runs in
    slices of :data:`SLICE` seconds :data:`PAUSE` apart (:mod:`.metrics_census`).

    A census is taken when a rendering is due and the last one is at least
    RENDER_INTERVAL old, or its CPU :data:`WALK_SPACING` times over when that is
    longer; until it is done the renderings use the one before. Only the first
    census, while there is none yet, keeps scrapers waiting (:meth:`when_ready`).
    While the last census took one turn (up to some ten thousand scopes) the walk
    runs in the scrape's turn and the rendering is of the core at the scrape, as
    before issue #44; after one of many turns the scrape renders the last census
    and the new walk starts in a turn of its own, so that at any size a scrape's
    turn is one rendering and a census's turns are at most a slice each.
    """

    def __init__(self, walk_: Callable[[], Generator[None, None, Census]],
                 render: Callable[[Census], bytes], *,
                 clock: Callable[[], float] = time.perf_counter,
                 later: Callable[[float, Callable[[], None]], object] = _call_later,
                 slice_: float = SLICE, pause: float = PAUSE) -> None:
        self.walk, self.render, self.clock, self.later = walk_, render, clock, later
        self.slice, self.pause = slice_, pause
        self.cached: bytes | None = None
        self.rendered_at = -math.inf
        self.census: Census | None = None
        self.next_walk = -math.inf
        self.steps: Generator[None, None, Census] | None = None
        self.timer: object = None
        self.waiting: list[Callable[[], None]] = []
        self.error: Exception | None = None
        #: The walk under way: its CPU so far, its turns, the longest.
        self.spent, self.turns, self.longest = 0.0, 0, 0.0
        #: Renderings made and scrapes answered with one made before (figures).
        self.renders = self.reused = 0

    def body(self) -> bytes | None:
        now = self.clock()
        if self.cached is not None and now - self.rendered_at < RENDER_INTERVAL:
            self.reused += 1
            return self.cached
        if self.steps is None and now >= self.next_walk:
            self.steps = self.walk()
            self.spent, self.turns, self.longest = 0.0, 0, 0.0
            last = self.census
            if last is None or last.turns <= 1:
                self._step()  # likely done at once: this scrape shows the core now
            else:
                # A walk of many turns: this scrape renders the last census and the
                # walk starts in a turn of its own, so that a scrape's turn is one
                # rendering, whatever the core holds.
                self.timer = self.later(0.0, self._step)
        if self.census is None:
            error, self.error = self.error, None
            if error is not None:
                raise error
            return None
        self.cached = self.render(self.census)
        self.rendered_at = now
        self.renders += 1
        return self.cached

    def when_ready(self, callback: Callable[[], None]) -> None:
        self.waiting.append(callback)

    def _step(self) -> None:
        """One slice of the walk; the next one is timed, or the census is done."""
        steps = self.steps
        self.timer = None
        if steps is None:
            return
        started = self.clock()
        census = None
        try:
            while self.clock() - started < self.slice:
                next(steps)
        except StopIteration as done:
            census = done.value
        except Exception as exc:  # noqa: BLE001 - a bug answers 500, mail flows
            self.steps, self.error = None, exc
            self.next_walk = started + RENDER_INTERVAL
            self._wake()
            return
        ended = self.clock()
        self.spent += ended - started
        self.turns += 1
        self.longest = max(self.longest, ended - started)
        if census is None:
            self.timer = self.later(self.pause, self._step)
            return
        self.steps = None
        census.cpu, census.turns, census.longest = self.spent, self.turns, self.longest
        census.finished = ended
        self.census = census
        self.cached = None
        self.next_walk = ended + max(RENDER_INTERVAL, census.cpu * WALK_SPACING)
        self._wake()

    def _wake(self) -> None:
        waiting, self.waiting = self.waiting, []
        for callback in waiting:
            callback()

    def close(self) -> None:
        self.steps = None
        cancel = getattr(self.timer, "cancel", None)
        if cancel is not None:
            cancel()


class Exporter:
    """The HTTP listener, bound where pyqmgr.cf says, retried until it is free.

    A bind failure is a warning, never fatal: mail flows without metrics. After
    ``postfix reload`` the old qmgr may still hold the port for a moment, so the first
    :data:`BIND_QUIET_FOR` seconds of retries are silent; then one warning, and a
    retry every :data:`BIND_RETRY_INTERVAL` seconds, with an info line once it works.
    """

    def __init__(self, settings: MetricsSettings, exposition: Exposition,
                 log: MailLog) -> None:
        self.settings = settings
        self.log = log
        self.exposition = exposition
        self.pacer = Pacer(exposition.walk, exposition.render)
        self.http = MetricsHttpServer(self.pacer, log)
        self.warned = False
        self.closed = False
        self.retry: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None
        self.started = 0.0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.started = loop.time()
        self._spawn()

    def _spawn(self) -> None:
        # The loop keeps only a weak reference to a task: hold it until it is done.
        self.task = asyncio.get_running_loop().create_task(self._bind())

    async def _bind(self) -> None:
        if self.closed:
            return
        loop = asyncio.get_running_loop()
        s = self.settings
        family = socket.AF_INET6 if ":" in s.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((s.host, s.port))
            sock.listen(self.http.max_clients)
            sock.setblocking(False)
            self.http.serve(sock)
        except OSError as exc:
            sock.close()
            quiet = loop.time() - self.started < BIND_QUIET_FOR
            if not quiet and not self.warned:
                self.warned = True
                why = exc.strerror or errno.errorcode.get(exc.errno or 0, str(exc))
                self.log.warning(f"metrics_listen {s.address}: {why}; metrics are "
                                 f"unavailable, tried again every "
                                 f"{BIND_RETRY_INTERVAL:g} s")
            delay = BIND_QUIET_STEP if quiet else BIND_RETRY_INTERVAL
            self.retry = loop.call_later(delay, self._spawn)
            return
        if self.warned:
            self.log.info(f"metrics_listen {s.address}: listening")

    def close(self) -> None:
        self.closed = True
        if self.retry is not None:
            self.retry.cancel()
        self.pacer.close()
        self.http.close()


def start(qmgr: Source, stats: DeliveryStats, settings: MetricsSettings,
          log: MailLog) -> Exporter:
    """Serve the metrics of ``qmgr`` (whose replies ``stats`` counts)."""
    stats.tenant_limit = settings.tenant_limit
    exporter = Exporter(settings, Exposition(
        qmgr, stats, settings.destination_limit, settings.site_limit,
        fleet=getattr(qmgr, "fleet", None), events=getattr(qmgr, "events", None),
        sources=getattr(getattr(qmgr, "active", None), "sources", None)), log)
    exporter.start()
    return exporter
