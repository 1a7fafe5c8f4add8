"""A transport: one master.cf delivery service and its destination queues.

Holds the transport's parameters (looked up by the configuration layer with stock's
``<transport>_*`` then ``default_*`` rule), its parsed feedback, its queues by name, and
its jobs in enqueue order. A transport whose agent cannot be reached is "dead" for
``transport_retry_time``; while dead, its mail is sent to the retry transport.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pyqmgr.scheduler.feedback import Feedback
from pyqmgr.scheduler.queue import Dsn, Queue

if TYPE_CHECKING:
    from pyqmgr.scheduler.job import Job


class TransportParams(Protocol):
    """What the core needs of a transport's configuration (config.TransportConfig)."""

    destination_concurrency_limit: int
    destination_recipient_limit: int
    initial_destination_concurrency: int
    failed_cohort_limit: int
    destination_rate_delay: int


@dataclass(eq=False)
class Transport:
    name: str
    cfg: TransportParams
    pos_feedback: Feedback
    neg_feedback: Feedback
    log: Callable[[str], None]
    feedback_debug: bool = False
    queues: dict[str, Queue] = field(default_factory=dict)
    #: Jobs in enqueue order (a dict keeps insertion order and O(1) removal).
    jobs: dict[Job, None] = field(default_factory=dict)
    dsn: Dsn | None = None
    revive_at: float | None = None
    todo_count: int = 0

    @property
    def throttled(self) -> bool:
        return self.dsn is not None

    @property
    def initial_concurrency(self) -> int:
        return self.cfg.initial_destination_concurrency

    @property
    def recipient_limit(self) -> int:
        """Recipients per delivery request (``<transport>_destination_recipient_limit``)."""
        return self.cfg.destination_recipient_limit

    def queue(self, name: str, nexthop: str) -> Queue:
        queue = self.queues.get(name)
        if queue is None:
            queue = Queue(self, name, nexthop, window=self.initial_concurrency)
            self.queues[name] = queue
        return queue
