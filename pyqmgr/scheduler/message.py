"""The scheduler's view of a message in the active queue (``qmgr_message.c``).

Only what scheduling needs: identity, the time it entered the active queue (the
preemption score's clock), its in-core recipient accounting (``rcpt_count`` used slots,
``rcpt_limit`` slots it may fill, ``rcpt_unread`` recipients still in the file, ``more``
while the file has recipients not yet read), the reference count of unfinished entries,
and its jobs (one per transport) in creation order. The queue file, its envelope and its
disposition belong to the daemon, which hangs them on ``owner``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False, slots=True)
class Recipient:
    """One envelope recipient as a delivery request carries it."""

    offset: int
    address: str
    orig_addr: str = ""
    dsn_orcpt: str = ""
    dsn_notify: int = 0


@dataclass(eq=False, slots=True)
class Message:
    queue_id: str
    #: When the message entered the active queue (scheduler clock, seconds). Stock
    #: keeps whole seconds (``queued_time``); the preemption score uses them so.
    enqueue_time: float
    #: Recipients the size record promises but that are not read into memory yet.
    rcpt_unread: int = 0
    #: Deliver one recipient per request (VERP).
    single_rcpt: bool = False
    #: The queue file has recipients not read yet (stock: ``rcpt_offset != 0``).
    more: bool = False
    #: Delivery requests (entries) not finished yet; 0 means the message is done.
    refcount: int = 0
    #: Recipients in core (assigned to entries and not finished).
    rcpt_count: int = 0
    #: Recipient slots this message may fill; starts at qmgr_message_recipient_minimum.
    rcpt_limit: int = 0
    #: When the last recipient batch was read (scheduler clock).
    refill_time: int = 0
    #: Set when some recipient needs another attempt (agent deferral, crash, dead site).
    deferred: bool = False
    #: nqmgr's jobs by transport name, in creation order (stock's message job list):
    #: the one per-message state a policy keeps on the message, typed loosely so that
    #: the message knows no policy (nqmgr's ``job_obtain`` reads it as its ``Job``).
    jobs: dict[str, Any] = field(default_factory=dict)
    #: Its class's rank (issue #34): 0 is the highest priority; with no
    #: ``message_classes`` every message is 0 and scheduling is stock's.
    rank: int = 0
    #: Its tenant (issue #34), "" with no ``tenant_key``.
    tenant: str = ""
    #: Its tenant's weight: jobs a round in its class (``tenant_weight_maps``).
    weight: int = 1
    #: The daemon's per-message state; the core never looks inside.
    owner: Any = None

    @property
    def queued_time(self) -> int:
        return int(self.enqueue_time)


@dataclass(frozen=True, slots=True)
class Route:
    """Where trivial-rewrite (and qmgr's own rules) sent one recipient."""

    transport: str
    queue_name: str
    nexthop: str
    recipient: Recipient
