"""Source pools' Prometheus metrics (issue #46): only with source pools and metrics on.

Read when scraped from what the pools keep anyway (:class:`pyqmgr.scheduler.source.
SourceBook`: each cold source's age, allowance and its count this window over every
site, kept as it changes), so a scrape costs one step per cold source whatever the
number of sites. Labels are bounded by master.cf (a source is one of its services);
per site counts are in ``pyqmgr status`` and ``pyqmgr top`` (the largest 100). Each
source's deliveries are its transport's series already (``transport="out11"``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from pyqmgr.daemon.sources import Sources


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


__all__ = ["SourcesCollector"]
