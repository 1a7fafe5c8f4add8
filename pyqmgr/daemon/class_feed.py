"""A higher class's mail into the active queue past a lower class's (issue #34).

Stock's feeder takes incoming/ in directory order, one name at a time, and stops at
``qmgr_message_active_limit``: a password reset that arrives behind 30,000 newsletter
messages waits until the scan reaches it, and while the active queue is full it waits
for the newsletter to make room. With message classes the feeder keeps both rules for
the lowest class (the scan, in order) and adds two:

* **Room by class**: each class below the highest stops entering the active queue
  ``message_class_active_reserve`` percent earlier than the class above it
  (:meth:`~pyqmgr.settings.classes.Classifier.caps`), so the highest always finds room.
* **A look into incoming/** (:meth:`ClassFeed.run`): new files in incoming/ are
  read up to their envelope (never moved, never their content) as the kernel reports
  them (inotify: a file renamed in, or made complete by cleanup's last chmod), and a
  message of any class but the lowest is fed at once if its class has room; the
  lowest class's are left to the scan, in order. Each new file is read once: O(1) a
  message however long the backlog. Listing the directory instead, after each
  new-mail trigger, cost 8 ms a trigger for 30,000 names and took 10% of a
  newsletter's rate at 5 resets a second; it is still how incoming/ is read at
  start-up, after the kernel's event queue overflowed, and when incoming/ is hashed
  (``hash_queue_names``), where a pass is at most one per :data:`PASS_INTERVAL`.

Deferred mail of a higher class comes back at its retry time past the deferred scan
(:mod:`.class_retry`, fed by the feeder).

cleanup(8) takes an ``in_flow_delay`` token before it knows a message's class, so
the feeder hands tokens out while the highest class has room, not only as stock does;
:class:`Inflow` tells it when new mail floods in, and then it hands them out as stock
does (issue #45).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from itertools import islice
from typing import Protocol

from pyqmgr.daemon.class_retry import ClassRetries
from pyqmgr.daemon.classes import envelope, read_headers
from pyqmgr.postfix import mail_queue, queue_file
from pyqmgr.settings.classes import Classifier

#: A listing pass over incoming/ at most this often (seconds): a hashed incoming/
#: with new mail at 5 a second costs at most this many listings a second.
PASS_INTERVAL = 0.2
#: Names remembered at most: the kernel's new files not read yet (beyond: the next
#: pass lists the directory), a higher class's files waiting for room, and in a
#: listing pass the lowest class's (beyond: read again on the next listing).
MAX_NAMES = 200_000
#: Names read at most in one pass: about 30 ms of envelopes, then the event loop runs.
CHUNK = 1000
#: A flood (:class:`Inflow`): incoming/ grew by more than this many messages a second
#: over the last :data:`FLOOD_WINDOW` (cleanup's new files less what qmgr took in).
FLOOD_GROWTH = 10
FLOOD_WINDOW = 1.0
#: Marks of the growth at most this often, so the window's are about ten.
FLOOD_STEP = 0.1
#: A flood lasts until incoming/ has not grown so for this long.
FLOOD_HOLD = 5.0


class FeedHost(Protocol):
    """What the look into incoming/ needs of the feeder (daemon/feeder.py)."""

    @property
    def message_count(self) -> int: ...

    def feed_incoming(self, qid: str) -> bool: ...


class IncomingWatch:
    """The kernel's news of incoming/ (inotify, through inotify_simple): names of
    files renamed in or whose mode changed (cleanup's chmod that marks one complete).
    """

    def __init__(self) -> None:
        from inotify_simple import INotify, flags  # type: ignore[import-untyped]

        self.inotify = INotify(nonblocking=True)
        self.overflow = int(flags.Q_OVERFLOW)
        self.attrib = int(flags.ATTRIB)
        self.inotify.add_watch("incoming", flags.ATTRIB | flags.MOVED_TO)

    def fileno(self) -> int:
        return self.inotify.fileno()

    def read(self) -> tuple[list[str], int, bool]:
        """The names reported since the last read, how many files cleanup completed
        (its chmod: ATTRIB; a file renamed in is not its), and whether events were
        lost."""
        events = self.inotify.read(timeout=0)
        return ([e.name for e in events if e.name],
                sum(1 for e in events if e.mask & self.attrib),
                any(e.mask & self.overflow for e in events))

    def close(self) -> None:
        self.inotify.close()


class ClassFeed:
    """Room by class in the active queue, and the look into incoming/."""

    def __init__(self, classifier: Classifier, active_limit: int, hash_names: list[str],
                 hash_depth: int) -> None:
        self.classifier = classifier
        self.caps = classifier.caps(active_limit)
        self.lowest = len(self.caps) - 1
        self.hash_names = hash_names
        self.hash_depth = hash_depth
        #: incoming/ is hashed (hash_queue_names): listed, not watched.
        self.hashed = mail_queue.queue_path("incoming", "ABC", hash_names,
                                            hash_depth) != "incoming/ABC"
        self.watch: IncomingWatch | None = None
        #: New names the kernel reported, not read yet (an ordered set).
        self.fresh: dict[str, None] = {}
        #: A higher class's names read while the class had no room, by rank, oldest
        #: first (ordered sets).
        self.waiting: list[dict[str, None]] = [{} for _ in self.caps]
        #: The next pass lists the directory (start-up, lost events, hashed).
        self.full = True
        #: A listing being read, :data:`CHUNK` names a pass, and where it is.
        self.listing: list[str] | None = None
        self.listing_at = 0
        #: Listing passes: the lowest class's names read before (left to the scan).
        self.skipped: set[str] = set()
        #: A new-mail trigger came since the last listing (listing mode).
        self.wanted = True
        self.last_pass = -math.inf
        #: For status: passes made, files read, messages fed by passes.
        self.passes = 0
        self.peeked = 0
        self.fed = 0
        #: Times events were lost (then a full listing).
        self.lost = 0
        #: The higher classes' deferred mail, fed when due (:mod:`.class_retry`).
        self.retries = ClassRetries()
        #: New mail against intake, for in_flow_delay's tokens (the feeder's).
        self.inflow = Inflow()

    def start(self, wake: Callable[[], None], warn: Callable[[str], None]) -> None:
        """Watch incoming/ from the running event loop (not when it is hashed). The
        kernel may refuse a watch (fs.inotify.max_user_instances or max_user_watches
        used up): then incoming/ is listed after each new-mail trigger, as when it is
        hashed, and a warning says so."""
        if self.hashed:
            return
        try:
            watch = IncomingWatch()
        except OSError as exc:
            warn(f"classes: cannot watch incoming/ for new mail ({exc.strerror or exc}): "
                 f"it is listed after each new-mail trigger instead, at most every "
                 f"{PASS_INTERVAL:g} s, at a cost that grows with its backlog")
            return
        self.watch = watch
        asyncio.get_running_loop().add_reader(watch.fileno(), self._news, watch, wake)

    def _news(self, watch: IncomingWatch, wake: Callable[[], None]) -> None:
        names, completed, lost = watch.read()
        self.inflow.arrived += completed
        fresh = self.fresh
        for name in names:
            if len(fresh) >= MAX_NAMES:
                lost = True
                break
            fresh[name] = None
        if lost:
            # The kernel dropped events (its queue overflowed) or too many names
            # waited: the next pass lists incoming/ whole.
            self.full = True
            self.lost += 1
            fresh.clear()
            self.inflow.overflowed = True  # more at once than the kernel keeps
        if names or lost:
            wake()

    def main_room(self, count: int) -> bool:
        """May the scans feed (any class) with ``count`` messages in the queue?"""
        return count < self.caps[-1]

    def top_room(self, count: int) -> bool:
        return count < self.caps[0]

    def triggered(self, new_mail: bool) -> None:
        """A trigger asked for an incoming scan; ``new_mail``: a wakeup, as cleanup
        sends for each message it queued. Without the watch (a hashed incoming/, or
        the kernel refused it) these count cleanup's new mail for :class:`Inflow`;
        a trigger cleanup could not deliver is not counted, so a flood may look
        smaller there than it is."""
        self.wanted = True
        if new_mail and self.watch is None:
            self.inflow.arrived += 1

    def pass_wait(self, now: float, count: int) -> float | None:
        """None: no pass wanted; else seconds until one may run (0: now)."""
        if self.full or self.listing is not None or any(
                names and count < self.caps[rank] for rank, names in enumerate(self.waiting)):
            return 0.0
        if self.watch is not None:
            return 0.0 if self.fresh else None
        if not self.wanted:
            return None
        return max(0.0, self.last_pass + PASS_INTERVAL - now)

    def run(self, host: FeedHost, now: float) -> int:
        """One pass, of at most :data:`CHUNK` names: feed the higher classes' new
        mail that has room; how many fed. A listing longer than that (start-up with
        200,000 files in incoming/) goes on in the next passes, the event loop
        serving agents in between."""
        self.passes += 1
        self.last_pass = now
        fed = self._retry_waiting(host)
        if self.full or (self.watch is None and self.listing is None):
            self.full = False
            self.wanted = False
            self.listing = names = self._names()
            self.listing_at = 0
            if len(self.skipped) > len(names):
                self.skipped.intersection_update(names)  # the scan took them: forget
        if self.listing is not None:
            at = self.listing_at
            chunk = self.listing[at:at + CHUNK]
            self.listing_at = at + len(chunk)
            if self.listing_at >= len(self.listing):
                self.listing = None
            fed += self._read(host, chunk, self.skipped)
        else:
            fresh = self.fresh
            chunk = list(islice(fresh, CHUNK))
            for name in chunk:
                del fresh[name]
            fed += self._read(host, chunk, None)
        self.fed += fed
        return fed

    def _retry_waiting(self, host: FeedHost) -> int:
        """The higher classes' files read while their class had no room: the highest
        class first, oldest first, while the class has room (at most :data:`CHUNK`)."""
        fed = tried = 0
        for rank, names in enumerate(self.waiting):
            while names and host.message_count < self.caps[rank] and tried < CHUNK:
                name = next(iter(names))
                del names[name]
                tried += 1
                fed += host.feed_incoming(name)
        return fed

    def _read(self, host: FeedHost, names: list[str], skipped: set[str] | None) -> int:
        fed = 0
        for name in names:
            if (skipped is not None and name in skipped) or not mail_queue.queue_id_ok(name):
                continue
            rank = self._peek(name)
            if rank is None:
                continue  # still being written, gone, or unreadable: the scan's
            if rank == self.lowest:
                if skipped is not None and len(skipped) < MAX_NAMES:
                    skipped.add(name)
            elif host.message_count < self.caps[rank]:
                fed += host.feed_incoming(name)
            elif len(self.waiting[rank]) < MAX_NAMES:
                self.waiting[rank][name] = None
        return fed

    def _names(self) -> list[str]:
        if self.hashed:
            return list(mail_queue.scan_all("incoming", warn=lambda text: None))
        try:
            return os.listdir("incoming")
        except OSError:
            return []  # the scan's own open says why, and ends the daemon as stock's

    def _peek(self, qid: str) -> int | None:
        """The class rank of an incoming file, from its envelope; None: not now."""
        path = mail_queue.queue_path("incoming", qid, self.hash_names, self.hash_depth)
        st = mail_queue.mail_open_ok(path)
        if st is None:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return None
        self.peeked += 1
        try:
            qf = queue_file.Message(queue_id=qid)
            batch = queue_file.read_batch(queue_file.FileWindow(fd, st.st_size), qf, 1,
                                          path=path, count_check=False)
            heads = read_headers(self.classifier, qf, path, fd) if batch.ok else None
        except OSError:
            return None
        finally:
            os.close(fd)
        if not batch.ok:
            return self.lowest  # damaged: the scan finds it and says so
        return self.classifier.classify(envelope(qf, heads), count=False)[0]

    def describe(self, ranks: Iterable[int]) -> dict[str, object]:
        """For status: each class's messages in the active queue (``ranks``: the
        active messages' ranks) and cap, and what the look into incoming/ did."""
        count = [0] * len(self.caps)
        for rank in ranks:
            count[rank] += 1
        return {"classes": [{"name": name, "active": count[rank], "cap": self.caps[rank]}
                            for rank, name in enumerate(self.classifier.classes)],
                "incoming": "watched" if self.watch is not None else "listed",
                "passes": self.passes, "files_read": self.peeked,
                "events_lost": self.lost,
                "fed_past_the_scan": self.fed,
                "waiting_for_room": sum(len(names) for names in self.waiting),
                "in_flow": self.inflow.describe(
                    "inotify" if self.watch is not None else "triggers"),
                **self.retries.describe()}


class Inflow:
    """Is new mail flooding in? For ``in_flow_delay``'s tokens with classes.

    Stock's qmgr puts a token for each message it takes from incoming/, and tops the
    tokens up to the process limit only when its incoming scan is done: while
    incoming/ has a backlog, cleanup gets about as many messages in as qmgr takes
    out, and each one more waits ``in_flow_delay``. With classes the feeder also tops
    up while the highest class has room, so that a password reset behind a
    newsletter in incoming/ never waits that second; under a flood that switched
    stock's back-pressure off, and incoming/ grew as fast as smtpd could take mail
    (issue #45). So the top-up is for a trickle only: a flood is incoming/ growing,
    cleanup's new files (:attr:`arrived`) less the messages the feeder took from
    incoming/ (:attr:`taken`), by more than :data:`FLOOD_GROWTH` a second over the
    last :data:`FLOOD_WINDOW`; then, and until it has not grown so for
    :data:`FLOOD_HOLD`, tokens go as stock's, and the top-up's tokens still in the
    pipe when a flood begins are taken back. A higher class's mail that arrives is
    taken in at once, so it adds nothing to the growth: resets alone are never a
    flood, however slow the newsletter's destinations.

    A flood that pauses cannot turn the top-up back on in a pause shorter than
    :data:`FLOOD_HOLD`; after a longer one it gets at most the process limit's
    tokens (stock's own top-up after its scan ends), then the growth of about
    :data:`FLOOD_GROWTH` messages shows it again. O(1) a message: two counters, and
    a mark of their difference at most every :data:`FLOOD_STEP`.
    """

    def __init__(self) -> None:
        #: cleanup's new files in incoming/ (inotify), or its wakeups (no watch).
        self.arrived = 0
        #: Messages the feeder took from incoming/.
        self.taken = 0
        #: (time, arrived - taken), a mark at most every FLOOD_STEP, the oldest the
        #: youngest at least FLOOD_WINDOW old.
        self.marks: deque[tuple[float, int]] = deque()
        #: The current flood lasts until then (monotonic clock).
        self.until = -math.inf
        #: The kernel lost events (its queue overflowed): a flood.
        self.overflowed = False
        #: A flood began and the feeder has not taken the top-up's tokens back yet.
        self.began = False
        #: For status: floods seen.
        self.floods = 0
        #: The growth a second that showed the last flood.
        self.rate = 0.0
        #: When a flood was last logged, and floods since not logged.
        self.logged = -math.inf
        self.unlogged = 0

    def flooding(self, now: float) -> bool:
        """Is mail flooding in now (or was, less than FLOOD_HOLD ago)?"""
        growth = self.arrived - self.taken
        marks = self.marks
        if not marks or now - marks[-1][0] >= FLOOD_STEP:
            marks.append((now, growth))
        while len(marks) > 1 and now - marks[1][0] >= FLOOD_WINDOW:
            marks.popleft()
        since, before = marks[0]
        # Over a second at least: at a flood's first messages the window is short.
        rate = (growth - before) / max(FLOOD_WINDOW, now - since)
        if rate > FLOOD_GROWTH or self.overflowed:
            self.overflowed = False
            if now >= self.until:
                self.floods += 1
                self.began = True
                self.rate = rate
            self.until = now + FLOOD_HOLD
        return now < self.until

    def log_line(self, now: float) -> str | None:
        """What to log of a flood that began (at most once a minute), or None."""
        if now - self.logged < 60:
            self.unlogged += 1
            return None
        more = (f"; {self.unlogged} more since the last such line" if self.unlogged
                else "")
        self.logged = now
        self.unlogged = 0
        return (f"classes: new mail floods in (incoming/ grew by {self.rate:.0f} or more "
                f"messages a second): in_flow_delay's tokens go as stock's until it has "
                f"not for {FLOOD_HOLD:g} s{more}")

    def ends_in(self, now: float) -> float | None:
        """Seconds until the flood may be over (then the feeder looks again, for
        mail may come with no other event to wake it); None: no flood."""
        return self.until - now if now < self.until else None

    def describe(self, counted_by: str) -> dict[str, object]:
        now = time.monotonic()
        return {"flood": now < self.until, "floods": self.floods,
                "new_mail": self.arrived, "taken_in": self.taken,
                "new_mail_counted_by": counted_by}
