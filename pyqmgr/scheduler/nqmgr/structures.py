"""nqmgr's structures, declared together as ``qmgr.h`` declares stock's.

A job holds its peers, a peer its entries, an entry points back at its peer, and all
of them at the transport's job lists: the structures name each other, so they live in
one module that imports none of nqmgr's verb modules, and :mod:`.job`, :mod:`.peer`
and the policy in :mod:`pyqmgr.scheduler.nqmgr` import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyqmgr.scheduler.policy import Policy
from pyqmgr.scheduler.qlist import Node, QList
from pyqmgr.scheduler.structures import Entry

if TYPE_CHECKING:
    from pyqmgr.scheduler.message import Message
    from pyqmgr.scheduler.policy import Context
    from pyqmgr.scheduler.structures import Queue, Transport


Key = tuple[int, int]
#: Tenants' round records kept at least this many before stale ones are dropped.
PRUNE_FLOOR = 1024


class Segments:
    """One transport's segment tails and its tenants' rounds."""

    __slots__ = ("keys", "tails", "tenants", "current", "prune_at")

    def __init__(self) -> None:
        #: The keys of the segments on the list, sorted.
        self.keys: list[Key] = []
        #: Each segment's last job node.
        self.tails: dict[Key, Node[Job]] = {}
        #: (rank, tenant) -> [its latest round, jobs it has in that round].
        self.tenants: dict[tuple[int, str], list[int]] = {}
        #: rank -> the latest round a delivery was selected from.
        self.current: dict[int, int] = {}
        self.prune_at = PRUNE_FLOOR


class NqState(Policy):
    """One transport's nqmgr state: its job lists, candidate cache and slot pools.

    The base of the nqmgr policy; the job and peer verbs take it as their transport.
    A Policy itself, so that the policy has one chain of bases: the compiled build
    (mypyc) has no multiple inheritance.
    """

    def __init__(self, transport: Transport, ctx: Context) -> None:
        Policy.__init__(self, transport, ctx)
        cfg = transport.cfg
        #: The scheduler's job list (preemption reorders it).
        self.job_list: QList[Job] = QList()
        #: The jobs in enqueue order, along which recipient slots are handed out.
        self.job_bytime: QList[Job] = QList()
        self.job_current: Job | None = None
        #: With message classes and tenants (issue #34) the job list is cut into
        #: segments (:mod:`.segment`); None while every job is of rank 0 with no
        #: tenant (stock: no segments to keep).
        self.segments: Segments | None = None
        self.job_next_unread: Job | None = None
        self.candidate_cache: Job | None = None
        self.candidate_cache_current: Job | None = None
        self.candidate_cache_time = 0
        #: Odd and bumped by 2, so a job's or queue's tag 0 never matches.
        self.blocker_tag = 1
        self.slot_cost = cfg.delivery_slot_cost
        self.slot_loan = cfg.delivery_slot_loan
        self.slot_loan_factor = 100 - cfg.delivery_slot_discount
        self.min_slots = cfg.minimum_delivery_slots
        #: The recipient slot pool (may go negative by the per-stack extra).
        self.rcpt_unused = cfg.recipient_limit
        self.rcpt_per_stack = cfg.extra_recipient_limit
        self.refill_limit = cfg.recipient_refill_limit
        self.refill_delay = cfg.recipient_refill_delay


class Job:
    __slots__ = (
        "message", "transport", "list_node", "time_node", "sibling_node",
        "stack_parent", "children", "stack_level", "blocker_tag", "peer_byname",
        "peers", "slots_used", "slots_available", "selected_entries", "read_entries",
        "rcpt_count", "rcpt_limit", "round",
    )

    def __init__(self, message: Message, transport: NqState) -> None:
        self.message = message
        self.transport = transport
        self.list_node: Node[Job] = Node(self)
        self.time_node: Node[Job] = Node(self)
        self.sibling_node: Node[Job] = Node(self)
        self.stack_parent: Job | None = None
        self.children: QList[Job] = QList()
        #: -1: off the job lists (new or retired); 0: on them; > 0: preempting.
        self.stack_level = -1
        self.blocker_tag = 0
        self.peer_byname: dict[str, Peer] = {}
        self.peers: QList[Peer] = QList()
        self.slots_used = 0
        self.slots_available = 0
        self.selected_entries = 0
        self.read_entries = 0
        self.rcpt_count = 0
        self.rcpt_limit = 0
        #: Its tenant's round (:mod:`.segment`); 0 without tenants.
        self.round = 0

    def __repr__(self) -> str:
        return (f"Job({self.message.queue_id}/{self.transport.tname} lvl {self.stack_level} "
                f"sel {self.selected_entries}/{self.read_entries} "
                f"slots {self.slots_available})")

    @property
    def has_entries(self) -> bool:
        return self.selected_entries < self.read_entries

    @property
    def max_entries(self) -> int:
        """At most this many entries in all: the read ones plus every unread recipient."""
        return self.read_entries + self.message.rcpt_unread


class Peer:
    __slots__ = ("job", "queue", "entries", "refcount", "node")

    def __init__(self, job: Job, queue: Queue) -> None:
        self.job = job
        self.queue = queue
        #: Todo entries of this job for this queue, oldest first.
        self.entries: QList[NqEntry] = QList()
        #: Entries (todo and busy) that still refer to this peer.
        self.refcount = 0
        self.node: Node[Peer] = Node(self)


class NqEntry(Entry):
    """An entry that is also on its job peer's list."""

    __slots__ = ("peer", "peer_node")

    def __init__(self, message: Message, queue: Queue, peer: Peer) -> None:
        super().__init__(message, queue)
        self.peer = peer
        self.peer_node: Node[NqEntry] = Node(self)

    def release(self) -> None:
        super().release()
        node = self.peer_node
        if node.owner is None:
            node.item = None  # type: ignore[assignment]
