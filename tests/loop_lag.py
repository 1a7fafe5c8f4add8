"""An event loop's lag, less the time the machine made it wait for a CPU.

Tests that bound how long work may hold the event loop (10 ms, issue #45) tick a 1 ms
timer beside the work and take its worst lateness. On CI's two cores, with three
lanes of tests beside, the process is also made to wait for a CPU now and then, for
tens of milliseconds (76 ms seen in a clean clone's run), which says nothing of the
code under test. Linux counts that wait per thread (``/proc/thread-self/schedstat``,
its second field: nanoseconds runnable but not running), so each tick's lateness is
taken less the loop thread's wait in that tick: what remains is the loop being busy
(a callback's CPU or a blocking call) or waiting for the GIL, which is the cost
being bounded. Where the file is missing the lateness is taken whole.
"""

from __future__ import annotations

import asyncio
import time


def run_delay() -> float:
    """Seconds this thread has been runnable but not running, since it started."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class LoopLag:
    """Tick every millisecond on the running loop until :meth:`stop`; ``own`` is the
    worst lateness less the machine's wait, ``raw`` the worst lateness as seen."""

    def __init__(self) -> None:
        self.raw = 0.0
        self.own = 0.0
        self._done = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        while not self._done:
            waited = run_delay()
            due = time.monotonic() + 0.001
            await asyncio.sleep(0.001)
            late = time.monotonic() - due
            self.raw = max(self.raw, late)
            self.own = max(self.own, late - (run_delay() - waited))

    async def stop(self) -> None:
        self._done = True
        if self._task is not None:
            await self._task
