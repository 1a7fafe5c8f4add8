"""The Prometheus exporter: the scheduler's own numbers, read when scraped.

Imported only when pyqmgr.cf sets ``metrics_listen`` (start-up imports it before the
chroot, after :func:`pyqmgr.daemon.metrics.import_exporter`); with metrics off,
neither this module nor prometheus_client is ever loaded.

Nothing here runs on the delivery path. Counters come from plain ints that the core
(:class:`~pyqmgr.scheduler.transport.Transport`: feedback steps, deaths, preemptions)
and the daemon (:class:`~pyqmgr.daemon.metrics.DeliveryStats`) raise in O(1); gauges
are computed from the scheduler's structures at scrape time, by a custom collector,
so no gauge is kept up to date on every event. Each scrape is one event-loop turn
(:mod:`.metrics_http`), so what it reports is one consistent instant.

**Label cardinality is bounded.** ``transport`` takes master.cf's services (and only
those that were used). ``destination`` is given only to in-core destinations (the core
discards idle ones, so a destination with nothing queued or in flight has no series
at all), and only to the ``metrics_destination_limit`` of them (default 100) with the
most queued recipients plus deliveries in flight (dead ones first among equals);
every other destination of a transport is summed into one series with
``destination="_other"``. So a server with 100,000 destinations in core exports at
most limit + one per transport destination series, and a scrape costs a walk over the
in-core destinations and entries (about 0.05 s for 100,000 destinations, see
tests/unit/test_metrics.py), never more text.
"""

from __future__ import annotations

import asyncio
import errno
import heapq
import socket
from collections.abc import Iterator
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
from pyqmgr.daemon.metrics import OUTCOMES, DeliveryStats, MetricsSettings, TransportStats
from pyqmgr.daemon.metrics_http import MetricsHttpServer
from pyqmgr.postfix.maillog_client import MailLog
from pyqmgr.scheduler.core import Scheduler

if TYPE_CHECKING:
    from pyqmgr.daemon.fleet import Fleet

#: The label value of the series that sums the destinations beyond the limit.
OTHER = "_other"

#: Quiet retries of a bind that failed (a reloaded qmgr's predecessor may still hold
#: the port for a moment), then one warning and a retry every BIND_RETRY_INTERVAL.
BIND_QUIET_FOR = 5.0
BIND_QUIET_STEP = 0.25
BIND_RETRY_INTERVAL = 10.0

#: (rank, transport, destination, window, in flight, queued recipients, dead).
Row = tuple[int, str, str, int, int, int, int]

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
    scheduler at start-up (pyqmgr.cf's policies).
    """

    def __init__(self, source: Source, stats: DeliveryStats,
                 destination_limit: int) -> None:
        self.source = source
        self.stats = stats
        self.destination_limit = destination_limit

    def collect(self) -> Iterator[Metric]:
        sched = self.source.scheduler
        yield from self._deliveries(sched)
        yield from self._core_counters(sched)
        yield from self._histograms()
        yield from self._gauges(sched)
        for label, table in (("class", self.stats.classes), ("tenant", self.stats.tenants)):
            if table:
                yield from self._kind(label, table)

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

    def _gauges(self, sched: Scheduler) -> Iterator[Metric]:
        rows, totals = self._destination_rows(sched)
        yield from self._transport_gauges(sched, totals)
        yield from self._destination_gauges(rows, totals)
        if sched.sites is not None:
            yield from self._site_gauges(sched)
        yield GaugeMetricFamily("pyqmgr_active_messages", "Messages in the active queue.",
                                value=self.source.message_count)
        yield GaugeMetricFamily("pyqmgr_active_recipients", "Recipients in core, all "
                                "messages.", value=sched.rcpt_count)

    @staticmethod
    def _site_gauges(sched: Scheduler) -> Iterator[Metric]:
        """Per provider site (site_grouping; only while sites are on): deliveries in
        flight, the limit in force (0: none), its destinations in core, and whether
        it is held (full, backing off, spaced by its rate, waiting for a lookup).
        Sites are few (providers) next to destinations, so every one gets a series."""
        labels = ["transport", "site"]
        in_flight = GaugeMetricFamily("pyqmgr_site_in_flight", "Deliveries under way to "
                                      "the site, all its destinations.", labels=labels)
        limit = GaugeMetricFamily("pyqmgr_site_limit", "The site's limit in force "
                                  "(site_concurrency_limit or a response rule's cap; 0: "
                                  "none).", labels=labels)
        members = GaugeMetricFamily("pyqmgr_site_destinations", "The site's destinations "
                                    "in core.", labels=labels)
        held = GaugeMetricFamily("pyqmgr_site_held", "1 while the site takes no delivery "
                                 "(full, backing off, rate-spaced or waiting for its "
                                 "lookup).", labels=labels)
        assert sched.sites is not None
        for (transport, name), site in sorted(sched.sites.sites.items()):
            key = [transport, name]
            in_flight.add_metric(key, site.busy)
            limit.add_metric(key, site.bound)
            members.add_metric(key, len(site.members))
            held.add_metric(key, 1 if site.gate is not None else 0)
        yield from (in_flight, limit, members, held)

    @staticmethod
    def _destination_rows(sched: Scheduler) -> tuple[list[Row], dict[str, list[int]]]:
        """One walk over every in-core destination: a row per destination, and per
        transport the totals [window, in flight, queued recipients, dead, destinations].

        A row is (rank, transport, destination, window, in flight, queued recipients,
        dead), rank = (queued recipients + in flight) * 2, +1 when dead, so that among
        equals dead destinations get a series first.
        """
        rows: list[Row] = []
        totals: dict[str, list[int]] = {}
        for name, t in sched.transports.items():
            window = busy = rcpts = dead = 0
            # With a recipient limit of 1 Postfix names each recipient's queue
            # user@nexthop: the endpoint is readable by every local user, whatever
            # authorized_mailq_users says, so such queues are one series per nexthop
            # and no address is exported (issue #31).
            by_nexthop: dict[str, list[int]] | None = (
                {} if t.cfg.destination_recipient_limit == 1 else None)
            for q in t.queues.values():
                w = q.window if q.window > 0 else 0
                b = q.busy_count
                r = 0
                if q.todo:
                    for e in q.todo:
                        r += len(e.recipients)
                d = 1 if q.window == 0 else 0
                window += w
                busy += b
                rcpts += r
                dead += d
                if by_nexthop is None:
                    rows.append(((r + b) * 2 + d, name, q.name, w, b, r, d))
                    continue
                sums = by_nexthop.setdefault(q.nexthop, [0, 0, 0, 0])
                sums[0] += w
                sums[1] += b
                sums[2] += r
                sums[3] += d
            if by_nexthop is not None:
                rows += [((r + b) * 2 + min(d, 1), name, nexthop, w, b, r, d)
                         for nexthop, (w, b, r, d) in by_nexthop.items()]
            totals[name] = [window, busy, rcpts, dead, len(t.queues)
                            if by_nexthop is None else len(by_nexthop)]
        return rows, totals

    @staticmethod
    def _transport_gauges(sched: Scheduler,
                          totals: dict[str, list[int]]) -> list[GaugeMetricFamily]:
        families = [GaugeMetricFamily(name, doc, labels=["transport"])
                    for name, doc in TRANSPORT_GAUGES]
        for name in sorted(sched.transports):
            t = sched.transports[name]
            window, busy, rcpts, _dead, count = totals[name]
            values = (window, busy, t.pending, rcpts, count, 1 if t.throttled else 0,
                      sched.process_limit(name), t.cfg.destination_concurrency_limit)
            for family, value in zip(families, values, strict=True):
                family.add_metric([name], value)
        return families

    def _destination_gauges(self, rows: list[Row],
                            totals: dict[str, list[int]]) -> list[GaugeMetricFamily]:
        """A series for each of the ``destination_limit`` highest-ranked destinations;
        the rest of a transport's summed into its ``_other`` series."""
        families = [GaugeMetricFamily(name, doc, labels=["transport", "destination"])
                    for name, doc in DESTINATION_GAUGES]
        d_count = GaugeMetricFamily("pyqmgr_destination_series_folded", "Destinations "
                                    "summed into the _other series "
                                    "(metrics_destination_limit).", labels=["transport"])
        limit = self.destination_limit
        shown = rows if len(rows) <= limit else heapq.nlargest(limit, rows)
        folded: dict[str, list[int]] = {}
        if shown is not rows:
            folded = {name: list(tot) for name, tot in totals.items()}
        for _rank, tname, qname, *values in sorted(shown, key=lambda row: row[1:3]):
            for family, value in zip(families, values, strict=True):
                family.add_metric([tname, qname], value)
            rest = folded.get(tname)
            if rest is not None:
                for i, value in enumerate(values):
                    rest[i] -= value
                rest[4] -= 1
        for tname in sorted(folded):
            *values, n = folded[tname]
            d_count.add_metric([tname], n)
            if n > 0:
                for family, value in zip(families, values, strict=True):
                    family.add_metric([tname, OTHER], value)
        return [*families, d_count]


def registry_for(source: Source, stats: DeliveryStats, destination_limit: int,
                 process: bool = True, fleet: Fleet | None = None) -> CollectorRegistry:
    """A registry of our own: the scheduler's collector, the fleet's (with
    ``shared_state``) and, optionally, the process's.

    Not prometheus_client's global REGISTRY: its platform and GC collectors would add
    series nobody asked for, and tests build several registries in one process.
    The process collector reads /proc/self; chrooted it finds nothing and exports
    nothing.
    """
    registry = CollectorRegistry()
    registry.register(SchedulerCollector(source, stats, destination_limit))
    if fleet is not None:
        registry.register(FleetCollector(fleet))
    if process:
        ProcessCollector(registry=registry)
    return registry


class Exporter:
    """The HTTP listener, bound where pyqmgr.cf says, retried until it is free.

    A bind failure is a warning, never fatal: mail flows without metrics. After
    ``postfix reload`` the old qmgr may still hold the port for a moment, so the first
    :data:`BIND_QUIET_FOR` seconds of retries are silent; then one warning, and a
    retry every :data:`BIND_RETRY_INTERVAL` seconds, with an info line once it works.
    """

    def __init__(self, settings: MetricsSettings, registry: CollectorRegistry,
                 log: MailLog) -> None:
        self.settings = settings
        self.log = log
        self.http = MetricsHttpServer(lambda: generate_latest(registry), log)
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
            self.http.server = await loop.create_server(self.http.protocol, sock=sock)
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
        self.http.close()


def start(qmgr: Source, stats: DeliveryStats, settings: MetricsSettings,
          log: MailLog) -> Exporter:
    """Serve the metrics of ``qmgr`` (whose replies ``stats`` counts)."""
    exporter = Exporter(settings, registry_for(qmgr, stats, settings.destination_limit,
                                               fleet=getattr(qmgr, "fleet", None)), log)
    exporter.start()
    return exporter
