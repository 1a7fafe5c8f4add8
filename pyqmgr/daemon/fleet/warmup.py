"""A fleet server's share of the warm-up's counts (issue #46 item 2).

Built by :mod:`pyqmgr.daemon.sources` when pyqmgr.cf sets both ``shared_state`` and a
warm-up plan with a cold source: the source book then counts against credits
(:mod:`pyqmgr.scheduler.source_credits`), and this asks the fleet for them
(:mod:`pyqmgr.fleet.warmup`) as the book wants them, from tasks on the event loop:
routing never waits for Redis. An answer comes back to :meth:`SourceBook.credited`.

When Redis is slow or gone, ``shared_state_failure`` decides, as for the fleet's
other units: ``local`` counts here against the plan as a server alone does (what it
takes then is added to the fleet's count at the next answer), ``hold`` lets the cold
source take nothing beyond the credits it holds; either way one warning for the
outage and a line when the fleet answers again. At exit (``postfix stop``,
``reload``) the credits held and the reservations never sent go back to the fleet
(:meth:`give_back`, run by :meth:`pyqmgr.daemon.fleet.node.Fleet.give_back`).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from pyqmgr.fleet.settings import FAILURE, HOLD
from pyqmgr.fleet.warmup import WarmupCredits
from pyqmgr.scheduler.source_credits import IDLE_RETURN

if TYPE_CHECKING:
    from pyqmgr.daemon.fleet.node import Fleet
    from pyqmgr.daemon.host import QmgrCore
    from pyqmgr.scheduler.source import SourceBook

#: How long a pair waits before asking again while Redis does not answer (s).
AWAY_RETRY = 1.0
#: Pairs whose fleet-wide count ``pyqmgr status`` remembers.
SEEN_MEMORY = 1000


class FleetWarmup:
    """Asks the fleet for credits as the book wants them, and gives them back at exit."""

    def __init__(self, host: QmgrCore, fleet: Fleet, book: SourceBook,
                 clock: Callable[[], float]) -> None:
        self.host, self.book, self.clock = host, book, clock
        self.credits = book.share()
        self.redis = WarmupCredits(fleet.shared)
        self.endpoint = fleet.settings.endpoint
        self.hold = fleet.settings.failure == HOLD
        self.failure = fleet.settings.failure
        self.down = False
        self._armed = False
        #: (source, site) -> the fleet's count at the last answer, for status.
        self.fleet_counts: dict[tuple[str, str], int] = {}
        self.counters: Counter[str] = Counter()
        #: Pairs whose whole allowance the fleet has granted: their credits go back
        #: when no mail asks for them (:meth:`_sweep`).
        self.exhausted: set[tuple[str, str]] = set()
        self._sweeping = False
        fleet.at_exit.append(self.give_back)

    def poke(self) -> None:
        """After a choice: ask for the credits the book wants, once this loop turn."""
        if self.credits.wanted and not self._armed:
            self._armed = True
            asyncio.get_running_loop().call_soon(self._ask)

    def _ask(self) -> None:
        self._armed = False
        window = self.book.window
        for source, site, allowance, owed in self.credits.drain():
            self.host.spawn(self._take(source, site, window, allowance, owed))

    async def _take(self, source: str, site: str, window: int, allowance: int,
                    owed: int) -> None:
        plan = self.book.plan
        assert plan is not None
        self.counters["asked"] += 1
        try:
            granted, count = await self.redis.take(
                source, site, window, plan.window, allowance,
                self.credits.want((source, site), allowance), owed, self.clock())
        except Exception as exc:  # noqa: BLE001 - RedisUnavailable, or a bug: no credit
            self._failed(source, site, window, owed, str(exc))
            return
        if self.down:
            self.down = False
            self.credits.away = False
            self.host.log.info(f"shared state {self.endpoint}: answering again; the "
                               "warm-up's counts are the fleet's")
        self.counters["granted"] += granted
        pair = (source, site)
        if pair in self.fleet_counts or len(self.fleet_counts) < SEEN_MEMORY:
            self.fleet_counts[pair] = count
        self.book.credited(source, site, window, granted, self.clock(),
                           room=max(0, allowance - count))
        if count >= allowance and window == self.book.window:
            self.exhausted.add(pair)
            if not self._sweeping:
                self._sweeping = True
                asyncio.get_running_loop().call_later(IDLE_RETURN, self._sweep)

    def _sweep(self) -> None:
        """Credits of exhausted pairs that no mail asked for lately go back to the
        fleet, for servers whose mail goes on; the sweep runs while any are held."""
        self._sweeping = False
        plan, window, now = self.book.plan, self.book.window, self.clock()
        if plan is None:
            return
        for source, site, n in self.credits.idle(self.exhausted, now):
            self.counters["given_back"] += n
            self.host.spawn(self._give(source, site, window, plan.window, n, now))
        self.exhausted = {p for p in self.exhausted if self.credits.held.get(p, 0) > 0}
        if self.exhausted:
            self._sweeping = True
            asyncio.get_running_loop().call_later(IDLE_RETURN, self._sweep)

    async def _give(self, source: str, site: str, window: int, seconds: float, n: int,
                    now: float) -> None:
        try:
            await self.redis.give_back(source, site, window, seconds, n, now)
        except Exception:  # noqa: BLE001 - lost to this window: the plan is not passed
            self.counters["errors"] += 1

    def _failed(self, source: str, site: str, window: int, owed: int, why: str) -> None:
        """No answer: ``local`` counts here from now on, ``hold`` takes nothing more."""
        self.counters["errors"] += 1
        if window == self.book.window:
            self.credits.owe((source, site), owed)
        if not self.down:
            self.down = True
            doing = ("a cold source takes no more than the credits held here" if self.hold
                     else "the warm-up counts here alone, against each cold source's plan")
            self.host.log.warning(f"shared state {self.endpoint}: {why}; {doing} "
                                  f"({FAILURE} = {self.failure}; said once until Redis "
                                  "answers again)")
        self.credits.away = not self.hold
        self.book.credited(source, site, window, 0, self.clock(), AWAY_RETRY)

    async def give_back(self) -> None:
        """At exit: credits held, reservations never sent, and what was owed, back to
        the fleet's count (the fleet's own exit bounds the time)."""
        plan = self.book.plan
        if plan is None:
            return
        now = self.clock()
        back = {(s, site): -n for s, site, n in self.book.unused()}
        for pair, n in self.credits.spent.items():
            back[pair] = back.get(pair, 0) + n
        self.credits.spent.clear()
        window = self.book.window
        results = await asyncio.gather(*(
            self.redis.take(s, site, window, plan.window, 0, 0, n, now)
            for (s, site), n in back.items() if n), return_exceptions=True)
        self.counters["given_back"] += sum(-n for n in back.values() if n < 0)
        self.counters["errors"] += sum(1 for r in results if isinstance(r, BaseException))

    def status(self) -> dict[str, object]:
        """The fleet's side of ``pyqmgr status``'s sources part."""
        return {"fleet_counts": [{"source": s, "site": site, "counted": n}
                                 for (s, site), n in sorted(self.fleet_counts.items())[:100]],
                "fleet_unavailable": self.down, "fleet_failure": self.failure,
                **{f"credits_{k}": self.counters[k]
                   for k in ("asked", "granted", "errors", "given_back")}}
