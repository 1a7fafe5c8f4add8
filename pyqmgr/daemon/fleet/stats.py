"""What the fleet counts of its Redis: round trips, errors, the last good answer (#35).

Read by the metrics exporter (:mod:`.metrics`) and published in the roster
(:mod:`.roster`). Timed around the fleet's own calls (:mod:`.node`), not inside
the client: what an operator wants to see is what a delivery waits for, script and
all, whichever client library carries it. Plain numbers on the delivery path: a
round trip costs two clock reads and a bisect.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType

from pyqmgr.daemon.metrics import Histogram
from pyqmgr.fleet.client import RedisUnavailable

#: Round-trip buckets (seconds): a local Redis answers in a fraction of a millisecond,
#: a distant or loaded one in tens; past shared_state_timeout (at most 10 s) a call
#: fails instead.
ROUND_TRIP_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                      0.5, 1.0, 2.5, 5.0, 10.0)


class FleetStats:
    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.clock, self.wall = clock, wall
        self.round_trip = Histogram(ROUND_TRIP_BUCKETS)
        #: Calls that met no answer (RedisUnavailable): in all, and since the last
        #: good answer.
        self.errors = 0
        self.errors_since_good = 0
        #: The last good answer (wall clock), for the roster and the metrics.
        self.last_sync: float | None = None
        #: Waits Redis asked for beyond what the settings explain, cut short.
        self.waits_capped = 0

    def timed(self) -> _Timed:
        """``with stats.timed(): await shared...``: the call's time, or its failure."""
        return _Timed(self)

    def answered(self, seconds: float) -> None:
        self.round_trip.observe(seconds)
        self.errors_since_good = 0
        self.last_sync = self.wall()

    def failed(self) -> None:
        self.errors += 1
        self.errors_since_good += 1


class _Timed:
    __slots__ = ("stats", "start")

    def __init__(self, stats: FleetStats) -> None:
        self.stats = stats
        self.start = 0.0

    def __enter__(self) -> None:
        self.start = self.stats.clock()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            self.stats.answered(self.stats.clock() - self.start)
        elif issubclass(kind, RedisUnavailable):
            self.stats.failed()
