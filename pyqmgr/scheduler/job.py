"""A job: one message's work on one transport (``qmgr_job.c``).

Each transport keeps its jobs in enqueue order; selection walks that list. Issue #3
replaces the plain in-order walk with nqmgr's preemptive scheduling (slots, loans,
candidate cache); the structure here is already the one it needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyqmgr.scheduler.message import Message
    from pyqmgr.scheduler.peer import Peer
    from pyqmgr.scheduler.queue import Queue
    from pyqmgr.scheduler.transport import Transport


@dataclass(eq=False)
class Job:
    message: Message
    transport: Transport
    #: Peers in creation order; the round-robin cursor rotates through them.
    peers: dict[Queue, Peer] = field(default_factory=dict)
    rcpt_count: int = 0
    selected_entries: int = 0
    read_entries: int = 0
    #: Peers with todo entries, in round-robin order.
    ready: list[Peer] = field(default_factory=list)
    cursor: int = 0
