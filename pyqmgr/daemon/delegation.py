"""Delivery policy delegation: ask a policy service before a delivery starts (#13).

With ``delivery_policy_service = inet:HOST:PORT`` (or ``unix:PATH``) in pyqmgr.cf,
each delivery the scheduler selects is first put to that service over Postfix's policy
protocol (:mod:`pyqmgr.postfix.policy_delegation`), so a site can limit its outgoing
mail with the servers it already runs for smtpd, postfwd's ``rate()`` for one.
Off unless set: with no such setting this module is never asked anything and the
daemon behaves as stock.

Why it is built this way:

* **Never blocking.** The agent has announced itself and the entry is selected (it
  counts against the destination's window, as a delivery does); the question goes out
  as a task and the agent waits with its reader off (:class:`AgentCall` state
  ``policy``). The answer, or the client's timeout, comes back to synchronous code
  that applies it through the core's I/O-free API
  (:meth:`~pyqmgr.scheduler.core.Scheduler.hold_back`, ``reject_to_error``,
  ``drop_message``), then sends the request or gives the same agent another entry.
* **Nothing lost.** Every outcome either delivers, keeps the recipients in core
  (DEFER), hands them to error(8) (REJECT with bounce) or moves the file to hold/
  (HOLD). A service that is slow, unreachable or speaks garbage gets
  ``delivery_policy_default_action`` (DUNNO: deliver; fail open), with a warning at most
  once a minute per service.
* **Settings** follow Postfix's ``<transport>_NAME`` rule and are all checked at
  start-up (every form set), so a typo is a fatal error naming pyqmgr.cf and the
  parameter, not a surprise when a transport is first used. One client (a pool of
  persistent connections) per distinct service and pool settings, made lazily on the
  event loop.

The ``attempt`` attribute: pyqmgr keeps no attempt count on disk (nor does Postfix),
so it is counted in memory per queue id: 1 when a message first comes from
``incoming/``, one more each time it comes back into the active queue, and at least 2
for mail from ``deferred/``. The table holds the :data:`ATTEMPT_MEMORY` most recent
queue ids; a restart forgets it (mail from deferred/ then says 2).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

from pyqmgr.daemon.host import QmgrCore
from pyqmgr.durations import duration
from pyqmgr.postfix.policy_delegation import (
    MAX_DELAY,
    MIN_DELAY,
    Decision,
    DeliveryRequest,
    Endpoint,
    PolicyClient,
    PolicyError,
    Verdict,
    WarnGate,
    parse_endpoint,
)
from pyqmgr.pyqmgr_cf import PyqmgrCf, PyqmgrCfError
from pyqmgr.scheduler.core import ERROR, RETRY
from pyqmgr.scheduler.queue import Dsn
from pyqmgr.scheduler.shaping import ShapingError, parse_duration

if TYPE_CHECKING:
    from pyqmgr.daemon.active import ActiveMessage
    from pyqmgr.daemon.delivery import AgentCall
    from pyqmgr.scheduler.entry import Entry


class DelegationHost(QmgrCore, Protocol):
    """What delegation needs of the daemon (daemon/qmgr.py's Qmgr) beyond the core: the
    two ways an asked-about delivery goes on. Declared here so that this module does not
    import the daemon that imports it."""

    def agent_deliver(self, call: AgentCall, entry: Entry) -> None: ...

    def agent_next(self, call: AgentCall, name: str) -> None: ...

SERVICE = "delivery_policy_service"
TIMEOUT = "delivery_policy_timeout"
DEFAULT_ACTION = "delivery_policy_default_action"
DEFER_DELAY = "delivery_policy_defer_delay"
REJECT = "delivery_policy_reject"
HOLD = "delivery_policy_hold"
CONNECTIONS = "delivery_policy_connections"
CONTEXT = "delivery_policy_context"
NAMES = (SERVICE, TIMEOUT, DEFAULT_ACTION, DEFER_DELAY, REJECT, HOLD, CONNECTIONS, CONTEXT)

#: The gate kind explain shows for a destination a service held back.
GATE_KIND = "policy service"
#: Bounds of delivery_policy_timeout: an agent process waits this long at most.
MAX_TIMEOUT = 300.0
MAX_CONNECTIONS = 100
#: Queue ids whose attempt count is remembered (about 100 bytes each).
ATTEMPT_MEMORY = 50_000
#: How often idle pooled connections are checked for expiry.
EXPIRE_INTERVAL = 10.0


@dataclass(frozen=True)
class ServiceSettings:
    """One transport's delegation settings (the ``<transport>_`` forms resolved)."""

    #: delivery_policy_service: where the service listens.
    endpoint: Endpoint
    #: delivery_policy_timeout: how long an answer may take.
    timeout: float = 5.0
    #: delivery_policy_default_action: what no answer means (DUNNO or DEFER).
    default_action: str = "DUNNO"
    #: delivery_policy_defer_delay: how long a DEFER holds a destination back.
    defer_delay: float = 60.0
    #: delivery_policy_reject: a REJECT defers or bounces.
    reject: str = "defer"
    #: delivery_policy_hold: a HOLD moves the message to hold/ or defers (a service
    #: that answers HOLD to everything must not be able to stop all mail: issue #31).
    hold: str = "hold"
    #: delivery_policy_connections: pooled connections to the service.
    connections: int = 4
    #: delivery_policy_context: sent as the request's ``policy_context``.
    context: str = ""

    @property
    def pool_key(self) -> tuple[str, float, int]:
        return (str(self.endpoint), self.timeout, self.connections)


def _check(settings: PyqmgrCf, name: str, transport: str | None,
           value: str) -> object:
    """Parse one value; PyqmgrCfError naming the parameter actually set."""
    used = settings.which(name, transport) or name
    text = value.strip()
    try:
        if name == SERVICE:
            return parse_endpoint(text) if text else None
        if name in (TIMEOUT, DEFER_DELAY):
            seconds = parse_duration(text, used)
            lo, hi = (0.001, MAX_TIMEOUT) if name == TIMEOUT else (MIN_DELAY, MAX_DELAY)
            if not lo <= seconds <= hi:
                raise ValueError(f"{text!r} is out of range {lo:g}s..{hi:g}s")
            return seconds
        if name == DEFAULT_ACTION:
            if text.upper() not in ("DUNNO", "DEFER"):
                raise ValueError(f'"{text}" is neither DUNNO (deliver) nor DEFER')
            return text.upper()
        if name == REJECT:
            if text.lower() not in ("defer", "bounce"):
                raise ValueError(f'"{text}" is neither defer nor bounce')
            return text.lower()
        if name == HOLD:
            if text.lower() not in ("hold", "defer"):
                raise ValueError(f'"{text}" is neither hold nor defer')
            return text.lower()
        if name == CONNECTIONS:
            if not text.isdigit() or not 1 <= int(text) <= MAX_CONNECTIONS:
                raise ValueError(f'"{text}" is not a whole number from 1 to '
                                 f"{MAX_CONNECTIONS}")
            return int(text)
        return value
    except ShapingError as exc:
        raise settings.error(used, str(exc).removeprefix(f"{used}: ")) from None
    except ValueError as exc:
        raise settings.error(used, str(exc)) from None


def suffix_of(key: str) -> str | None:
    """The delegation parameter ``key`` sets, in either form, or None."""
    for name in NAMES:
        if key == name or key.endswith("_" + name):
            return name
    return None


class DelegationSetup:
    """pyqmgr.cf's delegation settings, every form checked at start-up."""

    def __init__(self, settings: PyqmgrCf) -> None:
        self.settings = settings
        self.names = [k for k in settings.values if suffix_of(k) is not None]
        for key in self.names:
            name = suffix_of(key)
            assert name is not None
            transport = key[:-len(name) - 1] or None
            _check(settings, name, transport, settings.values[key])
        self._cache: dict[str, ServiceSettings | None] = {}

    @property
    def active(self) -> bool:
        """Does any transport have a service? (None set: the daemon stays stock.)"""
        return any(suffix_of(k) == SERVICE and self.settings.values[k].strip()
                   for k in self.names)

    def for_transport(self, transport: str) -> ServiceSettings | None:
        """The transport's settings, or None when it asks no service."""
        if transport in self._cache:
            return self._cache[transport]
        found: ServiceSettings | None = None
        if transport not in (ERROR, RETRY):
            endpoint = self._get(SERVICE, transport)
            if isinstance(endpoint, Endpoint):
                value = self._value
                found = ServiceSettings(
                    endpoint,
                    timeout=cast(float, value(TIMEOUT, transport, 5.0)),
                    default_action=cast(str, value(DEFAULT_ACTION, transport, "DUNNO")),
                    defer_delay=cast(float, value(DEFER_DELAY, transport, 60.0)),
                    reject=cast(str, value(REJECT, transport, "defer")),
                    hold=cast(str, value(HOLD, transport, "hold")),
                    connections=cast(int, value(CONNECTIONS, transport, 4)),
                    context=cast(str, value(CONTEXT, transport, "")))
        self._cache[transport] = found
        return found

    def _get(self, name: str, transport: str) -> object:
        value = self.settings.get(name, transport)
        return None if value is None else _check(self.settings, name, transport, value)

    def _value(self, name: str, transport: str, default: object) -> object:
        # The value was checked at start-up: parsing again cannot fail.
        value = self._get(name, transport)
        return default if value is None else value


def setup(settings: PyqmgrCf) -> DelegationSetup | None:
    """Start-up's check of the delegation settings; None when no transport asks."""
    found = DelegationSetup(settings)
    return found if found.active else None


@dataclass
class Counters:
    """One transport's dealings with its service, for ``pyqmgr status``."""

    asked: int = 0
    deliver: int = 0
    defer: int = 0
    hold: int = 0
    reject: int = 0
    unknown: int = 0
    errors: int = 0


@dataclass
class Service:
    """A transport's service as the running daemon uses it."""

    settings: ServiceSettings
    client: PolicyClient
    gate: WarnGate
    counters: Counters = field(default_factory=Counters)

    @property
    def name(self) -> str:
        return f"delivery policy service {self.settings.endpoint}"


class Delegation:
    """The daemon's delegation: services by transport, the questions under way."""

    def __init__(self, qmgr: DelegationHost, setup: DelegationSetup,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.qmgr = qmgr
        self.setup = setup
        self.clock = clock
        self._services: dict[str, Service | None] = {}
        self._clients: dict[tuple[str, float, int], PolicyClient] = {}
        self._gates: dict[str, WarnGate] = {}
        self._attempts: OrderedDict[str, int] = OrderedDict()
        self._instance = itertools.count(1)
        self._expiry: asyncio.Task[None] | None = None

    # -- which transports ask ------------------------------------------------------

    def service(self, transport: str) -> Service | None:
        """The transport's service (made on first use, on the event loop), or None."""
        svc = self._services.get(transport, self)
        if svc is not self:
            return svc  # type: ignore[return-value]
        settings = self.setup.for_transport(transport)
        found: Service | None = None
        if settings is not None:
            key = settings.pool_key
            client = self._clients.get(key)
            if client is None:
                client = self._clients[key] = PolicyClient(
                    settings.endpoint, timeout=settings.timeout,
                    max_connections=settings.connections)
                if self._expiry is None:
                    self._expiry = asyncio.get_running_loop().create_task(self._expire())
            gate = self._gates.setdefault(str(settings.endpoint), WarnGate(60.0))
            found = Service(settings, client, gate)
        self._services[transport] = found
        return found

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_INTERVAL)
            for client in self._clients.values():
                client.expire_idle()

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        if self._expiry is not None:
            self._expiry.cancel()

    # -- asking ---------------------------------------------------------------------

    def attempt(self, am: ActiveMessage) -> int:
        """This activation's attempt number (see the module docstring)."""
        if am.policy_attempt is not None:
            return am.policy_attempt
        n = self._attempts.pop(am.queue_id, 0) + 1
        if am.source == "deferred":
            n = max(n, 2)
        self._attempts[am.queue_id] = n
        while len(self._attempts) > ATTEMPT_MEMORY:
            self._attempts.popitem(last=False)
        am.policy_attempt = n
        return n

    def request(self, entry: Entry, svc: Service) -> DeliveryRequest:
        am: ActiveMessage = entry.message.owner
        queue = entry.queue
        return DeliveryRequest(
            queue_id=am.queue_id, sender=am.request.sender,
            recipient=entry.recipients[0].address if entry.recipients else "",
            recipient_count=len(entry.recipients), size=max(am.qf.cont_length, 0),
            instance=f"{am.queue_id}.{next(self._instance)}",
            transport=queue.transport.name, nexthop=queue.nexthop,
            destination_window=max(queue.window, 0),
            # The entry being asked about is counted as selected: not in flight yet.
            destination_in_flight=max(queue.busy_count - 1, 0),
            attempt=self.attempt(am), policy_context=svc.settings.context)

    def ask(self, call: AgentCall, entry: Entry, svc: Service) -> None:
        """Put the selected entry to the service; the answer comes back to :meth:`decided`."""
        svc.counters.asked += 1
        self.qmgr.spawn(self._ask(call, entry, svc, self.request(entry, svc)))

    async def _ask(self, call: AgentCall, entry: Entry, svc: Service,
                   request: DeliveryRequest) -> None:
        decision: Decision | None = None
        error: str | None = None
        try:
            decision = await svc.client.ask(request)
        except PolicyError as exc:
            # The client's text starts with "policy service ENDPOINT: ": said already.
            error = exc.text.removeprefix(f"policy service {svc.settings.endpoint}: ")
        except Exception as exc:  # noqa: BLE001 - a bug must not strand the agent
            error = f"internal error: {type(exc).__name__}: {exc}"
        self.decided(call, entry, svc, decision, error)

    # -- applying the answer ----------------------------------------------------------

    def decided(self, call: AgentCall, entry: Entry, svc: Service,
                decision: Decision | None, error: str | None) -> None:
        """Apply an answer (or the default action for a failure); synchronous."""
        qmgr = self.qmgr
        log = qmgr.log
        am: ActiveMessage = entry.message.owner
        qid = am.queue_id
        queue = entry.queue
        transport = queue.transport.name
        now = time.monotonic()
        where = f"{queue.nexthop} ({transport})"
        if am.hold is not None:
            # An earlier answer put the message on hold: this entry waits no more.
            qmgr.apply(qmgr.scheduler.drop_message(entry, now))
            qmgr.agent_next(call, transport)
            return
        if decision is None:
            svc.counters.errors += 1
            held = svc.gate.allow(self.clock())
            action = svc.settings.default_action
            if held is not None:
                more = f" ({held} more since the last warning)" if held else ""
                doing = "delivering" if action == "DUNNO" else "holding deliveries back"
                log.warning(f"{svc.name}: {error}; {doing} by {DEFAULT_ACTION} = "
                            f"{action} (this warning at most once a minute{more})")
            if action == "DUNNO":
                qmgr.agent_deliver(call, entry)
                return
            self._hold_back(entry, svc, svc.settings.defer_delay, where,
                            f"no answer ({DEFAULT_ACTION} = DEFER)", now)
            qmgr.agent_next(call, transport)
            return
        for note in decision.notes:
            severity = "info" if decision.command.upper() in ("WARN", "INFO") else "warning"
            log.log(severity, f"{qid}: {svc.name}: {note}")
        verdict = decision.verdict
        if verdict in (Verdict.DELIVER, Verdict.UNKNOWN):
            if verdict is Verdict.DELIVER:
                svc.counters.deliver += 1
            else:
                svc.counters.unknown += 1
            qmgr.agent_deliver(call, entry)
            return
        reply = f'"{decision.action.strip()}"'
        if verdict is Verdict.HOLD:
            self._held(am, entry, svc, reply, where, now)
        elif verdict is Verdict.REJECT and svc.settings.reject == "bounce":
            svc.counters.reject += 1
            assert decision.dsn is not None
            n = len(entry.recipients)
            rejected = qmgr.scheduler.reject_to_error(entry, Dsn(decision.dsn, decision.text),
                                                      now)
            qmgr.apply(rejected)
            if rejected.rejected:
                log.info(f"{qid}: {svc.name} rejected delivery to {where}: {reply}; "
                         f"{n} recipient{'s' if n != 1 else ''} bounced through "
                         f"{ERROR}(8) ({REJECT} = bounce)")
            else:
                self._hold_back(entry, svc, svc.settings.defer_delay, where,
                                f"replied {reply}, and the error transport is "
                                "unavailable", now)
        elif verdict is Verdict.REJECT:
            svc.counters.reject += 1
            delay = svc.settings.defer_delay
            log.warning(f"{qid}: {svc.name} replied {reply} for delivery to {where}; "
                        f"treated as DEFER, as {REJECT} = defer (set {REJECT} = bounce "
                        "to bounce)")
            self._hold_back(entry, svc, delay, where, f"replied {reply}", now)
        else:
            svc.counters.defer += 1
            delay = decision.delay if decision.delay is not None else svc.settings.defer_delay
            self._hold_back(entry, svc, delay, where, f"replied {reply}", now)
        qmgr.agent_next(call, transport)

    def _held(self, am: ActiveMessage, entry: Entry, svc: Service, reply: str, where: str,
              now: float) -> None:
        """HOLD: the message to hold/, or with delivery_policy_hold = defer a DEFER."""
        svc.counters.hold += 1
        qid, log = am.queue_id, self.qmgr.log
        if svc.settings.hold == "defer":
            log.warning(f"{qid}: {svc.name} replied {reply} for delivery to {where}; "
                        f"treated as DEFER, as {HOLD} = defer")
            self._hold_back(entry, svc, svc.settings.defer_delay, where, f"replied {reply}",
                            now)
            return
        am.hold = f"{svc.name} replied {reply}"
        rcpt = entry.recipients[0].address if entry.recipients else ""
        from pyqmgr.daemon.active import log_address

        log.info(f"{qid}: hold: {svc.name} replied {reply} for delivery to {where}; "
                 f"from=<{log_address(am.request.sender)}> to=<{log_address(rcpt)}>")
        self.qmgr.apply(self.qmgr.scheduler.drop_message(entry, now))

    def _hold_back(self, entry: Entry, svc: Service, delay: float, where: str,
                   why: str, now: float) -> None:
        am: ActiveMessage = entry.message.owner
        text = f"held back {duration(delay)}: {svc.name} {why}"
        self.qmgr.log.info(f"{am.queue_id}: delivery to {where} {text}")
        transport = entry.queue.transport.name
        setting = self.setup.settings.which(SERVICE, transport) or SERVICE
        self.qmgr.apply(self.qmgr.scheduler.hold_back(entry, now + delay, setting,
                                                      f"{entry.queue.nexthop} {text}", now))

    # -- status ----------------------------------------------------------------------

    def status(self, transport: str) -> dict[str, object] | None:
        """What ``pyqmgr status`` shows for a transport's service (None: none)."""
        svc = self._services.get(transport)
        if svc is None:
            return None
        c = svc.counters
        return {"service": str(svc.settings.endpoint), "asked": c.asked,
                "deliver": c.deliver, "defer": c.defer, "hold": c.hold,
                "reject": c.reject, "unknown": c.unknown, "errors": c.errors,
                "connections": svc.client.open_connections(),
                "default_action": svc.settings.default_action}


def annotate(result: dict[str, object], delegation: Delegation | None) -> dict[str, object]:
    """Add each transport's service and counters to a ``status`` reply."""
    if delegation is None:
        return result
    transports = result.get("transports")
    if isinstance(transports, list):
        for t in transports:
            if isinstance(t, dict):
                found = delegation.status(str(t.get("name")))
                if found is not None:
                    t["delivery_policy"] = found
    return result


__all__ = ["CONNECTIONS", "CONTEXT", "DEFAULT_ACTION", "DEFER_DELAY", "Delegation",
           "DelegationSetup", "PyqmgrCfError", "REJECT", "SERVICE", "ServiceSettings",
           "TIMEOUT", "annotate", "setup"]
