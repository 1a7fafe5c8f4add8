"""An event loop's lag, less the time the machine made the process wait for a CPU.

Tests that bound how long work may hold the event loop (10 ms, issue #45) tick a 1 ms
timer beside the work and take its worst lateness. On CI's two cores, with three lanes
of tests and the benchmarks beside, the process is also made to wait for a CPU now and
then, for tens of milliseconds (76 ms seen in a clean clone's run), which says nothing
of the code under test. Linux counts that wait per thread
(``/proc/self/task/*/schedstat``, its second field: nanoseconds runnable but not
running). The loop's thread waits for a CPU itself, and it also waits for the GIL
while the worker thread holding it is kept from a CPU, which the loop's own count does
not show (a 20 ms lateness in CI with the loop's own wait under 5 ms). So each tick's
lateness is taken less every thread's wait in that tick (at most the lateness): what
remains is a thread of ours busy (a callback's CPU, a blocking call, a GIL held),
which is the cost being bounded. A control that blocks the loop itself still shows its
lag: a blocked or busy thread is not waiting for a CPU. Where the files are missing
the lateness is taken whole.
"""

from __future__ import annotations

import asyncio
import os
import time


def run_delay() -> float:
    """Seconds this process's threads have been runnable but not running, summed."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9


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
            self.own = max(self.own, late - min(late, run_delay() - waited))

    async def stop(self) -> None:
        self._done = True
        if self._task is not None:
            await self._task
