"""Delivery events' Prometheus metrics (issue #46): only with events and metrics on.

Read when scraped from the counts the reader, the writer and the stream keep anyway,
so a scrape adds nothing to a delivery; no labels, so a handful of series whatever
the mail. Imported only by the exporter (prometheus_client is the metrics' extra).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from pyqmgr.events.tracker import DeliveryEvents

COUNTER, GAUGE = CounterMetricFamily, GaugeMetricFamily


class EventsCollector:
    def __init__(self, events: DeliveryEvents) -> None:
        self.events = events

    def collect(self) -> Iterator[Metric]:
        read, wrote = self.events.stats, self.events.writer.stats
        series: list[tuple[type, str, str, int]] = [
            (COUNTER, "read", "Events read from the trace logs (repeats after a restart "
             "included).", read.events),
            (COUNTER, "repeated", "Events read again from a trace log an earlier qmgr "
             "read (the same keys: a consumer keeps each once).", read.repeated),
            (COUNTER, "written", "Events written and fsynced to delivery_events_file.",
             wrote.written),
            (GAUGE, "waiting", "Events waiting in memory for the file.", wrote.queued),
            (COUNTER, "file_failures", "Writes to delivery_events_file that failed (tried "
             "again; the trace logs are kept meanwhile).", wrote.failures)]
        stream = self.events.stream
        if stream is not None:
            series += [
                (COUNTER, "streamed", "Events added to delivery_events_stream.",
                 stream.sent),
                (GAUGE, "stream_waiting", "Events waiting in memory for the stream (Redis "
                 "slow or down).", stream.pending),
                (COUNTER, "stream_dropped", "Events dropped from the stream (not the file) "
                 "past its memory bound while Redis did not take them.", stream.dropped),
                (COUNTER, "stream_failures", "Calls to Redis for the stream that failed or "
                 "timed out.", stream.failures)]
        for kind, name, text, value in series:
            yield kind(f"pyqmgr_delivery_events_{name}", text, value=value)


__all__ = ["EventsCollector"]
