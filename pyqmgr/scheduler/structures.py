"""The scheduler's structures, declared together as Postfix's ``qmgr.h`` declares them.

A destination queue holds its entries, an entry points back at its queue, a transport
holds its queues and its policy, and the policy works on entries: the structures name
each other, so they live in one module that imports no other part of the scheduler, and
the modules with the verbs that change them (:mod:`.entry`, :mod:`.queue`,
:mod:`.transport`, :mod:`.policy`, :mod:`.core` ...) import it, as each ``qmgr_*.c``
file includes ``qmgr.h``. What each structure is for is said at its class.

:class:`Backend` is what the shared machinery asks of a transport's scheduling policy
(OpenSMTPD's scheduler backend): :class:`~pyqmgr.scheduler.policy.Policy` implements
it, and so must any other scheduler.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pyqmgr.build import mypyc_attr
from pyqmgr.scheduler.feedback import Feedback, rounding_rules
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.qlist import Node, QList

if TYPE_CHECKING:
    from pyqmgr.scheduler.shaping import Gate, Shape, Shaping
    from pyqmgr.scheduler.suspension import Suspension

#: The transports stock routes to when a destination or transport is dead (retry) or
#: a recipient is undeliverable (error); they always run stock's policy.
RETRY = "retry"
ERROR = "error"

#: Delivery request flags for opportunistic connection caching (deliver_request.h).
DEL_REQ_FLAG_CONN_LOAD = 1 << 11
DEL_REQ_FLAG_CONN_STORE = 1 << 12
DEL_REQ_FLAG_CONN_MASK = DEL_REQ_FLAG_CONN_LOAD | DEL_REQ_FLAG_CONN_STORE


@mypyc_attr(allow_interpreted_subclasses=True)
class Entry:
    __slots__ = ("message", "queue", "recipients", "busy", "queue_node", "started")

    def __init__(self, message: Message, queue: Queue) -> None:
        self.message = message
        self.queue = queue
        self.recipients: list[Recipient] = []
        self.busy = False
        self.queue_node: Node[Entry] = Node(self)
        #: When its delivery started (scheduler clock); kept only under shaping.
        self.started = 0.0

    @property
    def transport(self) -> str:
        return self.queue.transport.name

    def release(self) -> None:
        """Finished: its list nodes let go of it, so that it dies by reference count.

        A node and its item refer to each other; left as they are, every finished
        entry is a cycle that only a full garbage collection frees, and a site down
        for hours makes a new one per recipient per retry (issue #30). A node still
        on a list keeps its item: only a bug leaves it there, and it must not turn
        into a crash on the list's next walk.
        """
        node = self.queue_node
        if node.owner is None:
            node.item = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"Entry({self.message.queue_id} {self.queue.transport.name}/"
                f"{self.queue.name} x{len(self.recipients)}{' busy' if self.busy else ''})")


#: The two values of ``Queue.window`` that are not a window, as stock's
#: QMGR_QUEUE_STAT_THROTTLED and QMGR_QUEUE_STAT_SUSPENDED: the destination is dead
#: (``Queue.dsn`` says why, ``revive_at`` when it is tried again), or paused by
#: ``destination_rate_delay`` until ``paused_until``. Stock calls the pause
#: "suspended"; here it is "paused", so that "suspend" only ever means an operator's
#: hold (:mod:`.suspension`). They share the int with the window, as in stock,
#: because every selection asks "may this destination take a delivery?" and
#: ``window > 0`` answers it in one comparison. ``Queue.status`` names the state.
THROTTLED = 0
PAUSED = -1

#: ``Queue.status``: a destination's state, one word each.
READY, DEAD, RATE_PAUSED, HELD = "ready", "dead", "paused", "held"


@dataclass(frozen=True, slots=True)
class Dsn:
    """A delivery status: ``4.4.1`` plus the text that explains it."""

    status: str
    reason: str

    @property
    def nexthop(self) -> str:
        """How the retry/error transports receive a DSN: as their next hop."""
        return f"{self.status} {self.reason}"


@dataclass(frozen=True, eq=False)
class ScopeKind:
    """The verbs of one kind of scope a delivery counts in beyond its destination
    (:mod:`.scope` walks them). Each takes the core (``state.Core``: typed ``Any``
    here, as this module cannot import the state that imports it) and the entry
    whose delivery moves; the scope itself is found from it (the queue's site, the
    message's tenant)."""

    #: The kind's name (``site``, ``tenant``): what explain and tests call it.
    name: str
    #: An agent took the entry's delivery.
    started: Callable[[Any, Entry], None]
    #: The delivery never left (its agent could not take the request): counted out as
    #: it was counted in. True if the scope must settle after the destination's sync.
    unselected: Callable[[Any, Entry], bool]
    #: The entry ended (``busy``: its delivery came back; else it went unsent, moved
    #: or deferred). True if the scope must settle after the destination's sync.
    ended: Callable[[Any, Entry, bool], bool]
    #: After the sync: a full scope with room again opens.
    settle: Callable[[Any, Entry], None]

    def __repr__(self) -> str:
        return f"ScopeKind({self.name})"


@dataclass(eq=False)
class Queue:
    transport: Transport
    name: str
    nexthop: str
    window: int = 0
    success: float = 0.0
    failure: float = 0.0
    fail_cohorts: float = 0.0
    busy_count: int = 0
    #: Entries waiting for an agent, in the order they were created.
    todo: QList[Entry] = field(default_factory=QList)
    #: Equal to the transport's blocker tag while this queue blocks the job list.
    blocker_tag: int = 0
    #: When a delivery to this destination last finished (whole seconds).
    last_done: int = 0
    #: Connection-caching request flags (DEL_REQ_FLAG_CONN_*) for its deliveries.
    dflags: int = 0
    #: Why the destination is dead; None while it is alive.
    dsn: Dsn | None = None
    #: When a dead destination comes back (scheduler clock).
    revive_at: float | None = None
    #: When a rate-delayed destination may deliver again (scheduler clock).
    paused_until: float | None = None
    #: Earliest time for the next "is using up N of M active queue entries" warning.
    clog_time_to_warn: float = 0.0
    #: Why no delivery starts now though the destination is alive, for reasons of its
    #: own: an operator's suspension (``pyqmgr suspend``), a rate's spacing, a backoff
    #: rule, a policy service's DEFER (:mod:`.shaping`). None: open. Its site's gate is
    #: the site's alone (:attr:`gate` joins the two), so that a site closes and opens
    #: without visiting its members (issue #44).
    own_gate: Suspension | Gate | None = None
    #: A response rule's cap on the window (0: none), below the concurrency limit.
    cap: int = 0
    #: Shaping state (:class:`.shaping.Shape`) when the transport has shaping.
    shape: Shape | None = None
    #: The provider site it belongs to while sites are on (:mod:`.site`); None: none.
    site: Site | None = None
    #: The kinds of scope beyond itself its deliveries count in (:mod:`.scope`): its
    #: site's while it has one; the transport's chain adds the tenant caps'.
    chain: tuple[ScopeKind, ...] = ()

    @property
    def gate(self) -> Suspension | Gate | None:
        """Why no delivery starts now (None: open): the attribute every policy tests.

        Its own gate, or its site's while the site is closed; an operator's suspension
        of the destination is named before the site's gate, as it outlasts it.
        """
        own = self.own_gate
        site = self.site
        if site is None:
            return own
        held = site.gate
        if held is None or (own is not None and own.kind == "suspended"):
            return own
        return held

    @property
    def ready(self) -> bool:
        return self.window > 0

    @property
    def status(self) -> str:
        """READY, DEAD, RATE_PAUSED or HELD (alive, but a gate holds it: an operator's
        suspension, a rate's spacing, a backoff rule or a policy service's DEFER)."""
        if self.window == THROTTLED:
            return DEAD
        if self.window == PAUSED:
            return RATE_PAUSED
        return READY if self.gate is None else HELD

    @property
    def throttled(self) -> bool:
        return self.window == THROTTLED

    @property
    def paused(self) -> bool:
        return self.window == PAUSED

    def pause(self, now: float, delay: float) -> None:
        """destination_rate_delay: emulate a slow channel by pausing this destination
        (stock's qmgr_queue_suspend)."""
        self.window = PAUSED
        self.paused_until = now + delay
        self.transport.timed_at(self, self.paused_until)

    def unpause(self) -> None:
        self.window = 1
        self.paused_until = None

    @property
    def idle(self) -> bool:
        """No entries at all: a live queue like this is discarded (``qmgr_queue_done``)."""
        return self.busy_count == 0 and self.todo.size == 0

    # -- feedback -----------------------------------------------------------------

    def _log_window(self, func: str) -> None:
        t = self.transport
        if t.feedback_debug:
            t.log(
                f"{func}: queue {self.name}: limit {t.cfg.destination_concurrency_limit} "
                f"window {self.window} success {self.success:g} failure {self.failure:g} "
                f"fail_cohorts {self.fail_cohorts:g}"
            )

    def _log_feedback(self, feedback: float) -> None:
        if self.transport.feedback_debug:
            self.transport.log(f"qmgr_queue_feedback: feedback {feedback:g}")

    def unthrottle(self) -> None:
        """Positive feedback after a delivery without hop failure; revive a dead site."""
        t = self.transport
        self.fail_cohorts = 0.0
        if self.window == THROTTLED:  # self.throttled without a call (once per delivery)
            self.dsn = None
            self.revive_at = None
            # Back from the almost grave, best concurrency is anyone's guess.
            self.window = self.busy_count if self.busy_count > 0 else t.initial_concurrency
            if self.cap and self.window > self.cap:
                self.window = self.cap
            self.success = self.failure = 0.0
            self._log_window("qmgr_queue_unthrottle")
            return
        limit = t.cfg.destination_concurrency_limit
        if self.cap and (limit == 0 or self.cap < limit):
            limit = self.cap
        if (limit == 0 or limit > self.window) and (
            self.window < self.busy_count + t.initial_concurrency
        ):
            feedback = t.pos_feedback.value(self.window)
            self._log_feedback(feedback)
            self.success += feedback
            hysteresis = t.pos_feedback.hysteresis
            while self.success + feedback * t.feedback_slack >= hysteresis:
                t.feedback_up += 1
                self.window += hysteresis
                self.success -= hysteresis
                self.failure = 0.0
            if limit > 0 and self.window > limit:
                self.window = limit
        self._log_window("qmgr_queue_unthrottle")

    def throttle(self, dsn: Dsn, now: float, min_backoff_time: float) -> bool:
        """Negative feedback after a hop failure; True when the site is now dead."""
        t = self.transport
        if self.ready:
            self.fail_cohorts += 1.0 / self.window
            limit = t.cfg.failed_cohort_limit
            if limit > 0 and (self.fail_cohorts > limit if t.cohort_beyond_limit
                              else self.fail_cohorts >= limit):
                self.window = THROTTLED
                t.destinations_died += 1
        if self.ready:
            feedback = t.neg_feedback.value(self.window)
            self._log_feedback(feedback)
            self.failure -= feedback
            hysteresis = t.neg_feedback.hysteresis
            while self.failure - feedback * t.feedback_slack < 0:
                t.feedback_down += 1
                self.window -= hysteresis
                self.success = 0.0
                self.failure += hysteresis
            if self.window < 1:
                self.window = 1
        dead = self.throttled
        if dead:
            self.dsn = dsn
            self.revive_at = now + min_backoff_time
            t.timed_at(self, self.revive_at)
        self._log_window("qmgr_queue_throttle")
        return dead


class Site:
    """A provider's site: the destinations one set of MX hosts serves (issue #33).

    Postfix counts sessions per destination; a provider counts them per site, and
    three hundred Workspace domains are one Google to it. A site sums the deliveries
    in flight of its member queues (one transport's; sites are per transport, as
    destination limits are) and, at ``limit``, gates every member (:attr:`gate`, the
    attribute every policy tests) until one of them finishes. The per-destination
    window stays stock's, below the site's cap. The verbs are in :mod:`.site`.
    """

    __slots__ = ("name", "transport", "limit", "setting", "busy", "members", "gate",
                 "bound", "shape", "limits", "quitting", "ready", "blocker_tag")

    def __init__(self, name: str, transport: str, limit: int, setting: str) -> None:
        self.name = name
        self.transport = transport
        #: Most deliveries in flight at the site (0: no cap), and the parameter that
        #: set it (for explain).
        self.limit = limit
        self.setting = setting
        #: Deliveries in flight to the site: the sum of its members' busy counts.
        self.busy = 0
        #: Its destination queues in core.
        self.members: dict[Queue, None] = {}
        #: Its members that could take a delivery now but for the site: the site's
        #: part of :attr:`Transport.ready_queues`, kept by :meth:`Transport.sync`, so
        #: that the site opens and closes in O(1) whatever its size (issue #44).
        self.ready: dict[Queue, None] = {}
        #: nqmgr's blocker tag: equal to the transport's while some job found its
        #: deliveries blocked by this site (nqmgr.job.site_opened clears it).
        self.blocker_tag = 0
        #: Deliveries that ended while the site was full, counted until these times
        #: (site.QUIT_GRACE): the remote server may not have seen their QUIT yet.
        self.quitting: deque[float] = deque()
        #: The gate its members have while the site is closed: at its limit, backing
        #: off after a throttling reply, or waiting for its first MX lookup.
        self.gate: Gate | None = None
        #: The limit in force: ``limit``, or a response rule's lower cap (0: none).
        self.bound = limit
        #: The site's shaping state: its starts (for a rate to learn), its rate's
        #: GCRA, a response rule's cap, matches and recovery steps.
        self.shape: Shape | None = None
        #: Its transport's site limits (the rate among them).
        self.limits: SiteLimits | None = None

    @property
    def full(self) -> bool:
        return 0 < self.bound <= self.busy

    def __repr__(self) -> str:
        return f"Site({self.transport}/{self.name} {self.busy}/{self.bound or '-'})"


#: The gate kinds explain shows for a destination whose site is full, for one whose
#: first MX lookup is under way (``site_dns_wait``), and for one whose site backs off
#: after a throttling reply (a response rule's ``suspend``).
#: The parameter of the sites' own limits, as explain names it.
SITE_LIMIT_MAPS = "site_concurrency_limit_maps"
SITE_GATE = "site"
#: A site's name where a site is counted beside destinations (a tenant's site limits,
#: the fleet's units in Redis and on its channels, issue #44): "site " and its name.
#: No queue name has a space (Postfix's tables split on whitespace), so neither can be
#: taken for the other; and it reads as it is shown.
SITE_SCOPE = "site "
LOOKUP_GATE = "site lookup"
BACKOFF_GATE = "site backoff"
RATE_GATE = "site rate"

#: Domains whose learnt site is remembered at most; the oldest answer goes first.
MAX_KNOWN = 100_000


@dataclass(frozen=True, slots=True)
class SiteLimits:
    """A transport's site limits: most deliveries in flight per site (0: none), and
    the parameter that set it, as explain names it; the starts a site takes (its
    ``shaping.rate``; a Shaping with no rate when none is set, whose rate a
    response rule can still learn and lower)."""

    concurrency: int
    setting: str
    shaping: Shaping | None = None
    rate_setting: str = "site_rate in pyqmgr.cf"
    #: A destination found dead takes every destination of its site with it
    #: (``site_dead_scope = site``); stock's scope, the destination alone, by default.
    dead_takes_site: bool = False


def site_domain(nexthop: str) -> str | None:
    """The domain whose MX records name a destination's site, or None.

    ``[host]`` and ``[host]:port`` are no domain: smtp(8) looks up no MX for them,
    and an address has no provider to group by. ``domain:port`` is the domain.
    """
    if not nexthop or nexthop[0] == "[":
        return None
    host, sep, port = nexthop.rpartition(":")
    if not sep:
        host = nexthop
    elif not port.isdigit() or ":" in host:
        return None
    host = host.rstrip(".").lower()
    return host or None


class SiteTable:
    """Which site each domain is at, and the sites in core; the core owns one while
    sites are on (``Scheduler.sites``; None: off, stock's per-destination limits)."""

    def __init__(self, limits_for: Callable[[str], SiteLimits | None],
                 pinned: dict[str, str] | None = None,
                 skip: frozenset[str] = frozenset(), wait: float = 0.0,
                 own_limits: dict[str, int] | None = None,
                 replied_from: Callable[[str, str], bool] | None = None) -> None:
        #: A transport's site limits; None: its destinations are not grouped.
        self.limits_for = limits_for
        self._limits: dict[str, SiteLimits | None] = {}
        #: Domains the admin put at a site (pyqmgr.cf), never looked up.
        self.pinned = {d.lower(): s for d, s in (pinned or {}).items()}
        #: Next hops never grouped (the relay host).
        self.skip = skip
        #: Learnt answers: domain -> (site, until when it holds on the scheduler clock).
        self.known: dict[str, tuple[str, float]] = {}
        #: Lookups asked of the driver and not answered yet.
        self.asked: set[str] = set()
        #: Sites with members or deliveries in flight, by (transport, site name).
        self.sites: dict[tuple[str, str], Site] = {}
        #: How long a new domain's queue waits for its first lookup (0: not at all).
        self.wait = wait
        #: Sites with a concurrency limit of their own (lowercased name -> limit),
        #: over their transport's (``site_concurrency_limit_maps``).
        self.own_limits: dict[str, int] = dict(own_limits or {})
        #: Sites with something timed (a lookup's wait, a backoff, a recovery step),
        #: with its time; ``tick`` runs them.
        self.due: dict[Site, float] = {}
        #: The same times in a heap, (time, order, site), so that a tick visits only
        #: the sites whose time came (thousands of new domains each wait for their
        #: lookup); an entry whose time is no longer ``due``'s is skipped.
        self.due_heap: list[tuple[float, int, Site]] = []
        self.due_order = 0
        #: Did a reply (smtp(8)'s text) come from one of the named site's own hosts
        #: (:func:`pyqmgr.site_names.replied_from_site`)? None: every reply does.
        self.replied_from = replied_from

    def limits(self, transport: str) -> SiteLimits | None:
        if transport not in self._limits:
            self._limits[transport] = self.limits_for(transport)
        return self._limits[transport]

    def name_of(self, domain: str, now: float, resolve: list[str]) -> str:
        """The domain's site as known now; asks for a lookup (in ``resolve``) when
        unknown or stale, and meanwhile answers the last one known, or the domain."""
        pin = self.pinned.get(domain)
        if pin is not None:
            return pin
        got = self.known.get(domain)
        if got is not None and got[1] > now:
            return got[0]
        if domain not in self.asked:
            self.asked.add(domain)
            resolve.append(domain)
        return got[0] if got is not None else domain

    def learn(self, domain: str, name: str, until: float) -> str:
        """An answer: the site the domain's queues were counted at until now."""
        self.asked.discard(domain)
        old = self.known.pop(domain, None)
        if len(self.known) >= MAX_KNOWN:
            del self.known[next(iter(self.known))]
        self.known[domain] = (name, until)
        return old[0] if old is not None else domain

    def site(self, transport: str, name: str, limits: SiteLimits) -> Site:
        site = self.sites.get((transport, name))
        if site is None:
            own = self.own_limits.get(name.lower())
            if own is not None:
                # The admin's limit for this site (site_concurrency_limit_maps).
                limits = SiteLimits(own, f"{SITE_LIMIT_MAPS} ({name}) in pyqmgr.cf",
                                    limits.shaping, limits.rate_setting,
                                    limits.dead_takes_site)
            site = self.sites[(transport, name)] = Site(
                name, transport, limits.concurrency, limits.setting)
            site.limits = limits
        return site


#: Stock keeps at most this many agent connections per transport waiting for an agent.
MAX_PENDING = 2


class TenantCaps:
    """A transport's limits on each tenant's deliveries at each destination and site
    (issue #34: ``tenant_concurrency_limit``, ``tenant_site_concurrency_limit``,
    ``tenant_rate``, ``tenant_site_rate``); the verbs are in :mod:`.tenant_cap`."""

    __slots__ = ("limit", "site_limit", "spacing", "site_spacing", "counts", "next_at",
                 "site_of", "staged_at", "timed", "armed")

    def __init__(self, limit: int, site_limit: int = 0, spacing: float = 0.0,
                 site_spacing: float = 0.0) -> None:
        self.limit = limit
        self.site_limit = site_limit
        #: Seconds between a tenant's entries at a destination / at a site (0: no rate).
        self.spacing = spacing
        self.site_spacing = site_spacing
        #: (tenant, scope) -> its entries there, todo and busy; a scope is a queue's
        #: name or ``@`` and a site's name.
        self.counts: dict[tuple[str, str], int] = {}
        #: (tenant, scope) -> when its rate lets its next entry in.
        self.next_at: dict[tuple[str, str], float] = {}
        #: Entries counted at a site, by their queue: the site scope each counts in.
        #: By queue, so that a domain's lookup answer recounts its own queue's
        #: entries, not every entry counted at any site.
        self.site_of: dict[Queue, dict[Entry, str]] = {}
        #: (tenant, site scope) -> its staging queues with mail for the site, by name.
        self.staged_at: dict[tuple[str, str], dict[str, Queue]] = {}
        #: Rate slots to wake for: (when, staging queue name), a heap; and the one
        #: armed per staging queue (a timer not the armed one is stale).
        self.timed: list[tuple[float, str]] = []
        self.armed: dict[str, float] = {}


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
        #: A site's members are indexed at their site instead (:attr:`Site.ready`), and
        #: the open sites with such members here.
        self.ready_queues: dict[Queue, None] = {}
        self.ready_sites: dict[Site, None] = {}
        #: Live queues with more deliveries out than their window (negative feedback
        #: came while they were busy): they count against the allocation test.
        self.over_busy: dict[Queue, None] = {}
        self.dsn: Dsn | None = None
        self.revive_at: float | None = None
        #: Its queues with a time to act (dead until ``revive_at``, paused until
        #: ``paused_until``) as a heap of (when, order, queue): time passing costs the
        #: queues due, not every queue in core, as stock's timer a queue does; an entry
        #: whose queue left the core or changed its time is dropped when it comes up.
        self.timed: list[tuple[float, int, Queue]] = []
        self._timed_order = 0
        #: transport_rate_delay: no new agent until the current delivery is over.
        self.rate_lock = False
        #: Agent connections asked for and not yet announced.
        self.pending = 0
        #: The transport's scheduling policy (set by the core right after creation).
        self.policy: Backend = None  # type: ignore[assignment]
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
        #: Each tenant's cap at each destination (tenant_concurrency_limit, issue #34:
        #: :mod:`.tenant_cap`); None: no cap.
        self.tenant_caps: TenantCaps | None = None
        #: The kinds of scope every delivery of the transport counts in beside its
        #: queue's (:mod:`.scope`): the tenant caps' when there are caps.
        self.chain: tuple[ScopeKind, ...] = ()
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

    def timed_at(self, queue: Queue, when: float) -> None:
        """The queue has something to do at ``when`` (:func:`enable.enable_due`)."""
        self._timed_order += 1
        heapq.heappush(self.timed, (when, self._timed_order, queue))

    @property
    def initial_concurrency(self) -> int:
        return self.cfg.initial_destination_concurrency

    @property
    def recipient_limit(self) -> int:
        """Recipients per delivery request (``<transport>_destination_recipient_limit``)."""
        return self.cfg.destination_recipient_limit

    def queue(self, name: str, nexthop: str) -> Queue:
        queue = self.queues.get(name)
        if queue is None:
            queue = Queue(self, name, nexthop, window=self.initial_concurrency)
            self.queues[name] = queue
        return queue

    def room(self, queue: Queue) -> int:
        """Deliveries ``queue`` may start now: its window, capped by the policy's cap
        and by what its site has left.

        Zero while the destination is gated (suspended, rate-spaced, backing off, its
        site full).
        """
        if queue.gate is not None:
            return 0
        window = queue.window
        cap = self.dest_cap
        if cap and window > cap:
            window = cap
        room = window - queue.busy_count
        site = queue.site
        if site is not None and site.bound and site.bound - site.busy < room:
            return site.bound - site.busy
        return room

    def sync(self, queue: Queue) -> None:
        """Keep :attr:`ready_queues` true for ``queue`` after any change to it.

        Called after every change to a queue, the hottest function of the core: the
        todo list's size is read as an attribute, not through ``QList.__bool__``.
        """
        site = queue.site
        if queue.window > queue.busy_count and queue.todo.size and queue.window > 0 and (
                not self.dest_cap or queue.busy_count < self.dest_cap) and (
                queue.own_gate is None):
            if site is None:
                self.ready_queues[queue] = None
            else:
                site.ready[queue] = None
                if site.gate is None:
                    self.ready_sites[site] = None
        elif site is None:
            self.ready_queues.pop(queue, None)
        else:
            site.ready.pop(queue, None)
            if not site.ready:
                self.ready_sites.pop(site, None)
        if queue.busy_count > queue.window > 0:
            self.over_busy[queue] = None
        elif self.over_busy:
            self.over_busy.pop(queue, None)

    def wants_agent(self) -> bool:
        """``qmgr_transport_select``'s test: enough deliverable work for one more agent.

        Stock walks the queue list (creation order; oqmgr's round-robin order) summing
        min(window - busy, todo) over live queues until it covers pending + 1. A queue
        with more deliveries out than its window adds a negative number: until its
        deliveries end, the work behind it in the list waits for more work (in a field
        mix, the second and third sessions to a rate limiter waited 0.2 s behind a 421
        limiter's over-busy queue in all ten stock runs; #32). With no such queue, only
        :attr:`ready_queues` add anything, each at least one, so at most MAX_PENDING + 1
        are looked at; with one, the list is walked in stock's order up to the point
        where the work suffices, as stock walks it.
        """
        if (self.dsn is not None or self.rate_lock or self.pending >= MAX_PENDING
                or self.suspension is not None):
            return False
        need = self.pending + 1
        if self.over_busy:
            return self._wants_agent_in_list_order(need)
        for queue in self.ready_queues:
            need -= min(self.room(queue), len(queue.todo))
            if need <= 0:
                return not self.gated or self.policy.has_work()
        for site in self.ready_sites:
            # An open site's ready members, together no more than the site has left.
            left = site.bound - site.busy if site.bound else need
            for queue in site.ready:
                got = min(self.room(queue), len(queue.todo), left)
                need -= got
                left -= got
                if need <= 0:
                    return not self.gated or self.policy.has_work()
                if left <= 0:
                    break
        return False

    def is_ready(self, queue: Queue) -> bool:
        """Could ``queue`` take a delivery now (:attr:`ready_queues`, or its open site's
        :attr:`Site.ready`)?"""
        site = queue.site
        if site is None:
            return queue in self.ready_queues
        return site.gate is None and queue in site.ready

    def _wants_agent_in_list_order(self, need: int) -> bool:
        ordered = getattr(self.policy, "queue_list", None)
        for queue in (ordered if ordered is not None else self.queues.values()):
            if queue.window <= 0:
                continue
            if queue.busy_count > queue.window:
                need -= min(queue.window - queue.busy_count, len(queue.todo))
            elif self.is_ready(queue):
                need -= min(self.room(queue), len(queue.todo))
            else:
                continue
            if need <= 0:
                return not self.gated or self.policy.has_work()
        return False


class Backend(Protocol):
    """A transport's scheduling policy as the shared machinery sees it.

    :class:`pyqmgr.scheduler.policy.Policy` is the base every built-in and ``module:``
    policy derives from; this is the whole of what the core, the entry verbs and the
    reports call on it, so that these modules need not import the policies.
    """

    name: ClassVar[str]

    def add(self, message: Message, queue: Queue, recipient: Recipient,
            last: Entry | None) -> Entry: ...
    def new_entry(self, message: Message, queue: Queue) -> Entry: ...
    def moved(self, entry: Entry, count: int) -> None: ...
    def select(self) -> Entry | None: ...
    def unselect(self, entry: Entry) -> None: ...
    def requeued(self, entry: Entry) -> None: ...
    def done(self, entry: Entry, busy: bool) -> None: ...
    def resumed(self, queue: Queue) -> None: ...
    def site_opened(self, site: Site) -> None: ...
    def queue_done(self, queue: Queue) -> None: ...
    def todo_entries(self, message: Message) -> list[Entry]: ...
    def has_work(self) -> bool: ...
    def describe(self) -> dict[str, object]: ...
    def jobs_report(self, now: float, limit: int | None = None) -> dict[str, object]: ...
    def explain(self, queue: Queue | None, message: Message | None) -> list[Any]: ...
