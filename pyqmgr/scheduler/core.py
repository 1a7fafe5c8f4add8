"""The scheduler core: events in, decisions out, no I/O.

Events are method calls: a message's recipients were read and routed
(:meth:`Scheduler.assign`), an agent of a transport announced itself (:meth:`select`),
a delivery finished (:meth:`done`), an agent could not be reached
(:meth:`allocation_failed`), time passed (:meth:`tick`), the admin asked for a flush
(:meth:`enable_all`). Decisions come back as values: which transport deserves one more
agent (:meth:`allocate`), the entry to deliver, and lists the driver drains: messages
that are finished, recipients to defer through the defer service because even the
retry transport is dead, deadlines at which to call :meth:`tick`, and log lines.
Reading more recipients of a message is the one request the core makes synchronously
(the ``refill`` callback), because stock's selection reads them in the middle of
choosing and uses them at once.

What every scheduler shares lives here and beside it: transports and agent allocation
(:mod:`.transport`), the Postfix 2.5 concurrency window per destination and dead sites
(:mod:`.queue`), entries (:mod:`.entry`) and messages (:mod:`.message`). Which entry an
agent delivers, and the bookkeeping that decision needs, is each transport's policy
(:mod:`.policy`): stock's nqmgr (:mod:`.nqmgr`) unless the scheduler's
:class:`~.policy.PolicyTable` says otherwise.
"""

from __future__ import annotations

import heapq
import itertools
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from pyqmgr.scheduler.decisions import Decisions, DeferRecipient, Outbox
from pyqmgr.scheduler.entry import Entry, entry_unselect
from pyqmgr.scheduler.feedback import parse_or_warn, rounding_rules
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.policy import PolicyClass, PolicyTable
from pyqmgr.scheduler.qlist import QList
from pyqmgr.scheduler.shaping import (
    Gate,
    Rule,
    Shape,
    Shaping,
    effective_interval,
    observed_rate,
    take_start,
    triggered,
)
from pyqmgr.scheduler.structures import (
    ERROR,
    RETRY,
    Backend,
    Dsn,
    Queue,
    Transport,
    TransportParams,
)
from pyqmgr.scheduler.suspension import Suspension, SuspensionTable, Target

SUSPENDED = "delivery temporarily suspended: "
#: Why mail waits when a transport's policy raised (as for an unreachable agent).
POLICY_DSN = Dsn("4.3.0", "mail transport unavailable: scheduler policy error")
_DSN_RE = re.compile(r"[245]\.\d{1,3}\.\d{1,3}$")

#: Stock reads at most this many recipients at once, to keep event latency in check.
MAX_READ = 5000
#: Destinations watched for deferred-mail recovery at most (:meth:`Scheduler.watch_recovery`).
#: Beyond this many dead or throttled at once, the others' deferred mail simply waits
#: for its retry time, as in stock: recovery is an optimisation, never a duty.
RECOVERY_WATCH_LIMIT = 10_000


class FullTransportParams(TransportParams, Protocol):
    """A transport's settings with the feedback strings the core parses itself.

    Read-only properties, so that a frozen config (config.TransportConfig) fits.
    """

    @property
    def positive_feedback(self) -> str: ...
    @property
    def positive_feedback_name(self) -> str: ...
    @property
    def negative_feedback(self) -> str: ...
    @property
    def negative_feedback_name(self) -> str: ...


class Settings(Protocol):
    """The main.cf parameters the core reads, by their names (config.QmgrConfig)."""

    minimal_backoff_time: int
    transport_retry_time: int
    initial_destination_concurrency: int
    destination_concurrency_feedback_debug: bool
    qmgr_message_active_limit: int
    qmgr_clog_warn_time: int
    helpful_warnings: bool
    qmgr_message_recipient_limit: int
    qmgr_message_recipient_minimum: int

    def transport(self, name: str) -> FullTransportParams: ...


@dataclass(frozen=True, slots=True)
class Route:
    """Where trivial-rewrite (and qmgr's own rules) sent one recipient."""

    transport: str
    queue_name: str
    nexthop: str
    recipient: Recipient


def dsn_valid(status: str) -> bool:
    return bool(_DSN_RE.match(status))


def _why(dsn: Dsn, rule: str | None = None) -> str:
    """Why a destination is watched for recovery, as its log line will say."""
    text = f"{dsn.status} {dsn.reason.removeprefix(SUSPENDED)}"
    if len(text) > 200:
        text = text[:197] + "..."
    if rule is not None:
        return f'a throttling reply "{text}" matched {rule}'
    return f"it was dead ({text})"


#: refill(message, limit): read up to ``limit`` more recipients of the message, set
#: ``message.more`` and ``message.rcpt_unread``, and return their routes sorted by
#: transport and queue (None: the file could not be read; ``more`` must be False then).
Refill = Callable[[Message, int], "list[Route] | None"]


class Scheduler:
    def __init__(
        self,
        params_for: Callable[[str], FullTransportParams],
        *,
        min_backoff_time: float = 300.0,
        transport_retry_time: float = 60.0,
        initial_concurrency: int = 5,
        feedback_debug: bool = False,
        active_limit: int = 20000,
        clog_warn_time: float = 300.0,
        helpful_warnings: bool = True,
        rcpt_limit: int = 20000,
        msg_rcpt_limit: int = 10,
        refill: Refill | None = None,
        feedback_rounding: str = "stock",
        policies: PolicyTable | None = None,
        fudge_factor: int = 100,
        process_limit_for: Callable[[str], int] | None = None,
        shaping_for: Callable[[str], Shaping | None] | None = None,
    ) -> None:
        self.params_for = params_for
        #: pyqmgr.cf's shaping per transport (:mod:`.shaping`); None: stock everywhere.
        self.shaping_for = shaping_for
        #: Each transport's policy (nqmgr everywhere unless pyqmgr.cf says otherwise).
        self.policies = policies or PolicyTable()
        #: master.cf's maxproc per transport (finch's workers, explain's process limit).
        self.process_limit_for = process_limit_for
        #: The policy classes in use, for their per-message hooks.
        self.policy_classes: list[PolicyClass] = []
        #: A policy without nqmgr's job slots is in use: a message without jobs then
        #: reads its recipients by oqmgr's limits (:meth:`read_limit`).
        self.slotless = False
        #: oqmgr's reading as a whole (the default policy is oqmgr): no more files
        #: opened while the in-core recipient limit is reached, early refills.
        self.bounded_reading = self.policies.bounded_reading
        #: oqmgr's qmgr_fudge_factor (percent of the recipient limit per batch).
        self.fudge_factor = fudge_factor
        self.min_backoff_time = min_backoff_time
        self.transport_retry_time = transport_retry_time
        self.initial_concurrency = initial_concurrency
        self.feedback_debug = feedback_debug
        self.active_limit = active_limit
        self.clog_warn_time = clog_warn_time
        self.helpful_warnings = helpful_warnings
        #: qmgr_message_recipient_limit (stock raises it to the active limit).
        self.rcpt_limit = max(rcpt_limit, active_limit)
        #: qmgr_message_recipient_minimum: every message's own slot reserve.
        self.msg_rcpt_limit = msg_rcpt_limit
        self.refill = refill
        #: "stock" (the daemon, always) or "pseudocode" (the seed's 2007 rules, for
        #: reproducing its tables in the simulator): see feedback.ROUNDINGS.
        rounding_rules(feedback_rounding)  # refuse an unknown rule now, not at first use
        self.feedback_rounding = feedback_rounding
        #: Messages in the active queue; the driver keeps it current (clog warnings).
        self.message_count = 0
        #: Recipients in core, all messages (stock's qmgr_recipient_count).
        self.rcpt_count = 0
        #: Destination queues in core (stock's qmgr_queue_count).
        self.queue_count = 0
        #: The scheduler clock as of the latest event that carried a time.
        self.now = 0.0
        self.transports: dict[str, Transport] = {}
        #: Transports in round-robin order for agent allocation (new ones go first).
        self.transport_list: QList[Transport] = QList()
        #: The decisions of the event under way (:mod:`.decisions`); each event's last
        #: step hands them to the driver as one value.
        self.out = Outbox()
        #: Operators' suspensions in force (:mod:`.suspension`).
        self.suspensions = SuspensionTable()
        #: Shaping deadlines: (when, seq, transport, queue name, what). Popped by
        #: :meth:`open_gates` in O(log n), never by a walk over every queue.
        self.gate_heap: list[tuple[float, int, Transport, str, str]] = []
        self._gate_seq = itertools.count()
        #: Deferred-mail recovery (pyqmgr.cf ``deferred_recovery_rate``), off (None)
        #: unless :meth:`watch_recovery`: the destinations, by (transport, queue name),
        #: that were dead or throttled and have not delivered since, with why.
        self.recovery_watch: dict[tuple[str, str], str] | None = None

    @classmethod
    def from_settings(cls, cfg: Settings, refill: Refill | None = None,
                      feedback_rounding: str = "stock",
                      policies: PolicyTable | None = None,
                      process_limit_for: Callable[[str], int] | None = None,
                      fudge_factor: int = 100,
                      shaping_for: Callable[[str], Shaping | None] | None = None) -> Scheduler:
        """The scheduler as main.cf configures it: the daemon's and the simulator's."""
        return cls(
            cfg.transport,
            min_backoff_time=cfg.minimal_backoff_time,
            transport_retry_time=cfg.transport_retry_time,
            initial_concurrency=cfg.initial_destination_concurrency,
            feedback_debug=cfg.destination_concurrency_feedback_debug,
            active_limit=cfg.qmgr_message_active_limit,
            clog_warn_time=cfg.qmgr_clog_warn_time,
            helpful_warnings=cfg.helpful_warnings,
            rcpt_limit=cfg.qmgr_message_recipient_limit,
            msg_rcpt_limit=cfg.qmgr_message_recipient_minimum,
            refill=refill,
            feedback_rounding=feedback_rounding,
            policies=policies,
            process_limit_for=process_limit_for,
            fudge_factor=fudge_factor,
            shaping_for=shaping_for,
        )

    @property
    def clock(self) -> int:
        """Stock's whole-second clock for preemption scores, refills and caching."""
        return int(self.now)

    # -- transports and queues ----------------------------------------------------

    def transport(self, name: str) -> Transport:
        t = self.transports.get(name)
        if t is None:
            cfg = self.params_for(name)
            pos, pos_warn = parse_or_warn(cfg.positive_feedback, cfg.positive_feedback_name)
            neg, neg_warn = parse_or_warn(cfg.negative_feedback, cfg.negative_feedback_name)
            debug = self.feedback_debug and name not in (RETRY, ERROR)
            t = Transport(name, cfg, pos, neg, self._info, feedback_debug=debug,
                          rounding=self.feedback_rounding)
            for warn in (pos_warn, neg_warn):
                if warn:
                    self.out.log.append(("warning", warn))
            if debug:
                for fb, fb_name in ((pos, cfg.positive_feedback_name),
                                    (neg, cfg.negative_feedback_name)):
                    self._info(
                        f"{name}: {fb_name} feedback type {fb.index} value at "
                        f"{self.initial_concurrency}: {fb.value(self.initial_concurrency):g}"
                    )
            self._attach_policy(t)
            self.transports[name] = t
            self.transport_list.prepend(t.node)
            if self.suspensions:
                t.suspension = self.suspensions.for_transport(name)
            if self.shaping_for is not None and name not in (RETRY, ERROR):
                t.shaping = self.shaping_for(name)
        return t

    def _attach_policy(self, t: Transport) -> None:
        """Give a new transport its policy (the retry and error transports run stock's)."""
        cls = self.policies.policy_for(t.name)
        t.policy = cls(t, self)
        if not cls.holds_slots:
            self.slotless = True
        t.dest_cap = cls.dest_cap
        t.gated = cls.gates_allocation
        if cls not in self.policy_classes:
            self.policy_classes.append(cls)

    def setting(self, name: str, transport: str, default: str) -> str:
        """A pyqmgr.cf parameter for a policy (``<transport>_<name>``, then ``<name>``)."""
        if self.policies.setting is None:
            return default
        return self.policies.setting(name, transport, default)

    def process_limit(self, transport: str) -> int:
        """master.cf's maxproc for the transport (0: no limit); 100 when unknown."""
        if self.process_limit_for is None:
            return 100
        return self.process_limit_for(transport)

    def policy(self, name: str) -> Backend:
        """The policy of transport ``name`` (created with the transport if need be)."""
        return self.transport(name).policy

    def _queue(self, t: Transport, name: str, nexthop: str) -> Queue:
        queue = t.queues.get(name)
        if queue is None:
            queue = t.queue(name, nexthop)
            self.queue_count += 1
            if t.shaping is not None:
                shape = t.shapes.get(name)
                if shape is None:
                    shape = t.shapes[name] = Shape()
                queue.shape = shape
                queue.cap = shape.cap
                if queue.cap and queue.window > queue.cap:
                    queue.window = queue.cap
            if self.suspensions or (queue.shape is not None and queue.shape.gate is not None):
                queue.gate = self._gate_for(queue)
        return queue

    def _queue_done(self, queue: Queue) -> None:
        """Discard an idle, live in-core queue."""
        t = queue.transport
        if t.queues.get(queue.name) is queue:
            del t.queues[queue.name]
            self.queue_count -= 1
        t.ready_queues.pop(queue, None)
        if not t.broken:
            t.policy.queue_done(queue)
        shape = queue.shape
        if shape is not None:
            if shape.neutral(self.now):
                t.shapes.pop(queue.name, None)
            elif shape.gate is None and shape.rule is None:
                # Only the rate's spacing remains: forget it once it has passed.
                self._push_gate(shape.tat, t, queue.name, "prune")

    def _info(self, text: str) -> None:
        self.out.log.append(("info", text))

    def _error_queue(self, service: str, dsn: Dsn) -> Queue | None:
        """The retry/error queue for ``dsn``, or None when that is dead too."""
        t = self.transport(service)
        if t.throttled:
            return None
        q = self._queue(t, dsn.nexthop, dsn.nexthop)
        return None if q.throttled else q

    # -- messages -------------------------------------------------------------------

    def _admit(self, message: Message) -> None:
        if message.rcpt_limit <= 0 and not message.jobs and message.refcount == 0:
            message.rcpt_limit = self.msg_rcpt_limit

    def read_limit(self, message: Message) -> int:
        """How many recipients to read into core for this message now.

        The first batch may fill the global pool (qmgr_message_recipient_limit) but
        gets at least the message's own reserve; later batches get exactly the slots
        the message's jobs were given. Never more than 5000 at once.
        """
        self._admit(message)
        if self.slotless and not message.jobs:
            # No nqmgr job holds slots for this message: oqmgr's per-batch limit.
            return min(self.fudge_limit, MAX_READ)
        if message.more:
            return min(message.rcpt_limit - message.rcpt_count, MAX_READ)
        return min(max(self.rcpt_limit - self.rcpt_count, message.rcpt_limit), MAX_READ)

    @property
    def fudge_limit(self) -> int:
        """oqmgr's batch size: FUDGE(qmgr_message_recipient_limit)."""
        return max(1, self.rcpt_limit * self.fudge_factor // 100)

    def may_feed(self) -> bool:
        """May the driver open another queue file? (oqmgr: not at the recipient limit.)"""
        return not self.bounded_reading or self.rcpt_count < self.rcpt_limit

    def first_read_limit(self) -> int:
        """:meth:`read_limit` for a message not created yet (the driver reads first)."""
        if self.bounded_reading:
            return min(self.fudge_limit, MAX_READ)
        return min(max(self.rcpt_limit - self.rcpt_count, self.msg_rcpt_limit), MAX_READ)

    def realloc(self, message: Message) -> None:
        """Read the message's next recipient batch now (``qmgr_message_realloc``)."""
        if self.refill is None or not message.more:
            return
        limit = self.read_limit(message)
        if limit <= 0:
            return
        routes = self.refill(message, limit)
        if routes is not None:
            self._assign(message, routes, False)

    # -- events -------------------------------------------------------------------

    def assign(self, message: Message, routes: Iterable[Route], flush_each: bool = False,
               now: float | None = None) -> Decisions:
        """Bundle a batch of routed recipients into entries (``qmgr_message_assign``).

        The driver sets ``message.more`` and ``message.rcpt_unread`` for the batch
        first. Recipients must come sorted by transport and queue, so consecutive
        recipients for one destination share a delivery request up to the transport's
        recipient limit. Dead transports and destinations send their recipients to the
        retry transport, as stock's resolver step does, unless the message is being
        flushed (``flush_each``: ``postqueue -i``/``-s``), which revives them first.
        """
        if now is not None:
            self.now = now
        self._assign(message, routes, flush_each)
        return self.out.take()

    def _assign(self, message: Message, routes: Iterable[Route], flush_each: bool) -> None:
        self._admit(message)
        message.refill_time = self.clock
        last: Entry | None = None
        last_queue: Queue | None = None
        for route in routes:
            t = self.transport(route.transport)
            queue: Queue | None
            dsn: Dsn | None
            if flush_each and t.throttled:
                self._transport_unthrottle(t)
            if flush_each and not t.throttled:
                named = t.queues.get(route.queue_name)
                if named is not None and named.throttled:
                    self._queue_unthrottle(named)
            if t.throttled:
                assert t.dsn is not None
                queue = self._error_queue(RETRY, t.dsn)
                dsn = t.dsn
                if self.recovery_watch is not None:
                    self._wait(message, t.name, route.queue_name, _why(dsn))
            else:
                queue = self._queue(t, route.queue_name, route.nexthop)
                dsn = queue.dsn if queue.throttled else None
                if dsn is not None:
                    queue = self._error_queue(RETRY, dsn)
                    if self.recovery_watch is not None:
                        self._wait(message, t.name, route.queue_name, _why(dsn))
            if queue is None:
                assert dsn is not None
                message.deferred = True
                self.out.deferrals.append(DeferRecipient(message, route.recipient, dsn))
                continue
            if queue is not last_queue:
                last = None
                last_queue = queue
            refs = message.refcount
            try:
                last = queue.transport.policy.add(message, queue, route.recipient, last)
            except Exception as exc:  # noqa: BLE001 - a policy's bug must not lose mail
                self._policy_failed(queue.transport, "add", exc)
                message.deferred = True
                self.out.deferrals.append(DeferRecipient(message, route.recipient, POLICY_DSN))
                last = last_queue = None
                continue
            if message.refcount != refs and self.helpful_warnings and self.clog_warn_time > 0:
                self._clog_warning(queue)
            message.rcpt_count += 1
            self.rcpt_count += 1
        for cls in self.policy_classes:
            cls.message_assigned(message)

    def _policy_failed(self, t: Transport, where: str, exc: Exception) -> None:
        """A policy raised: log it with its name, and treat it as a failed agent.

        The transport is dead for transport_retry_time, so its waiting mail goes to
        the retry transport and is deferred, never lost; its policy is not asked again
        until the transport revives with a fresh one.
        """
        if t.broken:
            return
        t.broken = True
        self.out.log.append(("warning", f"transport {t.name}: scheduler policy {t.policy.name}: "
                                    f"{where}: {type(exc).__name__}: {exc}"))
        self._throttle_transport(t.name, POLICY_DSN, self.now)

    def _clog_warning(self, queue: Queue) -> None:
        """One destination filling the active queue: stock's advice, at most so often."""
        length = len(queue.todo) + queue.busy_count
        if length <= self.active_limit // 5 or self.now < queue.clog_time_to_warn:
            return
        count = max(self.message_count, 1)
        share = length / count
        t = queue.transport
        warn = [f"mail for {queue.nexthop} is using up {length} of {count} active queue "
                "entries"]
        if share < 0.9:
            warn.append("this may slow down other mail deliveries")
        limit = t.cfg.destination_concurrency_limit
        if 0 < limit <= queue.busy_count + 1:
            warn.append(f"you may need to increase the main.cf {t.name}"
                        f"_destination_concurrency_limit from {limit}")
        elif queue.window > self.active_limit * share:
            warn.append("you may need to increase the main.cf qmgr_message_active_limit "
                        f"from {self.active_limit}")
        elif len(t.queues) > 1:
            warn.append(f"you may need a separate master.cf transport for {queue.nexthop}")
        else:
            warn += [
                f"you may need to reduce {t.name} connect and helo timeouts",
                "so that Postfix quickly skips unavailable hosts",
                "you may need to increase the main.cf minimal_backoff_time and "
                "maximal_backoff_time",
                "so that Postfix wastes less time on undeliverable mail",
                f"you may need to increase the master.cf {t.name} process limit",
            ]
        warn += [
            "please avoid flushing the whole queue when you have",
            "lots of deferred mail, that is bad for performance",
            "to turn off these warnings specify: qmgr_clog_warn_time = 0",
        ]
        self.out.log.extend(("warning", w) for w in warn)
        queue.clog_time_to_warn = self.now + self.clog_warn_time

    def allocate(self) -> str | None:
        """A transport that deserves one more agent connection, counted as pending.

        Stock's ``qmgr_transport_select``: round robin over live transports with fewer
        than two pending connections whose queues hold enough deliverable work.
        """
        node = self.transport_list.head
        while node is not None:
            t = node.item
            if t.wants_agent():
                self.transport_list.rotate(node)
                t.pending += 1
                if t.cfg.transport_rate_delay > 0:
                    t.rate_lock = True
                return t.name
            node = node.next
        return None

    def has_work(self, name: str) -> bool:
        """Would an agent of this transport get an entry now? (Worth connecting one.)"""
        t = self.transports.get(name)
        return t is not None and t.wants_agent()

    def select_delay(self, name: str) -> float:
        """transport_rate_delay: how long an announced agent waits before :meth:`select`."""
        t = self.transports.get(name)
        return float(t.cfg.transport_rate_delay) if t is not None else 0.0

    def select(self, name: str, now: float | None = None) -> Decisions:
        """An agent of transport ``name`` announced itself: the entry it delivers."""
        if now is not None:
            self.now = now
        return self.out.take(self._select(name))

    def _select(self, name: str) -> Entry | None:
        t = self.transports.get(name)
        if t is None:
            return None
        if t.pending > 0:
            t.pending -= 1
        try:
            entry = None if t.broken or t.suspension is not None else t.policy.select()
        except Exception as exc:  # noqa: BLE001 - a policy's bug must not lose mail
            self._policy_failed(t, "select", exc)
            entry = None
        if entry is not None and t.shaping is not None:
            entry.started = self.now
            self._started(entry.queue)
        if entry is None:
            # Stock would keep the rate lock until some delivery ends; with none under
            # way the transport would never be chosen again.
            t.rate_lock = False
        return entry

    def allocation_failed(self, name: str, dsn: Dsn, now: float) -> Decisions:
        """The agent could not be reached: the transport is dead for a while."""
        t = self.transport(name)
        if t.pending > 0:
            t.pending -= 1
        self._throttle_transport(name, dsn, now)
        return self.out.take()

    def send_failed(self, entry: Entry, dsn: Dsn, now: float) -> Decisions:
        """The request could not be written to the agent (``qmgr_deliver``).

        The entry never reached the agent: it goes back to todo, and the transport is
        treated as unavailable, so that entry and every other waiting one are deferred
        (moved to the retry transport) and no agent is asked for until
        ``transport_retry_time`` has passed.
        """
        entry_unselect(entry)
        self._throttle_transport(entry.queue.transport.name, dsn, now)
        return self.out.take()

    def done(self, entry: Entry, status: int, hop: Dsn | None, crashed: bool,
             now: float) -> Decisions:
        """A delivery finished (``qmgr_deliver_update``).

        ``status`` is the agent's final status (0 all final, else retry needed);
        ``hop`` is the agent's hop-level DSN when it reported one; ``crashed`` means
        no usable reply at all (3.7.11 behaviour: defer the message, leave the
        transport's state alone).
        """
        self.now = now
        queue = entry.queue
        t = queue.transport
        message = entry.message
        if queue.shape is not None and t.shaping is not None and t.shaping.rules:
            queue.shape.dones.append(now)
        if crashed or status != 0:
            message.deferred = True
            rule = None
            if hop is not None and hop.status and t.shaping is not None and t.shaping.rules:
                rule = t.shaping.match(hop.status, hop.reason)
            if rule is not None and rule.throttle and hop is not None:
                # Throttling, not failure: the rule's action instead of negative
                # feedback, and never a failed cohort (the site is alive).
                self._throttled(queue, rule, hop, now, entry.started)
                if self.recovery_watch is not None:
                    self._wait(message, t.name, queue.name, _why(hop, rule.where))
            elif hop is not None and hop.status:
                dsn = Dsn(
                    hop.status if dsn_valid(hop.status) else "4.0.0",
                    SUSPENDED + (hop.reason or "unknown error"),
                )
                if self.recovery_watch is not None:
                    # A site failure: this mail waits for the site, which is watched
                    # once it is dead (_defer_todo).
                    self._wait(message, t.name, queue.name, None)
                if queue.ready:
                    if queue.throttle(dsn, now, self.min_backoff_time):
                        self.out.timers.append(now + self.min_backoff_time)
                        self._defer_todo(queue, dsn)
                    t.sync(queue)
        if not crashed:
            self._transport_unthrottle(t)
            if hop is None or not hop.reason:
                self._queue_unthrottle(queue)
                if status == 0 and self.recovery_watch:
                    self._delivered_again(queue)
        self._entry_done(entry, busy=True)
        return self.out.take()

    def _entry_done(self, entry: Entry, busy: bool) -> None:
        """Finish an entry, busy (a delivery came back) or todo (``qmgr_entry_done``)."""
        queue = entry.queue
        message = entry.message
        t = queue.transport
        if busy:
            entry.busy = False
            queue.busy_count -= 1
        else:
            queue.todo.unlink(entry.queue_node)
        n = len(entry.recipients)
        message.rcpt_count -= n
        self.rcpt_count -= n
        # destination_rate_delay emulates a slow channel: pause the destination after
        # each delivery; scheduling decisions wait for it to resume.
        delay = t.cfg.destination_rate_delay
        if busy and delay > 0:
            if queue.throttled:
                self._queue_unthrottle(queue)
            if queue.ready:
                queue.suspend(self.now, delay)
                self.out.timers.append(self.now + delay)
        if not t.broken:
            try:
                t.policy.done(entry, busy)
            except Exception as exc:  # noqa: BLE001 - a policy's bug must not lose mail
                self._policy_failed(t, "done", exc)
        if busy:
            queue.last_done = self.clock
        if queue.idle:
            # A dead site's empty queue goes too once queues crowd memory.
            if queue.throttled and self.queue_count > 2 * self.rcpt_limit:
                self._queue_unthrottle(queue)
            if queue.ready:
                self._queue_done(queue)
        t.sync(queue)
        message.refcount -= 1
        if (self.bounded_reading and message.more and not message.jobs
                and self.rcpt_count < self.fudge_limit - 100):
            self.realloc(message)
        if message.refcount == 0:
            self._message_done(message)

    def _message_done(self, message: Message) -> None:
        """All in-core entries finished: tell the driver; policies drop their state."""
        self.out.finished.append(message)
        for cls in self.policy_classes:
            cls.message_done(message)

    def _defer_todo(self, queue: Queue, dsn: Dsn) -> None:
        """A dead destination: move its waiting entries to retry, or defer them."""
        if self.recovery_watch is not None:
            self._watch(queue.transport.name, queue.name, _why(dsn))
            for entry in queue.todo:
                self._wait(entry.message, queue.transport.name, queue.name, None)
        retry = self._error_queue(RETRY, dsn)
        for entry in list(queue.todo):
            if retry is not None:
                self._entry_move_todo(retry, entry)
                continue
            entry.message.deferred = True
            for rcpt in entry.recipients:
                self.out.deferrals.append(DeferRecipient(entry.message, rcpt, dsn))
            self._entry_done(entry, busy=False)

    def _entry_move_todo(self, dst: Queue, entry: Entry) -> None:
        """Hand a todo entry's recipients to another queue (the retry transport)."""
        message = entry.message
        dst_policy = dst.transport.policy
        new = dst_policy.new_entry(message, dst)
        new.recipients, entry.recipients = entry.recipients, []
        src = entry.queue.transport
        if not src.broken:
            src.policy.moved(entry, -len(new.recipients))
        dst_policy.moved(new, len(new.recipients))
        self._entry_done(entry, busy=False)

    def throttle_transport(self, name: str, dsn: Dsn, now: float) -> Decisions:
        """The transport's agent is unreachable: dead for transport_retry_time."""
        self._throttle_transport(name, dsn, now)
        return self.out.take()

    def _throttle_transport(self, name: str, dsn: Dsn, now: float) -> None:
        self.now = now
        t = self.transport(name)
        if not t.throttled:
            t.times_died += 1
            t.dsn = dsn
            t.revive_at = now + self.transport_retry_time
            self.out.timers.append(t.revive_at)
        for queue in list(t.queues.values()):
            self._defer_todo(queue, dsn)

    def _transport_unthrottle(self, t: Transport) -> None:
        if t.broken:
            if any(q.busy_count for q in t.queues.values()):
                # Deliveries chosen by the broken policy are still out: wait longer.
                t.revive_at = self.now + self.transport_retry_time
                self.out.timers.append(t.revive_at)
                return
            t.broken = False
            self._attach_policy(t)
        t.dsn = None
        t.revive_at = None
        t.rate_lock = False

    def _queue_unthrottle(self, queue: Queue) -> None:
        queue.unthrottle()
        queue.transport.sync(queue)

    def tick(self, now: float) -> Decisions:
        """Time passed: revive dead transports and sites, resume rate-delayed ones."""
        self.now = now
        if self.suspensions:
            for s in self.suspensions:
                if now >= s.until:
                    self._resume(s.target)
                    self.out.ended.append(s)
        for t in list(self.transports.values()):
            if t.revive_at is not None and now >= t.revive_at:
                self._transport_unthrottle(t)
            for queue in list(t.queues.values()):
                if queue.revive_at is not None and now >= queue.revive_at:
                    self._queue_unthrottle(queue)
                    if queue.ready and queue.idle:
                        self._queue_done(queue)
                elif queue.resume_at is not None and now >= queue.resume_at:
                    queue.resume()
                    t.sync(queue)
                    if queue.ready and queue.idle:
                        self._queue_done(queue)
                    elif not t.broken:
                        t.policy.resumed(queue)
        return self.out.take()

    def enable_all(self) -> Decisions:
        """``F`` trigger: forget dead transports and destinations now."""
        for t in list(self.transports.values()):
            if t.throttled:
                self._transport_unthrottle(t)
            for queue in list(t.queues.values()):
                if queue.throttled:
                    self._queue_unthrottle(queue)
                if queue.ready and queue.idle:
                    self._queue_done(queue)
        return self.out.take()

    # -- operator controls (pyqmgr suspend, resume, retry) ---------------------------

    def _matching_queues(self, target: Target) -> list[Queue]:
        """The in-core destination queues a destination target covers."""
        dest = target.destination
        if dest is None:
            return []
        if target.transport is not None:
            t = self.transports.get(target.transport)
            transports = [t] if t is not None else []
        else:
            transports = list(self.transports.values())
        return [q for t in transports for q in t.queues.values()
                if q.name.lower() == dest or q.nexthop.lower() == dest]

    def suspend(self, s: Suspension) -> Decisions:
        """Put an operator's suspension in force; the in-core queues it now covers.

        The timer at ``s.until`` ends it (:meth:`tick`), whether or not anything is
        in core for it now: mail that comes later is held too.
        """
        self.suspensions.add(s)
        self.out.timers.append(s.until)
        self.out.affected.extend(self._apply(s.target))
        return self.out.take()

    def resume(self, target: Target) -> Decisions:
        """End the suspension of exactly ``target``; its queues deliver again at once."""
        return self.out.take(resumed=self._resume(target))

    def _resume(self, target: Target) -> Suspension | None:
        s = self.suspensions.remove(target)
        if s is not None:
            self._apply(target)
        return s

    def _apply(self, target: Target) -> list[str]:
        """Bring the queues and transport of ``target`` in line with the table."""
        names: list[str] = []
        if target.destination is None:
            assert target.transport is not None
            t = self.transports.get(target.transport)
            if t is not None:
                was = t.suspension
                t.suspension = self.suspensions.for_transport(t.name)
                names.append(t.name)
                if was is not None and t.suspension is None:
                    t.rate_lock = False
            return names
        for queue in self._matching_queues(target):
            names.append(f"{queue.transport.name}:{queue.name}")
            self._regate(queue)
        return names

    def retry(self, target: Target) -> Decisions:
        """Revive dead destinations (or a dead transport) now, as a flush does for all.

        Only the in-core state: mail the dead site sent to the deferred queue waits
        for its retry time or a flush (``postqueue -f``, ``postqueue -s``).
        """
        self.out.affected.extend(self._retry(target))
        return self.out.take()

    def _retry(self, target: Target) -> list[str]:
        revived: list[str] = []
        if target.destination is None:
            assert target.transport is not None
            t = self.transports.get(target.transport)
            if t is not None and t.throttled:
                self._transport_unthrottle(t)
                if not t.throttled:
                    revived.append(t.name)
            return revived
        for queue in self._matching_queues(target):
            if queue.throttled:
                self._queue_unthrottle(queue)
                revived.append(f"{queue.transport.name}:{queue.name}")
                if queue.ready and queue.idle:
                    self._queue_done(queue)
        return revived

    # -- deferred-mail recovery (pyqmgr.cf deferred_recovery_rate; daemon/retry.py) ---

    def watch_recovery(self) -> None:
        """Note which mail waits for which dead or throttled destination, and say when
        such a destination delivers again (:attr:`waits`, :attr:`recovered`).

        The core cannot see the deferred queue; it only knows, as it happens, that a
        recipient went to the retry transport (or the defer log) because its
        destination or transport was dead, that a delivery failed at the site, or that
        a reply was throttling, and later that the destination delivered. The daemon
        keeps the queue ids; this keeps the destinations, bounded by
        :data:`RECOVERY_WATCH_LIMIT`. Off, none of it runs.
        """
        if self.recovery_watch is None:
            self.recovery_watch = {}

    def _watch(self, transport: str, name: str, why: str) -> None:
        watch = self.recovery_watch
        assert watch is not None
        if (transport, name) not in watch and len(watch) < RECOVERY_WATCH_LIMIT:
            watch[(transport, name)] = why

    def _wait(self, message: Message, transport: str, name: str, why: str | None) -> None:
        """``message`` waits for destination (transport, name); ``why``: it is dead or
        throttled, so watch it too. A message's recipients come sorted by destination:
        only the first of a run is noted."""
        waits = self.out.waits
        last = waits[-1] if waits else None
        if last is None or last[0] is not message or last[1] != transport or last[2] != name:
            waits.append((message, transport, name))
        if why is not None:
            self._watch(transport, name, why)

    def _delivered_again(self, queue: Queue) -> None:
        """A delivery succeeded: a watched destination is back, unless a throttling
        rule still holds it down (then its mail would only wait in core for the rate)."""
        if queue.shape is not None and queue.shape.rule is not None:
            return
        watch = self.recovery_watch
        assert watch is not None
        why = watch.pop((queue.transport.name, queue.name), None)
        if why is not None:
            self.out.recovered.append((queue.transport.name, queue.name, queue.nexthop, why))

    # -- shaping: gates, rates, response rules (pyqmgr.cf; see shaping.py) -------------

    def _gate_for(self, queue: Queue) -> Suspension | Gate | None:
        """The gate a queue should have now: an operator's suspension, else shaping's."""
        if self.suspensions:
            s = self.suspensions.for_queue(queue.transport.name, queue.name, queue.nexthop)
            if s is not None:
                return s
        shape = queue.shape
        return shape.gate if shape is not None else None

    def _regate(self, queue: Queue) -> None:
        """Bring a queue's gate in line; an opened queue delivers (or goes, if idle)."""
        t = queue.transport
        was = queue.gate
        queue.gate = self._gate_for(queue)
        t.sync(queue)
        if was is not None and queue.gate is None and not t.broken:
            if queue.ready and queue.idle:
                self._queue_done(queue)
            else:
                t.policy.resumed(queue)

    def _push_gate(self, when: float, t: Transport, name: str, what: str) -> None:
        if not self.gate_heap or when < self.gate_heap[0][0]:
            self.out.gate_timers.append(when)
        heapq.heappush(self.gate_heap, (when, next(self._gate_seq), t, name, what))

    def _close(self, queue: Queue, gate: Gate) -> None:
        assert queue.shape is not None
        queue.shape.gate = gate
        self._push_gate(gate.until, queue.transport, queue.name, "gate")
        self._regate(queue)

    def _started(self, queue: Queue) -> None:
        """A delivery to a shaped destination starts: space the next by the rate."""
        t = queue.transport
        shaping, shape = t.shaping, queue.shape
        assert shaping is not None and shape is not None
        nxt = take_start(shaping, shape, self.now)
        if nxt is not None and (shape.gate is None or shape.gate.until < nxt):
            rate = shaping.rate
            setting = f"{t.name}_{shaping.rate_setting}"
            if shape.rate_factor < 1.0 and shape.rule is not None:
                setting = shape.rule.where
            every = effective_interval(shaping, shape)
            text = (f"{queue.nexthop} starts a delivery at most every {every:.3g} s"
                    + (f" ({t.name}_{shaping.rate_setting} = {rate}"
                       + (f", burst {shaping.burst})" if shaping.burst > 1 else ")")
                       if rate and shape.rate_factor >= 1.0 else
                       f" ({shape.rule.describe()})" if shape.rule is not None else ""))
            self._close(queue, Gate("rate", nxt, setting, text))

    def _throttled(self, queue: Queue, rule: Rule, hop: Dsn, now: float,
                   started: float) -> None:
        """A reply a rule calls throttling: cap, slow or gate the destination.

        One reduction per round trip, as TCP cuts once per window: replies to
        deliveries that started before the last reduction were sent at the old pace
        and say nothing about the new one, so they are counted but cut nothing (a
        burst of 421s to one burst of starts is one signal, not five).
        """
        t = queue.transport
        shape = queue.shape
        assert shape is not None and t.shaping is not None
        if not triggered(rule, shape, now) or started < shape.last_cut:
            return
        shape.last_cut = now
        # The matches that led here are spent: the next reduction needs new ones.
        shape.matches.clear()
        first = shape.rule is None
        shape.rule = rule
        shape.last_match = now
        done = []
        if rule.window is not None:
            in_flight = queue.busy_count
            cap = max(rule.window_floor, math.floor(in_flight * rule.window))
            if shape.cap:
                cap = min(cap, shape.cap)
            shape.cap = queue.cap = cap
            if queue.window > cap:
                queue.window = cap
            done.append(f"window capped at {cap} ({in_flight} in flight)")
        if rule.rate is not None:
            if first and t.shaping.rate is None:
                shape.learnt_rate = observed_rate(shape, now)
            if t.shaping.rate is not None or shape.learnt_rate > 0:
                shape.rate_factor *= rule.rate
                base = t.shaping.rate.count / t.shaping.rate.period if t.shaping.rate else (
                    shape.learnt_rate)
                per_s = base * shape.rate_factor
                if rule.rate_floor is not None:
                    per_s = max(per_s, rule.rate_floor.count / rule.rate_floor.period)
                done.append(f"rate lowered to {per_s:.3g}/s")
        if rule.suspend is not None:
            self._close(queue, Gate("backoff", now + rule.suspend, rule.where,
                                    f"{queue.nexthop} is held back {rule.suspend:g} s after "
                                    f"a throttling reply ({rule.describe()})"))
            done.append(f"held back {rule.suspend:g}s")
        shape.next_step = now + rule.quiet
        self._push_gate(shape.next_step, t, queue.name, "step")
        t.sync(queue)
        self.out.log.append(("info", f"shaping: {queue.nexthop} ({t.name}): throttling reply "
                                 f"\"{hop.status} {hop.reason}\" matched {rule.where}: "
                                 f"{', '.join(done) or 'not counted as a failure'}"))

    def _step_up(self, t: Transport, name: str, shape: Shape, now: float) -> None:
        """A quiet interval passed with no throttling reply: give back one step."""
        rule = shape.rule
        if rule is None or now < shape.next_step:
            return
        nexthop = t.queues[name].nexthop if name in t.queues else name
        if now - shape.last_match >= rule.ttl:
            shape.cap, shape.rate_factor, shape.rule = 0, 1.0, None
            shape.learnt_rate = 0.0
            what = "throttling over: cap and rate back to normal"
        else:
            if shape.cap:
                shape.cap += rule.step
                limit = t.cfg.destination_concurrency_limit
                if limit and shape.cap >= limit:
                    shape.cap = 0
            if rule.rate is not None and shape.rate_factor < 1.0:
                shape.rate_factor = min(1.0, shape.rate_factor / rule.rate)
            if not shape.cap and shape.rate_factor >= 1.0:
                shape.rule = None
                what = "throttling over: cap and rate back to normal"
            else:
                shape.next_step = now + rule.quiet
                self._push_gate(shape.next_step, t, name, "step")
                what = (f"quiet for {rule.quiet:g}s: "
                        + (f"window cap {shape.cap}" if shape.cap else "no window cap")
                        + (f", rate x{shape.rate_factor:.3g}" if shape.rate_factor < 1 else ""))
        queue = t.queues.get(name)
        if queue is not None:
            queue.cap = shape.cap
            t.sync(queue)
        self.out.log.append(("info", f"shaping: {nexthop} ({t.name}): {what}"))

    def open_gates(self, now: float) -> Decisions:
        """Time passed: open the gates and take the recovery steps that are due."""
        self.now = now
        heap = self.gate_heap
        while heap and heap[0][0] <= now:
            _, _, t, name, what = heapq.heappop(heap)
            shape = t.shapes.get(name)
            if shape is None:
                continue
            if what == "gate":
                if shape.gate is not None and shape.gate.until <= now:
                    shape.gate = None
                    queue = t.queues.get(name)
                    if queue is not None:
                        self._regate(queue)
            elif what == "step":
                self._step_up(t, name, shape, now)
            if name not in t.queues and shape.neutral(now):
                t.shapes.pop(name, None)
        if heap:
            self.out.gate_timers.append(heap[0][0])
        return self.out.take()

    # -- delivery policy delegation (pyqmgr.cf delivery_policy_service) ----------------
    #
    # The daemon asks a policy service before it sends a selected entry to its agent;
    # while it waits, the entry stays selected (busy, inside the window). These turn the
    # answer into scheduler state, synchronously and without I/O, so that the simulator
    # applies a scenario's policy function through the very same calls.

    def reselect(self, name: str, now: float) -> Decisions:
        """Another entry for an agent that already announced itself (and was counted).

        :meth:`select` takes the announcement off the transport's pending count; an
        agent whose first entry the policy service held back is not a new
        announcement, so the count is given back first.
        """
        t = self.transports.get(name)
        if t is not None:
            t.pending += 1
        return self.select(name, now)

    def hold_back(self, entry: Entry, until: float, setting: str, text: str,
                  now: float) -> Decisions:
        """The policy service said "not now": the entry waits, its destination too.

        The selected entry goes back to its queue's todo list (its request never left)
        and the queue is gated until ``until`` with a ``policy service`` gate, so no
        agent is asked for it meanwhile; the gate heap reopens it. The recipients stay
        in core: nothing is deferred to disk and nothing is logged per recipient. A
        later gate already in force (a rate's spacing, a backoff) is kept. If the
        destination or its transport died while the service was asked, the entry
        follows the others of that queue to the retry transport.
        """
        self.now = now
        queue = entry.queue
        t = queue.transport
        entry_unselect(entry)
        if not t.broken:
            t.policy.requeued(entry)
        dsn = t.dsn if t.throttled else queue.dsn if queue.throttled else None
        if dsn is not None:
            self._defer_todo(queue, dsn)
        shape = queue.shape
        if shape is None:
            # A transport without shaping gets the destination's shape on demand; it
            # is kept by name like any shape, so a gate outlives an idle queue.
            shape = t.shapes.get(queue.name)
            if shape is None:
                shape = t.shapes[queue.name] = Shape()
            queue.shape = shape
        if shape.gate is None or shape.gate.until < until:
            self._close(queue, Gate("policy service", until, setting, text))
        else:
            t.sync(queue)
        return self.out.take()

    def reject_to_error(self, entry: Entry, dsn: Dsn, now: float) -> Decisions:
        """The policy service rejected the delivery: its recipients go to error(8).

        As stock routes an undeliverable recipient (``error`` transport, the DSN as
        nexthop), so the error agent bounces them with the reply's status and text and
        the usual ``status=bounced`` lines. False when the error transport is dead too:
        the entry is then still selected and the caller holds it back instead.
        """
        self.now = now
        err = self._error_queue(ERROR, dsn)
        if err is None:
            return self.out.take()
        entry_unselect(entry)
        self._entry_move_todo(err, entry)
        return self.out.take(rejected=True)

    def drop_message(self, entry: Entry, now: float) -> Decisions:
        """The message goes on hold: drop its waiting entries, none of them deferred.

        ``entry`` is the selected one the service answered about; every other entry
        of the message still waiting in core goes too, and no more recipients are
        read from its file. Deliveries already under way finish as usual; when the
        last one is back the message is finished (:attr:`finished`) and the daemon
        moves the file to hold/ instead of deferring or removing it. Entries are found
        through nqmgr's job peers where the transport runs nqmgr, else by a walk over
        the transport's todo lists.
        """
        self.now = now
        message = entry.message
        message.more = False
        entry_unselect(entry)
        waiting: list[Entry] = []
        for t in list(self.transports.values()):
            if t.broken:
                waiting += [e for q in t.queues.values() for e in q.todo
                            if e.message is message]
            else:
                waiting += t.policy.todo_entries(message)
        for e in waiting:
            self._entry_done(e, busy=False)
        return self.out.take()
