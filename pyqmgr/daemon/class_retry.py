"""A higher class's deferred mail, fed when its retry time comes (issue #34).

The deferred scan takes deferred/ in directory order, and with message classes it
stops while the lowest class's room in the active queue is full: behind a bulk
backlog, a transactional message whose destination was down would wait for the bulk
to drain (with 200,000 deferred newsletter messages, an hour) although its own class
has room. The daemon knows each message's class when it defers it; this remembers
the queue ids of the classes above the lowest with their retry times (the file's new
mtime, as ``qmgr_active_done_3`` sets it), and the feeder brings each into the active
queue when its time has come and its class has room, wherever the scan is: O(log n)
a message, and a pass that finds nothing due costs one look per class.

Bounded: at most :data:`MAX_KEPT` ids. A restart forgets them: the scan finds them,
as stock's would. What the feed finds is checked, never trusted: a file the scan took
first is forgotten when the scan takes it (and remembered again if it is deferred
again); a file deleted (``postsuper -d``) or moved away (``postsuper -r``, ``-h``) is
not there and is dropped; a file whose mtime is still in the future (deferred again
meanwhile, or its time moved) is re-timed from that mtime.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

#: Deferred messages of the higher classes remembered at most. A remembered message
#: costs about 200 bytes (its heap entry, its id and its time), so this is a couple of
#: megabytes at worst; a relay whose transactional mail defers by the ten thousand has
#: a dead destination, and the rest of that mail comes back with the scan, as stock's.
MAX_KEPT = 10_000
#: Seconds past a file's retry time that it is offered to the feed. The failure that
#: deferred it also made its destination dead for ``minimal_backoff_time`` from the
#: failure, and the retry time is the deferral's whole second plus the backoff: up to
#: a second before the destination revives. Fed at its retry time, a message met its
#: destination still dead and was deferred for a whole backoff more ("delivery
#: temporarily suspended": on real Postfix, 6.0 s late with a 6 s backoff).
GRACE = 2.0
#: Forgotten entries left in the heaps before they are rebuilt from the remembered
#: ones (a forgotten entry is otherwise dropped only when its time comes).
SLACK = 1024

#: What the feed says of a message offered to it: True fed, False not taken (gone,
#: damaged, not complete: the scan's), or the file's real retry time (a float) when
#: it lies in the future.
Taken = bool | float


class ClassRetries:
    """Due times of the higher classes' deferred messages, per class, earliest first.

    Each class has a heap of (retry time, queue id); :attr:`due_at` holds each
    remembered message's current time, and a heap entry that does not match it was
    forgotten or re-timed (dropped when it comes to the top, or when the heaps hold
    more than :data:`SLACK` such entries).
    """

    def __init__(self) -> None:
        self.heaps: dict[int, list[tuple[float, str]]] = {}
        self.due_at: dict[str, float] = {}
        self.entries = 0
        #: For status: fed past the deferred scan, re-timed, not remembered (the cap).
        self.fed = 0
        self.retimed = 0
        self.over_cap = 0

    def __len__(self) -> int:
        return len(self.due_at)

    def deferred(self, qid: str, when: float, rank: int) -> None:
        """``qid`` of class ``rank`` went to deferred/ with retry time ``when``: it
        is offered at ``when`` + :data:`GRACE`."""
        if qid not in self.due_at and len(self.due_at) >= MAX_KEPT:
            self.over_cap += 1
            return
        when += GRACE
        self.due_at[qid] = when
        heapq.heappush(self.heaps.setdefault(rank, []), (when, qid))
        self.entries += 1
        if self.entries > len(self.due_at) + SLACK:
            self._rebuild()

    def forget(self, qid: str) -> None:
        """``qid`` left deferred/ another way (the scan, recovery)."""
        self.due_at.pop(qid, None)

    def next_due(self, after: float) -> float | None:
        """The earliest retry time later than ``after`` (None: none remembered)."""
        soonest: float | None = None
        for heap in self.heaps.values():
            self._drop_stale(heap)
            if heap and heap[0][0] > after and (soonest is None or heap[0][0] < soonest):
                soonest = heap[0][0]
        return soonest

    def feed_due(self, now: float, room: Callable[[int], bool],
                 take: Callable[[str], Taken]) -> tuple[int, bool]:
        """Offer each message due by ``now`` whose class has ``room(rank)`` to
        ``take(qid)``, highest class first, earliest first. How many were fed, and
        whether a class had due messages but no room (they stay, offered again)."""
        fed = 0
        blocked = False
        for rank in sorted(self.heaps):
            heap = self.heaps[rank]
            while True:
                self._drop_stale(heap)
                if not heap or heap[0][0] > now:
                    break
                if not room(rank):
                    blocked = True
                    break
                _, qid = heapq.heappop(heap)
                self.entries -= 1
                del self.due_at[qid]
                got = take(qid)
                if isinstance(got, bool):
                    fed += got
                elif got > now:
                    self.retimed += 1
                    self.deferred(qid, got, rank)
                # A time not in the future although not taken: the scan's.
        self.fed += fed
        return fed, blocked

    def describe(self) -> dict[str, int]:
        return {"deferred_watched": len(self.due_at), "deferred_fed_past_the_scan": self.fed,
                "deferred_retimed": self.retimed, "deferred_over_the_cap": self.over_cap}

    def _drop_stale(self, heap: list[tuple[float, str]]) -> None:
        due_at = self.due_at
        while heap and due_at.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
            self.entries -= 1

    def _rebuild(self) -> None:
        """Keep only the remembered entries: O(n) once every :data:`SLACK` forgotten
        ones, so the heaps stay within MAX_KEPT + SLACK entries."""
        due_at = self.due_at
        for rank, heap in self.heaps.items():
            live = [(when, qid) for when, qid in heap if due_at.get(qid) == when]
            heapq.heapify(live)
            self.heaps[rank] = live
        self.entries = sum(len(heap) for heap in self.heaps.values())
