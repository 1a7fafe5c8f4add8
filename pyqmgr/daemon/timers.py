"""The queue manager's own timers, due at whole seconds of ``time()`` as stock's are.

Stock's ``event_request_timer()`` counts a delay from the whole second now and runs
the timer once ``time()`` reaches that second (see :mod:`pyqmgr.scheduler.clock`):
the deferred scan runs at whole seconds, when a deferred file's whole-second retry time
has just come, and a dead site comes back at a whole second. The core puts its
timers on that grid itself; the daemon's deferred scan is kept on it here, and the
core is told where the grid is.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Protocol

from pyqmgr.daemon.active import SCAN_START


class Scan(Protocol):
    """A queue scan (the daemon's QueueScan), asked to start."""

    def request(self, flags: int) -> None: ...


#: A timer is armed this much past its deadline: asyncio may run a callback up to its
#: clock's resolution early, and the core acts only on what is due by ``now``.
TIMER_SLACK = 0.001


def second_phase() -> float:
    """Where ``time()``'s whole seconds fall on the monotonic clock the core keeps
    (read again every second: NTP may step ``time()``)."""
    return (time.time() - time.monotonic()) % 1.0


async def deferred_runs(scan: Scan, delay: float, wakeup: asyncio.Event) -> None:
    """Stock's qmgr_deferred_run_event: a deferred scan every ``queue_run_delay``, due
    at whole seconds (a deferred file is ripe at a whole second too, so the phase
    decides which scan takes it)."""
    while True:
        now = time.time()
        await asyncio.sleep(math.floor(now) + delay - now + TIMER_SLACK)
        scan.request(SCAN_START)
        wakeup.set()
