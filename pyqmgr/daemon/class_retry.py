"""A higher class's deferred mail, fed when its retry time comes (issue #34).

The deferred scan takes deferred/ in directory order, and with message classes it
stops while the lowest class's room in the active queue is full: behind a bulk
backlog, a transactional message whose destination was down would wait for the bulk
to drain (with 200,000 deferred newsletter messages, an hour) although its own class
has room. The daemon knows each message's class when it defers it; this remembers
the queue ids of the classes above the lowest with their retry times (the file's new
mtime), and the feeder brings each into the active queue when its time has come and
its class has room, wherever the scan is: O(log n) a message.

Bounded: at most :data:`MAX_KEPT` ids (a few hundred kilobytes; a relay whose
transactional mail defers by the ten thousand has the scan for the rest, as stock).
A restart forgets them: the scan finds them, as stock's would. A file that the scan
took first, that was deleted, or whose time was moved (``postsuper -r``, a flush) is
not taken by the feed (the active queue's own checks), and left to the scan.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

#: Deferred messages of the higher classes remembered at most.
MAX_KEPT = 10_000


class ClassRetries:
    """Due times of the higher classes' deferred messages, earliest first."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, str, int]] = []
        #: For status: messages fed past the deferred scan.
        self.fed = 0

    def __len__(self) -> int:
        return len(self.heap)

    def deferred(self, qid: str, when: float, rank: int) -> None:
        if len(self.heap) < MAX_KEPT:
            heapq.heappush(self.heap, (when, qid, rank))

    def next_due(self) -> float | None:
        return self.heap[0][0] if self.heap else None

    def feed_due(self, now: float, feed: Callable[[str, int], bool | None]) -> int:
        """Offer each message due by ``now`` to ``feed(qid, rank)``: True fed, False
        not taken (gone, not due after all: the scan's), None no room for its class
        now (kept, offered again at the next pass). How many were fed."""
        fed = 0
        kept: list[tuple[float, str, int]] = []
        while self.heap and self.heap[0][0] <= now:
            item = heapq.heappop(self.heap)
            took = feed(item[1], item[2])
            if took is None:
                kept.append(item)
            elif took:
                fed += 1
        for item in kept:
            heapq.heappush(self.heap, item)
        self.fed += fed
        return fed
