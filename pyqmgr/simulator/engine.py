"""The simulation: the scheduler core driven from a virtual clock.

Everything that decides is the core (:class:`~pyqmgr.scheduler.core.Scheduler`): which
transport gets an agent, which entry that agent delivers, how windows grow and shrink,
when a destination is dead, how many recipients of a message are read. The engine only
plays the world around it, in event order on a heap keyed by (time, sequence), so a
scenario and a seed give one result:

* arrivals feed the active queue, at most ``qmgr_message_active_limit`` messages;
* each transport has ``process_limit`` delivery processes; an agent connection the core
  asks for waits for a free process, then the core selects its entry;
* a destination answers each delivery after its latency per recipient; above its
  server limit it answers 421 at once, or lets the attempt hang for a timeout
  (congestion); a dead destination refuses at once. Failures are hop-level, so they
  feed back into the window exactly as an smtp agent's reply does;
* deferred recipients are counted; unless the scenario models the deferred queue
  (``[deferred] retry = true``), that is all: the run is the first delivery pass. With
  the model, a message with deferred recipients goes to a deferred queue with stock's
  retry time (its age bounded by ``minimal_backoff_time`` and ``maximal_backoff_time``)
  plus pyqmgr.cf's ``deferred_retry_jitter``, and its deferred recipients come back
  as a new attempt at the first deferred-queue scan (every ``queue_run_delay``, on
  whole seconds, run when the queue manager next wakes as stock's timers are) after
  that time, or earlier, paced, through ``deferred_recovery_rate`` when the destination
  it waited for delivers again (as the daemon's :mod:`pyqmgr.daemon.retry`, with the
  same registry, :class:`pyqmgr.settings.retry.Registry`).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import os
import random
from collections import deque
from collections.abc import Callable, Sequence

from pyqmgr.postfix.config import QmgrConfig, oqmgr_fudge_factor
from pyqmgr.pyqmgr_cf import PyqmgrCf, PyqmgrCfError
from pyqmgr.scheduler.core import ERROR, RETRY, Route, Scheduler
from pyqmgr.scheduler.decisions import NOTHING, Decisions
from pyqmgr.scheduler.entry import Entry
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.queue import Dsn, Queue
from pyqmgr.scheduler.shaping import RULES
from pyqmgr.settings.scheduling import SchedulingSettings, scheduling_settings
from pyqmgr.simulator.arrivals import Arrivals
from pyqmgr.simulator.classes import classify, scenario_classifier, scenario_tenant_limits
from pyqmgr.simulator.deferred import DeferredQueue
from pyqmgr.simulator.delegation import PolicyService
from pyqmgr.simulator.fleet import FleetRun
from pyqmgr.simulator.message import SimMessage
from pyqmgr.simulator.remote import Remote
from pyqmgr.simulator.result import Delivery, Result
from pyqmgr.simulator.scenario import (
    Scenario,
    ScenarioError,
    parse_script,
)
from pyqmgr.simulator.sites import answer, scenario_sites
from pyqmgr.simulator.sources import SimSources, scenario_sources

#: The scenario file's section with pyqmgr.cf's parameters, as errors name it.
PYQMGR_CF_SECTION = "pyqmgr_cf"


def scenario_settings(sc: Scenario) -> SchedulingSettings:
    """The scenario's ``[pyqmgr_cf]`` by the daemon's own route; bad ones: ScenarioError.

    Rules paths are relative to the scenario's file.
    """
    values = dict(sc.pyqmgr_cf)
    for name, value in values.items():
        if name.endswith(RULES) and value.strip() and not os.path.isabs(value.strip()):
            values[name] = os.path.normpath(os.path.join(sc.base_dir, value.strip()))
    try:
        settings = scheduling_settings(PyqmgrCf(PYQMGR_CF_SECTION, True, values))
    except PyqmgrCfError as exc:
        # "pyqmgr_cf: parameter NAME: text" -> "pyqmgr_cf.NAME: text"
        raise ScenarioError(str(exc).replace(": parameter ", ".", 1)) from None
    if settings.retry is not None and not sc.retry_deferred:
        raise ScenarioError("pyqmgr_cf sets deferred retry jitter or recovery: they act on "
                            "the deferred queue, which needs [deferred] retry = true")
    return settings


class Engine:
    def __init__(self, scenario: Scenario, seed: int | None = None,
                 record: bool = True) -> None:
        seed = scenario.seed if seed is None else seed
        # A server's coming-up time, where the scenario gives a span (dead_until_low).
        returns = random.Random(f"coming up {seed}")
        scenario = dataclasses.replace(scenario, destinations={
            name: d.drawn(returns) for name, d in scenario.destinations.items()})
        self.sc = scenario
        #: Keep every delivery and window change (the trace, plots); a replay of
        #: millions of deliveries keeps only the counts and delays.
        self.record = record
        self.rng = random.Random(seed)
        text = "".join(f"{k} = {v}\n" for k, v in scenario.main_cf.items())
        self.cfg = QmgrConfig.from_text(text, hostname="sim.example")
        settings = scenario_settings(scenario)
        self.policies = settings.policies
        self.shaping = settings.shaping
        #: Provider sites (issue #33; pyqmgr/simulator/sites.py), None: off.
        self.sites = scenario_sites(scenario, PYQMGR_CF_SECTION)
        self.classes = scenario_classifier(scenario, PYQMGR_CF_SECTION)  # issue #34
        self.sched = Scheduler.from_settings(
            self.cfg, refill=self._refill, feedback_rounding=scenario.feedback_rounding,
            policies=self.policies,
            process_limit_for=lambda name: scenario.process_limits.get(
                name, self.cfg.default_process_limit),
            fudge_factor=oqmgr_fudge_factor(self.cfg),
            shaping_for=self.shaping.shaping_for if self.shaping is not None else None,
            sites=self.sites.table() if self.sites is not None else None,
            tenant_limits=scenario_tenant_limits(scenario, PYQMGR_CF_SECTION))
        self.now = 0.0
        self._seq = itertools.count()
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        #: Decisions of the engine event under way, acted on after it (:meth:`_decisions`).
        self._decided: list[Decisions] = []
        self.incoming: deque[SimMessage] = deque()
        #: Per transport: processes delivering or announced, and agents waiting for one.
        self.busy_procs: dict[str, int] = {}
        self.waiting: dict[str, int] = {}
        #: Deliveries under way per destination (busy, across its queues).
        self.in_flight: dict[str, int] = {}
        #: Each destination's server: sessions open and connections waiting.
        #: The destinations' servers: sessions, listen queues, rate limits.
        self.remote = Remote(self, self.rng)
        self.sources: SimSources | None = scenario_sources(  # issue #46, or None
            scenario, PYQMGR_CF_SECTION, self.sched, self.cfg, self.classes, self)
        self.result = Result()
        self._last_end: float | None = None
        self._serial = itertools.count(1)
        #: The deferred-queue model (``[deferred] retry``): simulator/deferred.py.
        self.retry = settings.retry
        self.deferred_queue = DeferredQueue(self, self.retry, seed)
        #: The agents' hand-off times have their own random numbers.
        self.handoff_rng = random.Random(f"handoff {seed}")
        if self.deferred_queue.registry is not None:
            self.sched.watch_recovery()
        #: The scenario's delivery policy service, when it has one.
        self.policy_service = (PolicyService(self, scenario.delegation)
                               if scenario.delegation is not None else None)
        #: Replayed content-filter loops: trace index -> the messages it re-injects.
        self._children: dict[int, list[int]] = {}
        for i, m in enumerate(scenario.trace):
            if 0 <= m.follows < i:
                self._children.setdefault(m.follows, []).append(i)
        #: A fleet simulation (simulator/fleet.py): the run, this server's number among
        #: its servers and its name in the others' logs; None alone.
        self.fleet: FleetRun | None = None
        self.node = 0
        self.server = "sim.example"

    # -- clock --------------------------------------------------------------------

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._seq), action))

    def start_arrivals(self) -> None:
        """Push the first arrival (of this server's share, in a fleet) onto the heap."""
        self.arrivals = Arrivals(self)
        self.arrivals.push_next()

    def run(self) -> Result:
        self.start_arrivals()
        while self._events:
            when, _, action = heapq.heappop(self._events)
            if when > self.sc.duration:
                break
            self.now = when
            action()
            dq = self.deferred_queue
            if dq.asleep:
                dq.asleep = False
                continue
            dq.last_wake = when
            if dq.scan_late is not None:
                dq.scan_late = None
                dq.scan()
            self._decisions()
        # The last delivery's end, not the clock's: shaping's recovery timers run on
        # after the mail is gone and would stretch the figure with idle time.
        self.result.end_time = self._last_end if self._last_end is not None else self.now
        self.result.still_deferred = len(self.deferred_queue.deferred)
        self.result.sources = self.sources.summary() if self.sources is not None else None
        return self.result

    # -- messages -------------------------------------------------------------------

    def _arrival(self, spread: tuple[tuple[str, int], ...], name: str,
                 k: int, sender: str = "") -> Callable[[], None]:
        def arrive() -> None:
            qid = f"{name}{k}" if name else f"M{next(self._serial)}"
            self._enter(qid, [(dest, n, "") for dest, n in spread], True, sender=sender)
        return arrive

    def _trace_arrival(self, index: int) -> Callable[[], None]:
        def arrive() -> None:
            m = self.sc.trace[index]
            self._enter(f"M{next(self._serial)}", m.recipients, m.measured, m.born,
                        self._children.get(index), m.klass == "bounce", m.sender)
        return arrive

    def _enter(self, qid: str, spread: Sequence[tuple[str, int, str]],
               measured: bool, born: float | None = None,
               children: list[int] | None = None, bounce: bool = False,
               sender: str = "") -> None:
        routes: list[Route] = []
        scripts: dict[int, tuple[tuple[str, float | None], ...]] | None = None
        for dest_name, nrcpt, script in spread:
            dest = self.sc.destinations[dest_name]
            limit = self.cfg.transport(dest.transport).destination_recipient_limit
            for _ in range(nrcpt):
                i = len(routes)
                address = f"r{i}@{dest.name}"
                queue = f"{address}" if limit == 1 else dest.name
                routes.append(Route(dest.transport, queue, dest.name,
                                    Recipient(i, address)))
                if script:
                    if scripts is None:
                        scripts = {}
                    scripts[i] = parse_script(script)
        msg = SimMessage(Message(qid, self.now, rcpt_unread=len(routes)), routes,
                          spread[0][0], self.now if born is None else born, scripts,
                          measured)
        msg.children = children
        msg.bounce = bounce
        msg.node = self
        msg.sched.owner = msg
        classify(self.classes, msg.sched, sender)
        self._let_in(msg)

    def _let_in(self, msg: SimMessage, feed: bool = True) -> None:
        """Put a message in the active queue; its deliveries start after its transport's
        hand-off.

        The hand-off is what a real maillog shows between a message entering the
        active queue and its first delivery leaving, at a destination with room:
        delays= b of a first try, a few milliseconds mostly and up to a second now
        and then. It belongs to the message coming in, not to each agent handed a
        delivery: at a destination held at its limit, a delivery's slot goes to the
        next one within a millisecond in the same logs. Drawn per agent
        allocation, it held the transport's two pending allocations for up to a
        second and starved every destination behind them (measured: the 421
        limiter's p50 12-17% high).

        The message waits inside the active queue, as b is time in it: its entries
        keep their in-core queues alive meanwhile, so that the failures of tries
        handed off together count in one queue's life, where stock declares a
        site dead (three failed cohorts from a window of 5). Held outside it
        before, every refused try of a down host ended its queue before the next
        came, and the simulation never held a site dead: replaying real runs, a
        4.7.28 rate limiter at the sink's own rate of 2 drew 85-108 refused tries
        (the logs: 102-111) but 41-180 deferrals of the site held dead (the logs:
        79-261); waiting inside, 100-107 and 153-276.
        """
        handoff = self.sc.handoffs.get(self.sc.destinations[msg.destination].transport)
        if handoff is not None:
            msg.ready_at = self.now + handoff.draw(self.handoff_rng)
        self.incoming.append(msg)
        if feed:
            self._feed()

    def _feed(self) -> None:
        sched = self.sched
        # The core's message_count is the active queue's one count, as the daemon's.
        while (self.incoming and sched.message_count < self.cfg.qmgr_message_active_limit
               and sched.may_feed()):
            msg = self.incoming.popleft()
            sched.message_count += 1
            msg.sched.enqueue_time = self.now
            routes = self._read(msg, sched.read_limit(msg.sched))
            self.apply(sched.assign(msg.sched, routes, now=self.now))

    def _read(self, msg: SimMessage, limit: int) -> list[Route]:
        batch = msg.routes[msg.pos:msg.pos + limit]
        msg.pos += len(batch)
        msg.sched.rcpt_unread = len(msg.routes) - msg.pos
        msg.sched.more = msg.sched.rcpt_unread > 0
        return batch if self.sources is None else self.sources.route(msg.sched, batch)

    def _refill(self, message: Message, limit: int) -> list[Route]:
        return self._read(message.owner, limit)

    # -- decisions ------------------------------------------------------------------

    def apply(self, d: Decisions) -> Entry | None:
        """Take one event's decisions (:mod:`pyqmgr.scheduler.decisions`); its entry.

        They are acted on after the engine event that caused them, all of that event's
        together (:meth:`_decisions`), as the daemon's event loop would see them.
        """
        if d is not NOTHING:
            self._decided.append(d)
        return d.deliver

    def _decisions(self) -> None:
        """Act on the decisions of the engine event that just ran: the one place the
        simulator applies them, in the daemon's order (logs, timers, deferrals,
        recovery, finished messages), then connect agents for the work there is."""
        sched = self.sched
        batch, self._decided = self._decided, []
        for d in batch:
            for severity, text in d.log:
                self.result.log.append((self.now, severity, text))
            if d.throttled and self.fleet is not None:
                self.fleet.tell(self, d.throttled)
            if d.resolve and self.sites is not None:
                for learnt in answer(self.sc, self.sites, sched, d.resolve, self.now):
                    self.apply(learnt)
        for d in batch:
            for when in d.timers:
                self.at(when, self._tick)
        for d in batch:
            for when in d.gate_timers:
                self.at(when, self._open_gates)
        for d in batch:
            for deferral in d.deferrals:
                dest = deferral.message.owner.route_of(deferral.recipient).nexthop
                self.result.deferred[dest] = self.result.deferred.get(dest, 0) + 1
                if self.sc.retry_deferred:
                    self._deferred_rcpt(deferral.message.owner, deferral.recipient)
        for d in batch:
            for message, transport, qname in d.waits:
                message.owner.waits.add((transport, qname))
        for d in batch:
            for transport, qname, nexthop, why in d.recovered:
                self.deferred_queue.recover(transport, qname, nexthop, why)
        done = [message for d in batch for message in d.finished]
        while done:
            for message in done:
                msg: SimMessage = message.owner
                if message.more:
                    self.apply(sched.assign(message, self._read(msg, sched.read_limit(message)),
                                            now=self.now))
                else:
                    sched.message_count -= 1
                    if self.classes is not None and not msg.retry:
                        # Gone for good: unlisted_tenant_limit counts it no more (a
                        # deferred one still counts while it waits: the simulator
                        # classifies a message once, where it arrives).
                        self.classes.left(message.tenant)
                    if msg.retry:
                        self.deferred_queue.defer(msg)
                    elif msg.children:
                        # Its content filter re-injects the message as it is done.
                        for i in msg.children:
                            self.at(self.now + self.sc.trace[i].gap, self._trace_arrival(i))
            self._feed()
            # Messages these readings finished are handled now; the rest of their
            # decisions wait for the next engine event, as they always have.
            done = [message for d in self._decided for message in d.finished]
            self._decided = [d._replace(finished=()) if d.finished else d
                             for d in self._decided]
        while (name := sched.allocate()) is not None:
            limit = self.sc.process_limits.get(name, self.cfg.default_process_limit)
            if self.busy_procs.get(name, 0) < limit:
                self.busy_procs[name] = self.busy_procs.get(name, 0) + 1
                self.at(self.now + sched.select_delay(name), self._agent(name))
            else:
                self.waiting[name] = self.waiting.get(name, 0) + 1

    def _sample(self, queue: Queue) -> None:
        if self.record and queue.transport.name not in (RETRY, ERROR):
            self.result.sample(self.now, queue, self.in_flight.get(queue.nexthop, 0))

    def _tick(self) -> None:
        self.apply(self.sched.tick(self.now))
        for t in list(self.sched.transports.values()):
            for queue in list(t.queues.values()):
                self._sample(queue)

    def _open_gates(self) -> None:
        self.apply(self.sched.open_gates(self.now))

    def _release(self, name: str) -> None:
        if self.waiting.get(name, 0) > 0:
            self.waiting[name] -= 1
            self.at(self.now, self._agent(name))
        else:
            self.busy_procs[name] -= 1

    # -- deliveries -------------------------------------------------------------------

    def _agent(self, name: str) -> Callable[[], None]:
        def ready() -> None:
            entry = self.apply(self.sched.select(name, self.now))
            fleet = self.fleet
            while entry is not None and fleet is not None and not fleet.admit(self, name,
                                                                               entry):
                # Held back for the fleet: the agent takes another entry, as the
                # daemon's does (agent_next).
                entry = self.apply(self.sched.reselect(name, self.now))
            if entry is None:
                self._release(name)
                return
            self.result.decisions += 1
            if self.policy_service is not None and name not in (RETRY, ERROR):
                self.policy_service.ask(name, entry)
            else:
                self._attempt(name, entry)
        return ready

    def _attempt(self, name: str, entry: Entry) -> None:
        msg: SimMessage = entry.message.owner
        if msg.ready_at > self.now and name not in (RETRY, ERROR):
            # Still in its hand-off (see _let_in): the entry is chosen, its agent
            # waits for it.
            self.at(msg.ready_at, functools.partial(self._attempt, name, entry))
            return
        start = self.now
        window = entry.queue.window
        if name in (RETRY, ERROR):
            self.at(self.now, self._finish(entry, start, window,
                                           msg.route_of(entry.recipients[0]).nexthop,
                                           "retry" if name == RETRY else "bounced", None, False))
            return
        dest = self.sc.destinations[entry.queue.nexthop]
        self.in_flight[dest.name] = self.in_flight.get(dest.name, 0) + 1
        self._sample(entry.queue)
        self.remote.connect(entry, start, window, dest, msg)

    def _finish(self, entry: Entry, start: float, window: int, dest: str, outcome: str,
                hop: Dsn | None, session: bool,
                replies: list[str] | None = None) -> Callable[[], None]:
        def finish() -> None:
            n = len(entry.recipients)
            name = entry.queue.transport.name
            if session:
                self.remote.session_end(dest)
            res = self.result
            queue = entry.queue
            if name not in (RETRY, ERROR):
                self.in_flight[dest] -= 1
                if self.fleet is not None:
                    self.fleet.ended(self, entry)
            elif name == RETRY:
                res.held_dead[dest] = res.held_dead.get(dest, 0) + n
            if outcome == "sent" and replies is not None:
                ok = replies.count("2xx")
                later = [r for r, how in zip(entry.recipients, replies, strict=True)
                         if how == "4xx"]
                res.sent[dest] = res.sent.get(dest, 0) + ok
                if ok:
                    self.result.add_delays(self.now, entry.message.owner, dest, ok)
                if later:
                    res.deferred[dest] = res.deferred.get(dest, 0) + len(later)
                if n - ok - len(later):
                    res.bounced[dest] = res.bounced.get(dest, 0) + n - ok - len(later)
                if self.sc.retry_deferred:
                    for rcpt in later:
                        self._deferred_rcpt(entry.message.owner, rcpt)
                self.apply(self.sched.done(entry, 1 if later else 0, None, False, self.now))
            elif outcome == "sent":
                res.sent[dest] = res.sent.get(dest, 0) + n
                self.result.add_delays(self.now, entry.message.owner, dest, n)
                self.apply(self.sched.done(entry, 0, None, False, self.now))
            else:
                res.deferred[dest] = res.deferred.get(dest, 0) + n
                if self.sc.retry_deferred and outcome != "bounced":
                    for rcpt in entry.recipients:
                        self._deferred_rcpt(entry.message.owner, rcpt)
                self.apply(self.sched.done(entry, 1, hop, False, self.now))
            self._last_end = self.now
            if self.sources is not None:
                self.sources.finished(entry, dest, outcome, replies)
            if self.record:
                res.deliveries.append(Delivery(start, self.now, name, dest,
                                               entry.message.queue_id, n, outcome, window,
                                               hop.reason if hop else "",
                                               self.server if self.fleet else ""))
                self._sample(queue)
            self._release(name)
        return finish

    # -- the deferred queue (``[deferred] retry = true``; simulator/deferred.py) -----

    def _deferred_rcpt(self, msg: SimMessage, rcpt: Recipient) -> None:
        """This attempt's recipient must be tried again."""
        msg.retry.append(msg.route_of(rcpt))


def simulate(scenario: Scenario, seed: int | None = None, record: bool = True) -> Result:
    """Run a scenario to its end (or its duration); same scenario and seed, same result.

    Without ``record`` only counts and delays are kept, not every delivery and window
    change: a replayed day of a busy server fits in memory.
    """
    if scenario.fleet_servers > 1:
        return FleetRun(scenario, [Engine(scenario, seed, record)
                                   for _ in range(scenario.fleet_servers)]).run()
    return Engine(scenario, seed, record).run()
