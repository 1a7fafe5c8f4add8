"""A fleet of servers in the simulator (``[fleet] servers = N``, issue #23).

N engines, each with its own scheduler core, delivery processes and active queue,
run on one clock against one set of destination servers, and share what the daemons
share through Redis (:mod:`pyqmgr.daemon.fleet`): each destination's fleet-wide
sessions and rate, the sessions passed on at every delivery's end, and the dead
sites and response-rule throttling one server finds. The scenario's messages are
dealt to the servers in turn, as a load balancer in front of them would; the result
is one sender's, all servers' deliveries together.

The shared state here is the Redis scripts' model without their latency: a start is
admitted or refused at once, a session given back goes to the longest waiting
server at once (or stays with its server for its next delivery), and news of
throttling reaches the others at once. Their settings are the daemon's own, read
from ``[pyqmgr_cf]`` by :func:`pyqmgr.fleet.settings.fleet_settings`
(``fleet_destination_concurrency_limit``, ``fleet_destination_rate``,
``fleet_destination_rate_burst``, ``fleet_throttling``, and per site, issue #33,
``fleet_site_concurrency_limit``, ``fleet_site_rate``, ``fleet_site_rate_burst``: a
destination at a site counts at the site, ``site NAME``, as the daemon's does).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from pyqmgr.fleet.sessions import GATE_KIND, SPARE_TIME, session_retry
from pyqmgr.fleet.settings import FleetSettings, Limits, fleet_settings
from pyqmgr.fleet.shared import SITE_UNIT
from pyqmgr.pyqmgr_cf import PyqmgrCf, PyqmgrCfError
from pyqmgr.scheduler.core import ERROR, RETRY
from pyqmgr.scheduler.decisions import Throttling
from pyqmgr.scheduler.queue import Dsn
from pyqmgr.simulator.remote import Remote
from pyqmgr.simulator.scenario import Scenario, ScenarioError

if TYPE_CHECKING:
    import itertools as _itertools
    import random

    from pyqmgr.postfix.config import QmgrConfig
    from pyqmgr.scheduler.core import Scheduler
    from pyqmgr.scheduler.decisions import Decisions
    from pyqmgr.scheduler.entry import Entry
    from pyqmgr.scheduler.structures import Queue
    from pyqmgr.simulator.result import Result


class Engine(Protocol):
    """What a fleet needs of each of its servers (simulator/engine.py's Engine), declared
    here so that this module does not import the engine that imports it."""

    now: float
    node: int
    server: str
    sched: Scheduler
    cfg: QmgrConfig
    fleet: FleetRun | None
    result: Result
    rng: random.Random
    remote: Remote
    in_flight: dict[str, int]
    _events: list[tuple[float, int, Callable[[], None]]]
    _serial: _itertools.count[int]
    _seq: _itertools.count[int]
    _last_end: float | None

    def apply(self, d: Decisions) -> Entry | None: ...
    def at(self, when: float, action: Callable[[], None]) -> None: ...
    def start_arrivals(self) -> None: ...
    def _decisions(self) -> None: ...
    def _finish(self, entry: Entry, start: float, window: int, dest: str, outcome: str,
                hop: Dsn | None, session: bool,
                replies: list[str] | None = None) -> Callable[[], None]: ...

#: Where the scenario's fleet settings are read from, as errors name them.
SECTION = "pyqmgr_cf"


def scenario_fleet(sc: Scenario) -> FleetSettings:
    """The fleet's settings from the scenario's ``[pyqmgr_cf]``, by the daemon's route.

    ``shared_state`` is the simulator's own shared state, so the scenario need not
    (and should not) name a Redis server.
    """
    values = {"shared_state": "redis://simulated.invalid:6379", **sc.pyqmgr_cf}
    try:
        # News between simulated servers never leaves the process: nothing to sign,
        # and throttling is shared as a real fleet with its key shares it.
        settings = fleet_settings(PyqmgrCf(SECTION, True, values), "sim.example",
                                  key=b"simulated")
    except PyqmgrCfError as exc:
        raise ScenarioError(str(exc).replace(": parameter ", ".", 1)) from None
    assert settings is not None
    return settings


def _active(cache: dict[str, Limits | None], transport: str,
            limits_for: Callable[[str], Limits]) -> Limits | None:
    """A transport's fleet limits when they limit anything (never the retry and error
    transports'), read once into ``cache``."""
    if transport not in cache:
        limits = limits_for(transport) if transport not in (RETRY, ERROR) else None
        cache[transport] = limits if limits is not None and limits.active else None
    return cache[transport]


class SharedState:
    """Each destination's fleet-wide sessions, rate and line of waiting servers."""

    def __init__(self, settings: FleetSettings) -> None:
        self.settings = settings
        self._limits: dict[str, Limits | None] = {}
        self._site_limits: dict[str, Limits | None] = {}
        self.sessions: dict[tuple[str, str], int] = {}
        self.tat: dict[tuple[str, str], float] = {}
        self.waiters: dict[tuple[str, str], deque[Engine]] = {}
        #: Sessions kept or handed to a server for its next delivery: (server, key) ->
        #: the times they came.
        self.spares: dict[tuple[int, tuple[str, str]], list[float]] = {}
        self.asked = 0
        self.handed = 0

    def limits(self, transport: str) -> Limits | None:
        return _active(self._limits, transport, self.settings.limits_for)

    def site_limits(self, transport: str) -> Limits | None:
        return _active(self._site_limits, transport, self.settings.site_limits_for)

    def unit(self, entry: Entry) -> tuple[tuple[str, str], Limits] | None:
        """What the entry's delivery counts at across the fleet (daemon's Fleet.unit)."""
        queue = entry.queue
        t = queue.transport.name
        if queue.site is not None and (limits := self.site_limits(t)) is not None:
            return (t, SITE_UNIT + queue.site.name), limits
        limits = self.limits(t)
        return ((t, queue.name), limits) if limits is not None else None

    def unit_limits(self, key: tuple[str, str]) -> Limits | None:
        if key[1].startswith(SITE_UNIT):
            return self.site_limits(key[0])
        return self.limits(key[0])

    def _line_up(self, key: tuple[str, str], node: Engine) -> None:
        line = self.waiters.setdefault(key, deque())
        if node not in line:
            line.append(node)

    def admit(self, node: Engine, key: tuple[str, str], limits: Limits,
              now: float) -> tuple[bool, float, int]:
        """(admitted, seconds until the rate allows a start, sessions in use)."""
        used = self.sessions.get(key, 0)
        spare = self.spares.get((node.node, key))
        if spare:
            spare.pop()
            return True, 0.0, used
        self.asked += 1
        if limits.sessions and used >= limits.sessions:
            self._line_up(key, node)
            return False, 0.0, used
        if limits.rate is not None:
            interval = limits.rate.interval
            tat = max(self.tat.get(key, now), now)
            allow_at = tat - (limits.burst - 1) * interval
            if now < allow_at:
                return False, allow_at - now, used
            self.tat[key] = tat + interval
        if limits.sessions:
            self.sessions[key] = used + 1
        return True, 0.0, used + 1

    def release(self, node: Engine, key: tuple[str, str], more: bool,
                now: float) -> Engine | None:
        """A delivery of ``node`` ended: its session goes to the longest waiting other
        server (returned, to be woken), or stays with ``node`` when it has more."""
        limits = self.unit_limits(key)
        if limits is None or not limits.sessions:
            return None
        self.sessions[key] -= 1
        line = self.waiters.get(key)
        while line:
            waiter = line.popleft()
            if waiter is node or not _wants(waiter, key):
                # A server that no longer has mail for it passes it on and leaves
                # the line, as the daemon's does.
                continue
            self.handed += 1
            line.append(waiter)
            if more:
                self._line_up(key, node)
            if limits.rate is None:
                self.sessions[key] += 1
                self.spares.setdefault((waiter.node, key), []).append(now)
            return waiter
        if more:
            self.sessions[key] += 1
            self.spares.setdefault((node.node, key), []).append(now)
        return None

    def sweep(self, now: float) -> None:
        """Spares unused for SPARE_TIME go back."""
        for (_, key), times in self.spares.items():
            while times and times[0] <= now - SPARE_TIME:
                times.pop(0)
                self.sessions[key] -= 1


def _members(node: Engine, key: tuple[str, str]) -> list[Queue]:
    """The destination's queue on ``node``, or its site's queues there."""
    if key[1].startswith(SITE_UNIT):
        sites = node.sched.sites
        site = sites.sites.get((key[0], key[1][len(SITE_UNIT):])) if sites else None
        return list(site.members) if site is not None else []
    t = node.sched.transports.get(key[0])
    queue = t.queues.get(key[1]) if t is not None else None
    return [queue] if queue is not None else []


def _wants(node: Engine, key: tuple[str, str]) -> bool:
    """Whether ``node`` has deliveries waiting for the destination (or its site)."""
    return any(q.todo.size > 0 for q in _members(node, key))


class FleetRun:
    """N engines on one clock, one world of servers, one shared state."""

    def __init__(self, scenario: Scenario, engines: list[Engine]) -> None:
        if scenario.retry_deferred or scenario.delegation is not None:
            raise ScenarioError("a [fleet] simulation does not model the deferred queue "
                                "or a delivery policy service yet", ("fleet",))
        self.sc = scenario
        self.shared = SharedState(scenario_fleet(scenario))
        self.engines = engines
        #: The unit each admitted delivery counts at, until it ends.
        self.units: dict[Entry, tuple[str, str]] = {}
        for transport in sorted({d.transport for d in scenario.destinations.values()}):
            if self.shared.limits(transport) is not None and engines[0].cfg.transport(
                    transport).destination_recipient_limit == 1:
                raise ScenarioError(
                    f"{transport}_destination_recipient_limit = 1 makes each recipient a "
                    "destination of its own (Postfix's rule), so a fleet limit would count "
                    f"per recipient: raise it for the {transport} transport's fleet limits "
                    "to count per destination", ("fleet",))
        self.now = 0.0
        self._sweeping = False
        #: One world of destination servers for all: each sees the fleet as one client.
        self.remote = Remote(_World(self), self.engines[0].rng)
        for k, engine in enumerate(self.engines):
            join(engine, self, k)

    # -- what the engines call -----------------------------------------------------

    def admit(self, node: Engine, name: str, entry: Entry) -> bool:
        """May the entry's delivery start? Refused, the destination waits on ``node``."""
        unit = self.shared.unit(entry)
        if unit is None:
            return True
        key, limits = unit
        admitted, wait, used = self.shared.admit(node, key, limits, node.now)
        if admitted:
            # Given back where it was taken, should the destination change sites
            # meanwhile (its MX lookup answered).
            self.units[entry] = key
            return True
        site = key[1].startswith(SITE_UNIT)
        whose = key[1] + " " if site else ""
        if wait > 0:
            text = f"{whose}fleet rate: next start in {wait:.3g}s"
            until = node.now + wait
        else:
            text = f"waits for a {whose}fleet session: {used} of {limits.sessions} in use"
            until = node.now + session_retry(self.shared.settings.lease_time)
        setting = ("fleet_site_concurrency_limit" if site
                   else "fleet_destination_concurrency_limit")
        node.apply(node.sched.hold_back(entry, until, setting,
                                        f"{entry.queue.nexthop} {text}", node.now, GATE_KIND))
        return False

    def ended(self, node: Engine, entry: Entry) -> None:
        """A delivery of ``node`` ended: pass its session on."""
        key = self.units.pop(entry, None)
        if key is None:
            return
        waiter = self.shared.release(node, key, _wants(node, key), node.now)
        if waiter is not None:
            for queue in _members(waiter, key):
                waiter.apply(waiter.sched.lift_hold(key[0], queue.name, GATE_KIND,
                                                    waiter.now))
        if self.shared.spares and not self._sweeping:
            self._sweeping = True
            node.at(node.now + SPARE_TIME, self._sweep)

    def _sweep(self) -> None:
        self._sweeping = False
        self.shared.sweep(self.now)
        if any(self.shared.spares.values()):
            self._sweeping = True
            self.engines[0].at(self.now + SPARE_TIME, self._sweep)

    def tell(self, node: Engine, found: tuple[Throttling, ...]) -> None:
        """Throttling ``node`` found: every other server learns it now."""
        for news in found:
            if not self.shared.settings.shares_throttling(news.transport):
                continue
            for other in self.engines:
                if other is not node:
                    other.apply(other.sched.learnt(news, node.server, other.now))

    # -- the run ---------------------------------------------------------------------

    def run(self) -> Result:
        engines = self.engines
        first = engines[0]
        seq = itertools.count(sum(s.count for s in self.sc.messages) + len(self.sc.trace))
        for engine in engines:
            engine.start_arrivals()
        for engine in engines:
            engine._seq = seq
        events = first._events
        while events:
            when, _, action = heapq.heappop(events)
            if when > self.sc.duration:
                break
            self.now = when
            for engine in engines:
                engine.now = when
            action()
            for engine in engines:
                engine._decisions()
        ends = [e._last_end for e in engines if e._last_end is not None]
        first.result.end_time = max(ends) if ends else self.now
        return first.result


def join(engine: Engine, fleet: FleetRun, k: int) -> None:
    """Make ``engine`` server ``k`` of ``fleet``: the first server's clock, event heap,
    results and counts of deliveries under way; the fleet's world of destination
    servers; the scenario's every ``k``-th message; throttling told to and heard from
    the rest."""
    first = fleet.engines[0]
    engine.fleet, engine.node, engine.server = fleet, k, f"server{k}"
    engine._events, engine._serial = first._events, first._serial
    engine.result, engine.in_flight, engine.rng = first.result, first.in_flight, first.rng
    engine.remote = fleet.remote
    engine.sched.share_throttling = True


class _World:
    """The destinations' servers' view of the fleet: one clock, and each delivery's end
    told to the server whose delivery it was."""

    def __init__(self, run: FleetRun) -> None:
        self.run = run
        self.sc = run.sc

    @property
    def now(self) -> float:
        return self.run.now

    def at(self, when: float, action: Callable[[], None]) -> None:
        self.run.engines[0].at(when, action)

    def _finish(self, entry: Entry, start: float, window: int, dest: str, outcome: str,
                hop: Dsn | None, session: bool,
                replies: list[str] | None = None) -> Callable[[], None]:
        node: Engine = entry.message.owner.node
        return node._finish(entry, start, window, dest, outcome, hop, session, replies)
