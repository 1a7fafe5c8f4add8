"""The job list's segments: message classes and tenants' fair shares (issue #34).

Stock keeps a transport's jobs in one list in enqueue-time order. With message classes
and tenants the list is cut into segments, each a key ``(rank, round)``, in key order:
every job of a higher class (lower rank) before any of a lower one, and inside a class,
tenants' jobs in rounds. A tenant of weight *w* has at most *w* jobs in a round; its
next job goes into the round after its last one, or into the class's current round
(the latest one served) when it has fallen behind or is new. So a tenant sending ten
times the others gets its w jobs a round like them, and when the others are idle its
rounds follow one another and it gets every delivery (work-conserving). A round is
deficit round robin counted in jobs (messages), not recipients.

Inside a segment the order is stock's (enqueue time) and nqmgr's preemption stays
inside it. Inserting a job is O(log segments): the key's tail, or the tail of the
nearest lower key, is where it goes (a sorted list of the keys, bisected). With no
classes and no tenants there are no segments and job_link is stock's.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import TYPE_CHECKING

from pyqmgr.scheduler.nqmgr.structures import PRUNE_FLOOR, Key, Segments

if TYPE_CHECKING:
    from pyqmgr.scheduler.nqmgr.structures import Job
    from pyqmgr.scheduler.qlist import Node

def segment_key(seg: Segments, job: Job) -> Key:
    """The job's segment, its round taken from its tenant's (set on the job)."""
    message = job.message
    rank = message.rank
    if not message.tenant:
        job.round = 0
        return rank, 0
    current = seg.current.get(rank, 0)
    state = seg.tenants.get((rank, message.tenant))
    if state is None or state[0] < current:
        state = [current, 0]
        if len(seg.tenants) >= seg.prune_at:
            _prune(seg)
        seg.tenants[(rank, message.tenant)] = state
    elif state[1] >= message.weight:
        state[0] += 1
        state[1] = 0
    state[1] += 1
    job.round = state[0]
    return rank, state[0]


def _prune(seg: Segments) -> None:
    """Forget tenants behind their class's current round (they start afresh anyway);
    amortized O(1): the next prune waits until the records have doubled."""
    current = seg.current
    seg.tenants = {k: v for k, v in seg.tenants.items() if v[0] >= current.get(k[0], 0)}
    seg.prune_at = max(PRUNE_FLOOR, 2 * len(seg.tenants))


def segment_end(seg: Segments, key: Key) -> Node[Job] | None:
    """Where a job of ``key`` goes after: its segment's tail or, with none, the tail
    of the nearest lower segment (None: the list's head)."""
    node = seg.tails.get(key)
    if node is not None:
        return node
    i = bisect_left(seg.keys, key)
    return seg.tails[seg.keys[i - 1]] if i > 0 else None


def segment_linked(seg: Segments, key: Key, node: Node[Job]) -> None:
    """A job of ``key`` was linked at ``node``: the tail moves if it went last."""
    nxt = node.next
    if nxt is None or (nxt.item.message.rank, nxt.item.round) != key:
        if key not in seg.tails:
            insort(seg.keys, key)
        seg.tails[key] = node


def segment_unlinked(seg: Segments, job: Job) -> None:
    """The job leaves the list: its segment's tail moves back, or the segment ends."""
    key = (job.message.rank, job.round)
    node = job.list_node
    if seg.tails.get(key) is not node:
        return
    prev = node.prev
    if prev is not None and (prev.item.message.rank, prev.item.round) == key:
        seg.tails[key] = prev
        return
    del seg.tails[key]
    del seg.keys[bisect_left(seg.keys, key)]


def segment_served(seg: Segments, job: Job) -> None:
    """A delivery was selected from the job: its round is (at least) the current one."""
    rank = job.message.rank
    if job.round > seg.current.get(rank, 0):
        seg.current[rank] = job.round
