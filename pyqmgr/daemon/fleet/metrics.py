"""The fleet's Prometheus metrics (issue #35): only with ``shared_state`` and metrics on.

Read when scraped from what the fleet keeps anyway (:class:`pyqmgr.daemon.fleet.Fleet`'s
leases and counters, :class:`.stats.FleetStats`, the roster's last read), so a
scrape adds nothing to a delivery. Labels are bounded: ``transport`` by master.cf,
``reason`` and ``mode`` by the lists below.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from pyqmgr.fleet.roster import MODES, NORMAL

if TYPE_CHECKING:
    from pyqmgr.daemon.fleet import Fleet

#: Why a start waited, as the fleet counts it (Fleet.counters) -> the label's value.
WAIT_REASONS = (("sessions_full", "sessions_full"), ("rate_wait", "rate"),
                ("recount_wait", "recount"))


class FleetCollector:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        #: Transports the fleet was asked about: their series stay (at 0) once they exist.
        self.transports: set[str] = set()

    def collect(self) -> Iterator[Metric]:
        fleet = self.fleet
        held: Counter[str] = Counter(t for t, _, _ in fleet.leases.values())
        for (transport, _), spares in fleet.spares.items():
            held[transport] += len(spares)
        self.transports |= set(held) | {t for t, _ in fleet.seen}
        leases = GaugeMetricFamily(
            "pyqmgr_fleet_leases_held", "Fleet sessions this server holds: deliveries "
            "under way and sessions kept for its next ones.", labels=["transport"])
        for transport in sorted(self.transports):
            leases.add_metric([transport], held[transport])
        yield leases
        waits = CounterMetricFamily(
            "pyqmgr_fleet_waits", "Starts the fleet held back, by why: all its sessions in "
            "use, its rate, or a recount after Redis lost its data.", labels=["reason"])
        for counted, reason in WAIT_REASONS:
            waits.add_metric([reason], fleet.counters[counted])
        yield waits
        yield CounterMetricFamily("pyqmgr_fleet_admitted", "Starts the fleet admitted.",
                                  value=fleet.counters["admitted"])
        stats = fleet.stats
        yield CounterMetricFamily("pyqmgr_fleet_redis_errors", "Calls to Redis that met "
                                  "no answer within shared_state_timeout, or an error.",
                                  value=stats.errors)
        hist = stats.round_trip
        trips = HistogramMetricFamily(
            "pyqmgr_fleet_redis_round_trip_seconds", "The fleet's calls to Redis, from "
            "the question to the answer (an admission, a release, a renewal, the roster).")
        trips.add_metric([], [(floatToGoString(le), n) for le, n in hist.cumulative()],
                         hist.total)
        yield trips
        mode = GaugeMetricFamily(
            "pyqmgr_fleet_failure_mode", "1 for what this server does now: normal (Redis "
            "answers), or its shared_state_failure (local, hold) in force.", labels=["mode"])
        now = fleet.settings.failure if fleet.down else NORMAL
        for name in MODES:
            mode.add_metric([name], 1 if name == now else 0)
        yield mode
        yield GaugeMetricFamily(
            "pyqmgr_fleet_last_sync_timestamp_seconds", "When Redis last answered (Unix "
            "time; 0: never).", value=stats.last_sync or 0.0)
        roster = fleet.roster
        yield GaugeMetricFamily("pyqmgr_fleet_servers", "Servers in the fleet's roster at "
                                "the last read, this one included.", value=roster.servers)
        yield GaugeMetricFamily(
            "pyqmgr_fleet_mismatches", "Settings in which another server differs from this "
            "one now (each obeys the stricter; pyqmgr status --fleet lists them).",
            value=len(roster.differences))
        yield GaugeMetricFamily("pyqmgr_fleet_lease_time_seconds", "The lease time in "
                                "force: the longest in the fleet.", value=roster.lease_time)
        yield CounterMetricFamily(
            "pyqmgr_fleet_waits_capped", "Waits Redis asked for beyond what this server's "
            "settings explain, cut short.", value=stats.waits_capped)
        yield CounterMetricFamily("pyqmgr_fleet_roster_skipped", "Roster records skipped "
                                  "as malformed or oversized.", value=roster.skipped)
