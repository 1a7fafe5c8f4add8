"""A destination queue and its concurrency window (``qmgr_queue.c``).

This is the Postfix 2.5 concurrency scheduler of the seed document: a per-destination
window grown by positive feedback after deliveries without hop failure and shrunk by
negative feedback after hop failures, with hysteresis, the safety rule that the window
only grows while it is below busy + initial concurrency, and "dead" destinations after
``failed_cohort_limit`` pseudo-cohorts of failures. A window of 0 means throttled (dead).

The structure and its window methods are declared in :mod:`.structures`, beside the
structures they name; this module is where code asks for them by this name.
"""

from __future__ import annotations

from pyqmgr.scheduler.structures import SUSPENDED, THROTTLED, Dsn, Queue

__all__ = ["SUSPENDED", "THROTTLED", "Dsn", "Queue"]
