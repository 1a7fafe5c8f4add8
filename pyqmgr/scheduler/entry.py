"""A queue entry: one delivery request's worth of recipients (``qmgr_entry.c``).

An entry belongs to one message and one destination queue; it is "todo" until the
scheduler selects it for an agent, then "busy" until the agent's reply comes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pyqmgr.scheduler.message import Message, Recipient

if TYPE_CHECKING:
    from pyqmgr.scheduler.peer import Peer
    from pyqmgr.scheduler.queue import Queue


@dataclass(eq=False)
class Entry:
    message: Message
    queue: Queue
    peer: Peer
    recipients: list[Recipient] = field(default_factory=list)
    busy: bool = False

    @property
    def transport(self) -> str:
        return self.queue.transport.name
