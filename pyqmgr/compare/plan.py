"""A workload made concrete for real Postfix: every message, its recipients, when it arrives.

The simulator and ``pyqmgr compare`` read the same file; this module is what compare
adds. Every message gets a number in arrival order, and each recipient an address
that says which class, message and recipient it is (``bulk.m12.r3@big.example``), so
the maillog alone tells whose delivery a line is, in every contender's run alike.
The time scale multiplies the world's times (arrivals, latencies, timeouts,
``dead_until``) and divides its rates; Postfix's own settings stay as the file says,
except the retry timers, which default to Postfix's defaults scaled.

Destinations that name an MX host (``mx = "HOST"``, issue #33) share that host's
server, as in the simulator (:func:`~pyqmgr.simulator.remote.server_of`): the plan
lists them by host (:attr:`Plan.mx_hosts`), and the runner gives each host one sink
and real MX records. The server's own settings (its session limit, rate limit, the
time a refusal takes, being dead) must then agree between the host's destinations:
one sink plays them for all, and which destination a session is for is known only
at RCPT, after the server has accepted or refused it.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from dataclasses import dataclass, field

from pyqmgr.simulator.remote import server_of
from pyqmgr.simulator.scenario import (
    Destination,
    MessageSpec,
    Scenario,
    ScenarioError,
    TraceMessage,
)

#: Recipient addresses of a compare run: CLASS.mMESSAGE.rRECIPIENT@DOMAIN.
ADDRESS = re.compile(r"^(?P<klass>[A-Za-z0-9_]+)\.m(?P<mid>\d+)\.r(?P<rcpt>\d+)@"
                     r"(?P<domain>[A-Za-z0-9.-]+)$")
#: Postfix's defaults for the retry timers, scaled unless the workload sets them.
RETRY_TIMERS = {"minimal_backoff_time": 300, "maximal_backoff_time": 4000,
                "queue_run_delay": 300}
#: A server's settings, which the destinations of one MX host must agree on: the sink
#: that plays the host decides them before it knows the session's destination.
SERVER_SETTINGS = ("server_limit", "overload", "rate_limit", "rate_reply", "reject_time",
                   "dead", "dead_mode", "dead_until", "dead_until_low")


def address(klass: str, mid: int, rcpt: int, domain: str) -> str:
    return f"{klass}.m{mid}.r{rcpt}@{domain}"


def parse_address(addr: str) -> tuple[str, int, int, str] | None:
    """(class, message number, recipient number, domain) of a workload recipient."""
    m = ADDRESS.match(addr)
    if m is None:
        return None
    return m["klass"], int(m["mid"]), int(m["rcpt"]), m["domain"].lower()


@dataclass(frozen=True)
class Arrival:
    """One message: when it is submitted (seconds after the run's start, scaled)."""

    mid: int
    at: float
    klass: str
    sender: str
    size: int
    recipients: tuple[str, ...]


@dataclass
class Plan:
    scenario: Scenario
    scale: float
    arrivals: list[Arrival]
    #: main.cf for the instance (before transport_maps, which needs the sinks' ports).
    main_cf: dict[str, str]
    #: Transport (master.cf service) -> maxproc.
    process_limits: dict[str, int]
    #: Destinations as the sinks play them, times and rates scaled.
    destinations: dict[str, Destination]
    #: Domains of the envelope senders (bounce notices go to discard:).
    sender_domains: list[str] = field(default_factory=list)
    #: Replayed recipients' answers at RCPT, try by try (address -> d/b/s script).
    scripts: dict[str, str] = field(default_factory=dict)
    #: MX host -> the destinations it serves (sorted): those named by some
    #: destination's ``mx``, with their destinations (server_of: a destination named
    #: as the host, without an ``mx``, is served by it too, as in the simulator).
    mx_hosts: dict[str, list[str]] = field(default_factory=dict)

    @property
    def recipients(self) -> int:
        return sum(len(a.recipients) for a in self.arrivals)

    def last_arrival(self) -> float:
        return max((a.at for a in self.arrivals), default=0.0)

    def never_deliver(self) -> set[str]:
        """Destinations dead for the whole run: their mail is only ever deferred."""
        return {d.name for d in self.destinations.values() if d.dead}


def _scaled(d: Destination, scale: float) -> Destination:
    """The destination on the run's clock (replace, so that a field added to
    Destination, such as ``mx``, is carried over rather than dropped)."""
    return dataclasses.replace(
        d, latency=d.latency.scaled(scale), timeout=d.timeout * scale,
        reject_time=d.reject_time * scale,
        rate_limit=d.rate_limit / scale if d.rate_limit else 0.0,
        dead_until=d.dead_until * scale, dead_until_low=d.dead_until_low * scale)


def mx_hosts(sc: Scenario) -> dict[str, list[str]]:
    """MX host -> its destinations (sorted by name); ScenarioError (with the key) when
    they disagree on a server setting (:data:`SERVER_SETTINGS`)."""
    named = {d.mx for d in sc.destinations.values() if d.mx}
    hosts: dict[str, list[str]] = {}
    for name in sorted(sc.destinations):
        host = server_of(sc.destinations[name])
        if host in named:
            hosts.setdefault(host, []).append(name)
    for host, names in hosts.items():
        first = sc.destinations[names[0]]
        for name in names[1:]:
            d = sc.destinations[name]
            for setting in SERVER_SETTINGS:
                a, b = getattr(d, setting), getattr(first, setting)
                if a != b:
                    raise ScenarioError(
                        f'destinations."{name}": its {setting} ({a!r}) is not that of '
                        f'"{names[0]}" ({b!r}), and both are served by MX host {host}: '
                        "compare plays a host as one server, which refuses or accepts a "
                        "session before it knows the domain; give the host's destinations "
                        f"one {setting}", ("destinations", name, setting))
    return hosts


def seconds(value: float) -> str:
    """A Postfix time value: whole seconds, at least 1."""
    return f"{max(1, math.ceil(value - 1e-9))}s"


def make_plan(sc: Scenario, scale: float | None = None) -> Plan:
    """The concrete run; ScenarioError (with the key) for what real Postfix cannot play."""
    scale = sc.compare.time_scale if scale is None else scale
    if not scale > 0:
        raise ScenarioError("the time scale must be more than 0")
    for name, d in sc.destinations.items():
        if d.server_limit and d.overload != "421":
            raise ScenarioError(
                f'destinations."{name}": compare plays overload = "421" only (a server '
                f"that answers 421 above server_limit); {d.overload} needs a listen queue "
                "the sink does not model: use it in pyqmgr simulate",
                ("destinations", name, "overload"))
    # The client's timeouts are per transport in Postfix: one value for all.
    timeouts = {d.timeout for d in sc.destinations.values()
                if d.timeout_set or (d.dead and d.dead_mode == "timeout")}
    if len(timeouts) > 1:
        name = next(n for n, d in sc.destinations.items() if d.timeout_set)
        raise ScenarioError(
            "destinations have different timeouts; on real Postfix smtp_connect_timeout "
            f"and smtp_helo_timeout are one per transport: give them one value "
            f"({', '.join(f'{t:g}' for t in sorted(timeouts))} now)",
            ("destinations", name, "timeout"))
    main_cf = {"smtp_connection_cache_on_demand": "no"}
    main_cf.update(sc.main_cf)
    for param, default in RETRY_TIMERS.items():
        if param not in sc.main_cf and param not in sc.compare.main_cf:
            main_cf[param] = seconds(default * scale)
    if timeouts:
        value = seconds(timeouts.pop() * scale)
        main_cf.setdefault("smtp_connect_timeout", value)
        main_cf.setdefault("smtp_helo_timeout", value)
    main_cf.update(sc.compare.main_cf)
    hosts = mx_hosts(sc)

    rng = random.Random(f"compare sizes {sc.seed}")
    #: A server's coming-up time, where the workload gives a span (dead_until_low).
    returns = random.Random(f"coming up {sc.seed}")
    pending: list[tuple[float, int, int, MessageSpec | TraceMessage]] = []
    for index, ms in enumerate(sc.messages):
        for k, at in enumerate(ms.times(sc.seed, index)):
            pending.append((at, index, k, ms))
    pending += [(m.at, len(sc.messages), i, m) for i, m in enumerate(sc.trace)]
    pending.sort(key=lambda p: (p[0], p[1], p[2]))
    arrivals = []
    scripts: dict[str, str] = {}
    for mid, (at, _, _, spec) in enumerate(pending):
        rcpts: list[str] = []
        if isinstance(spec, TraceMessage):
            for dest, n, script in spec.recipients:
                for _ in range(n):
                    rcpts.append(address(spec.klass, mid, len(rcpts), dest))
                    if script:
                        scripts[rcpts[-1]] = script
            size = spec.size
        else:
            for dest, n in spec.destinations():
                rcpts += [address(spec.klass, mid, len(rcpts) + j, dest) for j in range(n)]
            size = max(1, int(spec.size.draw(rng)))
        arrivals.append(Arrival(mid, at * scale, spec.klass, spec.sender, size,
                                tuple(rcpts)))
    transports = {d.transport for d in sc.destinations.values()} | set(sc.process_limits)
    limits = {t: sc.process_limits.get(t, 0) for t in sorted(transports)}
    senders = sorted({a.sender.rpartition("@")[2].lower() for a in arrivals})
    # An MX host comes up once, for all its destinations: its first destination's
    # drawn time holds for the others (drawn in the file's order, as before hosts).
    came_up: dict[str, float] = {}
    destinations = {}
    for name, d in sc.destinations.items():
        host = server_of(d)
        if host in hosts and host in came_up:
            d = dataclasses.replace(d, dead_until=came_up[host], dead_until_low=0.0)
        else:
            d = d.drawn(returns)
            came_up[host] = d.dead_until
        destinations[name] = _scaled(d, scale)
    return Plan(sc, scale, arrivals, main_cf, limits, destinations, senders, scripts,
                hosts)
