"""One fleet, one configuration: what a server obeys when the fleet's servers differ
(issue #35).

Redis's scripts take each server's limits as arguments (:mod:`.shared`), so servers
that disagree each enforce their own: with one at 5 sessions and another at 10, the
destination sees up to 10 whenever the second asks; with one at ``1/1d`` the rate's
next slot moves a day ahead for all. So a server that finds a difference in the
roster (:mod:`.roster`) obeys the stricter of the two, and says so: the smallest
session limit, the slowest rate (fewest starts a second) and the smallest burst, the
longest lease time. No limit (0, no rate) is looser than any. Obeyed by every server,
this makes the fleet's limit the strictest any of them is configured with, whichever
asks.

Only records signed with the fleet's key are agreed with (issue #45), and each is
bounded first: a lease time within pyqmgr.cf's range (a longer one makes the record
invalid; the longest in force is at most an hour, and only the leases' expiry follows
it: this server's roster and renewal loops keep to its own), every limit within its
parameter's. :func:`agree` is pure and bounded: the transports compared are this
server's own and at most :data:`MAX_COMPARED` more that only others name, the
differences kept at most :data:`MAX_DIFFERENCES` (the rest counted), so a thousand
records cost a bounded time, in a thread (pyqmgr/daemon/fleet/roster.py).

And the other side of the same trust: what Redis answers is bounded by what the
settings allow (:func:`wait_bound`), so a wrong or hostile value cannot hold a
destination for hours.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pyqmgr.fleet.roster import ANY_TRANSPORT, DESTINATION, SITE, Record
from pyqmgr.fleet.settings import DESTINATION_PARAMS, LEASE_TIME, SITE_PARAMS, Limits
from pyqmgr.scheduler.shaping import Rate

#: Added to the longest wait the settings explain, for Redis's and the network's time.
WAIT_MARGIN = 1.0
#: The most transports compared at one read that this server neither has nor limits
#: itself (only another server names them: their differences are news, not limits
#: that apply here).
MAX_COMPARED = 64
#: The most differences kept from one read; the rest are counted.
MAX_DIFFERENCES = 1000
#: The difference that is no setting: the keys' layout.
LAYOUT = "key layout"


@dataclass(frozen=True)
class Difference:
    """One setting that another server runs with differently."""

    #: The parameter, as pyqmgr.cf names it for the transport.
    setting: str
    theirs: str
    ours: str
    #: What this server obeys of the two, and why (the rule's word for it).
    obeyed: str
    rule: str = "stricter"


def starts_per_second(rate: Rate | None) -> float:
    return math.inf if rate is None else rate.count / rate.period


def stricter_sessions(a: int, b: int) -> int:
    """The smaller limit; 0 (none) is looser than any."""
    if not a or not b:
        return a or b
    return min(a, b)


def stricter(own: Limits, theirs: Limits) -> Limits:
    """The stricter of two servers' limits, part by part. A burst counts only with a
    rate: without one it is no limit, so it is this server's own then."""
    sessions = stricter_sessions(own.sessions, theirs.sessions)
    if theirs.rate is None:
        rate, burst = own.rate, own.burst
    elif own.rate is None:
        rate, burst = theirs.rate, theirs.burst
    else:
        slower = starts_per_second(theirs.rate) < starts_per_second(own.rate)
        rate = theirs.rate if slower else own.rate
        burst = min(own.burst, theirs.burst)
    return Limits(sessions, rate, burst)


def _same_rate(a: Rate | None, b: Rate | None) -> bool:
    """Two rates that let as many starts through (10/1s is 600/1m)."""
    if a is None or b is None:
        return a is b
    return math.isclose(starts_per_second(a), starts_per_second(b), rel_tol=1e-9)


def _rate_text(rate: Rate | None) -> str:
    return "0" if rate is None else str(rate)


def setting_name(transport: str, parameter: str, any_transport: str) -> str:
    """``smtp_fleet_destination_rate`` for smtp, the bare name for the default."""
    return parameter if transport == any_transport else f"{transport}_{parameter}"


def differences(own: Limits, theirs: Limits, names: tuple[str, str, str]) -> list[Difference]:
    """Where another server's limits differ from this one's, and what is obeyed.

    ``names``: the settings' names (concurrency limit, rate, burst) for the messages."""
    limit_name, rate_name, burst_name = names
    found: list[Difference] = []
    if own.sessions != theirs.sessions:
        found.append(Difference(limit_name, str(theirs.sessions), str(own.sessions),
                                str(stricter_sessions(own.sessions, theirs.sessions))))
    obeyed = stricter(own, theirs)
    if not _same_rate(own.rate, theirs.rate):
        found.append(Difference(rate_name, _rate_text(theirs.rate), _rate_text(own.rate),
                                _rate_text(obeyed.rate)))
    if own.rate is not None and theirs.rate is not None and own.burst != theirs.burst:
        found.append(Difference(burst_name, str(theirs.burst), str(own.burst),
                                str(obeyed.burst)))
    return found


def _differs(own: Limits, theirs: Limits) -> bool:
    """Whether :func:`differences` would find any, without making them."""
    return own.sessions != theirs.sessions or not _same_rate(own.rate, theirs.rate) or (
        own.rate is not None and theirs.rate is not None and own.burst != theirs.burst)


def lease_difference(own: float, theirs: float, name: str) -> Difference | None:
    """A lease time that differs: the longer is obeyed (a session stays counted for as
    long as the most careful server counts it)."""
    if math.isclose(own, theirs, rel_tol=1e-9):
        return None
    return Difference(name, f"{theirs:g}s", f"{own:g}s", f"{max(own, theirs):g}s", "longer")


def wait_bound(limits: Limits | None, recount: float) -> float:
    """The longest wait for a start that the settings explain: a rate's whole burst
    spent (``interval x burst``), or a recount's pause; plus :data:`WAIT_MARGIN`. A
    wait Redis asks for beyond it comes from a server with other settings or a damaged
    key, and is cut to it."""
    spent = 0.0
    if limits is not None and limits.rate is not None:
        spent = limits.rate.interval * max(1, limits.burst)
    return max(spent, recount) + WAIT_MARGIN


# -- agreeing with the roster -----------------------------------------------------------


@dataclass(frozen=True)
class Ours:
    """What this server runs with, as agreeing needs it: taken on the event loop, each
    part pure, so that :func:`agree` can run in a thread."""

    node: str
    lease_time: float
    layout: int
    #: This server's own limits of a kind for a transport (``*``: the bare parameters).
    own: Callable[[str, str], Limits]
    #: Whether a transport's destinations are grouped into sites here (``*``: sites on).
    grouped: Callable[[str], bool]
    #: Transports pyqmgr.cf gives fleet limits of their own, and those this server has.
    named: frozenset[str]
    known: frozenset[str] = frozenset()


@dataclass
class Agreement:
    """What one read of the roster makes this server obey, and the differences."""

    #: The limits obeyed per (transport or ``*``, kind): empty while the fleet agrees.
    overrides: dict[tuple[str, str], Limits | None]
    lease_time: float
    #: (node, setting) -> the difference, at most :data:`MAX_DIFFERENCES`.
    found: dict[tuple[str, str], Difference] = field(default_factory=dict)
    #: Differences beyond those kept (past the cap, a server's limits that differ for
    #: a transport count once), and transports only others name left uncompared.
    more: int = 0
    uncompared: int = 0

    def note(self, node: str, diff: Difference) -> None:
        key = (node, diff.setting)
        if key in self.found or len(self.found) < MAX_DIFFERENCES:
            self.found[key] = diff
        else:
            self.more += 1


def agree(ours: Ours, others: Sequence[Record],
          pause: Callable[[], None] | None = None) -> Agreement:
    """The stricter of this server's settings and each other's, and every difference.
    ``others``: signed records of other nodes. ``pause``: called between transports
    (a thread gives way to the event loop there)."""
    lease = ours.lease_time
    out = Agreement({}, lease)
    for record in others:
        diff = lease_difference(ours.lease_time, record.lease_time, LEASE_TIME)
        if diff is not None:
            out.note(record.node, diff)
            lease = max(lease, record.lease_time)
        if record.layout != ours.layout:
            out.note(record.node, Difference(LAYOUT, str(record.layout), str(ours.layout),
                                             "", LAYOUT))
    out.lease_time = lease
    names = _compared(ours, others, out)
    differs = False
    for kind, params in ((DESTINATION, DESTINATION_PARAMS), (SITE, SITE_PARAMS)):
        default = ours.own(ANY_TRANSPORT, kind)
        for transport in names:
            if pause is not None:
                pause()
            if kind == SITE and not ours.grouped(transport):
                continue
            own = ours.own(transport, kind)
            obeyed, specific = _obeyed(transport, kind, own, own != default, others, params,
                                       out)
            differs = differs or obeyed != own
            if specific:
                out.overrides[(transport, kind)] = obeyed if obeyed.active else None
    if not differs:
        out.overrides = {}
    return out


def _compared(ours: Ours, others: Sequence[Record], out: Agreement) -> list[str]:
    """The transports compared: the default, this server's own, then those only
    others name, at most :data:`MAX_COMPARED` of them (the rest counted)."""
    mine = (ours.named | ours.known) - {ANY_TRANSPORT}
    theirs: set[str] = set()
    for record in others:
        theirs.update(record.limits)
    only = sorted(theirs - mine - {ANY_TRANSPORT})
    out.uncompared = max(0, len(only) - MAX_COMPARED)
    return [ANY_TRANSPORT, *sorted(mine | set(only[:MAX_COMPARED]))]


def _obeyed(transport: str, kind: str, own: Limits, specific: bool,
            others: Sequence[Record], params: tuple[str, str, str], out: Agreement
            ) -> tuple[Limits, bool]:
    """The transport's limits of ``kind`` obeyed (the stricter of all), noting each
    difference; and whether it is said apart from the default (``*``, or a transport
    that this server or another limits of its own)."""
    specific = specific or transport == ANY_TRANSPORT
    names = tuple(setting_name(transport, p, ANY_TRANSPORT) for p in params)
    obeyed = own
    for record in others:
        theirs = record.limits_for(transport, kind)
        if theirs is None:
            continue
        if specific or transport in record.limits:
            # A transport neither names is the default's: said there once.
            specific = True
            if len(out.found) < MAX_DIFFERENCES:
                for diff in differences(own, theirs, (names[0], names[1], names[2])):
                    out.note(record.node, diff)
            elif _differs(own, theirs):
                out.more += 1  # past the cap: counted, no object made
        obeyed = stricter(obeyed, theirs)
    return obeyed, specific
