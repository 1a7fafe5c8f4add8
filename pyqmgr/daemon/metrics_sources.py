"""Source pools' Prometheus metrics (issue #46): only with source pools and metrics on.

Read when scraped from what the pools keep anyway (:class:`pyqmgr.scheduler.source.
SourceBook`: each cold source's age, allowance and its count this window over every
site, kept as it changes), so a scrape costs one step per cold source whatever the
number of sites. Labels are bounded by master.cf (a source is one of its services);
per site counts are in ``pyqmgr status`` and ``pyqmgr top`` (the largest 100). Each
source's deliveries are its transport's series already (``transport="out11"``).

In a fleet (``shared_state`` with a cold source) the credits this server holds and
owes are summed per source from the pairs it holds (:class:`pyqmgr.scheduler.
source_credits.Credits`), a step per pair held: per site credits are in ``pyqmgr
status``. The questions to Redis and their answers are counted by
:class:`pyqmgr.daemon.fleet.warmup.FleetWarmup` as they happen.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from pyqmgr.daemon.fleet.warmup import FleetWarmup
    from pyqmgr.daemon.sources import Sources

#: FleetWarmup's counters, each a series ``pyqmgr_source_fleet_credits_<key>_total``.
FLEET_COUNTERS = (
    ("asked", "Questions for credits this server put to the fleet (shared_state)."),
    ("granted", "Credits the fleet granted this server."),
    ("given_back", "Credits this server gave back to the fleet: unused "
     "once the allowance was granted, or held at exit."),
    ("errors", "Questions to the fleet for credits, or credits given back, "
     "that met no answer from Redis."),
)


class SourcesCollector:
    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        book = self.sources.book
        now = self.sources.clock()
        book.roll(now)
        member = GaugeMetricFamily(
            "pyqmgr_source_pool_weight", "Each pool member's weight (source_pools).",
            labels=["pool", "source"])
        for name, pool in sorted(book.pools.items()):
            for source, weight in zip(pool.members, pool.weights, strict=True):
                member.add_metric([name, source], weight)
        yield member
        age = GaugeMetricFamily(
            "pyqmgr_source_age_days", "A cold source's age in days (0 on its first day) "
            "by source_warmup_plan.", labels=["source"])
        allowance = GaugeMetricFamily(
            "pyqmgr_source_allowance", "A cold source's allowance per site this window.",
            labels=["source"])
        counted = GaugeMetricFamily(
            "pyqmgr_source_warmup_counted", "Recipients a cold source took this window, "
            "over every site (each site's count against the allowance: pyqmgr status).",
            labels=["source"])
        for source in sorted(book.starts):
            days, allowed = book.age_days(source, now), book.allowance(source, now)
            if days is not None:
                age.add_metric([source], days)
            if allowed is not None:
                allowance.add_metric([source], allowed)
            counted.add_metric([source], book.totals.get(source, 0))
        yield from (age, allowance, counted)
        yield CounterMetricFamily(
            "pyqmgr_source_waited", "Recipients that waited: no pool member could take "
            "them (the plan's overflow is wait, or none was warm).", value=book.waited)
        yield CounterMetricFamily(
            "pyqmgr_source_unknown_site", "Recipients that went to a warm source because "
            "their site was not known yet.", value=book.unknown_site)
        if self.sources.warmup is not None:
            yield from fleet_metrics(self.sources.warmup, sorted(book.starts))


def fleet_metrics(warmup: FleetWarmup, cold: list[str]) -> Iterator[Metric]:
    """A fleet's warm-up credits: held and owed per cold source (each listed, 0 when
    none), the questions' counters, and whether Redis answers."""
    credits = warmup.credits
    held = dict.fromkeys(cold, 0)
    for (source, _), n in credits.held.items():
        held[source] = held.get(source, 0) + n
    owed = dict.fromkeys(cold, 0)
    for (source, _), n in credits.spent.items():
        owed[source] = owed.get(source, 0) + n
    for what, values, text in (
            ("held", held, "Credits this server holds for a cold source, over every site "
             "(each site's: pyqmgr status)."),
            ("owed", owed, "Recipients a cold source took while Redis did not answer, "
             "not yet added to the fleet's count.")):
        family = GaugeMetricFamily(f"pyqmgr_source_fleet_credits_{what}", text,
                                   labels=["source"])
        for source, n in sorted(values.items()):
            family.add_metric([source], n)
        yield family
    for key, text in FLEET_COUNTERS:
        yield CounterMetricFamily(f"pyqmgr_source_fleet_credits_{key}", text,
                                  value=warmup.counters[key])
    yield GaugeMetricFamily(
        "pyqmgr_source_fleet_unavailable", "1 while the fleet's Redis does not answer "
        "the warm-up's questions (shared_state_failure is in force).",
        value=1 if warmup.down else 0)


__all__ = ["SourcesCollector"]
