"""The feeder: queue files into the active queue (``qmgr.c:qmgr_loop``'s scans).

Stock qmgr's main loop feeds at most one message per event-loop pass, alternating the
incoming and deferred scans, and between passes services agent connections. Here the
same happens in one task; agent connections and message completions are tasks of
their own. Each message is resolved while it is read, with blocking round trips to
trivial-rewrite as in stock (resolving ahead over several connections was measured
and bought nothing: the daemon is CPU-bound, see the README), so messages reach the
scheduler in the order they were read.

Split off ``Qmgr`` (issue #34) when message classes made feeding more than the scans:
with ``message_classes`` the active queue's room is kept by class and new mail of a
higher class is looked for past the scan (:mod:`.class_feed`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from pyqmgr.daemon.active import (
    FLUSH_DFXP,
    FLUSH_ONCE,
    SCAN_ALL,
    SCAN_START,
    ActiveMessage,
    ActiveQueue,
)
from pyqmgr.daemon.class_feed import PASS_INTERVAL, ClassFeed
from pyqmgr.daemon.host import Fatal, QmgrCore
from pyqmgr.postfix import mail_queue

if TYPE_CHECKING:
    from pyqmgr.postfix.master import FlowControl
    from pyqmgr.settings.classes import Classifier

#: Messages fed per event-loop pass: one, as stock feeds. Four (before issue #30) saved
#: no CPU on the drain (5,000 messages, 1.28 s either way) but made every pass cost
#: four messages' reading and routing before agents were served again: with a dead
#: site's 20,000 messages cycling, its retry deliveries ran two at a time, each
#: message waited 3 s in active/ (stock 0.08 s) and the backlog cycled at 78% of
#: stock's rate; with one, 0 s and 93%.
FEED_PER_PASS = 1
#: Queue file names looked at per pass at most. A name whose file is not taken (not
#: due yet, gone, locked) does not end the pass: a scan of 200,000 deferred files not
#: due made one event-loop pass each, 4x stock's scan time (issue #30).
NAMES_PER_PASS = 64

INCOMING = 0
DEFERRED = 1


class QueueScan:
    """One queue directory scan with stock's start/restart flag semantics."""

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.handle: Iterator[str] | None = None
        self.flags = 0
        self.nflags = 0

    def request(self, flags: int) -> None:
        if self.handle is not None and flags & SCAN_ALL:
            self.flags |= SCAN_ALL
        if self.handle is not None and flags & FLUSH_DFXP:
            self.flags |= FLUSH_DFXP
        self.nflags |= flags
        if self.handle is None and flags & SCAN_START:
            self.nflags &= ~SCAN_START
            self._start()

    def _start(self) -> Iterator[str]:
        self.flags = self.nflags
        self.nflags = 0
        self.handle = handle = mail_queue.scan_all(self.queue)
        return handle

    def next(self) -> str | None:
        # The new scan's handle is the one _start returns: after ``self.handle = None``
        # mypy holds the attribute to None across the call, and the compiled build
        # (mypyc) would check that.
        qid: str | None = None
        try:
            if self.handle is not None:
                qid = next(self.handle, None)
                if qid is None:
                    self.handle = None
            if self.handle is None and self.nflags & SCAN_START:
                qid = next(self._start(), None)
                if qid is None:
                    self.handle = None
        except mail_queue.ScanError as exc:
            raise Fatal(str(exc)) from None
        return qid


def scan_requests(data: bytes) -> tuple[int, int]:
    """The scan flags of a trigger's request bytes (mail_proto.h's QMGR_REQ_*), for
    (incoming, deferred): every byte counts, each once."""
    incoming = deferred = 0
    for byte in set(data):
        ch = chr(byte)
        if ch in "WI":
            incoming |= SCAN_START
        elif ch == "D":
            deferred |= SCAN_START
        elif ch == "A":
            incoming |= SCAN_ALL
            deferred |= SCAN_ALL
        elif ch == "F":
            incoming |= FLUSH_ONCE | FLUSH_DFXP
            deferred |= FLUSH_ONCE | FLUSH_DFXP
    return incoming, deferred


class FeederHost(QmgrCore, Protocol):
    """What the feeder needs of the daemon that holds it (daemon/qmgr.py's Qmgr)."""

    @property
    def message_count(self) -> int: ...

    @property
    def active(self) -> ActiveQueue: ...

    def load(self, am: ActiveMessage) -> None:
        """Take a message the feeder brought into active/ (counted from here on)."""


class Feeder:
    """The incoming and deferred scans, in stock's order, and in_flow_delay's tokens."""

    def __init__(self, host: FeederHost, flow: FlowControl | None,
                 classifier: Classifier | None) -> None:
        self.host = host
        self.cfg = cfg = host.cfg
        self.flow = flow
        self.scans = [QueueScan("incoming"), QueueScan("deferred")]
        self.first_scan = INCOMING
        self.wakeup = asyncio.Event()
        #: Room by class and the look into incoming/ (message_classes); None: stock.
        self.classes: ClassFeed | None = (
            ClassFeed(classifier, cfg.qmgr_message_active_limit, cfg.hash_queue_names,
                      cfg.hash_queue_depth)
            if classifier is not None and len(classifier.classes) > 1 else None)

    @property
    def message_count(self) -> int:
        return self.host.message_count

    def start(self) -> None:
        self.scans[INCOMING].request(SCAN_START)
        self.scans[DEFERRED].request(SCAN_START)
        if self.classes is not None:
            self.classes.start(self.wakeup.set, self.host.log.warning)

    def request(self, incoming: int, deferred: int) -> None:
        """A trigger's scan requests (:func:`scan_requests`)."""
        if incoming:
            self.scans[INCOMING].request(incoming)
            if self.classes is not None:
                self.classes.triggered(bool(incoming & SCAN_START))
        if deferred:
            self.scans[DEFERRED].request(deferred)
        self.wakeup.set()

    async def deferred_timer(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.queue_run_delay)
            self.scans[DEFERRED].request(SCAN_START)
            self.wakeup.set()

    def _room(self) -> bool:
        """May the scans feed one more message now?"""
        count = self.host.message_count
        if count >= self.cfg.qmgr_message_active_limit or not self.host.scheduler.may_feed():
            return False
        return self.classes is None or self.classes.main_room(count)

    async def run(self) -> None:
        """Stock's qmgr_loop: one message per pass, then let the event loop run."""
        while True:
            wait = self._class_pass()
            fed: bool | None = None
            loaded = 0
            for _ in range(NAMES_PER_PASS):
                if not self._room():
                    fed = None
                    break
                fed, from_incoming = self._feed_once()
                self._flow_tokens(fed, from_incoming)
                if fed is None or (fed and (loaded := loaded + 1) >= FEED_PER_PASS):
                    break
            if fed is None:
                self._flow_tokens(None, False)
                self.wakeup.clear()
                if wait is None:
                    await self.wakeup.wait()
                else:
                    # A pass over incoming/ is due later: wake for it, or for news.
                    try:
                        await asyncio.wait_for(self.wakeup.wait(), max(wait, 0.001))
                    except TimeoutError:
                        pass
            else:
                await asyncio.sleep(0)

    def _class_pass(self) -> float | None:
        """Run the look into incoming/ when due (message classes only); the seconds
        until the next one is due, or None when none is wanted."""
        classes = self.classes
        if classes is None:
            return None
        due = self._class_retries(classes) if classes.retries else None
        wait = self._incoming_pass(classes)
        if (ends := classes.inflow.ends_in(time.monotonic())) is not None:
            # A flood may end with no event to wake the feeder: then it tops the
            # tokens up before the next message's cleanup wants one.
            due = ends if due is None else min(due, ends)
        return due if wait is None else wait if due is None else min(due, wait)

    def _incoming_pass(self, classes: ClassFeed) -> float | None:
        now = time.monotonic()
        wait = classes.pass_wait(now, self.message_count)
        if wait is None:
            return None
        if (classes.watch is None and classes.listing is None and not classes.full
                and self.scans[INCOMING].handle is None
                and classes.main_room(self.message_count)):
            # No backlog in incoming/ and room: the scan the trigger started finds it.
            classes.wanted = False
            return None
        if wait > 0:
            return wait
        classes.run(self, now)
        # More than a pass's names may be left (a burst of new files): the next pass
        # comes after one turn of the event loop, not at the next trigger.
        return classes.pass_wait(time.monotonic(), self.message_count)

    def _class_retries(self, classes: ClassFeed) -> float | None:
        """Feed the higher classes' deferred mail that is due (:mod:`.class_retry`);
        the seconds until the next is due, or None when none is remembered."""
        caps = classes.caps

        def room(rank: int) -> bool:
            return self.message_count < caps[rank] and self.host.scheduler.may_feed()

        now = time.time()
        _, blocked = classes.retries.feed_due(now, room, self._take_deferred)
        due = classes.retries.next_due(now)
        wait = None if due is None else due - now
        # A class with due mail and no room: a message leaving wakes the feeder, and
        # a pass's interval bounds the wait (the core's may_feed changes silently).
        return wait if not blocked else PASS_INTERVAL if wait is None else min(
            wait, PASS_INTERVAL)

    def _take_deferred(self, qid: str) -> bool | float:
        """A remembered deferred file, now due: fed (True), not there or not
        takeable (False: the scan's), or its real retry time when that is still in the
        future (deferred again, or its time moved since)."""
        path = mail_queue.queue_path("deferred", qid, self.cfg.hash_queue_names,
                                     self.cfg.hash_queue_depth)
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            return False
        if mtime > time.time() + 1:  # as the active queue's own check (active.feed)
            return mtime
        return self.feed_deferred(qid)

    def feed_incoming(self, qid: str) -> bool:
        """One incoming file into the active queue now, past the scan (a higher class's
        mail found by :class:`ClassFeed`); False when it was not taken."""
        am = self.host.active.feed("incoming", qid, 0)
        if am is None:
            return False
        self.host.load(am)
        self._flow_tokens(True, True)
        return True

    def _feed_once(self) -> tuple[bool | None, bool]:
        """One pass over both scans in priority order; at most one message loaded.

        Returns (None when no scan had a name, else whether a message was loaded),
        and whether that name came from the incoming queue.
        """
        host = self.host
        saw_name = False
        last = self.first_scan
        loaded = False
        for i in range(2):
            last = (self.first_scan + i) % 2
            scan = self.scans[last]
            qid = scan.next()
            if qid is None:
                continue
            saw_name = True
            am = host.active.feed(scan.queue, qid, scan.flags)
            if am is not None:
                if last == DEFERRED and self.classes is not None:
                    self.classes.retries.forget(qid)
                host.load(am)
                loaded = True
                break
        if host.message_count < self.cfg.qmgr_message_active_limit:
            self.first_scan = (last + 1) % 2
        else:
            self.first_scan = INCOMING
        return (loaded, loaded and last == INCOMING) if saw_name else (None, False)

    def may_feed(self) -> bool:
        """Is there room in the active queue for one more message?"""
        return (self.host.message_count < self.cfg.qmgr_message_active_limit
                and self.host.scheduler.may_feed())

    def feed_deferred(self, qid: str) -> bool:
        """Bring one deferred file into the active queue now, outside the scans.

        Deferred-mail recovery's way in (:mod:`pyqmgr.daemon.retry`); False when the
        file was not taken (gone, not complete, or still in the future).
        """
        am = self.host.active.feed("deferred", qid, 0)
        if am is None:
            return False
        if self.classes is not None:
            self.classes.retries.forget(qid)
        self.host.load(am)
        return True

    def _flow_tokens(self, fed: bool | None, from_incoming: bool) -> None:
        """in_flow_delay's tokens, as stock's qmgr puts them. With message classes,
        also whenever the highest class has room and no flood is coming in: cleanup
        takes a token before it knows a message's class, and a password reset must
        not wait in_flow_delay because a newsletter fills incoming/; a flood must
        (:class:`~pyqmgr.daemon.class_feed.Inflow`)."""
        flow = self.flow
        if flow is None or self.cfg.in_flow_delay <= 0:
            return
        classes = self.classes
        if classes is not None and fed and from_incoming:
            classes.inflow.taken += 1
        limit = self.cfg.default_process_limit
        count = flow.count()
        if count < 0:
            return
        if count < limit:
            if fed and from_incoming:
                flow.put(1)
            elif self.scans[INCOMING].handle is None:
                flow.put(limit - count)
            elif classes is not None and classes.top_room(self.host.message_count):
                inflow = classes.inflow
                now = time.monotonic()
                if not inflow.flooding(now):
                    flow.put(limit - count)
                elif inflow.began:
                    # The top-up's tokens left in the pipe go back: stock's would not
                    # be there for the flood's next messages.
                    inflow.began = False
                    flow.get(count)
                    if (line := inflow.log_line(now)) is not None:
                        self.host.log.info(line)
        elif count > limit:
            flow.get(count - limit)
