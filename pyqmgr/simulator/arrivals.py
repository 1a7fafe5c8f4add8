"""The scenario's messages arriving, one at a time, onto the engine's event heap.

Every arrival is made in time order (the ``[[messages]]`` specs, then the arrivals
file), each with the sequence number it would have had if all were pushed up front,
so that arrivals made one at a time keep their order among events of the same time;
only the next one sits on the heap, so a replayed day of millions of messages costs
no memory until it comes. A server of a fleet takes every N-th of them.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pyqmgr.simulator.scenario import MessageSpec, Scenario

Arrival = tuple[float, int, Callable[[], None]]


class ArrivalHost(Protocol):
    """What the arrivals need of the engine (simulator/engine.py's Engine)."""

    sc: Scenario
    _seq: itertools.count[int]
    _events: list[Arrival]
    node: int

    @property
    def fleet(self) -> Any: ...

    def _arrival(self, spread: tuple[tuple[str, int], ...], name: str,
                 k: int, sender: str = "") -> Callable[[], None]: ...

    def _trace_arrival(self, index: int) -> Callable[[], None]: ...


class Arrivals:
    def __init__(self, engine: ArrivalHost) -> None:
        self.engine = engine
        sc = engine.sc
        streams: list[Iterator[Arrival]] = []
        offset = 0
        for index, spec in enumerate(sc.messages):
            streams.append(self._spec(spec, index, offset))
            offset += spec.count
        if sc.trace:
            streams.append(self._trace(offset))
            offset += len(sc.trace)
        engine._seq = itertools.count(offset)
        self.pending = heapq.merge(*streams, key=lambda a: (a[0], a[1]))
        fleet = engine.fleet
        #: In a fleet: (servers, this one's number); each takes every N-th message.
        self.share: tuple[int, int] | None = (
            (len(fleet.engines), engine.node) if fleet is not None else None)

    def _spec(self, spec: MessageSpec, index: int, offset: int) -> Iterator[Arrival]:
        engine = self.engine
        spread = spec.destinations()
        for k, at in enumerate(spec.times(engine.sc.seed, index)):
            yield at, offset + k, engine._arrival(spread, spec.name, k, spec.sender)

    def _trace(self, offset: int) -> Iterator[Arrival]:
        engine = self.engine
        for i, m in enumerate(engine.sc.trace):
            if not 0 <= m.follows < i:
                yield m.at, offset + i, engine._trace_arrival(i)

    def push_next(self) -> None:
        item = next(self.pending, None)
        if self.share is not None:
            servers, node = self.share
            while item is not None and item[1] % servers != node:
                item = next(self.pending, None)
        if item is None:
            return
        when, seq, arrive = item

        def fire() -> None:
            arrive()
            self.push_next()
        heapq.heappush(self.engine._events, (when, seq, fire))
