"""A job's peer: the entries of one job bound for one destination queue (``qmgr_peer.c``).

Jobs round-robin over their peers so that one message's destinations are served
fairly: the peer chosen last moves to the end of the job's peer list. A peer goes away
when its last entry is finished.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyqmgr.scheduler.nqmgr.structures import Job, Peer

if TYPE_CHECKING:
    from pyqmgr.scheduler.queue import Queue


def peer_obtain(job: Job, queue: Queue) -> Peer:
    peer = job.peer_byname.get(queue.name)
    if peer is None:
        peer = Peer(job, queue)
        job.peers.append(peer.node)
        job.peer_byname[queue.name] = peer
    return peer


def peer_free(peer: Peer) -> None:
    assert peer.refcount == 0 and not peer.entries, "peer_free: peer still in use"
    job = peer.job
    job.peers.unlink(peer.node)
    del job.peer_byname[peer.queue.name]
    peer.node.item = None  # type: ignore[assignment]  # no cycle left (Entry.release)


def peer_select(job: Job) -> Peer | None:
    """The first peer whose queue has room and that has a todo entry, rotated last."""
    node = job.peers.head
    while node is not None:
        peer = node.item
        queue = peer.queue
        if queue.window > queue.busy_count and peer.entries and queue.gate is None:
            job.peers.rotate(node)
            return peer
        node = node.next
    return None
