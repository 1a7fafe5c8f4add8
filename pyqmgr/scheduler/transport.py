"""A transport: one master.cf delivery service and its queues (``qmgr_transport.c``).

Holds the transport's parameters (looked up by the configuration layer with stock's
``<transport>_*`` then ``default_*`` rule, see :class:`TransportParams`), its parsed
feedback, its destination queues by name, which of them could take a delivery now
(the allocation test), and its scheduling policy (:mod:`.policy`), which keeps its own
per-transport state (nqmgr's job lists, oqmgr's round-robin list, ...). A transport
whose agent cannot be reached is "dead" for ``transport_retry_time``; while dead, its
mail goes to the retry transport.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from pyqmgr.scheduler.feedback import Feedback, rounding_rules
from pyqmgr.scheduler.qlist import Node
from pyqmgr.scheduler.queue import Dsn, Queue

if TYPE_CHECKING:
    from pyqmgr.scheduler.policy import Policy
    from pyqmgr.scheduler.shaping import Shape, Shaping
    from pyqmgr.scheduler.suspension import Suspension

#: Stock keeps at most this many agent connections per transport waiting for an agent.
MAX_PENDING = 2


class TransportParams(Protocol):
    """What the core needs of a transport's configuration (config.TransportConfig).

    Read-only properties, so that a frozen config fits.
    """

    @property
    def destination_concurrency_limit(self) -> int: ...
    @property
    def destination_recipient_limit(self) -> int: ...
    @property
    def initial_destination_concurrency(self) -> int: ...
    @property
    def failed_cohort_limit(self) -> int: ...
    @property
    def destination_rate_delay(self) -> int: ...
    @property
    def transport_rate_delay(self) -> int: ...
    @property
    def delivery_slot_cost(self) -> int: ...
    @property
    def delivery_slot_loan(self) -> int: ...
    @property
    def delivery_slot_discount(self) -> int: ...
    @property
    def minimum_delivery_slots(self) -> int: ...
    @property
    def recipient_limit(self) -> int: ...
    @property
    def extra_recipient_limit(self) -> int: ...
    @property
    def recipient_refill_limit(self) -> int: ...
    @property
    def recipient_refill_delay(self) -> int: ...


class Transport:
    def __init__(self, name: str, cfg: TransportParams, pos: Feedback, neg: Feedback,
                 log: Callable[[str], None], feedback_debug: bool = False,
                 rounding: str = "stock") -> None:
        self.name = name
        self.cfg = cfg
        self.pos_feedback = pos
        self.neg_feedback = neg
        #: Feedback rounding (see feedback.ROUNDINGS): the fraction of a feedback step
        #: that counts as reaching the hysteresis boundary, and whether a destination
        #: dies at (stock) or only beyond (pseudocode) the failed cohort limit.
        self.feedback_slack, self.cohort_beyond_limit = rounding_rules(rounding)
        self.log = log
        self.feedback_debug = feedback_debug
        self.node: Node[Transport] = Node(self)
        self.queues: dict[str, Queue] = {}
        #: Queues that could take a delivery now (ready, room, todo): allocation test.
        self.ready_queues: dict[Queue, None] = {}
        self.dsn: Dsn | None = None
        self.revive_at: float | None = None
        #: transport_rate_delay: no new agent until the current delivery is over.
        self.rate_lock = False
        #: Agent connections asked for and not yet announced.
        self.pending = 0
        #: The transport's scheduling policy (set by the core right after creation).
        self.policy: Policy = None  # type: ignore[assignment]
        #: The policy's cap on deliveries in flight per destination (0: none).
        self.dest_cap = 0
        #: Ask the policy before connecting an agent (Policy.gates_allocation).
        self.gated = False
        #: The policy raised: its hooks are not called again, the transport is dead
        #: until transport_retry_time passes, then it gets a fresh policy.
        self.broken = False
        #: An operator's suspension of the whole transport: no agents while set.
        self.suspension: Suspension | None = None
        #: pyqmgr.cf's shaping for this transport (:mod:`.shaping`); None: stock.
        self.shaping: Shaping | None = None
        #: Shaping state by queue name, kept while it matters after a queue is gone.
        self.shapes: dict[str, Shape] = {}
        # Event counters for the metrics exporter (pyqmgr/daemon/metrics_exporter.py):
        # plain ints raised in O(1) where the event happens, because the core does no
        # I/O and knows nothing of Prometheus; the daemon reads them when scraped.
        # Transports are never discarded, so the counts only grow.
        #: Concurrency window steps up (positive feedback) and down (negative).
        self.feedback_up = 0
        self.feedback_down = 0
        #: Destinations declared dead (failed cohorts reached their limit).
        self.destinations_died = 0
        #: Times the transport itself was declared dead (agent unreachable, policy bug).
        self.times_died = 0
        #: nqmgr preemptions: a job jumped ahead of the current one.
        self.preemptions = 0

    @property
    def throttled(self) -> bool:
        return self.dsn is not None

    @property
    def initial_concurrency(self) -> int:
        return self.cfg.initial_destination_concurrency

    @property
    def recipient_limit(self) -> int:
        """Recipients per delivery request (``<transport>_destination_recipient_limit``)."""
        return self.cfg.destination_recipient_limit

    @property
    def todo_count(self) -> int:
        return sum(len(q.todo) for q in self.queues.values())

    def queue(self, name: str, nexthop: str) -> Queue:
        queue = self.queues.get(name)
        if queue is None:
            queue = Queue(self, name, nexthop, window=self.initial_concurrency)
            self.queues[name] = queue
        return queue

    def room(self, queue: Queue) -> int:
        """Deliveries ``queue`` may start now: its window, capped by the policy's cap.

        Zero while the destination is gated (suspended, rate-spaced, backing off).
        """
        if queue.gate is not None:
            return 0
        window = queue.window
        cap = self.dest_cap
        if cap and window > cap:
            window = cap
        return window - queue.busy_count

    def sync(self, queue: Queue) -> None:
        """Keep :attr:`ready_queues` true for ``queue`` after any change to it."""
        if queue.window > queue.busy_count and queue.todo and queue.window > 0 and (
                not self.dest_cap or queue.busy_count < self.dest_cap) and (
                queue.gate is None):
            self.ready_queues[queue] = None
        else:
            self.ready_queues.pop(queue, None)

    def wants_agent(self) -> bool:
        """``qmgr_transport_select``'s test: enough deliverable work for one more agent.

        Stock walks the queue list summing min(room, todo) over ready queues until it
        covers pending + 1; queues outside :attr:`ready_queues` add nothing, and each
        queue inside adds at least one, so at most MAX_PENDING + 1 are looked at.
        """
        if (self.dsn is not None or self.rate_lock or self.pending >= MAX_PENDING
                or self.suspension is not None):
            return False
        need = self.pending + 1
        for queue in self.ready_queues:
            need -= min(self.room(queue), len(queue.todo))
            if need <= 0:
                return not self.gated or self.policy.has_work()
        return False
