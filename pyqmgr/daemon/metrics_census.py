"""The exporter's gauges: one walk over the core, in slices that never hold the loop long.

What the gauges say needs every in-core destination and site once: the transport's
totals (windows, queued recipients, dead destinations) and the ``_other`` series that
make every sum come out right need them all, and the core keeps no running totals of
them. So a :class:`Census` is taken by a walk, as a generator that stops every
:data:`CHUNK` scopes; the exporter (:class:`.metrics_exporter.Pacer`) runs it for a
slice of at most a millisecond or two per event-loop turn, deliveries in between,
and renders from the last census it completed. With up to some ten thousand
destinations and sites the walk ends within its first slice, so a scrape reads one
instant of the core, as before issue #44; beyond, each census is of the time of its
walk (with 100,000 destinations and 100,000 sites a walk takes about 0.1 s of CPU in
slices), and a new one starts only after the last one's CPU time a hundred times
over, so the walks stay under 1% of a core whatever the core holds.

Which destinations and sites get a series of their own is decided in the same walk:
the ``limit`` highest-ranked, ranked by their activity: recipients waiting plus
deliveries in flight plus delivery requests answered in the last minute
(:class:`.metrics.Activity`, kept at O(1) a reply), times two, plus one while dead
or held (so among equals those come first). A bounded heap keeps them: O(log N) for
a scope that enters it, one comparison for one that does not. The rest of each
transport is summed into its ``_other`` series, of the same walk, so that a sum over
a transport's series is its total.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pyqmgr.scheduler.explain import site_load, sites_in_core

if TYPE_CHECKING:
    from pyqmgr.scheduler.core import Scheduler

#: Scopes walked between two looks at the clock.
CHUNK = 256

#: A destination's series: (rank, order, transport, label, window, in flight,
#: queued recipients, dead). ``order`` breaks ties: the one longer in core first.
DestinationRow = tuple[int, int, str, str, int, int, int, int]
#: A site's series: (rank, order, transport, name, in flight, limit, destinations, held).
SiteRow = tuple[int, int, str, str, int, int, int, int]


@dataclass
class Census:
    """One walk's gauges; ``cpu`` and ``turns`` say what it cost the loop."""

    #: Per transport: [window, in flight, queued recipients, dead, destinations].
    transports: dict[str, list[int]] = field(default_factory=dict)
    #: The highest-ranked destinations (at most the limit, any order).
    destinations: list[DestinationRow] = field(default_factory=list)
    #: Per transport with sites: [in flight, destinations, held, sites].
    sites: dict[str, list[int]] = field(default_factory=dict)
    site_rows: list[SiteRow] = field(default_factory=list)
    #: Seconds of the loop the walk took, in how many turns, the longest of them.
    cpu: float = 0.0
    turns: int = 0
    longest: float = 0.0
    #: When it ended (the exporter's clock).
    finished: float = 0.0


class _Top:
    """The ``limit`` highest rows seen, in a heap: O(log N) a row that enters."""

    __slots__ = ("limit", "heap")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.heap: list[tuple[int, int, str, str, int, int, int, int]] = []

    def offer(self, row: tuple[int, int, str, str, int, int, int, int]) -> None:
        heap = self.heap
        if len(heap) < self.limit:
            heapq.heappush(heap, row)
        elif self.limit and row > heap[0]:
            heapq.heapreplace(heap, row)


def walk(sched: Scheduler, limit: int, site_limit: int,
         destination_activity: Callable[[tuple[str, str]], int],
         site_activity: Callable[[tuple[str, str]], int]) -> Generator[None, None, Census]:
    """The census of ``sched``, yielding every :data:`CHUNK` scopes.

    Walks lists of the queues and sites taken at the start, so the core may change
    between two slices: a queue that left the core meanwhile is passed over, one
    that came is in the next census.
    """
    census = Census()
    top = _Top(limit)
    heap = top.heap
    order = 0
    for name, t in list(sched.transports.items()):
        per_nexthop = t.cfg.destination_recipient_limit == 1
        totals = census.transports[name] = [0, 0, 0, 0, 0]
        groups: dict[str, list[int]] = {}
        queues = t.queues
        snapshot = list(queues.values())
        window_sum = busy_sum = queued_sum = dead_sum = count = 0
        for start in range(0, len(snapshot), CHUNK):
            if start:
                yield
            for q in snapshot[start:start + CHUNK]:
                if queues.get(q.name) is not q:
                    continue  # it left the core between two slices
                # A window of 0 is a dead destination's, -1 a rate-paused one's
                # (counted as no window).
                window = q.window
                dead = 0
                if window <= 0:
                    dead = 1 if window == 0 else 0
                    window = 0
                busy = q.busy_count
                queued = 0
                node = q.todo.head
                while node is not None:
                    queued += len(node.item.recipients)
                    node = node.next
                count += 1
                window_sum += window
                busy_sum += busy
                queued_sum += queued
                dead_sum += dead
                if per_nexthop:
                    # With a recipient limit of 1 Postfix names each recipient's
                    # queue user@nexthop: the endpoint is readable by every local
                    # user, whatever authorized_mailq_users says, so such queues
                    # are one series per nexthop and no address is exported (#31).
                    sums = groups.setdefault(q.nexthop, [0, 0, 0, 0])
                    sums[0] += window
                    sums[1] += busy
                    sums[2] += queued
                    sums[3] += dead
                    continue
                order -= 1
                rank = (queued + busy + destination_activity((name, q.name))) * 2 + dead
                if len(heap) < limit or (limit and rank > heap[0][0]):
                    top.offer((rank, order, name, q.name, window, busy, queued, dead))
        totals[:4] = [window_sum, busy_sum, queued_sum, dead_sum]
        totals[4] = len(groups) if per_nexthop else count
        for nexthop, (window, busy, queued, dead) in groups.items():
            order -= 1
            rank = (queued + busy + destination_activity((name, nexthop))) * 2 + min(dead, 1)
            top.offer((rank, order, name, nexthop, window, busy, queued, dead))
    census.destinations = heap
    yield
    yield from _sites(sched, census, site_limit, site_activity)
    return census


def _sites(sched: Scheduler, census: Census, limit: int,
           activity: Callable[[tuple[str, str]], int]) -> Iterator[None]:
    sites = sites_in_core(sched)
    if sched.sites is None:
        return
    top = _Top(limit)
    order = 0
    for start in range(0, len(sites), CHUNK):
        if start:
            yield
        for site in sites[start:start + CHUNK]:
            transport, name, busy, bound, members, held = site_load(site)
            totals = census.sites.get(transport)
            if totals is None:
                totals = census.sites[transport] = [0, 0, 0, 0]
            totals[0] += busy
            totals[1] += members
            totals[2] += held
            totals[3] += 1
            order -= 1
            rank = (busy + members + activity((transport, name))) * 2 + held
            top.offer((rank, order, transport, name, busy, bound, members, held))
    census.site_rows = top.heap


def take(sched: Scheduler, limit: int, site_limit: int,
         destination_activity: Callable[[tuple[str, str]], int],
         site_activity: Callable[[tuple[str, str]], int]) -> Census:
    """A whole census at once (tests, and a collector asked outside the daemon)."""
    steps = walk(sched, limit, site_limit, destination_activity, site_activity)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            census: Census = done.value
            return census
