"""The running queue manager: asyncio glue between Postfix and the scheduler core.

Stock qmgr's main loop (``qmgr.c:qmgr_loop``) feeds messages between servicing agent
connections; here the feeder (:mod:`.feeder`) is one task, agent connections and
message completions are tasks of their own, and this class routes what the feeder
read, hands agents their entries and carries out the core's decisions.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Coroutine
from functools import partial
from typing import Any

from pyqmgr.daemon.active import (
    FLUSH_EACH,
    FLUSH_ONCE,
    MAX_BATCH,
    ActiveMessage,
    ActiveQueue,
    ReadFailure,
    read_more,
)
from pyqmgr.daemon.applier import Applier
from pyqmgr.daemon.class_lookups import ClassLookups, proxied
from pyqmgr.daemon.classes import envelope, place, read_headers
from pyqmgr.daemon.delegation import Delegation
from pyqmgr.daemon.delivery import PENDING, AgentCall, Pending, expire_calls
from pyqmgr.daemon.feeder import Feeder, scan_requests
from pyqmgr.daemon.fleet import Fleet
from pyqmgr.daemon.host import Fatal
from pyqmgr.daemon.metrics import DeliveryStats
from pyqmgr.daemon.request import delivery_request
from pyqmgr.daemon.retry import RetryControl
from pyqmgr.daemon.setup import DaemonSetup
from pyqmgr.daemon.sites import SiteResolver
from pyqmgr.daemon.sources import sources_for
from pyqmgr.daemon.suspensions import Suspensions
from pyqmgr.events.daemon import delivery_events
from pyqmgr.postfix.config import QmgrConfig
from pyqmgr.postfix.deliver_request import DeliveryReply
from pyqmgr.postfix.maillog_client import MailLog
from pyqmgr.postfix.master import FlowControl
from pyqmgr.postfix.resolve import ResolveClient
from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.decisions import Decisions
from pyqmgr.scheduler.entry import Entry
from pyqmgr.scheduler.message import Message
from pyqmgr.scheduler.queue import Dsn


class Qmgr:
    def __init__(self, cfg: QmgrConfig, log: MailLog, flow: FlowControl | None,
                 setup: DaemonSetup) -> None:
        self.cfg = cfg
        self.log = log
        self.flow = flow
        pol = setup.policies
        # With no pyqmgr.cf the table is nqmgr everywhere, the fudge factor stock's 100
        # and shaping None: stock scheduling (the process limits only inform explain).
        self.scheduler = Scheduler.from_settings(
            cfg, refill=self._refill, policies=pol.table,
            process_limit_for=pol.process_limit, fudge_factor=pol.fudge_factor,
            shaping_for=pol.shaping.shaping_for if pol.shaping is not None else None,
            sites=setup.sites.settings.table() if setup.sites is not None else None,
            tenant_limits=setup.tenant_limits)
        self.resolver = ResolveClient(
            f"private/{cfg.rewrite_service_name}", ipc_timeout=cfg.qmgr_ipc_timeout,
            ipc_idle=cfg.ipc_idle, ipc_ttl=cfg.ipc_ttl, give_up_after=cfg.qmgr_ipc_timeout,
            warn=log.warning)
        self.active = ActiveQueue(self)
        #: Message classes and tenants (message_classes, tenant_key); None: stock.
        self.classifier = setup.classes
        if setup.classes is not None:
            self.scheduler.class_names = list(setup.classes.classes)
        self.scheduler.suspensions.wall_offset = time.time() - time.monotonic()
        #: The scans and the active queue's room (stock's qmgr_loop half).
        self.feeder = Feeder(self, flow, setup.classes)
        self.tasks: set[asyncio.Task[None]] = set()
        self.calls: set[AgentCall] = set()
        self.loop = asyncio.get_running_loop()
        #: proxy: class tables are asked in a worker thread, not on this loop (#45).
        self.class_lookups = (ClassLookups(setup.classes, log.warning, self.loop)
                              if setup.classes is not None and proxied(setup.classes)
                              else None)
        #: Operator controls (suspend, resume, retry) and their state file.
        self.suspensions = Suspensions(
            self, setup.state, pol.process_limits,
            tenants=setup.classes is not None and setup.classes.tenant_key != "none")
        self.applier = Applier(self)
        #: Delivery counts for the metrics exporter; None (not counted) unless
        #: pyqmgr.cf sets metrics_listen.
        self.metrics: DeliveryStats | None = (
            DeliveryStats(transports=setup.metrics.transports, class_names=tuple(
                setup.classes.classes if setup.classes is not None else ()))
            if setup.metrics is not None else None)
        #: Retry jitter and recovery of deferred mail; None (stock) unless pyqmgr.cf.
        #: Its core half is switched on in start().
        self.retry: RetryControl | None = (
            RetryControl(self, pol.retry) if pol.retry is not None else None)
        #: Delivery policy delegation (pyqmgr.cf delivery_policy_service); None: off.
        self.delegation: Delegation | None = (
            Delegation(self, setup.delegation) if setup.delegation is not None else None)
        #: Provider sites' MX lookups (pyqmgr.cf site_grouping); None: off.
        self.sites: SiteResolver | None = (
            SiteResolver(self, setup.sites.settings, setup.sites.lookup)
            if setup.sites is not None else None)
        #: The fleet's shared limits (pyqmgr.cf shared_state); None: off.
        self.fleet: Fleet | None = Fleet(self, setup.fleet) if setup.fleet is not None else None
        #: The resident size for status, and memory_warning_limit's warning (#30).
        self.memory = setup.memory
        self.events = delivery_events(setup.events, cfg, log, self.loop, self.scheduler)  # #46
        #: Source pools and warm-up (pyqmgr.cf source_pools, #46); None: off.
        self.sources = self.active.sources = sources_for(self, setup.sources, setup.state,
                                                         setup.classes)

    # -- life cycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Stock's post-init: recover active/, start both scans and the deferred timer."""
        self.active.recover()
        for part in (self.retry, self.fleet):
            if part is not None:
                part.start()
        self.feeder.start()
        self.spawn(self.feeder.run())
        self.spawn(self.feeder.deferred_timer())
        self.spawn(self._ticker())

    def close(self) -> None:
        """On the way out: let trivial-rewrite see the connection end."""
        self.resolver.close()
        if self.class_lookups is not None:
            self.class_lookups.close()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        """A task that ends in an exception ends the daemon, as msg_fatal ends stock's:
        a daemon that ran on without its feeder (issue #31: an EMFILE killed it once)
        would take no more mail until someone restarted it; master restarts this one
        at once, and start-up recovery puts back what was in flight."""
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            self.log.fatal(str(exc) if isinstance(exc, Fatal) else
                           f"internal error: {type(exc).__name__}: {exc}")
            os._exit(1)

    def trigger(self, data: bytes) -> None:
        """A trigger arrived on ``public/qmgr``: OR all request bytes, act once."""
        incoming, deferred = scan_requests(data)
        if (incoming | deferred) & FLUSH_ONCE:
            self.apply(self.scheduler.enable_all())
        self.feeder.request(incoming, deferred)
        self.dispatch()

    async def _ticker(self) -> None:
        """Revive dead transports and destinations when their timers expire."""
        while True:
            await asyncio.sleep(1.0)
            self.apply(self.scheduler.tick(time.monotonic()))
            self.resolver.expire_idle()
            expire_calls(self.calls, self.log)
            self.dispatch()

    # -- feeding ------------------------------------------------------------------------

    def may_feed(self) -> bool:
        """Is there room in the active queue for one more message? (Retry recovery.)"""
        return self.feeder.may_feed()

    def feed_deferred(self, qid: str) -> bool:
        """One deferred file into the active queue now (:meth:`Feeder.feed_deferred`)."""
        return self.feeder.feed_deferred(qid)

    @property
    def message_count(self) -> int:
        """Messages in the active queue (stock's qmgr_message_count).

        Counted once, in the core, which reads it for clog warnings and status; this
        daemon changes it only as a message is loaded (:meth:`load`) and as it leaves
        (:meth:`message_left`), and the feeder, the metrics and the controls read it.
        """
        return self.scheduler.message_count

    def load(self, am: ActiveMessage) -> None:
        """A message the feeder read: route its first batch and hand it to the core."""
        self.scheduler.message_count += 1
        if (classes := self.classifier) is not None:
            heads = (read_headers(classes, am.qf, am.path, warn=self.log.warning)
                     if classes.header_names else None)
            if self.class_lookups is not None:
                self.class_lookups.submit(envelope(am.qf, heads),
                                          partial(self._classified, am))
                return
            place(classes, am.sched, *classes.classify(envelope(am.qf, heads)))
        self._route_first(am)

    def _classified(self, am: ActiveMessage, rank: int, tenant: str, weight: int) -> None:
        """A message's class and tenant, from the worker (:meth:`load`, proxy: tables)."""
        assert self.classifier is not None  # the worker is made only beside one
        place(self.classifier, am.sched, rank, tenant, weight)
        self._route_first(am)

    def _route_first(self, am: ActiveMessage) -> None:
        recipients = am.take_pending()
        routes = self.active.route(am, recipients) if self.active.prepare(am) else []
        self._assign(am, routes)

    def _assign(self, am: ActiveMessage, routes: list[Route] | None) -> None:
        if routes is None:
            # trivial-rewrite is unreachable: defer the whole message, lose nothing.
            self.log.warning(f"{am.queue_id}: address resolver failure -- deferring message")
            self.active.abandon(am)
            return
        self.apply(self.scheduler.assign(am.sched, routes,
                                         flush_each=bool(am.scan_flags & FLUSH_EACH),
                                         now=time.monotonic()))
        if am.sched.refcount == 0:
            self.message_done(am)
        self.dispatch()

    def _read_more(self, am: ActiveMessage, limit: int) -> list[Route] | None:
        """Read and route up to ``limit`` more recipients; None when that failed.

        A failure is remembered: the message then waits for its in-core deliveries
        to end, and completion retries the read once more (corrupt file, or the
        resolver's deferral), as stock's qmgr_active_done does.
        """
        try:
            batch = read_more(am, min(limit, MAX_BATCH), self.cfg.verp_delimiter_filter,
                              count_check=not self.scheduler.bounded_reading)
        except OSError as exc:
            self.log.warning(f"{am.queue_id}: open {am.path}: {exc.strerror}")
            am.read_failed = "open"
            return None
        for text in batch.warnings:
            self.log.warning(text)
        if not batch.ok:
            am.read_failed = "corrupt"
            return None
        am.sched.more = am.qf.rcpt_offset > 0
        am.sched.rcpt_unread = am.qf.rcpt_unread
        routes = self.active.route(am, batch.recipients)
        if routes is None:
            am.read_failed = "resolve"
        return routes

    def _refill(self, message: Message, limit: int) -> list[Route] | None:
        """The core wants more recipients of a message while choosing (realloc)."""
        am: ActiveMessage = message.owner
        if am is None or am.read_failed is not None:
            return None
        return self._read_more(am, limit)

    def next_batch(self, am: ActiveMessage) -> None:
        """All in-core recipients are done and the file has more: read the next batch."""
        if self._read_failed(am):
            return
        limit = self.scheduler.read_limit(am.sched)
        routes = self._read_more(am, max(limit, 1))
        if self._read_failed(am):
            return
        self._assign(am, routes)

    def _read_failed(self, am: ActiveMessage) -> bool:
        """Whether the last read found the file unreadable or corrupt: the message then
        ends here, to corrupt/. The read's mark is cleared either way (a resolver
        failure's routes are None, which :meth:`_assign` defers)."""
        failed: ReadFailure | None = am.read_failed
        am.read_failed = None
        if failed != "corrupt" and failed != "open":
            return False
        self.active.messages.pop(am.queue_id, None)
        self.message_left(am)
        self.active.corrupt(am.queue_id)
        return True

    def deferred(self, am: ActiveMessage, when: float) -> None:
        """``am`` went to deferred/, due at ``when``: recovery remembers what it waits
        for, and a higher class's mail is fed when due (:mod:`.class_retry`)."""
        if self.retry is not None:
            self.retry.deferred(am)
        if (classes := self.feeder.classes) is not None and am.sched.rank < classes.lowest:
            classes.retries.deferred(am.queue_id, when, am.sched.rank)

    def message_left(self, am: ActiveMessage) -> None:
        """A message left the active queue: one fewer counted (and of its tenant, for
        unlisted_tenant_limit), room for the feeder."""
        self.scheduler.message_count -= 1
        self.events.message_left(am)
        if self.classifier is not None:
            self.classifier.left(am.sched.tenant)
        self.feeder.wakeup.set()

    def message_done(self, am: ActiveMessage) -> None:
        if am.hold is not None:
            # A delivery policy service said HOLD: to hold/, nothing else done.
            self.active.hold(am)
            return
        if not self.active.try_quick_finish(am):
            self.spawn(self._finish(am))

    async def _finish(self, am: ActiveMessage) -> None:
        await self.active.finish(am)
        self.feeder.wakeup.set()

    # -- delivery -----------------------------------------------------------------------

    def dispatch(self) -> None:
        """Connect agents for every transport the scheduler says deserves one.

        Called after every event that may free or create work; the scheduler keeps at
        most two connections pending per transport, as stock does.
        """
        sched = self.scheduler
        while (name := sched.allocate()) is not None:
            call = AgentCall(self.loop, f"private/{name}", self.cfg.daemon_timeout,
                             self._agent_ready, self._agent_reply, self._agent_unavailable,
                             self._agent_send_failed, rate_delay=sched.select_delay(name))
            call.entry = name
            self.calls.add(call)
            call.start()

    def _agent_ready(self, call: AgentCall) -> bytes | Pending | None:
        """An agent announced itself: hand it the entry the scheduler picks."""
        name = call.entry
        assert isinstance(name, str)
        now = time.monotonic()
        entry = self.apply(self.scheduler.select(name, now))
        if entry is None:
            self.calls.discard(call)
            return None
        call.entry = entry
        call.selected = now
        self.dispatch()
        if self.fleet is None and self.delegation is None:
            return delivery_request(self.cfg, entry, self.events.flags(entry))
        return self._admission(call, entry, name)

    def _admission(self, call: AgentCall, entry: Entry, name: str) -> bytes | Pending:
        """Ask whoever must agree before a delivery starts: the fleet's shared limits,
        then the delivery policy service; PENDING while one of them is asked."""
        fleet = self.fleet
        if fleet is not None and (unit := fleet.units.unit(entry)) is not None and (
                not fleet.admit(call, entry, unit)):
            return PENDING
        return self._delegate(call, entry, name)

    def _delegate(self, call: AgentCall, entry: Entry, name: str) -> bytes | Pending:
        delegation = self.delegation
        if delegation is not None and (svc := delegation.service(name)) is not None:
            delegation.ask(call, entry, svc)
            return PENDING
        return delivery_request(self.cfg, entry, self.events.flags(entry))

    def fleet_admitted(self, call: AgentCall, entry: Entry) -> None:
        """The fleet let the entry go: on to the policy service, or to the agent."""
        request = self._delegate(call, entry, entry.queue.transport.name)
        if not isinstance(request, Pending):
            call.resume(request)

    def agent_deliver(self, call: AgentCall, entry: Entry) -> None:
        """The policy service let the entry go: send its request as :meth:`_agent_ready`
        would have."""
        call.resume(delivery_request(self.cfg, entry, self.events.flags(entry)))

    def agent_next(self, call: AgentCall, name: str) -> None:
        """The fleet or the policy service held the agent's entry back: give the agent
        another (a fleet session it took for the entry goes back)."""
        if self.fleet is not None:
            self.fleet.released(call)
        now = time.monotonic()
        entry = self.apply(self.scheduler.reselect(name, now))
        if entry is None:
            self.calls.discard(call)
            call.resume(None)
            self.dispatch()
            return
        call.entry = entry
        call.selected = now
        self.dispatch()
        request = self._admission(call, entry, name)
        if not isinstance(request, Pending):
            call.resume(request)

    def _agent_unavailable(self, call: AgentCall, why: str) -> None:
        """Connect or handshake failed: the transport is dead for transport_retry_time."""
        self.calls.discard(call)
        name = call.entry
        assert isinstance(name, str)
        self.log.warning(f"connect to transport {call.path}: {why}")
        self.apply(self.scheduler.allocation_failed(
            name, Dsn("4.3.0", "mail transport unavailable"), time.monotonic()))
        self.dispatch()

    def _agent_send_failed(self, call: AgentCall, why: str) -> None:
        """The request could not be written: the entry goes back, the transport waits."""
        self.calls.discard(call)
        if self.fleet is not None:
            self.fleet.released(call)
        entry = call.entry
        assert isinstance(entry, Entry)
        self.log.warning(f"write to process ({entry.transport}): {why}")
        self.apply(self.scheduler.send_failed(entry, Dsn("4.3.0", "mail transport unavailable"),
                                              time.monotonic()))
        self.dispatch()

    def _agent_reply(self, call: AgentCall, reply: DeliveryReply | None,
                     why: str | None) -> None:
        self.calls.discard(call)
        if self.fleet is not None:
            self.fleet.released(call)
        entry = call.entry
        assert isinstance(entry, Entry)
        now = time.monotonic()
        if self.metrics is not None:
            self.metrics.delivery_done(entry, None if reply is None else reply.status,
                                       now - call.selected)
        if reply is None:
            # 3.7.11: a crashed or silent agent defers the message, nothing more.
            if why == "timeout":
                self.log.warning(f"{entry.message.queue_id}: timeout receiving delivery "
                                 f"status from transport: {entry.transport}")
            else:
                self.log.warning(f"{call.path} socket: malformed response")
            decisions = self.scheduler.done(entry, -1, None, True, now)
        else:
            hop = reply.hop
            dsn = Dsn(hop.status, hop.reason) if hop.status else None
            decisions = self.scheduler.done(entry, reply.status, dsn, False, now)
        self.events.after_reply(entry.message.owner, entry)
        self.apply(decisions)
        self.dispatch()

    def in_flight(self) -> list[Entry]:
        """Entries out with delivery agents now (the core keeps no list of them)."""
        return [call.entry for call in self.calls if isinstance(call.entry, Entry)]

    def after_control(self, decisions: Decisions) -> None:
        """An operator control changed the scheduler: act on it now."""
        self.apply(decisions)
        self.dispatch()

    def apply(self, d: Decisions) -> Entry | None:
        """Carry out one event's decisions (:class:`~pyqmgr.daemon.applier.Applier`)."""
        return self.applier.apply(d)
