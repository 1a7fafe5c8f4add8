"""Does the log's retry timing fit the configuration it is replayed under?

A replay's deferred mail comes back when the configuration says: qmgr sets a deferred
message's next try to its age bounded by ``minimal_backoff_time`` and
``maximal_backoff_time`` (not a doubling: docs/retry.md), and a deferred-queue scan
every ``queue_run_delay`` takes it. Replayed without ``-o``, the simulation runs
stock's defaults (300 s, 4000 s, 300 s), and a log written with other timers is
replayed as another world: the shipped test-bed logs retry after 10-20 s, and their
replay under the defaults delivered rate.example's mail at p50 0.59 s against the
log's 54 s, and down.example 1 recipient against 15, with no hint why (issue #43).

The log shows its own timers: each retry is seen whole (:attr:`Derived.retries`: the
message's age at its round's last line, and the seconds to its coming back). A
message younger than minimal_backoff_time comes back after about that; one older
than maximal_backoff_time after about that; the rest of each interval is the wait
for the next scan. Times are whole seconds in most logs, and qmgr's clock runs a
little behind the agents' lines, so a retry shows up to a second early; that second
is added back. A timer is said to contradict the configuration only when the log
shows it clearly: from at least :data:`MIN_RETRIES` retries (maximal_backoff_time
from at least :data:`MIN_CAPPED` messages it held back), off by a factor of
:data:`FACTOR` and by more than :data:`SLACK` seconds. Then the report says what
the log shows and which ``-o name=value`` to pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pyqmgr.compare.figures import percentile
from pyqmgr.postfix.config import QmgrConfig

MIN_RETRIES = 5
MIN_CAPPED = 3
FACTOR = 2.0
#: Seconds a retry may seem early or late by the log's whole-second time stamps.
SLACK = 2.0
TIMERS = ("minimal_backoff_time", "maximal_backoff_time", "queue_run_delay")


@dataclass
class RetryTiming:
    """What the log's retries show, against the configuration replayed under."""

    retries: int
    #: The intervals seen: shortest, median, longest (seconds).
    shortest: float
    median: float
    longest: float
    #: The timers as the log shows them (a timer it does not show is absent).
    seen: dict[str, int] = field(default_factory=dict)
    #: The configuration replayed under (seconds).
    configured: dict[str, int] = field(default_factory=dict)
    #: The timers the log contradicts, with the value it shows.
    suggest: dict[str, int] = field(default_factory=dict)
    #: Retries sooner and later than the configuration would make them.
    early: int = 0
    late: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"retries": self.retries, "shortest": self.shortest, "median": self.median,
                "longest": self.longest, "seen": self.seen, "configured": self.configured,
                "suggest": self.suggest, "early": self.early, "late": self.late}

    def warning(self) -> str | None:
        """The report's line, or None when the log's timing fits."""
        if not self.suggest:
            return None
        conf = ", ".join(f"{k} = {v}s" for k, v in self.configured.items())
        opts = " ".join(f"-o {k}={v}s" for k, v in self.suggest.items())
        return (f"the log's retry timing contradicts the configuration replayed under "
                f"({conf}): its deferred mail came back after {self.shortest:g}-"
                f"{self.longest:g} s ({self.retries} retries, median {self.median:g} s), "
                f"as {_shown(self.seen)} would; the replay's retries, and every delay "
                f"that waits for one, follow the configuration: replay with {opts} (or "
                "--config-dir with the logged instance's main.cf)")


def _shown(seen: dict[str, int]) -> str:
    return ", ".join(f"{k} = {v}s" for k, v in seen.items())


def _clamp(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def _differs(seen: float, configured: float) -> bool:
    hi, lo = max(seen, configured), min(seen, configured)
    return hi - lo > SLACK and (lo <= 0 or hi / lo >= FACTOR)


def _low(values: list[float]) -> float:
    """The low end of a set of intervals, past a stray early one (a flush)."""
    return percentile(values, 10) or 0.0


def retry_timing(retries: list[tuple[float, float]],
                 main_cf: dict[str, str]) -> RetryTiming | None:
    """The log's retries held against ``main_cf`` (the replay's); None when the log
    shows too few retries to tell.

    Each retry has a window under the configuration: from its age bounded by the
    backoff times, to that plus queue_run_delay (each widened by SLACK). The log
    contradicts the configuration when most of its retries fall outside, early or
    late; a flush (``postqueue -f``) or a busy queue's late scan is one retry, not
    most. Then the timers the log shows are read off it, and those that differ from
    the configuration's are suggested.
    """
    if len(retries) < MIN_RETRIES:
        return None
    cfg = QmgrConfig.from_text("".join(f"{k} = {v}\n" for k, v in main_cf.items()),
                               hostname="replay.example")
    cmin, cmax = float(cfg.minimal_backoff_time), float(cfg.maximal_backoff_time)
    crun = float(cfg.queue_run_delay)
    configured = {"minimal_backoff_time": int(cmin), "maximal_backoff_time": int(cmax),
                  "queue_run_delay": int(crun)}
    early = late = 0
    for age, i in retries:
        due = _clamp(age, cmin, cmax)
        early += i < due - SLACK
        late += i > due + crun + SLACK
    intervals = sorted(i for _, i in retries)
    seen: dict[str, int] = {}
    # Mail younger than its interval came back after minimal_backoff_time (or its
    # age) and a wait for the scan; mail older than its interval was held back by
    # maximal_backoff_time. Their low ends are the timers, plus the second the time
    # stamps lose.
    young = [i for age, i in retries if age + SLACK < i]
    capped = [i for age, i in retries if age > i + SLACK]
    if len(young) >= MIN_RETRIES:
        seen["minimal_backoff_time"] = max(1, round(_low(young) + 1))
    if len(capped) >= MIN_CAPPED:
        seen["maximal_backoff_time"] = max(seen.get("minimal_backoff_time", 1),
                                           round(_low(capped) + 1))
    # What is left of each interval is the wait for the next scan, less than
    # queue_run_delay: its upper range (p90, a busy queue's late scans aside).
    lo = seen.get("minimal_backoff_time", cmin)
    hi = seen.get("maximal_backoff_time", cmax)
    waits = [i + 1 - _clamp(age, lo, hi) for age, i in retries]
    seen["queue_run_delay"] = max(1, math.ceil(percentile(waits, 90) or 0.0))
    contradicted = max(early, late) * 2 >= len(retries)
    suggest = ({k: v for k, v in seen.items() if _differs(v, configured[k])}
               if contradicted else {})
    median = percentile(intervals, 50) or 0.0
    return RetryTiming(len(retries), round(intervals[0], 2), round(median, 2),
                       round(intervals[-1], 2), seen, configured, suggest,
                       early, late)
