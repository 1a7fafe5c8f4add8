"""The scheduler's view of a message in the active queue (``qmgr_message.c``).

Only what scheduling needs: identity, arrival order, the reference count of unfinished
entries, and the jobs (one per transport) that hold its entries. The queue file, its
envelope and its disposition belong to the daemon, which hangs them on ``owner``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyqmgr.scheduler.job import Job


@dataclass(eq=False, slots=True)
class Recipient:
    """One envelope recipient as a delivery request carries it."""

    offset: int
    address: str
    orig_addr: str = ""
    dsn_orcpt: str = ""
    dsn_notify: int = 0


@dataclass(eq=False)
class Message:
    queue_id: str
    #: When the message entered the active queue (scheduler clock).
    enqueue_time: float
    #: Recipients the size record promises but that are not read into memory yet.
    rcpt_unread: int = 0
    #: Delivery requests (entries) not finished yet; 0 means the message is done.
    refcount: int = 0
    #: Recipients assigned to entries so far (all batches).
    rcpt_count: int = 0
    #: Set when some recipient needs another attempt (agent deferral, crash, dead site).
    deferred: bool = False
    #: Deliver one recipient per request (VERP).
    single_rcpt: bool = False
    jobs: dict[str, Job] = field(default_factory=dict)
    #: The daemon's per-message state; the core never looks inside.
    owner: Any = None
