"""The scheduler core: events in, decisions out, no I/O.

Events are method calls: a message's recipients were read and routed
(:meth:`Scheduler.assign`), an agent of a transport announced itself (:meth:`select`),
a delivery finished (:meth:`done`), an agent could not be reached
(:meth:`allocation_failed`), time passed (:meth:`tick`, :meth:`open_gates`), the admin
asked for a flush (:meth:`enable_all`), an operator or a policy service acted. Each
event returns one :class:`~.decisions.Decisions` value: the entry to deliver, log
lines, recipients to defer, finished messages, timers to arm. Which transport
deserves one more agent is a query (:meth:`allocate`). Reading more recipients of a
message is the one request the core makes synchronously, through the port the driver
gives it (``refill``, :data:`~.state.Refill`), because stock's selection reads them in
the middle of choosing and uses them at once.

The :class:`Scheduler` holds the state stock keeps in ``qmgr.h``'s globals and routes
each event to the verbs, which live beside what they change, as in stock's
``src/qmgr/``:

========================  ================================================================
:mod:`.structures`        entries, queues, transports, the policy Backend (``qmgr.h``)
:mod:`.message`           a message's scheduling state and its recipients
:mod:`.entry`             select, unselect, finish and move entries (``qmgr_entry.c``)
:mod:`.queue`             destination queues into and out of core (``qmgr_queue.c``)
:mod:`.reading`           how many recipients to read, filing them (``qmgr_message.c``)
:mod:`.defer`             dead destinations and transports (``qmgr_defer.c``)
:mod:`.gates`             suspensions' and shaping's gates, rates, response rules
:mod:`.controls`          operators' suspend, resume and retry
:mod:`.recovery`          which deferred mail waits for which destination
:mod:`.delegation`        a delivery policy service's answers
:mod:`.decisions`         one event's decisions as one value
:mod:`.state`             the core's state as the verb modules see it
:mod:`.policy`            the policy seam; :mod:`.nqmgr` (stock), :mod:`.oqmgr`,
                          :mod:`.finch`, :mod:`.zmailer` implement it
========================  ================================================================

Which entry an agent delivers, and the bookkeeping that decision needs, is each
transport's policy: stock's nqmgr unless the scheduler's
:class:`~.policy.PolicyTable` says otherwise. The core names no policy.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Protocol

from pyqmgr.scheduler import (
    controls,
    defer,
    delegation,
    deliver,
    enable,
    gates,
    reading,
    site,
    tenant_hold,
    throttling,
)
from pyqmgr.scheduler.decisions import Decisions, Outbox, Throttling
from pyqmgr.scheduler.defer import POLICY_DSN
from pyqmgr.scheduler.deliver import dsn_valid
from pyqmgr.scheduler.entry import Entry, entry_unselect
from pyqmgr.scheduler.feedback import parse_or_warn, rounding_rules
from pyqmgr.scheduler.message import Message, Route
from pyqmgr.scheduler.policy import PolicyClass, PolicyTable
from pyqmgr.scheduler.qlist import QList
from pyqmgr.scheduler.queue import queue_done
from pyqmgr.scheduler.reading import MAX_READ
from pyqmgr.scheduler.recovery import RECOVERY_WATCH_LIMIT
from pyqmgr.scheduler.shaping import Shaping
from pyqmgr.scheduler.state import Refill
from pyqmgr.scheduler.structures import (
    ERROR,
    RETRY,
    Backend,
    Dsn,
    Queue,
    SiteTable,
    Transport,
    TransportParams,
)
from pyqmgr.scheduler.suspension import Suspension, SuspensionTable, Target
from pyqmgr.scheduler.tenant_cap import TenantLimitTable
from pyqmgr.scheduler.tenant_scope import tenant_caps
from pyqmgr.scheduler.transport import transport_select

__all__ = ["ERROR", "MAX_READ", "POLICY_DSN", "RECOVERY_WATCH_LIMIT", "RETRY",
           "Refill", "Route", "Scheduler", "Settings", "dsn_valid"]



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


class Scheduler:
    def __init__(
        self,
        params_for: Callable[[str], FullTransportParams],
        *,
        min_backoff_time: float = 300.0,
        transport_retry_time: float = 60.0,
        initial_concurrency: int = 5, feedback_debug: bool = False,
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
        sites: SiteTable | None = None, tenant_limits: TenantLimitTable | None = None,
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
        #: A policy without job slots is in use: jobless messages read by oqmgr's limits.
        self.slotless = False
        #: oqmgr's reading (the default policy is oqmgr): bounded in-core recipients.
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
        #: "stock" (the daemon) or "pseudocode" (the seed's rules): feedback.ROUNDINGS.
        rounding_rules(feedback_rounding)  # refuse an unknown rule now, not at first use
        self.feedback_rounding = feedback_rounding
        #: Messages in the active queue, counted here only (by Qmgr.load, message_left).
        self.message_count = 0
        #: Recipients in core, all messages (stock's qmgr_recipient_count).
        self.rcpt_count = 0
        self.class_names: list[str] = []  #: message classes by rank, for explain
        #: Destination queues in core (stock's qmgr_queue_count).
        self.queue_count = 0
        #: The scheduler clock as of the latest event that carried a time.
        self.now = 0.0
        self.transports: dict[str, Transport] = {}
        #: Transports in round-robin order for agent allocation (new ones go first).
        self.transport_list: QList[Transport] = QList()
        #: The decisions of the event under way (:mod:`.decisions`), taken at its end.
        self.out = Outbox()
        #: Operators' suspensions in force (:mod:`.suspension`).
        self.suspensions = SuspensionTable()
        #: Shaping deadlines: (when, seq, transport, queue name, what), see gates.py.
        self.gate_heap: list[tuple[float, int, Transport, str, str]] = []
        self.gate_seq = itertools.count()
        #: Deferred-mail recovery (``deferred_recovery_rate``; None: off): destinations
        #: that were dead or throttled and have not delivered since, with why.
        self.recovery_watch: dict[tuple[str, str], str] | None = None
        #: A fleet (issue #23) shares them: report dead or throttled ones (``throttled``).
        self.share_throttling = False
        self.fleet_heard: dict[tuple[str, str], tuple[Throttling, str, float]] = {}
        #: Provider sites (pyqmgr.cf ``site_grouping``, :mod:`.site`); None: off.
        self.sites = sites
        self.tenant_limits = tenant_limits  #: per transport (:mod:`.tenant_cap`); None: none

    @classmethod
    def from_settings(cls, cfg: Settings, refill: Refill | None = None,
                      feedback_rounding: str = "stock", policies: PolicyTable | None = None,
                      process_limit_for: Callable[[str], int] | None = None,
                      fudge_factor: int = 100,
                      shaping_for: Callable[[str], Shaping | None] | None = None,
                      sites: SiteTable | None = None,
                      tenant_limits: TenantLimitTable | None = None) -> Scheduler:
        """The scheduler as main.cf configures it: the daemon's and the simulator's."""
        return cls(
            cfg.transport, min_backoff_time=cfg.minimal_backoff_time,
            transport_retry_time=cfg.transport_retry_time,
            initial_concurrency=cfg.initial_destination_concurrency,
            feedback_debug=cfg.destination_concurrency_feedback_debug,
            active_limit=cfg.qmgr_message_active_limit,
            clog_warn_time=cfg.qmgr_clog_warn_time, helpful_warnings=cfg.helpful_warnings,
            rcpt_limit=cfg.qmgr_message_recipient_limit,
            msg_rcpt_limit=cfg.qmgr_message_recipient_minimum, refill=refill,
            feedback_rounding=feedback_rounding, policies=policies,
            process_limit_for=process_limit_for, fudge_factor=fudge_factor,
            shaping_for=shaping_for, sites=sites, tenant_limits=tenant_limits)

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
            t = Transport(name, cfg, pos, neg, self.info, feedback_debug=debug,
                          rounding=self.feedback_rounding)
            for warn in (pos_warn, neg_warn):
                if warn:
                    self.out.log.append(("warning", warn))
            if debug:
                for fb, fb_name in ((pos, cfg.positive_feedback_name),
                                    (neg, cfg.negative_feedback_name)):
                    self.info(
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
            tenant_caps(t, self.tenant_limits)  # issue #34
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
        """A policy's own pyqmgr.cf parameter (``<transport>_<name>``, then ``<name>``)."""
        found = self.policies.setting
        return default if found is None else found(name, transport, default)

    def process_limit(self, transport: str) -> int:
        """master.cf's maxproc for the transport (0: no limit); 100 when unknown."""
        if self.process_limit_for is None:
            return 100
        return self.process_limit_for(transport)

    def policy(self, name: str) -> Backend:
        """The policy of transport ``name`` (created with the transport if need be)."""
        return self.transport(name).policy

    def info(self, text: str) -> None:
        self.out.log.append(("info", text))

    # -- messages -------------------------------------------------------------------

    # -- events -------------------------------------------------------------------

    # -- what the driver and the policies ask (reading.py has the rules) -------------

    def read_limit(self, message: Message) -> int:
        """How many recipients to read into core for this message now."""
        return reading.read_limit(self, message)

    @property
    def fudge_limit(self) -> int:
        """oqmgr's batch size: FUDGE(qmgr_message_recipient_limit)."""
        return reading.fudge_limit(self)

    def may_feed(self) -> bool:
        """May the driver open another queue file? (oqmgr: not at the recipient limit.)"""
        return reading.may_feed(self)

    def first_read_limit(self) -> int:
        """:meth:`read_limit` for a message not created yet (the driver reads first)."""
        return reading.first_read_limit(self)

    def realloc(self, message: Message) -> None:
        """Read the message's next recipient batch now (``qmgr_message_realloc``)."""
        reading.realloc(self, message)

    def queue_done(self, queue: Queue) -> None:
        """Discard an idle, live in-core queue (for the verbs that cannot import it)."""
        queue_done(self, queue)

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
        reading.assign(self, message, routes, flush_each)
        return self.out.take()

    def policy_failed(self, t: Transport, where: str, exc: Exception) -> None:
        """A policy raised: the transport is dead, its mail deferred, never lost."""
        defer.defer_broken_policy(self, t, where, exc)

    def allocate(self) -> str | None:
        """A transport that deserves one more agent connection, counted as pending."""
        return transport_select(self)

    def has_work(self, name: str) -> bool:
        """Would an agent of this transport get an entry now? (Worth connecting one.)"""
        return (t := self.transports.get(name)) is not None and t.wants_agent()

    def select_delay(self, name: str) -> float:
        """transport_rate_delay: how long an announced agent waits before :meth:`select`."""
        t = self.transports.get(name)
        return float(t.cfg.transport_rate_delay) if t is not None else 0.0

    def select(self, name: str, now: float | None = None) -> Decisions:
        """An agent of transport ``name`` announced itself: the entry it delivers."""
        if now is not None:
            self.now = now
        return self.out.take(deliver.deliver_select(self, name))

    def allocation_failed(self, name: str, dsn: Dsn, now: float) -> Decisions:
        """The agent could not be reached: the transport is dead for a while."""
        t = self.transport(name)
        if t.pending > 0:
            t.pending -= 1
        defer.defer_transport(self, name, dsn, now)
        return self.out.take()

    def send_failed(self, entry: Entry, dsn: Dsn, now: float) -> Decisions:
        """The request could not be written to the agent (``qmgr_deliver``).

        The entry never reached the agent: it goes back to todo, and the transport is
        treated as unavailable, so that entry and every other waiting one are deferred
        (moved to the retry transport) and no agent is asked for until
        ``transport_retry_time`` has passed.
        """
        entry_unselect(self, entry)
        defer.defer_transport(self, entry.queue.transport.name, dsn, now)
        return self.out.take()

    def done(self, entry: Entry, status: int, hop: Dsn | None, crashed: bool,
             now: float) -> Decisions:
        """A delivery finished (``qmgr_deliver_update``); see :func:`.deliver.deliver_update`."""
        deliver.deliver_update(self, entry, status, hop, crashed, now)
        return self.out.take()

    def throttle_transport(self, name: str, dsn: Dsn, now: float) -> Decisions:
        """The transport's agent is unreachable: dead for transport_retry_time."""
        defer.defer_transport(self, name, dsn, now)
        return self.out.take()

    def transport_unthrottle(self, t: Transport) -> None:
        """A dead transport lives again (and a broken policy is replaced by a fresh one)."""
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

    def tick(self, now: float) -> Decisions:
        """Time passed: revive dead transports and sites, resume rate-delayed ones."""
        enable.enable_due(self, now)
        return self.out.take()

    def enable_all(self) -> Decisions:
        """``F`` trigger: forget dead transports and destinations now."""
        enable.enable_all(self)
        return self.out.take()

    # -- operator controls (pyqmgr suspend, resume, retry) ---------------------------

    def suspend(self, s: Suspension) -> Decisions:
        """Put an operator's suspension in force (``affected``: the in-core queues it
        now covers); the timer at ``s.until`` ends it in :meth:`tick`."""
        controls.suspend(self, s)
        return self.out.take()

    def resume(self, target: Target) -> Decisions:
        """End the suspension of exactly ``target``; its queues deliver again at once."""
        return self.out.take_control(resumed=controls.resume(self, target))

    def retry(self, target: Target) -> Decisions:
        """Revive dead destinations (or a dead transport) now, as a flush does for all.

        Only the in-core state: mail the dead site sent to the deferred queue waits
        for its retry time or a flush (``postqueue -f``, ``postqueue -s``).
        """
        self.out.affected.extend(controls.retry(self, target))
        return self.out.take()

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

    # -- shaping: gates, rates, response rules (pyqmgr.cf; see shaping.py) -------------

    def open_gates(self, now: float) -> Decisions:
        """Time passed: open the gates and take the recovery steps that are due."""
        gates.open_gates(self, now)
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
                  now: float, kind: str = delegation.POLICY_GATE) -> Decisions:
        """A policy service or the fleet said "not now": the entry and its
        destination wait (``kind`` names the gate in explain)."""
        delegation.hold_back(self, entry, until, setting, text, now, kind)
        return self.out.take()

    def lift_hold(self, transport: str, queue_name: str, kind: str, now: float) -> Decisions:
        """A hold of ``kind`` ends early (the fleet freed a session here)."""
        delegation.lift_hold(self, transport, queue_name, kind, now)
        return self.out.take()

    # -- provider sites (pyqmgr.cf site_grouping; see site.py) -------------------------

    def site_lookup_waits(self, domains: tuple[str, ...], until: float,
                          now: float) -> Decisions:
        """These domains' first queues wait for their lookups until ``until``: the
        driver's line of lookups is no part of ``site_dns_wait`` (site.py)."""
        self.now = now
        site.site_lookup_waits(self, domains, until)
        return self.out.take()

    def site_learnt(self, domain: str, name: str, until: float, now: float) -> Decisions:
        """A lookup the core asked for (``Decisions.resolve``) found the domain's site,
        valid until ``until``: its queues count there from now on."""
        self.now = now
        tenant_hold.site_learnt(self, domain, name, until)  # moves tenants' entries
        return self.out.take()

    # -- a fleet's shared throttling (pyqmgr.cf shared_state; see throttling.py) -------

    def learnt(self, news: Throttling, who: str, now: float) -> Decisions:
        """Another server of the fleet found a destination dead or throttled: so it is
        here (what the news says, and who said it, in the decisions' log)."""
        throttling.learnt(self, news, who, now)
        return self.out.take()

    def reject_to_error(self, entry: Entry, dsn: Dsn, now: float) -> Decisions:
        """The policy service rejected the delivery: its recipients go to error(8)."""
        return self.out.take_control(rejected=delegation.reject_to_error(self, entry, dsn, now))

    def drop_message(self, entry: Entry, now: float) -> Decisions:
        """The message goes on hold: its waiting entries go, none deferred."""
        delegation.drop_message(self, entry, now)
        return self.out.take()
