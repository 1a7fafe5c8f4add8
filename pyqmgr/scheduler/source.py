"""Source pools and warm-up plans: which source a recipient leaves from (issue #46).

A source is an smtp (or lmtp) service the admin defines in master.cf, bound to one
address (``-o smtp_bind_address=``); a pool is a named list of them. At routing the
daemon asks :meth:`SourceBook.choose` for a member of the pool a message's class or
tenant maps to, and the member's service name becomes the recipient's transport. Its
queue is then (member, nexthop) and its site (member, site): the per-transport
machinery (limits, rates, response rules, suspensions, the fleet's units) makes every
one of them per source x destination and per source x site without anything new.

What is new is here, I/O-free, with the time passed in (wall-clock seconds: a
window is a calendar day or hour in UTC, as a provider counts it):

* a :class:`WarmupPlan`: a cold source's allowance per site per window, by the
  source's age in days, and what mail beyond it does (goes to a warm member, or
  waits);
* the counts: each recipient chosen for a cold source at a known site is a
  reservation, counted at once (so a burst routed in one loop turn cannot pass the
  allowance before any of it is delivered) and given back when its entry ends
  without having left (deferred in core, moved to the retry transport, its queue
  killed). A delivery an agent took stays counted, whatever it answered: qmgr hears
  one status per request, not per recipient, and giving back a request's recipients
  of which some were sent could pass the plan. A cold source never exceeds its plan;
  a deferral after a session opened may leave it short by that request.
* what survives a restart: :meth:`SourceBook.snapshot` keeps the window's counts of
  deliveries that left (an agent took them); the reservations still waiting in core
  are left out, as the next qmgr routes those recipients again and counts them then.

A domain whose site is not known yet (its MX never looked up: the site table's cache
has no answer) goes to a warm member: a cold source's count is per site, and a
guess could pass the real site's plan.

Choosing among the members that may take a recipient is a smooth weighted round
robin (nginx's), O(members) a recipient: a pool holds a handful.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pyqmgr.scheduler.scope import ScopeKind, nothing, nothing_to_settle
from pyqmgr.scheduler.source_credits import DRY_RETRY, FULL, UNSURE, Credits

if TYPE_CHECKING:
    from pyqmgr.scheduler.structures import Entry

#: A plan step's allowance that means "warm from this age on".
WARM = -1
DAY = 86400.0
HOUR = 3600.0
#: What mail beyond a cold source's allowance does.
OVERFLOW_WARM = "warm"
OVERFLOW_WAIT = "wait"
#: Most lines a plan may have (a plan is a few dozen steps).
MAX_PLAN_STEPS = 1000
#: Counts kept per window at most: (source, site) pairs. Beyond, a cold source takes
#: no new site in the window (its mail goes warm): memory stays bounded.
MAX_COUNTS = 100_000


class PlanError(ValueError):
    """A plan line that cannot be used: the text names the line and why."""


@dataclass(frozen=True, slots=True)
class WarmupPlan:
    """A cold source's allowance per site per window by its age in days."""

    #: (age in days, allowance), ages ascending; the allowance WARM: warm from then on.
    steps: tuple[tuple[int, int], ...]
    #: The window's length: DAY or HOUR.
    window: float = DAY
    overflow: str = OVERFLOW_WARM

    def allowance(self, age_days: int) -> int | None:
        """Messages a site may take from a source this old in one window; None: no
        limit (warm). Younger than the first step (a start date to come): nothing."""
        got: int | None = 0
        for age, value in self.steps:
            if age > age_days:
                break
            got = None if value == WARM else value
        return got

    @property
    def window_name(self) -> str:
        return "hour" if self.window == HOUR else "day"


def parse_plan(text: str, where: str) -> WarmupPlan:
    """A plan file's text: ``AGE MESSAGES`` lines (``AGE warm`` ends the warm-up),
    ``window day|hour`` and ``overflow warm|wait``; ``#`` comments. PlanError names
    ``where`` and the line."""
    steps: dict[int, int] = {}
    window, overflow = DAY, OVERFLOW_WARM
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.partition("#")[0].strip()
        if not line:
            continue
        parts = line.replace("=", " ").split()
        bad = f"{where}, line {number}: {raw.strip()!r}"
        if len(parts) != 2:
            raise PlanError(f"{bad}: expected AGE MESSAGES, window day|hour or "
                            "overflow warm|wait")
        key, value = parts[0].lower(), parts[1].lower()
        if key == "window":
            if value not in ("day", "hour"):
                raise PlanError(f"{bad}: window is day or hour")
            window = DAY if value == "day" else HOUR
            continue
        if key == "overflow":
            if value not in (OVERFLOW_WARM, OVERFLOW_WAIT):
                raise PlanError(f"{bad}: overflow is warm or wait")
            overflow = value
            continue
        if not key.isdigit() or len(key) > 5:
            raise PlanError(f"{bad}: the age is a number of days (0, 1, 2...)")
        if value == "warm":
            amount = WARM
        elif value.isdigit() and len(value) <= 9:
            amount = int(value)
        else:
            raise PlanError(f"{bad}: the messages are a number or warm")
        if int(key) in steps:
            raise PlanError(f"{bad}: age {int(key)} is given twice")
        steps[int(key)] = amount
        if len(steps) > MAX_PLAN_STEPS:
            raise PlanError(f"{bad}: more than {MAX_PLAN_STEPS} steps")
    if not steps:
        raise PlanError(f"{where}: no AGE MESSAGES line")
    return WarmupPlan(tuple(sorted(steps.items())), window, overflow)


@dataclass(slots=True)
class Pool:
    """A named list of sources with their weights (``src1 src2:3``)."""

    name: str
    members: tuple[str, ...]
    weights: tuple[int, ...]
    #: The smooth round robin's running scores, one per member.
    scores: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.scores = [0] * len(self.members)


@dataclass(slots=True)
class Reservation:
    """One recipient counted for a cold source at a site in a window."""

    source: str
    site: str
    window: int
    #: An agent took it (counted in the snapshot).
    left: bool = False
    #: A fleet's credit paid for it (:mod:`.source_credits`): given back, it is one
    #: to spend again.
    credited: bool = False


class SourceBook:
    """The pools, the plan and the window's counts: the daemon's only source state."""

    def __init__(self, pools: dict[str, Pool], plan: WarmupPlan | None,
                 starts: dict[str, float]) -> None:
        self.pools = pools
        self.plan = plan
        #: Each cold source's first day (Unix time of its midnight); absent: warm.
        self.starts = starts if plan is not None else {}
        self.window = -1
        #: (source, site) -> recipients counted in this window (reserved and left).
        self.counts: dict[tuple[str, str], int] = {}
        #: (source, site) -> of those, the ones an agent took (the snapshot's).
        self.left: dict[tuple[str, str], int] = {}
        #: source -> its counts over every site, kept as they change (the metrics'
        #: per-source series, read without a walk over the pairs).
        self.totals: dict[str, int] = {}
        #: Reservations by recipient (any hashable the daemon keys a recipient by).
        self.reservations: dict[object, Reservation] = {}
        #: Recipients that waited (overflow wait) and went warm for want of a site.
        self.waited = 0
        self.unknown_site = 0
        self.members = frozenset(m for p in pools.values() for m in p.members)
        #: A fleet's credits (:meth:`share`); None: the counts are this server's alone.
        self.credits: Credits | None = None

    def share(self) -> Credits:
        """Count against the fleet's credits from now on (``shared_state``): a cold
        source takes a recipient at a site only with a credit for it in hand."""
        if self.credits is None:
            self.credits = Credits()
        return self.credits

    # -- windows and ages ---------------------------------------------------------------

    def roll(self, now: float) -> None:
        """A new window starts with no counts; reservations of the old one are
        forgotten (giving them back would count in a window they were not in)."""
        if self.plan is None:
            return
        window = int(now // self.plan.window)
        if window != self.window:
            self.window = window
            self.counts.clear()
            self.left.clear()
            self.totals.clear()
            self.reservations.clear()
            if self.credits is not None:
                self.credits.clear()

    def age_days(self, source: str, now: float) -> int | None:
        """The source's age on ``now``'s day (0 on its first day); None: warm."""
        start = self.starts.get(source)
        if start is None:
            return None
        return math.floor((now - start) / DAY)

    def allowance(self, source: str, now: float) -> int | None:
        """The source's allowance per site in ``now``'s window; None: no limit."""
        age = self.age_days(source, now)
        if age is None or self.plan is None:
            return None
        return self.plan.allowance(age)

    # -- choosing -------------------------------------------------------------------------

    def choose(self, pool_name: str, site: str | None, now: float,
               key: object, skip: Collection[str] = ()) -> str | None:
        """The member a recipient (``key``) leaves from, counted; None: it waits (the
        plan's overflow is wait and no member may take it, or no member is warm).
        ``site``: the destination's site, None when not known yet; ``skip``: members
        that take nothing now (their transport is dead)."""
        pool = self.pools[pool_name]
        self.roll(now)
        wait = self.plan is not None and self.plan.overflow == OVERFLOW_WAIT
        best = -1
        best_full = False
        total = 0
        scores, weights = pool.scores, pool.weights
        for i, member in enumerate(pool.members):
            if member in skip:
                continue
            full = False
            allowance = self.allowance(member, now)
            if allowance is not None:
                if site is None:
                    continue
                pair = (member, site)
                counted = self.counts.get(pair, 0)
                if counted < allowance and pair not in self.counts and (
                        len(self.counts) >= MAX_COUNTS):
                    continue
                if self.credits is not None and allowance > 0:
                    # The fleet's count: a credit in hand, none left fleet-wide (full),
                    # or none yet (passed over, as before a site is known).
                    said = self.credits.check(pair, allowance, counted, now)
                    if said == UNSURE:
                        continue
                    full = said == FULL
                else:
                    full = counted >= allowance
                # Beyond its allowance a cold source's share goes to the warm members,
                # or (overflow wait) keeps its turn and its mail waits.
                if full and not wait:
                    continue
            scores[i] += weights[i]
            total += weights[i]
            if best < 0 or scores[i] > scores[best]:
                best, best_full = i, full
        if best < 0:
            self.waited += 1
            return None
        scores[best] -= total
        if best_full:
            self.waited += 1
            return None
        member = pool.members[best]
        if site is None:
            self.unknown_site += 1
        elif self.allowance(member, now) is not None:
            pair = (member, site)
            self.counts[pair] = self.counts.get(pair, 0) + 1
            self.totals[member] = self.totals.get(member, 0) + 1
            self.reservations[key] = Reservation(
                member, site, self.window,
                credited=self.credits.take(pair) if self.credits is not None else False)
        return member

    # -- a reservation's life -------------------------------------------------------------

    def started(self, key: object) -> None:
        """An agent took the recipient's delivery: it counts in the snapshot."""
        r = self.reservations.get(key)
        if r is not None and r.window == self.window and not r.left:
            r.left = True
            pair = (r.source, r.site)
            self.left[pair] = self.left.get(pair, 0) + 1

    def unselected(self, key: object) -> None:
        """The delivery never left after all: back to reserved only."""
        r = self.reservations.get(key)
        if r is not None and r.window == self.window and r.left:
            r.left = False
            pair = (r.source, r.site)
            self.left[pair] -= 1

    def ended(self, key: object, sent: bool) -> None:
        """The recipient's entry ended: ``sent`` (its delivery came back) keeps the
        count, else the reservation is given back."""
        r = self.reservations.pop(key, None)
        if r is None or r.window != self.window or sent:
            return
        pair = (r.source, r.site)
        self.counts[pair] -= 1
        self.totals[r.source] -= 1
        if r.left:
            self.left[pair] -= 1
        if self.credits is not None:
            self.credits.give(pair, r.credited)

    # -- a fleet's credits (:mod:`.source_credits`) ----------------------------------------

    def credited(self, source: str, site: str, window: int, granted: int, now: float,
                 retry: float = DRY_RETRY, room: int | None = None) -> None:
        """The fleet's answer for (source, site) in ``window``: ``granted`` credits (0:
        none left; asked again after ``retry`` seconds), ``room`` left to grant after
        (None: no answer). An answer for a window past is dropped: its key expires
        with what it counted."""
        self.roll(now)
        if self.credits is not None and window == self.window:
            self.credits.answered((source, site), granted, now, retry, room)

    def unused(self) -> list[tuple[str, str, int]]:
        """What this server gives back to the fleet as it exits: each pair's credits
        held and its credited reservations that never left (the next qmgr routes those
        recipients again and counts them then). Nothing is held after."""
        credits = self.credits
        if credits is None:
            return []
        back = dict(credits.held)
        credits.held.clear()
        for r in self.reservations.values():
            if r.credited and not r.left and r.window == self.window:
                r.credited = False
                pair = (r.source, r.site)
                back[pair] = back.get(pair, 0) + 1
        return [(s, site, n) for (s, site), n in sorted(back.items()) if n > 0]

    # -- what survives a restart -----------------------------------------------------------

    def snapshot(self) -> dict[str, object]:
        """The window's counts of deliveries that left, as the state file keeps them."""
        assert self.plan is not None
        return {"window": self.window, "window_seconds": self.plan.window,
                "counts": [[s, site, n] for (s, site), n in sorted(self.left.items())
                           if n > 0]}

    def restore(self, records: Iterable[tuple[str, str, int]], window: int,
                window_seconds: float, now: float) -> int:
        """Counts from a snapshot, when it is of ``now``'s window; how many kept."""
        self.roll(now)
        if self.plan is None or window != self.window or window_seconds != self.plan.window:
            return 0
        kept = 0
        for source, site, n in records:
            if source in self.starts and len(self.counts) < MAX_COUNTS:
                pair = (source, site)
                self.counts[pair] = self.counts.get(pair, 0) + n
                self.left[pair] = self.left.get(pair, 0) + n
                self.totals[source] = self.totals.get(source, 0) + n
                kept += 1
        return kept

    def status(self, now: float, limit: int = 100) -> dict[str, object]:
        """Each pool's members, their age and allowance, and the window's counts (the
        ``limit`` largest: a window may hold 100,000)."""
        self.roll(now)
        top = heapq.nlargest(limit, self.counts.items(), key=lambda item: item[1])
        return {
            "pools": {name: [{"source": m, "weight": w, "age_days": self.age_days(m, now),
                              "allowance": self.allowance(m, now)}
                             for m, w in zip(p.members, p.weights, strict=True)]
                      for name, p in self.pools.items()},
            "window": self.plan.window_name if self.plan else None,
            "counts": [{"source": s, "site": site, "counted": n,
                        "left": self.left.get((s, site), 0)} for (s, site), n in top],
            "count_pairs": len(self.counts),
            "waited": self.waited, "unknown_site": self.unknown_site,
            "shared": self.credits is not None,
            **(self.credits.status(limit) if self.credits is not None else {}),
        }


# -- a cold source's deliveries as a scope (:mod:`.scope`) ----------------------------------


def source_kinds(book: SourceBook, changed: Callable[[], None]) -> tuple[ScopeKind, ScopeKind]:
    """The scope kinds a source book puts on transports' chains: one for each cold
    source's transport (its deliveries start, never leave, end) and one for the retry
    transport (a todo entry moved there with a cold source's recipients gives their
    reservations back when it ends). ``changed``: the counts that survive a restart
    moved (the daemon writes its state file; the simulator has none).

    Kept beside :class:`SourceBook`, as the site's and the tenants' kinds are beside
    theirs, so that whatever drives the core (the daemon, the simulator) takes the same
    verbs from here, not from the daemon."""

    def started(core: object, entry: Entry) -> None:
        for r in entry.recipients:
            book.started(r)
        changed()

    def unselected(core: object, entry: Entry) -> bool:
        for r in entry.recipients:
            book.unselected(r)
        return False

    def ended(core: object, entry: Entry, busy: bool) -> bool:
        for r in entry.recipients:
            book.ended(r, sent=busy)
        if not busy:
            changed()
        return False

    def retried(core: object, entry: Entry, busy: bool) -> bool:
        if book.reservations:
            for r in entry.recipients:
                book.ended(r, sent=False)
        return False

    return (ScopeKind("source", started, unselected, ended, nothing),
            ScopeKind("source", nothing, nothing_to_settle, retried, nothing))
