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
  while the delivery runs and given back when it ends, however it ends;
* **refused**: the entry goes back to its queue and the destination is gated
  (``fleet`` in ``pyqmgr explain``) until the rate allows a start, or, when the
  fleet's sessions are all in use, until a session is given back: Redis announces it
  to the process that has waited longest (a channel of its own, see
  :mod:`pyqmgr.fleet.shared`), and :data:`SESSION_RETRY` covers what nobody
  announces. The agent is given another
  entry. Nothing is deferred and nothing logged per refusal: waiting for the
  fleet is the normal state of a busy destination.
* **Redis slow or gone** (no answer within ``shared_state_timeout``):
  ``shared_state_failure = local`` delivers under the node's own limits,
  ``hold`` holds the destination back for :data:`HOLD_RETRY`; either way a warning at
  most once a minute, and a line when Redis answers again. No delivery is lost or
  doubled: the request is sent once, after the answer, or not at all.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter as Tally
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from pyqmgr.fleet.client import RedisClient, RedisUnavailable, Subscriber
from pyqmgr.fleet.settings import (
    FAILURE,
    FLEET_LIMIT,
    FLEET_RATE,
    HOLD,
    FleetSettings,
    Limits,
)
from pyqmgr.fleet.shared import Admission, Shared, news_payload, parse_news
from pyqmgr.postfix.policy_delegation import WarnGate
from pyqmgr.scheduler.decisions import DEAD
from pyqmgr.scheduler.structures import ERROR, RETRY

if TYPE_CHECKING:
    from pyqmgr.daemon.delivery import AgentCall
    from pyqmgr.daemon.suspensions import Suspensions
    from pyqmgr.postfix.maillog_client import MailLog
    from pyqmgr.scheduler.core import Scheduler
    from pyqmgr.scheduler.decisions import Decisions, Throttling
    from pyqmgr.scheduler.entry import Entry

#: The gate explain shows for a destination the fleet holds back.
GATE_KIND = "fleet"
#: How long a destination whose fleet sessions are all in use waits before it asks
#: again unless told sooner: a session given back is announced to the first process
#: waiting for it (and this node's own ends reopen its gate at once), so this only
#: covers what no one announces: a dead node's leases expiring, a lost message.
SESSION_RETRY = 1.0
#: How long ``shared_state_failure = hold`` holds a destination back per try.
HOLD_RETRY = 1.0
#: Destinations whose fleet figures ``pyqmgr status`` remembers.
SEEN_MEMORY = 1000


class FleetHost(Protocol):
    """What the fleet needs of the daemon (daemon/qmgr.py's Qmgr), declared here so
    that this module does not import the daemon that imports it."""

    @property
    def log(self) -> MailLog: ...

    @property
    def scheduler(self) -> Scheduler: ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...

    def apply(self, decisions: Decisions) -> Entry | None: ...

    def after_control(self, decisions: Decisions) -> None: ...

    def fleet_admitted(self, call: AgentCall, entry: Entry) -> None: ...

    @property
    def suspensions(self) -> Suspensions: ...

    def agent_next(self, call: AgentCall, name: str) -> None: ...


#: How a suspension made by the fleet's table says so in its "by" (and the maillog).
FLEET_MARK = " (fleet)"
#: What ``pyqmgr status`` counts of the fleet's answers to this server.
COUNTED = ("asked", "admitted", "sessions_full", "rate_wait", "told", "errors",
           "throttling_told", "throttling_heard")


class Fleet:
    def __init__(self, host: FleetHost, settings: FleetSettings,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = RedisClient(settings.endpoint, timeout=settings.timeout,
                                  retry_delay=1.0, clock=clock)
        self.host, self.settings, self.clock = host, settings, clock
        self.shared = Shared(self.client, settings.prefix, settings.node,
                             settings.lease_time)
        self._limits: dict[str, Limits | None] = {}
        #: The lease each admitted delivery holds: call -> (transport, queue, lease).
        self.leases: dict[AgentCall, tuple[str, str, str]] = {}
        self.warn = WarnGate(60.0)
        self.down = False
        self.counters: Tally[str] = Tally()
        self._tasks: list[asyncio.Task[None]] = []
        #: The fleet's suspensions in force here, by target: the record as read.
        self.applied: dict[str, dict[str, object]] = {}
        #: What the fleet last said of each destination asked about: (sessions in use
        #: fleet-wide, the limit), the most recent :data:`SEEN_MEMORY` destinations.
        self.seen: OrderedDict[tuple[str, str], tuple[int, int]] = OrderedDict()
        #: Destinations whose fleet sessions were all in use at the last answer, and
        #: the questions out per destination (both bounded by the destinations waiting).
        self.full: set[tuple[str, str]] = set()
        self.asking: dict[tuple[str, str], int] = {}
        #: Whether each transport's throttling is the fleet's (``fleet_throttling``).
        self._shares: dict[str, bool] = {}
        self.news_warn = WarnGate(60.0)

    def limits(self, transport: str) -> Limits | None:
        """The transport's fleet limits, or None when its deliveries ask nobody."""
        if transport in self._limits:
            return self._limits[transport]
        found: Limits | None = None
        if transport not in (RETRY, ERROR):
            limits = self.settings.limits_for(transport)
            found = limits if limits.active else None
        self._limits[transport] = found
        return found

    def shares(self, transport: str) -> bool:
        """Whether the transport's dead sites and throttling are the fleet's."""
        found = self._shares.get(transport)
        if found is None:
            found = self._shares[transport] = (
                transport not in (RETRY, ERROR) and self.settings.shares_throttling(transport))
        return found

    # -- asking -------------------------------------------------------------------------

    def start(self) -> None:
        """On the event loop: renew leases, hear of freed sessions, of the fleet's
        suspensions (read once now, and again at every resubscription) and of the
        throttling other servers find; tell them what this one finds."""
        loop = asyncio.get_running_loop()
        ep, timeout = self.settings.endpoint, self.settings.timeout
        self.host.scheduler.share_throttling = True
        self._tasks = [
            loop.create_task(self._renew()),
            loop.create_task(Subscriber(ep, self.shared.channel, self._freed,
                                        timeout=timeout).run()),
            loop.create_task(Subscriber(ep, self.shared.suspensions_channel,
                                        self._suspensions_changed, timeout=timeout,
                                        on_subscribed=lambda: self._suspensions_changed(b"")
                                        ).run()),
            loop.create_task(Subscriber(ep, self.shared.throttling_channel,
                                        self._throttling_heard, timeout=timeout).run())]

    def admit(self, call: AgentCall, entry: Entry, limits: Limits) -> None:
        """Ask the fleet about the selected entry; the answer comes to :meth:`decided`."""
        self.host.spawn(self._admit(call, entry, limits))

    async def _admit(self, call: AgentCall, entry: Entry, limits: Limits) -> None:
        queue = entry.queue
        key = (queue.transport.name, queue.name)
        if key in self.full and self.asking.get(key, 0):
            # The fleet's sessions were all in use at the last answer and a question
            # is out already: when a session comes back one question takes it, the
            # agents of this node need not all ask and all but one be refused.
            self.decided(call, entry, Admission(False, 0.0, self.seen.get(key, (0, 0))[0]))
            return
        self.counters["asked"] += 1
        self.asking[key] = self.asking.get(key, 0) + 1
        interval = limits.rate.interval if limits.rate is not None else 0.0
        try:
            answer: Admission | str = await self.shared.admit(
                key[0], key[1], limits.sessions, interval, limits.burst,
                more=queue.todo.size > 0)
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
            # is likely refused too, so only one at a time until a session comes back.
            self.full.add(key)
        else:
            self.full.discard(key)
        self.decided(call, entry, answer)

    def decided(self, call: AgentCall, entry: Entry, answer: Admission | str) -> None:
        """Apply the fleet's answer, or the failure mode for none; synchronous."""
        queue = entry.queue
        transport = queue.transport.name
        if isinstance(answer, str):
            self._unavailable(call, entry, answer)
            return
        if self.down:
            self.down = False
            self.host.log.info(f"shared state {self.settings.endpoint}: answering again; "
                               "fleet limits apply")
        key = (transport, queue.name)
        limit = self.limits(transport)
        self.seen[key] = (answer.in_use, limit.sessions if limit is not None else 0)
        self.seen.move_to_end(key)
        if len(self.seen) > SEEN_MEMORY:
            self.seen.popitem(last=False)
        if answer.admitted:
            self.counters["admitted"] += 1
            if answer.lease:
                self.leases[call] = (transport, queue.name, answer.lease)
            self.host.fleet_admitted(call, entry)
            return
        now = self.clock()
        if answer.wait > 0:
            self.counters["rate_wait"] += 1
            name = FLEET_RATE
            text = f"fleet rate: next start in {answer.wait:.3g}s"
            until = now + answer.wait
        else:
            self.counters["sessions_full"] += 1
            name = FLEET_LIMIT
            here = sum(1 for t, q, _ in self.leases.values() if (t, q) == key)
            text = (f"waits for a fleet session: {answer.in_use} of "
                    f"{limit.sessions if limit is not None else '?'} in use, {here} here")
            until = now + SESSION_RETRY
        self._hold_back(entry, until, name, text, now)
        self.host.agent_next(call, transport)

    def _unavailable(self, call: AgentCall, entry: Entry, why: str) -> None:
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
        if not hold:
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
        """The call's delivery ended (or never started): its session goes back."""
        held = self.leases.pop(call, None)
        if held is not None:
            # Redis tells whoever waited longest for a session, this node or another.
            self.host.spawn(self._release(*held))

    def _freed(self, payload: bytes) -> None:
        """Another process gave back a session this node waits for: ask again now."""
        transport, _, queue = payload.decode("utf-8", "replace").partition("\n")
        self.counters["told"] += 1
        t = self.host.scheduler.transports.get(transport)
        waiting = t.queues.get(queue) if t is not None else None
        if waiting is None or not waiting.todo.size:
            # Nothing here wants it any more: the next in line should hear of it.
            self.host.spawn(self._pass_on(transport, queue))
            return
        self.host.after_control(self.host.scheduler.lift_hold(transport, queue, GATE_KIND,
                                                              self.clock()))

    async def _pass_on(self, transport: str, queue: str) -> None:
        try:
            await self.shared.pass_on(transport, queue)
        except RedisUnavailable:
            pass  # the others ask again after SESSION_RETRY

    async def _release(self, transport: str, queue: str, lease: str) -> None:
        try:
            await self.shared.release(transport, queue, lease)
        except RedisUnavailable:
            pass  # the lease expires by itself within shared_state_lease_time

    async def _renew(self) -> None:
        """Renew every lease held, a third of the lease time before it could expire."""
        while True:
            await asyncio.sleep(self.settings.lease_time / 3)
            by_destination: dict[tuple[str, str], list[str]] = {}
            for transport, queue, lease in list(self.leases.values()):
                by_destination.setdefault((transport, queue), []).append(lease)
            try:
                await asyncio.gather(*(self.shared.renew(t, q, leases)
                                       for (t, q), leases in by_destination.items()))
            except RedisUnavailable:
                pass  # next round; a lease lost meanwhile only lets the fleet go over

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.host.spawn(self.client.close())

    # -- throttling (dead sites, response rules) ----------------------------------------

    def tell(self, found: tuple[Throttling, ...]) -> None:
        """Destinations this server just found dead or throttled: news for the others."""
        for news in found:
            if self.shares(news.transport):
                self.host.spawn(self._tell(news))

    async def _tell(self, news: Throttling) -> None:
        try:
            await self.shared.tell_throttling(
                news_payload(news, self.settings.node, self.shared.instance))
            self.counters["throttling_told"] += 1
        except RedisUnavailable as exc:
            state = "dead" if news.kind == DEAD else "throttled"
            self.host.log.warning(
                f"shared state {self.settings.endpoint}: the fleet did not hear that "
                f"{news.nexthop} ({news.transport}) is {state}: {exc}")

    def _throttling_heard(self, payload: bytes) -> None:
        """Another server found a destination dead or throttled: so it is here."""
        try:
            news, node, instance = parse_news(payload)
        except ValueError as exc:
            held = self.news_warn.allow(self.clock())
            if held is not None:
                more = f" ({held} more since the last warning)" if held else ""
                self.host.log.warning(
                    f"shared state {self.settings.endpoint}: ignored a notice of throttling "
                    f"that is not one ({exc}){more}; this warning at most once a minute")
            return
        if instance == self.shared.instance or not self.shares(news.transport):
            return
        self.counters["throttling_heard"] += 1
        self.host.after_control(self.host.scheduler.learnt(news, node, self.clock()))

    # -- suspensions (pyqmgr suspend --fleet) -------------------------------------------

    def share_suspension(self, target: str, reason: str, ttl: float, who: str) -> None:
        """A suspension made here with --fleet: into the fleet's table, news to all."""
        record = {"target": target, "reason": reason, "by": who,
                  "node": self.settings.node, "until": time.time() + ttl}
        self.applied[target] = record
        news = json.dumps({"by": who, "node": self.settings.node})
        self.host.spawn(self._set_suspension(target, json.dumps(record), news))

    def end_suspension(self, target: str, who: str) -> None:
        """``pyqmgr resume --fleet`` here: out of the table, news to all."""
        self.applied.pop(target, None)
        news = json.dumps({"by": who, "node": self.settings.node})
        self.host.spawn(self._set_suspension(target, "", news))

    async def _set_suspension(self, target: str, record: str, news: str) -> None:
        try:
            await self.shared.set_suspension(target, record, news)
        except RedisUnavailable as exc:
            self.host.log.warning(f"shared state {self.settings.endpoint}: the fleet did "
                                  f"not hear of the suspension of {target}: {exc}; it "
                                  "holds on this server only")

    def _suspensions_changed(self, news: bytes) -> None:
        self.host.spawn(self._sync_suspensions(news))

    async def _sync_suspensions(self, news: bytes) -> None:
        """Bring this server's suspensions in line with the fleet's table."""
        try:
            table = await self.shared.suspensions()
        except RedisUnavailable:
            return  # the next news, or the next resubscription, reads it again
        try:
            said = json.loads(news) if news else {}
        except ValueError:
            said = {}
        ender = (f"{said.get('by', '?')} on {said.get('node', '?')}{FLEET_MARK}"
                 if isinstance(said, dict) else "the fleet")
        now = time.time()
        current: dict[str, dict[str, object]] = {}
        for target, raw in table.items():
            record = _record(raw)
            if record is not None and float(record["until"]) > now:  # type: ignore[arg-type]
                current[target] = record
        controls = self.host.suspensions
        for target, record in current.items():
            if self.applied.get(target) == record:
                continue
            self.applied[target] = record
            if record["node"] == self.settings.node and any(
                    s.target.spec == target for s in self.host.scheduler.suspensions):
                continue  # made here (or in this node's last life) and in force here
            try:
                controls.suspend(target, str(record["reason"]),
                                 float(record["until"]) - now,  # type: ignore[arg-type]
                                 f"{record['by']} on {record['node']}{FLEET_MARK}")
            except Exception as exc:  # noqa: BLE001 - one bad record must not stop the rest
                self.host.log.warning(f"shared state: the fleet's suspension of "
                                      f"{target} cannot hold here: {exc}")
        ended = [t for t in self.applied if t not in current]
        for target in ended:
            record = self.applied.pop(target)
            if float(record["until"]) <= now:  # type: ignore[arg-type]
                ended.remove(target)  # ended by its ttl, here as everywhere
        # A fleet suspension this server kept across a restart (its state file) that
        # the fleet ended meanwhile: ended here too.
        ended += [s.target.spec for s in self.host.scheduler.suspensions
                  if s.who.endswith(FLEET_MARK) and s.target.spec not in current
                  and s.target.spec not in ended]
        for target in ended:
            try:
                controls.resume(target, ender)
            except Exception:  # noqa: BLE001, S110 - resumed here already
                pass

    # -- status ---------------------------------------------------------------------------

    def status(self) -> dict[str, object]:
        here = Tally((t, q) for t, q, _ in self.leases.values())
        destinations = [
            {"transport": t, "queue": q, "fleet_sessions": in_use, "limit": limit,
             "here": here.get((t, q), 0),
             "text": f"{in_use} of {limit} fleet sessions, {here.get((t, q), 0)} here"
             if limit else f"{here.get((t, q), 0)} here"}
            for (t, q), (in_use, limit) in sorted(self.seen.items())]
        return {"shared_state": str(self.settings.endpoint), "node": self.settings.node,
                "destinations": destinations,
                "failure": self.settings.failure, "connected": self.client.connected,
                "unavailable": self.down, "leases_held": len(self.leases),
                **{name: self.counters[name] for name in COUNTED}}


def _record(raw: bytes) -> dict[str, object] | None:
    """A suspension record from the fleet's table, or None if it is not one."""
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(record, dict) or not all(
            isinstance(record.get(k), str) for k in ("target", "reason", "by", "node")):
        return None
    if not isinstance(record.get("until"), int | float):
        return None
    return record
