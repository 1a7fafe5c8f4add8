"""The daemon's applier: where the core's decisions become actions.

Every event into the core returns one :class:`~pyqmgr.scheduler.decisions.Decisions`;
:meth:`Applier.apply` is the one place the daemon carries one out (the simulator's
``Engine.apply`` is the other): log lines, timers, synchronous deferrals,
deferred-mail recovery, ended suspensions, finished messages, the fleet's news and
the sites' lookups, in that order. Its timers call back into the core and then let
the dispatcher run. Split from :class:`~pyqmgr.daemon.qmgr.Qmgr`, which feeds and
dispatches, so that a new kind of decision is one line here and nothing there.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from pyqmgr.daemon.active import Appends
from pyqmgr.daemon.host import QmgrCore
from pyqmgr.postfix import bounce
from pyqmgr.postfix.deliver_request import DEL_REQ_FLAG_RECORD
from pyqmgr.postfix.log_adhoc import log_adhoc_line
from pyqmgr.scheduler.decisions import NOTHING, Decisions, DeferRecipient
from pyqmgr.scheduler.entry import Entry

if TYPE_CHECKING:

    from pyqmgr.daemon.active import ActiveMessage, TraceRecords
    from pyqmgr.daemon.fleet import Fleet
    from pyqmgr.daemon.retry import RetryControl
    from pyqmgr.daemon.sites import SiteResolver
    from pyqmgr.daemon.suspensions import Suspensions


class ApplierHost(QmgrCore, Protocol):
    """What the applier acts through (:class:`~pyqmgr.daemon.qmgr.Qmgr`) beyond the core:
    the event loop's timers, and each part a decision may be for."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...
    @property
    def suspensions(self) -> Suspensions: ...
    @property
    def retry(self) -> RetryControl | None: ...
    @property
    def fleet(self) -> Fleet | None: ...
    @property
    def sites(self) -> SiteResolver | None: ...
    @property
    def events(self) -> TraceRecords: ...
    def message_done(self, am: ActiveMessage) -> None: ...


#: The core's deadlines are rounded up to this grain, and those that fall on one wake
#: the core once. Stock's qmgr keeps its timers in whole seconds; pyqmgr's core asks
#: for finer ones, and with sites one or two per new domain (its first MX lookup's
#: wait, issue #44): one event-loop timer and one tick each was about 1.6 of both per
#: message with 3,000 domains. 5 ms later at most is nothing to a backoff or a wait.
TIMER_GRAIN = 0.005


class Applier:
    def __init__(self, qmgr: ApplierHost) -> None:
        self.q = qmgr
        #: The core's pending deadlines (grains, as a heap and a set), and the one
        #: loop timer armed for the earliest.
        self._wakes: list[float] = []
        self._waking: set[float] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        #: The armed shaping timer (at most one: the core asks for its earliest).
        self._gate_timer: asyncio.TimerHandle | None = None
        self._gate_at = 0.0

    def apply(self, d: Decisions) -> Entry | None:
        """Carry out what the core decided in one event; the entry it chose, if any."""
        if d is NOTHING:
            return None
        q = self.q
        if d.ended:
            q.suspensions.ended(list(d.ended))
        if d.gate_timers:
            self._arm_gate_timer(min(d.gate_timers))
        if d.timers:
            self._wake_at(d.timers)
        for severity, text in d.log:
            q.log.log(severity, text)
        for deferral in d.deferrals:
            self._begin(deferral.message.owner)
            q.spawn(self._defer_recipient(deferral))
        if d.waits or d.recovered:
            assert q.retry is not None
            q.retry.decisions(d.waits, d.recovered)
        for message in d.finished:
            if message.owner is not None:
                q.message_done(message.owner)
        if d.throttled and q.fleet is not None:
            q.fleet.tell(d.throttled)
        if d.resolve and q.sites is not None:
            q.sites.resolve(d.resolve)
        return d.deliver

    def _wake_at(self, times: Iterable[float]) -> None:
        """Deadlines the core asked for: each grain once, one loop timer for the
        earliest."""
        for when in times:
            grain = math.ceil(when / TIMER_GRAIN) * TIMER_GRAIN
            if grain in self._waking:
                continue
            self._waking.add(grain)
            heapq.heappush(self._wakes, grain)
        self._arm()

    def _arm(self) -> None:
        if not self._wakes or self._wakes[0] >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = self._wakes[0]
        self._timer = self.q.loop.call_later(max(0.0, self._timer_at - time.monotonic()),
                                             self._on_timer)

    def _on_timer(self) -> None:
        """Deadlines the core asked for have come: revive or resume destinations,
        deliver; then the timer for the next."""
        self._timer, self._timer_at = None, math.inf
        now = time.monotonic()
        while self._wakes and self._wakes[0] <= now:
            self._waking.discard(heapq.heappop(self._wakes))
        try:
            self.apply(self.q.scheduler.tick(now))
            self.q.dispatch()
        finally:
            # Armed again whatever happened: one timer now stands for every later
            # deadline, where each had its own before.
            self._arm()

    def _on_gate_timer(self) -> None:
        """A shaping gate opens or a recovery step is due (rates, response rules)."""
        self._gate_timer = None
        self.apply(self.q.scheduler.open_gates(time.monotonic()))
        self.q.dispatch()

    def _arm_gate_timer(self, when: float) -> None:
        if self._gate_timer is not None:
            if self._gate_at <= when:
                return
            self._gate_timer.cancel()
        self._gate_at = when
        self._gate_timer = self.q.loop.call_later(max(0.0, when - time.monotonic()),
                                                  self._on_gate_timer)

    async def _defer_recipient(self, d: DeferRecipient) -> None:
        """The retry transport is dead too: append to the defer log ourselves, as
        stock's ``qmgr_defer_recipient`` does with ``defer_append()``: the defer log,
        the maillog line, then, with a trace flag (the message's, or delivery
        events'), the trace log, whose record the events then read."""
        am: ActiveMessage = d.message.owner
        r = d.recipient
        q = self.q
        qid = am.queue_id
        am.flags |= 1
        try:
            flags = am.tflags | q.events.record_flags(am)
            if await bounce.append("defer", flags, qid, r.orig_addr, r.address, r.offset,
                                   r.dsn_orcpt, r.dsn_notify, d.dsn.status, "delayed",
                                   d.dsn.reason) != 0:
                q.log.warning(f"{qid}: defer service failure")
            now = time.time()
            sec = int(now)
            q.log.info(log_adhoc_line(
                qid, r.address, r.orig_addr, bounce.NO_RELAY, am.qf.arrival_time,
                am.active_time, (sec, int((now - sec) * 1e6)), d.dsn.status, "deferred",
                d.dsn.reason, q.cfg.delay_logging_resolution_limit,
            ))
            if flags & DEL_REQ_FLAG_RECORD:
                if await bounce.trace_append(flags, qid, r.orig_addr, r.address, r.offset,
                                             r.dsn_orcpt, r.dsn_notify, bounce.NO_RELAY,
                                             d.dsn.status, "delayed", d.dsn.reason) != 0:
                    q.log.warning(f"{qid}: trace service failure")
                q.events.after_reply(am, None)
        finally:
            self._end(am)

    def _begin(self, am: ActiveMessage) -> None:
        if am.appends is None:
            am.appends = Appends(self.q.loop.create_future())
        am.appends.count += 1

    @staticmethod
    def _end(am: ActiveMessage) -> None:
        appends = am.appends
        assert appends is not None
        appends.count -= 1
        if appends.count == 0:
            am.appends = None
            appends.done.set_result(None)
