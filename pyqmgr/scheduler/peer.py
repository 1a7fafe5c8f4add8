"""A job's peer: the entries of one job bound for one destination queue (``qmgr_peer.c``).

Jobs round-robin over their peers so that one message's destinations are served
fairly; a peer disappears when its last entry is selected.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyqmgr.scheduler.entry import Entry
    from pyqmgr.scheduler.job import Job
    from pyqmgr.scheduler.queue import Queue


@dataclass(eq=False)
class Peer:
    job: Job
    queue: Queue
    entries: deque[Entry] = field(default_factory=deque)
