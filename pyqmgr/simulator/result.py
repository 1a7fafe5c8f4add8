"""What a simulation run produced: every delivery, each destination's window over time,
counts per destination, the scheduler's log lines (one sender's, a fleet's too)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyqmgr.scheduler.queue import Queue
    from pyqmgr.simulator.message import SimMessage


@dataclass(frozen=True)
class Delivery:
    """One delivery attempt as it ended."""

    start: float
    end: float
    transport: str
    destination: str
    message: str
    recipients: int
    outcome: str  # "sent", "deferred" (hop failure), "retry", "bounced"
    window: int  # the destination's window when the delivery was chosen
    reason: str = ""
    #: Which server of a fleet made it ("" for a single server).
    server: str = ""


@dataclass
class Result:
    deliveries: list[Delivery] = field(default_factory=list)
    #: Per destination: (time, window, busy) whenever either changed.
    windows: dict[str, list[tuple[float, int, int]]] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)
    deferred: dict[str, int] = field(default_factory=dict)
    #: Recipients a destination answered with a 5xx (``rcpt_5xx``).
    bounced: dict[str, int] = field(default_factory=dict)
    #: Of the deferred, those of a site held dead (qmgr's "delivery temporarily
    #: suspended", deferred without a try).
    held_dead: dict[str, int] = field(default_factory=dict)
    #: Per destination: each sent recipient's delay from its message's arrival (the
    #: maillog's ``delay``), for messages that count (an arrivals file's measured).
    delays: dict[str, list[float]] = field(default_factory=dict)
    log: list[tuple[float, str, str]] = field(default_factory=list)
    end_time: float = 0.0
    decisions: int = 0
    #: The deferred-queue model: (time, queue id, "scan" or "recovery") for every
    #: message that came back from the deferred queue ...
    retries: list[tuple[float, str, str]] = field(default_factory=list)
    #: ... (time, messages it took) for every deferred-queue scan that took some ...
    scans: list[tuple[float, int]] = field(default_factory=list)
    #: ... and the messages still deferred when the run ended; messages that outlived
    #: maximal_queue_lifetime (bounce_queue_lifetime for a bounce) with recipients
    #: still deferred, returned to sender as stock does.
    still_deferred: int = 0
    expired: int = 0
    #: Delivery policy delegation: questions asked, answers that held a destination
    #: back (per destination), messages put on hold, recipients rejected to error(8).
    asked: int = 0
    held_back: dict[str, int] = field(default_factory=dict)
    held: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    #: Source pools and warm-up (simulator/sources.py's summary), None: off.
    sources: dict[str, Any] | None = None

    def sample(self, now: float, queue: Queue, in_flight: int) -> None:
        """Record a destination's window and busy count if either changed.

        Only the queue an event touched is looked at, so sampling stays O(1) per
        event; busy counts are the engine's own per destination (with per-recipient
        queues one destination has many queues).
        """
        dest = queue.nexthop
        points = self.windows.setdefault(dest, [])
        point = (now, queue.window, in_flight)
        if not points or points[-1][1:] != point[1:]:
            if points and points[-1][0] == now:
                points[-1] = point
            else:
                points.append(point)

    def add_delays(self, now: float, msg: SimMessage, dest: str, n: int) -> None:
        """``n`` recipients of ``msg`` delivered to ``dest`` now: their delays."""
        if msg.measured:
            delays = self.delays.get(dest)
            if delays is None:
                delays = self.delays[dest] = []
            delay = now - msg.arrival
            for _ in range(n):
                delays.append(delay)

    def deferral_rate(self, destination: str) -> float:
        """Deferred recipients / recipients tried, over the first delivery pass."""
        sent = self.sent.get(destination, 0) + self.bounced.get(destination, 0)
        deferred = self.deferred.get(destination, 0)
        return deferred / (sent + deferred) if sent + deferred else 0.0

    def mean_concurrency(self, destination: str) -> float:
        """Time-weighted mean of busy deliveries while any was under way."""
        points = self.windows.get(destination, [])
        total = weight = 0.0
        for (t0, _, busy), (t1, _, _) in itertools.pairwise(points):
            if busy > 0:
                total += busy * (t1 - t0)
                weight += t1 - t0
        return total / weight if weight else 0.0
