"""Deferred mail's next try: retry jitter, and recovery when a destination is back.

Both are off unless pyqmgr.cf turns them on; then the deferred queue is exactly stock's
(``qmgr_active_done_3``: the next retry time is the file's mtime, the message's age
bounded by ``minimal_backoff_time`` and ``maximal_backoff_time``).

**Jitter** (``deferred_retry_jitter = 10m`` or ``= 20%``). Stock gives every message
deferred in the same second the same retry time, so a burst of mail that met a dead
destination together comes back together, scan after scan. The jitter adds a uniform
random delay in ``[0, jitter)`` to each deferred file's retry time: a duration, or a
share of that deferral's backoff (20% of a 300 s backoff is up to 60 s, of 4000 s up
to 800 s). Only ever *added*: no retry comes earlier than stock's, so
``minimal_backoff_time`` still holds. The random numbers come from a
:class:`random.Random` the daemon owns (:attr:`RetryControl.rng`); tests replace it
with a seeded one, production has no setting for that.

The deferred scan runs every ``queue_run_delay`` (300 s) and takes every file whose
time has come, so retry times spread over less than that still meet in one scan;
a jitter of a few ``queue_run_delay`` spreads them over that many scans.

**Recovery** (``deferred_recovery_rate = 20/1s``). When a destination that was dead
(failed cohorts, or its transport unreachable) or throttled (a response rule, see
:mod:`pyqmgr.scheduler.shaping`) delivers again, the mail it sent to deferred/ is
brought forward instead of waiting out its backoff, paced at the rate so that the
recovery does not become the flush storm that ``postqueue -f`` would be. The core
says which messages waited for which destination and when one delivered again
(:meth:`pyqmgr.scheduler.core.Scheduler.watch_recovery`); this module remembers the
queue ids of the deferred files (:class:`~pyqmgr.settings.retry.Registry`, shared
with the simulator) and brings them forward: the file's mtime is set to now if it
still lies in the future, and the file is fed into the active queue directly, one
every 1/rate seconds, oldest deferral first.

Why fed directly rather than by asking for a deferred scan: a scan walks the whole of
deferred/ and takes everything that is due at the speed of the feeder, so pacing by
touching files would need a scan per step (a walk over 100,000 names every second of
a recovery) or give up the pacing. Feeding the known files is O(1) each, and a file
the running scan reaches later is simply gone from deferred/ by then, as when two
scans meet in stock. The active queue limit still holds: with no room the recovery
waits.

The registry is in memory and bounded (``deferred_recovery_limit`` queue ids in all,
the least recently deferred forgotten first); a restart forgets it. That is safe
because recovery is an optimisation: forgotten mail is retried at its normal time.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pyqmgr.daemon.host import QmgrCore
from pyqmgr.durations import duration
from pyqmgr.postfix import mail_queue
from pyqmgr.settings.retry import JITTER, RECOVERY_RATE, Key, Registry, RetrySettings

if TYPE_CHECKING:
    from pyqmgr.daemon.active import ActiveMessage
    from pyqmgr.scheduler.message import Message


class RetryHost(QmgrCore, Protocol):
    """What the retry controls need of the daemon (daemon/qmgr.py's Qmgr) beyond the
    core, declared here so that this module does not import the daemon that imports it."""

    def may_feed(self) -> bool: ...

    def feed_deferred(self, qid: str) -> bool: ...


@dataclass(eq=False)
class Run:
    """One recovery: a destination that delivered again, and its deferred mail."""

    transport: str
    queue: str
    nexthop: str
    #: Why the destination was watched (dead, or a throttling reply), for the log.
    why: str
    started: float
    #: Messages brought forward in all.
    total: int = 0
    #: Fed into the active queue so far; no longer in deferred/ (delivered or retried
    #: meanwhile, or a file the feed refused).
    brought_forward: int = 0
    gone: int = 0

    @property
    def left(self) -> int:
        return self.total - self.brought_forward - self.gone


@dataclass
class RetryControl:
    """The daemon's jitter and recovery: settings, randomness, registry, the pacer."""

    qmgr: RetryHost
    settings: RetrySettings
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self.registry = Registry(self.settings.recovery_limit)
        #: (queue id, its recovery) to bring forward, in order.
        self.due: deque[tuple[str, Run]] = deque()
        self.runs: dict[Key, Run] = {}
        self.pacing = False
        #: Counters since start, for status.
        self.jittered = 0
        self.recoveries = 0
        self.brought_forward = 0

    @property
    def recovery(self) -> bool:
        return self.settings.recovery_rate is not None

    def start(self) -> None:
        """Switch the core's half on (after the scheduler is final) and say what is on."""
        s = self.settings
        parts = []
        if s.jitter_text:
            parts.append(f"{JITTER} = {s.jitter_text}: up to "
                         + (duration(s.jitter) if s.jitter else f"{s.jitter_share:.0%} of the "
                            "backoff") + " added to each deferred message's retry time")
        if s.recovery_rate is not None:
            self.qmgr.scheduler.watch_recovery()
            parts.append(f"{RECOVERY_RATE} = {s.recovery_rate}: deferred mail of a dead or "
                         "throttled destination is brought forward when it delivers again "
                         f"(at most {s.recovery_limit} queue ids remembered)")
        for text in parts:
            self.qmgr.log.info(f"deferred retry: {text}")

    # -- the deferred queue's side (ActiveQueue) ------------------------------------

    def retry_time(self, when: float, backoff: float) -> float:
        """Stock's retry time ``when`` plus the jitter for a backoff of ``backoff``."""
        if self.settings.jitter or self.settings.jitter_share:
            self.jittered += 1
            return when + self.settings.jitter_for(backoff, self.rng)
        return when

    def deferred(self, am: ActiveMessage) -> None:
        """``am`` is now in deferred/: remember what it waits for."""
        if am.waits:
            self.registry.remember(am.queue_id, sorted(am.waits))

    def fed(self, qid: str) -> None:
        """A file left its queue for active/: it waits for nothing remembered."""
        if self.registry.of:
            self.registry.forget(qid)

    # -- the core's decisions ---------------------------------------------------------

    def decisions(self, waits: Iterable[tuple[Message, str, str]],
                  recovered: Iterable[tuple[str, str, str, str]]) -> None:
        """Act on the core's recovery decisions (:meth:`Scheduler.watch_recovery`)."""
        for message, transport, name in waits:
            am = message.owner
            if am is not None:
                if am.waits is None:
                    am.waits = set()
                am.waits.add((transport, name))
        for transport, name, nexthop, why in recovered:
            self.recover(transport, name, nexthop, why)

    def recover(self, transport: str, name: str, nexthop: str, why: str) -> None:
        """A watched destination delivered again: bring its deferred mail forward."""
        key = (transport, name)
        qids = self.registry.take(key)
        if not qids or self.settings.recovery_rate is None:
            return
        rate = self.settings.recovery_rate
        run = self.runs.get(key)
        if run is None:
            run = self.runs[key] = Run(transport, name, nexthop, why, time.monotonic())
            self.recoveries += 1
        run.total += len(qids)
        self.due.extend((qid, run) for qid in qids)
        self.qmgr.log.info(
            f"deferred recovery: {nexthop} ({transport}) delivers again after {why}: "
            f"bringing {len(qids)} deferred messages forward at {rate} "
            f"({RECOVERY_RATE}), about {duration(len(self.due) * rate.interval)}")
        if not self.pacing:
            self.pacing = True
            self.qmgr.spawn(self._pace())

    async def _pace(self) -> None:
        """One file every 1/rate seconds, while there is room in the active queue.

        The schedule runs from the ideal start times, so sleeping late does not slow
        the rate down; after a stall at most two go back to back.
        """
        rate = self.settings.recovery_rate
        assert rate is not None
        interval = rate.interval
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        try:
            while self.due:
                now = loop.time()
                if next_at > now:
                    await asyncio.sleep(next_at - now)
                    continue
                if not self.qmgr.may_feed():
                    # The active queue is full: wait for room rather than touch files
                    # that the next scan would then take all at once.
                    next_at = now + interval
                    continue
                next_at = max(next_at, now - interval) + interval
                qid, run = self.due.popleft()
                self._bring_forward(qid, run)
                if run.left == 0:
                    self._finished(run)
        finally:
            self.pacing = False

    def _bring_forward(self, qid: str, run: Run) -> None:
        cfg = self.qmgr.cfg
        path = mail_queue.queue_path("deferred", qid, cfg.hash_queue_names,
                                     cfg.hash_queue_depth)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            run.gone += 1
            return
        now = time.time()
        if st.st_mtime > now:
            try:
                os.utime(path, (now, now))
            except OSError as exc:
                # The file keeps its retry time (the feed below skips it): logged,
                # not fatal, as recovery is only ever an early retry.
                self.qmgr.log.warning(f"{qid}: deferred recovery: utime {path}: "
                                      f"{exc.strerror}")
        if self.qmgr.feed_deferred(qid):
            run.brought_forward += 1
            self.brought_forward += 1
        else:
            run.gone += 1

    def _finished(self, run: Run) -> None:
        self.runs.pop((run.transport, run.queue), None)
        gone = f", {run.gone} no longer in deferred/" if run.gone else ""
        self.qmgr.log.info(
            f"deferred recovery: {run.nexthop} ({run.transport}): {run.brought_forward} "
            f"deferred messages brought forward in {time.monotonic() - run.started:.1f} s"
            f"{gone}")

    # -- pyqmgr status and explain ------------------------------------------------------

    def status(self, now: float) -> dict[str, object]:
        s = self.settings
        return {
            "jitter": s.jitter_text or None,
            "jittered": self.jittered,
            "recovery_rate": str(s.recovery_rate) if s.recovery_rate is not None else None,
            "remembered": len(self.registry),
            "remembered_destinations": len(self.registry.by_dest),
            "remembered_limit": s.recovery_limit,
            "forgotten_for_room": self.registry.evicted,
            "recoveries": self.recoveries,
            "brought_forward": self.brought_forward,
            "recovering": [
                {"destination": r.nexthop, "transport": r.transport, "why": r.why,
                 "total": r.total, "brought_forward": r.brought_forward, "gone": r.gone,
                 "left": r.left, "for": round(now - r.started, 3)}
                for r in self.runs.values()],
        }

    def explain(self, target: str) -> list[dict[str, object]]:
        """Reasons about ``target``'s deferred mail, for ``pyqmgr explain``."""
        if self.settings.recovery_rate is None:
            return []
        want = target.lower()
        watch = self.qmgr.scheduler.recovery_watch or {}
        out: list[dict[str, object]] = []
        for key, ids in self.registry.by_dest.items():
            if key[1] != want:
                continue
            why = watch.get(key)
            when = (f"when it delivers again after {why}" if why is not None
                    else "when it next delivers after being dead or throttled")
            out.append({"constraint": "deferred mail remembered",
                        "setting": RECOVERY_RATE,
                        "text": f"{len(ids)} deferred messages for {key[1]} ({key[0]}) wait "
                                f"for their retry time; they are brought forward {when}, at "
                                f"{self.settings.recovery_rate}"})
        for run in self.runs.values():
            if run.queue == want or run.nexthop.lower() == want:
                out.append({"constraint": "recovering", "setting": RECOVERY_RATE,
                            "text": f"{run.left} of {run.total} deferred messages for "
                                    f"{run.nexthop} ({run.transport}) still to bring "
                                    f"forward, at {self.settings.recovery_rate}"})
        return out
