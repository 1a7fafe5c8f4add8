"""The simulator's deferred queue (``[deferred] retry = true``): retries and recovery.

Deferred mail waits for stock's retry time (its age, clamped to minimal..maximal
backoff, plus pyqmgr.cf's jitter when set) and comes back at the deferred scan, which
runs every queue_run_delay as stock's timer does, when the queue manager next wakes.
With deferred-mail recovery on, mail that waited for a destination comes back at the
recovery rate once that destination delivers again. Past its lifetime, a message is
returned to sender instead.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from pyqmgr.scheduler.message import Message
from pyqmgr.settings.retry import Registry, RetrySettings
from pyqmgr.simulator.message import SimMessage

if TYPE_CHECKING:
    from pyqmgr.postfix.config import QmgrConfig
    from pyqmgr.simulator.scenario import Scenario


class Counts(Protocol):
    """The run's figures the deferred queue adds to (the engine's ``Result``)."""

    expired: int
    scans: list[tuple[float, int]]
    retries: list[tuple[float, str, str]]
    log: list[tuple[float, str, str]]


class Host(Protocol):
    """What the deferred queue needs of the engine."""

    now: float
    cfg: QmgrConfig
    sc: Scenario

    @property
    def result(self) -> Counts: ...
    def at(self, when: float, action: Callable[[], None]) -> None: ...
    def _feed(self) -> None: ...
    def _let_in(self, msg: SimMessage, feed: bool = True) -> None: ...


class DeferredQueue:
    """Queue id -> (retry time, message), the next scan, the jitter's own random numbers
    (so that turning it on changes no latency), recovery's registry and its pacing."""

    def __init__(self, host: Host, retry: RetrySettings | None, seed: int | None) -> None:
        self.host = host
        self.retry = retry
        self.deferred: dict[str, tuple[float, SimMessage]] = {}
        self.scan_due = False
        #: The deferred scan's whole-second deadline once it has passed with the queue
        #: manager asleep (None: not waiting); see scan_deadline.
        self.scan_late: float | None = None
        #: When the queue manager last woke (its event loop's last pass).
        self.last_wake = 0.0
        #: Set by an event that is no wake-up of the queue manager's loop.
        self.asleep = False
        self.retry_rng = random.Random(f"deferred retry {seed}")
        self.registry: Registry | None = None
        self.recovery_next = 0.0
        if retry is not None and retry.recovery_rate is not None:
            self.registry = Registry(retry.recovery_limit)

    def defer(self, msg: SimMessage) -> None:
        """To the deferred queue with stock's retry time, plus the jitter; or, past its
        lifetime, returned to sender (qmgr_active_done: whole seconds since the queue
        file's creation)."""
        cfg = self.host.cfg
        lifetime = cfg.bounce_queue_lifetime if msg.bounce else cfg.maximal_queue_lifetime
        if int(self.host.now) >= math.floor(msg.arrival) + lifetime:
            self.host.result.expired += 1
            return
        # Stock counts in whole seconds of the clock (event_time() less the queue
        # file's create_time) and stamps the file with their sum.
        delay = min(max(int(self.host.now) - math.floor(msg.arrival), cfg.minimal_backoff_time),
                    cfg.maximal_backoff_time)
        when: float = int(self.host.now) + int(delay)
        if self.retry is not None:
            when += self.retry.jitter_for(int(delay), self.retry_rng)
        qid = msg.sched.queue_id
        self.deferred[qid] = (when, msg)
        if self.registry is not None and msg.waits:
            self.registry.remember(qid, sorted(msg.waits))
        if not self.scan_due:
            # The deferred scan runs every queue_run_delay since start, as stock's timer
            # (since the scenario's scan_phase: a replayed log's scans' times).
            self.scan_due = True
            self.host.at(self.next_scan(), self.scan_deadline)

    def next_scan(self) -> float:
        period = self.host.cfg.queue_run_delay
        phase = self.host.sc.scan_phase % period
        return phase + (int((self.host.now - phase) // period) + 1) * period

    def scan_deadline(self) -> None:
        """The deferred scan's timer is due; it runs when the queue manager wakes.

        Postfix's timers have whole-second deadlines (event_request_timer: time() plus
        the delay), and its event loop sleeps in select() for whole seconds up to the
        next deadline. So a deadline that passes while it sleeps fires at the first
        event after it (new mail, an agent's report) or, if none comes, as many whole
        seconds after the loop went to sleep: the deadline plus the fraction of a
        second at which it last woke. On a real run of a quiet qmgr meeting a 4.7.28
        rate limiter (2 sessions a second), the sessions of retried mail began at
        every fraction of the second, and the first retries came 0.25 s after the
        second began. Run on the deadline, every retry met the server at the second's
        start, right after the previous second's sessions had left its count: with the
        arrivals placed to the millisecond, the replay fitted a limit of 1 and still
        delivered only 45 of 80 recipients by the log's end, with 388 deferred tries
        (the log: 226); run late as here, it fits 2 and defers 196 times (held out on
        a second run: 210 against 231).
        """
        self.asleep = True
        late = self.last_wake % 1.0
        if late <= 0.0:
            self.asleep = False
            self.scan()
            return
        deadline = self.host.now
        self.scan_late = deadline

        def timeout() -> None:
            if self.scan_late == deadline:
                self.scan_late = None
                self.scan()
            else:
                self.asleep = True  # an event ran the scan before: nothing wakes here

        self.host.at(deadline + late, timeout)

    def scan(self) -> None:
        """A deferred-queue scan: everything whose retry time has come, at once."""
        self.scan_due = False
        # Stock takes a file whose retry time is at most a second away (qmgr_active.c:
        # "st_mtime > time + 1" is not yet ripe, time in whole seconds), as the daemon
        # does.
        ripe = int(self.host.now) + 1
        due = [qid for qid, (when, _) in self.deferred.items() if when <= ripe]
        for qid in due:
            self.come_back(qid, "scan")
        if due:
            self.host.result.scans.append((self.host.now, len(due)))
        if self.deferred:
            self.scan_due = True
            self.host.at(self.next_scan(), self.scan_deadline)
        self.host._feed()

    def come_back(self, qid: str, how: str) -> None:
        _, msg = self.deferred.pop(qid)
        if self.registry is not None:
            self.registry.forget(qid)
        again = SimMessage(Message(qid, self.host.now, rcpt_unread=len(msg.retry)), msg.retry,
                            msg.destination, msg.arrival, msg.scripts, msg.measured)
        again.tries = msg.tries
        again.children = msg.children
        again.bounce = msg.bounce
        # Its class and tenant, as the daemon reads them off the queue file again
        # (a source pool's choice goes by them).
        again.sched.rank, again.sched.tenant = msg.sched.rank, msg.sched.tenant
        again.sched.weight = msg.sched.weight
        again.sched.owner = again
        self.host.result.retries.append((self.host.now, qid, how))
        self.host._let_in(again, feed=False)

    def recover(self, transport: str, name: str, nexthop: str, why: str) -> None:
        """A destination delivers again: its deferred mail comes back at the rate."""
        assert self.registry is not None and self.retry is not None
        rate = self.retry.recovery_rate
        assert rate is not None
        qids = self.registry.take((transport, name))
        if not qids:
            return
        self.host.result.log.append((self.host.now, "info", (
            f"deferred recovery: {nexthop} ({transport}) delivers again after {why}: "
            f"bringing {len(qids)} deferred messages forward at {rate}")))
        start = max(self.host.now, self.recovery_next)
        for i, qid in enumerate(qids):
            self.host.at(start + i * rate.interval, self.bring_forward(qid))
        self.recovery_next = start + len(qids) * rate.interval

    def bring_forward(self, qid: str) -> Callable[[], None]:
        def forward() -> None:
            if qid in self.deferred:
                self.come_back(qid, "recovery")
                self.host._feed()
        return forward
