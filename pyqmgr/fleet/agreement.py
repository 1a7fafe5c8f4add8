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

And the other side of the same trust: what Redis answers is bounded by what the
settings allow (:func:`wait_bound`), so a wrong or hostile value cannot hold a
destination for hours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pyqmgr.fleet.settings import Limits
from pyqmgr.scheduler.shaping import Rate

#: Added to the longest wait the settings explain, for Redis's and the network's time.
WAIT_MARGIN = 1.0


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
