"""A higher class's mail into the active queue past a lower class's (issue #34).

Stock's feeder takes incoming/ in directory order, one name at a time, and stops at
``qmgr_message_active_limit``: a password reset that arrives behind 30,000 newsletter
messages waits until the scan reaches it, and while the active queue is full it waits
for the newsletter to make room. With message classes the feeder keeps both rules for
the lowest class (the scan, in order) and adds two:

* **Room by class**: each class below the highest stops entering the active queue
  ``message_class_active_reserve`` percent earlier than the class above it
  (:meth:`~pyqmgr.daemon.classes.Classifier.caps`), so the highest always finds room.
* **A look into incoming/** (:meth:`ClassFeed.run`): after a new-mail trigger, while
  the scan is still under way or the queue is at a lower class's cap, the names in
  incoming/ not looked at before are read up to their envelope (never moved, never
  their content), and a message of any class but the lowest is fed at once if its
  class has room. The lowest class's names are remembered and left to the scan, in
  order. A pass lists the directory (about 8 ms for 30,000 names here) and reads only
  new files; passes are at most one per :data:`PASS_INTERVAL`.

Deferred mail of a higher class is not looked for: it comes back with the deferred
scan, in order, within its class's room.
"""

from __future__ import annotations

import math
import os
import stat
from typing import Protocol

from pyqmgr.daemon.classes import Classifier, envelope
from pyqmgr.postfix import mail_queue, queue_file

#: A pass over incoming/ at most this often (seconds): new mail at 5 a second costs
#: at most this many directory listings a second.
PASS_INTERVAL = 0.2
#: Lowest-class names remembered as looked at, at most; beyond, later ones are read
#: again on the next pass (a bounded set: 200,000 names, about 15 MB).
MAX_SKIPPED = 200_000


class FeedHost(Protocol):
    """What the look into incoming/ needs of the feeder (daemon/feeder.py)."""

    @property
    def message_count(self) -> int: ...

    def feed_incoming(self, qid: str) -> bool: ...


class ClassFeed:
    """Room by class in the active queue, and the passes over incoming/."""

    def __init__(self, classifier: Classifier, active_limit: int, hash_names: list[str],
                 hash_depth: int) -> None:
        self.classifier = classifier
        self.caps = classifier.caps(active_limit)
        self.hash_names = hash_names
        self.hash_depth = hash_depth
        #: incoming/ is hashed (hash_queue_names): listed by the scan's walk.
        self.hashed = mail_queue.queue_path("incoming", "ABC", hash_names,
                                            hash_depth) != "incoming/ABC"
        #: Names read and found to be of the lowest class (left to the scan).
        self.skipped: set[str] = set()
        #: A new-mail trigger came since the last pass.
        self.wanted = False
        self.last_pass = -math.inf
        #: For status: passes made, files read, messages fed by passes.
        self.passes = 0
        self.peeked = 0
        self.fed = 0

    def main_room(self, count: int) -> bool:
        """May the scans feed (any class) with ``count`` messages in the queue?"""
        return count < self.caps[-1]

    def top_room(self, count: int) -> bool:
        return count < self.caps[0]

    def pass_wait(self, now: float) -> float | None:
        """None: no pass wanted; else seconds until one may run (0: now)."""
        if not self.wanted or len(self.caps) < 2:
            return None
        return max(0.0, self.last_pass + PASS_INTERVAL - now)

    def run(self, host: FeedHost, now: float) -> int:
        """One pass over incoming/: feed the higher classes' new mail; how many fed."""
        self.wanted = False
        self.last_pass = now
        self.passes += 1
        names = self._names()
        skipped = self.skipped
        lowest = len(self.caps) - 1
        fed = 0
        for name in names:
            if name in skipped or not mail_queue.queue_id_ok(name):
                continue
            rank = self._peek(name)
            if rank is None:
                continue  # still being written, gone, or unreadable: the scan's
            if rank < lowest and host.message_count < self.caps[rank]:
                if host.feed_incoming(name):
                    fed += 1
            elif len(skipped) < MAX_SKIPPED:
                skipped.add(name)
        if len(skipped) > len(names):
            skipped.intersection_update(names)  # the scan took them: forget
        self.fed += fed
        return fed

    def _names(self) -> list[str]:
        if self.hashed:
            return list(mail_queue.scan_all("incoming"))
        try:
            return os.listdir("incoming")
        except OSError:
            return []  # the scan's own open says why, and ends the daemon as stock's

    def _peek(self, qid: str) -> int | None:
        """The class rank of an incoming file, from its envelope; None: not now."""
        path = mail_queue.queue_path("incoming", qid, self.hash_names, self.hash_depth)
        st = mail_queue.mail_open_ok(path)
        if st is None or not stat.S_ISREG(st.st_mode):
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return None
        self.peeked += 1
        try:
            qf = queue_file.Message(queue_id=qid)
            batch = queue_file.read_batch(
                queue_file.FileWindow(fd, st.st_size), qf, 1,
                path=path, count_check=False)
        except OSError:
            return None
        finally:
            os.close(fd)
        if not batch.ok:
            return len(self.caps) - 1  # damaged: the scan finds it and says so
        return self.classifier.classify(envelope(qf))[0]

    def describe(self) -> dict[str, object]:
        """For status: the classes' caps and what the passes did."""
        return {"classes": list(self.classifier.classes), "active_caps": list(self.caps),
                "passes": self.passes, "files_read": self.peeked, "fed": self.fed,
                "lowest_class_waiting": len(self.skipped)}
