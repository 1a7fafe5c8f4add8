"""The fleet's limits in the daemon: ask Redis before a delivery starts (issue #23).

With ``shared_state`` in pyqmgr.cf and a ``fleet_destination_concurrency_limit`` or
``fleet_destination_rate`` for a transport, every delivery the scheduler selects for
it first takes a fleet session and a rate slot in Redis (:mod:`pyqmgr.fleet.shared`,
one round trip). Off unless set: the daemon never builds this without
``shared_state``.

It rides on the path delivery policy delegation made (:mod:`.delegation`): the agent
has announced itself and the entry is selected (inside the node's own window, as
stock's limits still hold); the question goes out as a task and the agent waits with
its reader off. The answer comes back to synchronous code:

* **admitted**: the delivery goes on (to the policy service, when one is set too,
  then to the agent); its lease is renewed every third of ``shared_state_lease_time``
  while the delivery runs and given back when it ends, however it ends. Given back,
  it is passed on in the same round trip: to the process that has waited longest
  for the destination (a lease in its name, published on its channel), or kept for
  this node's next delivery there when nobody else waits. Either way the delivery
  that starts on it asks nothing: one round trip a delivery, start and end together;
* **refused**: the entry goes back to its queue and the destination is gated
  (``fleet`` in ``pyqmgr explain``) until the rate allows a start, or, when the
  fleet's sessions are all in use, until a session is handed here; the node asks
  again only after a quarter of the lease time (1-15 s), for what nobody hands on
  (a dead node's leases expiring). The agent is given another entry. Nothing is
  deferred and nothing logged per refusal: waiting for the fleet is the normal
  state of a busy destination.
* **Redis slow or gone** (no answer within ``shared_state_timeout``):
  ``shared_state_failure = local`` delivers under the node's own limits,
  ``hold`` holds the destination back for :data:`HOLD_RETRY`; either way a warning at
  most once a minute, and a line when Redis answers again. No delivery is lost or
  doubled: the request is sent once, after the answer, or not at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter as Tally
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from pyqmgr.daemon.fleet.news import FleetNews
from pyqmgr.daemon.fleet.roster import FleetRoster
from pyqmgr.daemon.fleet.stats import FleetStats
from pyqmgr.daemon.fleet.suspensions import FleetSuspensions, SuspensionsHost
from pyqmgr.daemon.fleet.units import FleetUnits
from pyqmgr.fleet.client import RedisClient, RedisUnavailable, Subscriber
from pyqmgr.fleet.sessions import GATE_KIND, SPARE_TIME, session_retry
from pyqmgr.fleet.settings import (
    FAILURE,
    FLEET_LIMIT,
    FLEET_RATE,
    FLEET_SITE_LIMIT,
    FLEET_SITE_RATE,
    HOLD,
    FleetSettings,
    Limits,
)
from pyqmgr.fleet.shared import KEPT, SITE_UNIT, Admission, Shared
from pyqmgr.postfix.policy_delegation import WarnGate

if TYPE_CHECKING:
    from pyqmgr.daemon.delivery import AgentCall
    from pyqmgr.scheduler.decisions import Throttling
    from pyqmgr.scheduler.entry import Entry

#: How long after a delivery's end its session is given back. smtp(8) does not wait
#: for the reply to its QUIT (smtp_skip_quit_response = yes, the default), so the
#: agent reports while the remote server may not have read the QUIT yet; handed on
#: at once, the next session, from any server of the fleet, can reach it first and
#: be one too many. A few milliseconds cover the QUIT's way (3 in 1,000 of a
#: 200 ms delivery).
QUIT_GRACE = 0.005
#: The longest an exiting process spends giving its spare sessions back.
EXIT_GIVE_BACK = 0.5
#: Sessions given back while Redis was away, kept to give back when it answers.
MAX_UNRELEASED = 10_000
#: How long ``shared_state_failure = hold`` holds a destination back per try.
HOLD_RETRY = 1.0
#: Destinations whose fleet figures ``pyqmgr status`` remembers.
SEEN_MEMORY = 1000


class FleetHost(SuspensionsHost, Protocol):
    """What the fleet needs of the daemon (daemon/qmgr.py's Qmgr) beyond the core and
    its suspensions, declared here so that this module does not import the daemon that
    imports it."""

    def fleet_admitted(self, call: AgentCall, entry: Entry) -> None: ...

    def agent_next(self, call: AgentCall, name: str) -> None: ...


#: What ``pyqmgr status`` counts of the fleet's answers to this server.
COUNTED = ("asked", "admitted", "sessions_full", "rate_wait", "told", "handed", "kept",
           "round_trips", "errors", "throttling_told", "throttling_heard",
           "throttling_refused", "recount_wait", "leases_recounted")


def _whose(unit: str) -> str:
    """``site NAME``'s words in a hold's text; nothing for a destination's own."""
    return unit + " " if unit.startswith(SITE_UNIT) else ""


class Fleet:
    def __init__(self, host: FleetHost, settings: FleetSettings,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = RedisClient(settings.endpoint, timeout=settings.timeout,
                                  retry_delay=1.0, clock=clock)
        self.host, self.settings, self.clock = host, settings, clock
        self.shared = Shared(self.client, settings.prefix, settings.node,
                             settings.lease_time)
        #: Each transport's limits per destination and per site, and what a delivery
        #: counts at (:mod:`.units`).
        self.units = FleetUnits(host, settings)
        #: Round trips, errors and the last good answer (metrics, the roster).
        self.stats = FleetStats(clock)
        #: The lease each admitted delivery holds: call -> (transport, queue, lease).
        self.leases: dict[AgentCall, tuple[str, str, str]] = {}
        self.warn = WarnGate(60.0)
        self.down = False
        self.counters: Tally[str] = Tally()
        self._tasks: list[asyncio.Task[None]] = []
        #: The subscriptions' client (:meth:`start`).
        self.listener: RedisClient | None = None
        #: Sessions of ended deliveries that Redis was not there to take back.
        self.unreleased: list[tuple[str, str, str]] = []
        #: The fleet's suspensions (pyqmgr suspend --fleet), shared and heard.
        self.suspensions = FleetSuspensions(host, self.shared, settings)
        #: What the fleet last said of each destination asked about: (sessions in use
        #: fleet-wide, the limit), the most recent :data:`SEEN_MEMORY` destinations.
        self.seen: OrderedDict[tuple[str, str], tuple[int, int]] = OrderedDict()
        #: Destinations whose fleet sessions were all in use at the last answer, and
        #: the questions out per destination (both bounded by the destinations waiting).
        self.full: set[tuple[str, str]] = set()
        self.asking: dict[tuple[str, str], int] = {}
        #: When each full destination may ask again (unless handed a session first).
        self.ask_again: dict[tuple[str, str], float] = {}
        self.session_retry = session_retry(settings.lease_time)
        #: Sessions kept or handed to this node for its next delivery to a destination.
        #: Each lease with when it came; one timer sweeps out those unused after
        #: SPARE_TIME, and one gives back the sessions of the deliveries that ended
        #: within a QUIT_GRACE (a timer a delivery would crowd the event loop's heap).
        self.spares: dict[tuple[str, str], list[tuple[str, float]]] = {}
        self._sweep_armed = False
        self._ended: list[tuple[str, str, str]] = []
        self.recount_warn = WarnGate(60.0)
        #: News of throttling, told and heard (none without a key file).
        self.news = FleetNews(host, self.shared, settings, self.counters, clock)
        #: This server's record in the fleet's roster, and the others' (issue #35).
        self.roster = FleetRoster(self)
        #: What other parts give back to the fleet at exit, within the same bound (the
        #: warm-up's credits, :mod:`.warmup`).
        self.at_exit: list[Callable[[], Awaitable[None]]] = []

    # -- asking -------------------------------------------------------------------------

    def start(self) -> None:
        """On the event loop: renew leases, hear of freed sessions, of the fleet's
        suspensions (read once now, and again at every resubscription) and of the
        throttling other servers find; tell them what this one finds."""
        loop = asyncio.get_running_loop()
        timeout = self.settings.timeout
        # Subscriptions hold a connection each, apart from the calls' own.
        ears = self.listener = RedisClient(self.settings.endpoint, timeout=timeout,
                                           max_connections=8)
        self.host.scheduler.share_throttling = self.news.seal is not None
        self._tasks = [
            loop.create_task(self._renew()), loop.create_task(self.roster.run()),
            # Also at every (re)subscription: a node that was cut off from a Redis
            # that restarted empty missed the recount while it reconnected.
            loop.create_task(Subscriber(ears, self.shared.recount_channel, self._recount,
                                        timeout=timeout,
                                        on_subscribed=lambda: self._recount(b"")).run()),
            loop.create_task(Subscriber(ears, self.shared.freed_channels(), self._freed,
                                        timeout=timeout, sharded=self.shared.cluster).run()),
            loop.create_task(Subscriber(ears, self.shared.suspensions_channel,
                                        self.suspensions.changed, timeout=timeout,
                                        on_subscribed=lambda: self.suspensions.changed(b"")
                                        ).run())]
        if self.news.seal is not None:
            self._tasks.append(loop.create_task(Subscriber(
                ears, self.shared.throttling_channel,
                lambda payload: self.news.heard(payload, self.units.shares),
                timeout=timeout).run()))

    def admit(self, call: AgentCall, entry: Entry, unit: tuple[str, Limits]) -> bool:
        """May the selected entry's delivery start? True at once when this node holds a
        session kept or handed for its unit (:meth:`unit`; no question at all); else
        False, and the fleet's answer comes to :meth:`decided`."""
        key = (entry.queue.transport.name, unit[0])
        spares = self.spares.get(key)
        if spares:
            lease = spares.pop()[0]
            if not spares:
                del self.spares[key]
            self.counters["admitted"] += 1
            self.leases[call] = (key[0], key[1], lease)
            return True
        self.host.spawn(self._admit(call, entry, unit[0], unit[1]))
        return False

    async def _admit(self, call: AgentCall, entry: Entry, name: str, limits: Limits) -> None:
        key = (entry.queue.transport.name, name)
        in_use = self.seen.get(key, (0, 0))[0]
        if key in self.full and self.client.connected and (
                self.asking.get(key, 0) or self.clock() < self.ask_again.get(key, 0.0)):
            # The fleet's sessions were all in use at the last answer: the next one
            # given back is handed to this node (it is in line), and asking before
            # then would only be refused.
            self.decided(call, entry, Admission(False, 0.0, in_use), name)
            return
        self.counters["asked"] += 1
        self.counters["round_trips"] += 1
        self.asking[key] = self.asking.get(key, 0) + 1
        interval = limits.rate.interval if limits.rate is not None else 0.0
        try:
            with self.stats.timed():
                answer: Admission | str = await self.shared.admit(
                    key[0], key[1], limits.sessions, interval, limits.burst,
                    more=self._waiting(*key))
        except RedisUnavailable as exc:
            answer = str(exc)
        except Exception as exc:  # noqa: BLE001 - a bug must not strand the agent
            answer = f"internal error: {type(exc).__name__}: {exc}"
        finally:
            left = self.asking[key] - 1
            if left:
                self.asking[key] = left
            else:
                del self.asking[key]
        if isinstance(answer, Admission) and answer.wait <= 0 and (
                not answer.admitted or answer.in_use >= limits.sessions > 0):
            # Refused for want of a session, or given the last one: the next question
            # is likely refused too, so none until a session is handed here or the
            # time to ask again comes.
            self.full.add(key)
            self.ask_again[key] = self.clock() + self.session_retry
        else:
            self.full.discard(key)
            self.ask_again.pop(key, None)
        self.decided(call, entry, answer, name)

    def decided(self, call: AgentCall, entry: Entry, answer: Admission | str,
                unit: str) -> None:
        """Apply the fleet's answer for the entry's unit (a destination's queue name,
        or ``site NAME``), or the failure mode for none; synchronous."""
        queue = entry.queue
        transport = queue.transport.name
        if isinstance(answer, str):
            self._unavailable(call, entry, answer, unit)
            return
        if self.down:
            self.down = False
            self.host.log.info(f"shared state {self.settings.endpoint}: answering again; "
                               "fleet limits apply")
        key = (transport, unit)
        limit = self.units.unit_limits(transport, unit)
        wait = self.roster.cap(answer.wait, limit, transport, unit)
        site = unit.startswith(SITE_UNIT)
        self.seen[key] = (answer.in_use, limit.sessions if limit is not None else 0)
        self.seen.move_to_end(key)
        if len(self.seen) > SEEN_MEMORY:
            self.seen.popitem(last=False)
        if answer.admitted:
            self.counters["admitted"] += 1
            if answer.lease:
                self.leases[call] = (transport, unit, answer.lease)
            self.host.fleet_admitted(call, entry)
            return
        now = self.clock()
        if answer.recount:
            self.counters["recount_wait"] += 1
            name = FLEET_SITE_LIMIT if site else FLEET_LIMIT
            text = (f"the fleet counts its sessions again (Redis lost its data): next "
                    f"start in {wait:.3g}s")
            until = now + wait
        elif answer.wait > 0:
            self.counters["rate_wait"] += 1
            name = FLEET_SITE_RATE if site else FLEET_RATE
            text = f"{_whose(unit)}fleet rate: next start in {wait:.3g}s"
            until = now + wait
        else:
            self.counters["sessions_full"] += 1
            name = FLEET_SITE_LIMIT if site else FLEET_LIMIT
            here = sum(1 for t, q, _ in self.leases.values() if (t, q) == key)
            text = (f"waits for a {_whose(unit)}fleet session: {answer.in_use} of "
                    f"{limit.sessions if limit is not None else '?'} in use, {here} here")
            until = now + self.session_retry
        self._hold_back(entry, until, name, text, now)
        self.host.agent_next(call, transport)

    def _unavailable(self, call: AgentCall, entry: Entry, why: str, unit: str) -> None:
        self.counters["errors"] += 1
        self.down = True
        held = self.warn.allow(self.clock())
        hold = self.settings.failure == HOLD
        if held is not None:
            more = f" ({held} more since the last warning)" if held else ""
            doing = ("holding deliveries to shared destinations back" if hold
                     else "delivering under this node's own limits")
            self.host.log.warning(f"shared state {self.settings.endpoint}: {why}; {doing} "
                                  f"({FAILURE} = {self.settings.failure}; this warning at "
                                  f"most once a minute{more})")
        if not hold:  # leased here alone: the next renewal puts it in Redis's count
            self.leases[call] = (entry.queue.transport.name, unit, self.shared.member())
            self.host.fleet_admitted(call, entry)
            return
        now = self.clock()
        self._hold_back(entry, now + HOLD_RETRY, FAILURE,
                        "shared state unavailable (shared_state_failure = hold)", now)
        self.host.agent_next(call, entry.queue.transport.name)

    def _hold_back(self, entry: Entry, until: float, name: str, text: str,
                   now: float) -> None:
        transport = entry.queue.transport.name
        cf = self.settings.settings
        setting = (cf.which(name, transport) if cf is not None else None) or name
        self.host.apply(self.host.scheduler.hold_back(
            entry, until, setting, f"{entry.queue.nexthop} {text}", now, GATE_KIND))

    # -- the leases ---------------------------------------------------------------------

    def released(self, call: AgentCall) -> None:
        """The call's delivery ended (or never started): its session goes back, and
        on to the next delivery, here or elsewhere (:data:`pyqmgr.fleet.shared.RELEASE`)."""
        held = self.leases.pop(call, None)
        if held is not None:
            if not self._ended:
                asyncio.get_running_loop().call_later(QUIT_GRACE, self._give_back)
            self._ended.append(held)

    def _give_back(self) -> None:
        ended, self._ended = self._ended, []
        for transport, queue, lease in ended:
            more = self._waiting(transport, queue)
            if not more:
                self._done_waiting((transport, queue))
            self.host.spawn(self._release(transport, queue, lease, more=more))

    def _done_waiting(self, key: tuple[str, str]) -> None:
        """Nothing here waits for the destination now: mail that comes for it later
        asks the fleet at once instead of waiting to be handed a session."""
        self.full.discard(key)
        self.ask_again.pop(key, None)

    def _waiting(self, transport: str, unit: str) -> bool:
        """Whether this node has deliveries waiting for the unit."""
        return self.units.waiting(transport, unit)

    def _lift(self, transport: str, unit: str, held_only: bool) -> None:
        """Open the fleet's gate of the unit's destination, or of every destination of
        its site that the fleet holds (``held_only``: only a gate that is the fleet's)."""
        names = ([q.name for q in self.units.queues(transport, unit)]
                 if unit.startswith(SITE_UNIT) else [self.units.whole(unit)])
        t = self.host.scheduler.transports.get(transport)
        for name in names:
            shape = t.shapes.get(name) if t is not None else None
            if held_only and (shape is None or shape.gate is None
                              or shape.gate.kind != GATE_KIND):
                continue
            self.host.after_control(self.host.scheduler.lift_hold(
                transport, name, GATE_KIND, self.clock()))

    def _freed(self, payload: bytes) -> None:
        """Another process gave back a session: handed to this node (a lease in its
        name), or, for a destination with a fleet rate, news that it may ask again."""
        transport, _, rest = payload.decode("utf-8", "replace").partition("\n")
        queue, _, lease = rest.partition("\n")
        self.counters["told"] += 1
        if not self._waiting(transport, queue):
            # Nothing here wants it any more: the next in line gets it.
            self._done_waiting((transport, queue))
            if lease:
                self.host.spawn(self._release(transport, queue, lease, more=False))
            else:
                self.host.spawn(self._pass_on(transport, queue))
            return
        if lease:
            self.counters["handed"] += 1
            self._spare(transport, queue, lease)
            return
        self.ask_again.pop((transport, queue), None)
        self._lift(transport, queue, held_only=queue.startswith(SITE_UNIT))

    def _spare(self, transport: str, queue: str, lease: str) -> None:
        """A session for this node's next delivery to the destination: open its gate
        (if the fleet holds it) so that the next delivery starts on it; back after
        :data:`SPARE_TIME` unused."""
        key = (transport, queue)
        self.spares.setdefault(key, []).append((lease, self.clock()))
        if not self._sweep_armed:
            self._sweep_armed = True
            asyncio.get_running_loop().call_later(SPARE_TIME, _sweep, self)
        self._lift(transport, queue, held_only=True)

    async def _pass_on(self, transport: str, queue: str) -> None:
        self.counters["round_trips"] += 1
        try:
            with self.stats.timed():
                await self.shared.pass_on(transport, queue)
        except RedisUnavailable:
            pass  # the others ask again after their session retry time

    async def _release(self, transport: str, queue: str, lease: str, more: bool) -> None:
        limits = self.units.unit_limits(transport, queue)
        # With a fleet rate each start takes its own slot: the session is not handed on
        # then, the next in line is told to ask.
        limit = limits.sessions if limits is not None and limits.rate is None else 0
        self.counters["round_trips"] += 1
        try:
            with self.stats.timed():
                outcome, kept, _ = await self.shared.release(transport, queue, lease,
                                                             limit, more)
        except RedisUnavailable:
            # Given back again at the next renewal: a failover's new primary (a replica)
            # still counts it, and would until its lease ran out. Nothing is handed
            # here meanwhile, so the next start asks (and meets the failure mode).
            if not self.unreleased:  # tried again each HOLD_RETRY until Redis takes it
                asyncio.get_running_loop().call_later(HOLD_RETRY, self._recount, b"")
            if len(self.unreleased) < MAX_UNRELEASED:
                self.unreleased.append((transport, queue, lease))
            self.full.clear()
            self.ask_again.clear()
            return
        if outcome == KEPT:
            self.counters["kept"] += 1
            self._spare(transport, queue, kept)

    async def _renew(self) -> None:
        """Renew every lease held, a third of the lease time before it could expire."""
        while True:
            # This server's own lease time, never a longer one in force from another
            # record (issue #45): renewing sooner than needed keeps every lease.
            await asyncio.sleep(self.settings.lease_time / 3)
            await self._renew_all()

    def _recount(self, payload: bytes) -> None:
        """Redis lost its data (a node's admission found no epoch): count this node's
        deliveries under way again at once, within the recount's pause. A session this
        node waited to be handed may have been lost with the data: ask again instead."""
        _ask_again(self, list(self.full))
        self.host.spawn(self._renew_all())

    async def _renew_all(self) -> None:
        owed, self.unreleased = self.unreleased, []
        await asyncio.gather(*(self._release(t, q, lease, False) for t, q, lease in owed))
        # Given back: ask at once, not after the session retry time.
        _ask_again(self, {(t, q) for t, q, _ in owed} - {(t, q) for t, q, _ in self.unreleased})
        by_destination: dict[tuple[str, str], list[str]] = {}
        for transport, queue, lease in list(self.leases.values()):
            by_destination.setdefault((transport, queue), []).append(lease)
        for key, spares in self.spares.items():
            by_destination.setdefault(key, []).extend(lease for lease, _ in spares)
        try:
            with self.stats.timed():
                missing = await asyncio.gather(*(
                    self.shared.renew(t, q, leases) for (t, q), leases in
                    by_destination.items()))
        except RedisUnavailable:
            return  # the next round renews them, and counts again what expired meanwhile
        _recounted(self, sum(missing))

    async def give_back(self, timeout: float = EXIT_GIVE_BACK) -> None:
        """At exit (``postfix stop``, ``reload``): the sessions kept for this process's
        next deliveries, and those of deliveries just ended, go back to the fleet now,
        and on to whoever waits, not at their lease's end (up to a minute in which the
        fleet has that many sessions fewer). Deliveries under way keep theirs: after
        a reload their agents go on, and a lease given back early would let the fleet
        go over its limit."""
        held = list(self._ended) + [(t, q, lease) for (t, q), spares in self.spares.items()
                                    for lease, _ in spares]
        self._ended.clear()
        self.spares.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(self.roster.leave(), *(
                self._release(t, q, lease, more=False) for t, q, lease in held),
                *(part() for part in self.at_exit)), timeout)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.host.spawn(self.client.close())
        if self.listener is not None:
            self.host.spawn(self.listener.close())

    # -- throttling (dead sites, response rules): pyqmgr/daemon/fleet/news.py -------------

    def tell(self, found: tuple[Throttling, ...]) -> None:
        """Destinations this server just found dead or throttled: news for the others."""
        self.news.tell(found, self.units.shares)

    # -- status ---------------------------------------------------------------------------

    def status(self) -> dict[str, object]:
        return fleet_status(self)


def _sweep(fleet: Fleet) -> None:
    """Sessions kept or handed here that no delivery took within SPARE_TIME go back."""
    fleet._sweep_armed = False
    stale = fleet.clock() - SPARE_TIME
    for key in list(fleet.spares):
        spares = fleet.spares[key]
        for lease, since in [sp for sp in spares if sp[1] <= stale]:
            spares.remove((lease, since))
            fleet.host.spawn(fleet._release(key[0], key[1], lease, more=False))
        if not spares:
            del fleet.spares[key]
    if fleet.spares:
        fleet._sweep_armed = True
        asyncio.get_running_loop().call_later(SPARE_TIME, _sweep, fleet)


def _ask_again(fleet: Fleet, keys: Iterable[tuple[str, str]]) -> None:
    """The fleet's gates of these destinations open, their waits for a handed session
    forgotten: the next start asks Redis."""
    for transport, unit in keys:
        fleet._done_waiting((transport, unit))
        fleet._lift(transport, unit, held_only=True)


def _recounted(fleet: Fleet, lost: int) -> None:
    """Deliveries under way that a renewal found missing from Redis's count."""
    if not lost:
        return
    fleet.counters["leases_recounted"] += lost
    if fleet.recount_warn.allow(fleet.clock()) is not None:
        fleet.host.log.warning(
            f"shared state {fleet.settings.endpoint}: {lost} deliveries under way were "
            "missing from Redis's count (Redis restarted, flushed, or too slow to renew): "
            "counted again; this warning at most once a minute")


def fleet_status(fleet: Fleet) -> dict[str, object]:
    """``pyqmgr status``'s fleet block: this server's view of the destinations it asked
    about, its counts, and the roster's last read."""
    here = Tally((t, q) for t, q, _ in fleet.leases.values())
    destinations = [
        {"transport": t, "queue": q, "fleet_sessions": in_use, "limit": limit,
         "here": here.get((t, q), 0),
         "text": f"{in_use} of {limit} fleet sessions, {here.get((t, q), 0)} here"
         if limit else f"{here.get((t, q), 0)} here"}
        for (t, q), (in_use, limit) in sorted(fleet.seen.items())]
    return {"shared_state": str(fleet.settings.endpoint), "node": fleet.settings.node,
            "destinations": destinations,
            "failure": fleet.settings.failure, "connected": fleet.client.connected,
            "unavailable": fleet.down, "leases_held": len(fleet.leases),
            **{name: fleet.counters[name] for name in COUNTED}, **fleet.roster.summary()}

