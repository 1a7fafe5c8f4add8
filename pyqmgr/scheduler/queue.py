"""A destination queue and its concurrency window (``qmgr_queue.c``).

This is the Postfix 2.5 concurrency scheduler of the seed document: a per-destination
window grown by positive feedback after deliveries without hop failure and shrunk by
negative feedback after hop failures, with hysteresis, the safety rule that the window
only grows while it is below busy + initial concurrency, and "dead" destinations after
``failed_cohort_limit`` pseudo-cohorts of failures. A window of 0 means throttled (dead).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pyqmgr.scheduler.qlist import QList

if TYPE_CHECKING:
    from pyqmgr.scheduler.entry import Entry
    from pyqmgr.scheduler.shaping import Gate, Shape
    from pyqmgr.scheduler.suspension import Suspension
    from pyqmgr.scheduler.transport import Transport

THROTTLED = 0
SUSPENDED = -1


@dataclass(frozen=True, slots=True)
class Dsn:
    """A delivery status: ``4.4.1`` plus the text that explains it."""

    status: str
    reason: str

    @property
    def nexthop(self) -> str:
        """How the retry/error transports receive a DSN: as their next hop."""
        return f"{self.status} {self.reason}"


@dataclass(eq=False)
class Queue:
    transport: Transport
    name: str
    nexthop: str
    window: int = 0
    success: float = 0.0
    failure: float = 0.0
    fail_cohorts: float = 0.0
    busy_count: int = 0
    #: Entries waiting for an agent, in the order they were created.
    todo: QList[Entry] = field(default_factory=QList)
    #: Equal to the transport's blocker tag while this queue blocks the job list.
    blocker_tag: int = 0
    #: When a delivery to this destination last finished (whole seconds).
    last_done: int = 0
    #: Connection-caching request flags (DEL_REQ_FLAG_CONN_*) for its deliveries.
    dflags: int = 0
    #: Why the destination is dead; None while it is alive.
    dsn: Dsn | None = None
    #: When a dead destination comes back (scheduler clock).
    revive_at: float | None = None
    #: When a rate-delayed destination may deliver again (scheduler clock).
    resume_at: float | None = None
    #: Earliest time for the next "is using up N of M active queue entries" warning.
    clog_time_to_warn: float = 0.0
    #: Why no delivery starts now though the destination is alive: an operator's
    #: suspension (``pyqmgr suspend``), a rate's spacing, a backoff rule, a policy
    #: service's DEFER (:mod:`.shaping`). None: open. The one attribute every policy
    #: tests, so that each new reason to wait costs the delivery path nothing more.
    gate: Suspension | Gate | None = None
    #: A response rule's cap on the window (0: none), below the concurrency limit.
    cap: int = 0
    #: Shaping state (:class:`.shaping.Shape`) when the transport has shaping.
    shape: Shape | None = None

    @property
    def ready(self) -> bool:
        return self.window > 0

    @property
    def throttled(self) -> bool:
        return self.window == THROTTLED

    @property
    def suspended(self) -> bool:
        return self.window == SUSPENDED

    def suspend(self, now: float, delay: float) -> None:
        """destination_rate_delay: emulate a slow channel by pausing this destination."""
        self.window = SUSPENDED
        self.resume_at = now + delay

    def resume(self) -> None:
        self.window = 1
        self.resume_at = None

    @property
    def idle(self) -> bool:
        """No entries at all: a live queue like this is discarded (``qmgr_queue_done``)."""
        return self.busy_count == 0 and not self.todo

    # -- feedback -----------------------------------------------------------------

    def _log_window(self, func: str) -> None:
        t = self.transport
        if t.feedback_debug:
            t.log(
                f"{func}: queue {self.name}: limit {t.cfg.destination_concurrency_limit} "
                f"window {self.window} success {self.success:g} failure {self.failure:g} "
                f"fail_cohorts {self.fail_cohorts:g}"
            )

    def _log_feedback(self, feedback: float) -> None:
        if self.transport.feedback_debug:
            self.transport.log(f"qmgr_queue_feedback: feedback {feedback:g}")

    def unthrottle(self) -> None:
        """Positive feedback after a delivery without hop failure; revive a dead site."""
        t = self.transport
        self.fail_cohorts = 0.0
        if self.throttled:
            self.dsn = None
            self.revive_at = None
            # Back from the almost grave, best concurrency is anyone's guess.
            self.window = self.busy_count if self.busy_count > 0 else t.initial_concurrency
            if self.cap and self.window > self.cap:
                self.window = self.cap
            self.success = self.failure = 0.0
            self._log_window("qmgr_queue_unthrottle")
            return
        limit = t.cfg.destination_concurrency_limit
        if self.cap and (limit == 0 or self.cap < limit):
            limit = self.cap
        if (limit == 0 or limit > self.window) and (
            self.window < self.busy_count + t.initial_concurrency
        ):
            feedback = t.pos_feedback.value(self.window)
            self._log_feedback(feedback)
            self.success += feedback
            hysteresis = t.pos_feedback.hysteresis
            while self.success + feedback * t.feedback_slack >= hysteresis:
                t.feedback_up += 1
                self.window += hysteresis
                self.success -= hysteresis
                self.failure = 0.0
            if limit > 0 and self.window > limit:
                self.window = limit
        self._log_window("qmgr_queue_unthrottle")

    def throttle(self, dsn: Dsn, now: float, min_backoff_time: float) -> bool:
        """Negative feedback after a hop failure; True when the site is now dead."""
        t = self.transport
        if self.ready:
            self.fail_cohorts += 1.0 / self.window
            limit = t.cfg.failed_cohort_limit
            if limit > 0 and (self.fail_cohorts > limit if t.cohort_beyond_limit
                              else self.fail_cohorts >= limit):
                self.window = THROTTLED
                t.destinations_died += 1
        if self.ready:
            feedback = t.neg_feedback.value(self.window)
            self._log_feedback(feedback)
            self.failure -= feedback
            hysteresis = t.neg_feedback.hysteresis
            while self.failure - feedback * t.feedback_slack < 0:
                t.feedback_down += 1
                self.window -= hysteresis
                self.success = 0.0
                self.failure += hysteresis
            if self.window < 1:
                self.window = 1
        dead = self.throttled
        if dead:
            self.dsn = dsn
            self.revive_at = now + min_backoff_time
        self._log_window("qmgr_queue_throttle")
        return dead
