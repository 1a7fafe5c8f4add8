"""Stock's whole-second clock on the scheduler's clock.

Stock's queue manager keeps time as ``time()`` in whole seconds: ``event_request_timer``
counts a timer's delay from the whole second now and runs it once ``time()`` reaches
that second, and a deferred file's retry time (its mtime) is a whole second too. So a
10 s ``minimal_backoff_time`` brings a dead site back 9 to 10 s after it died, in step
with the deferred scans that bring its mail back, not 10 s to the microsecond after.
(Issue #32 looked here for why pyqmgr's sites die less often than stock's behind a
provider's rate limit; on its own the grid did not close that gap: benchmarks/README.md.)

The core never reads a clock: the daemon tells it where ``time()``'s whole seconds
fall on its monotonic ``now`` (``second_phase``: ``now + second_phase`` is whole at
each); the simulator's virtual clock is its own wall clock, phase 0.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyqmgr.scheduler.state import Core


def timer_base(core: Core) -> float:
    """The whole second now (stock's ``event_present``) on the scheduler's clock: what
    a timer's delay is added to."""
    return math.floor(core.now + core.second_phase) - core.second_phase
