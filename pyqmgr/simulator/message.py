"""The simulator's messages and its destinations' servers, shared by the engine's parts.

A message here is the scheduler's :class:`~pyqmgr.scheduler.message.Message` with what
the simulator keeps beside it: its routed recipients, where reading has got to, the
recipients deferred on this try and the scripts a replayed log gave them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from pyqmgr.scheduler.entry import Entry
from pyqmgr.scheduler.message import Message, Recipient, Route


class Waiter:
    __slots__ = ("entry", "start", "window", "served")

    def __init__(self, entry: Entry, start: float, window: int) -> None:
        self.entry = entry
        self.start = start
        self.window = window
        self.served = False


class SimServer:
    __slots__ = ("sessions", "queue", "starts")

    def __init__(self) -> None:
        self.sessions = 0
        self.queue: deque[Waiter] = deque()
        #: Session start times in the last second (a rate-limiting server).
        self.starts: deque[float] = deque()


class SimMessage:
    __slots__ = ("sched", "routes", "pos", "destination", "arrival", "retry", "waits",
                 "_by_rcpt", "scripts", "tries", "measured", "children", "bounce",
                 "ready_at", "node")

    scripts: dict[int, tuple[tuple[str, float | None], ...]] | None

    def __init__(self, sched: Message, routes: list[Route], destination: str,
                 arrival: float = 0.0,
                 scripts: dict[int, tuple[tuple[str, float | None], ...]] | None = None,
                 measured: bool = True) -> None:
        self.sched = sched
        self.routes = routes
        self.pos = 0
        self.destination = destination
        #: When the message first arrived (its backoff is its age, as in stock).
        self.arrival = arrival
        #: The deferred-queue model: this attempt's deferred recipients, and the
        #: destinations the core says they waited for.
        self.retry: list[Route] = []
        self.waits: set[tuple[str, str]] = set()
        self._by_rcpt: dict[int, Route] | None = None
        #: Recipients (by offset) that answer as a replayed log's did, try by try.
        self.scripts = scripts
        self.tries: dict[int, int] = {}
        self.measured = measured
        #: When its transport's hand-off ends (see Engine._let_in).
        self.ready_at = 0.0
        #: The engine (server) whose message it is, in a fleet simulation.
        self.node: Any = None
        #: Messages a content filter re-injects once this one is done (replay).
        self.children: list[int] | None = None
        #: A bounce (null sender): it expires after bounce_queue_lifetime.
        self.bounce = False

    def answer(self, rcpt: Recipient) -> tuple[str, float | None] | None:
        """This try of a scripted recipient: 2xx, 4xx or 5xx, and its seconds if the
        script has them; None for a recipient without a script."""
        if self.scripts is None or rcpt.offset not in self.scripts:
            return None
        script = self.scripts[rcpt.offset]
        n = self.tries.get(rcpt.offset, 0)
        self.tries[rcpt.offset] = n + 1
        code, secs = script[n] if n < len(script) else ("s", None)
        return ("4xx" if code == "d" else "5xx" if code == "b" else "2xx"), secs

    def whole_failure(self, rcpts: Sequence[Recipient]) -> tuple[str, float | None] | None:
        """The delivery's failure as a whole (``D`` or ``B`` in a replayed recipient's
        script for this try: a lost connection, a DNS answer, error(8)), if any.

        Only the recipients whose script says so spend their try on it: the others
        are deferred with the delivery, as stock defers every recipient of a failed
        session, and answer their own next try later.
        """
        if self.scripts is None:
            return None
        found: tuple[str, float | None] | None = None
        for rcpt in rcpts:
            script = self.scripts.get(rcpt.offset)
            if script is None:
                continue
            n = self.tries.get(rcpt.offset, 0)
            if n < len(script) and script[n][0] in "DB":
                self.tries[rcpt.offset] = n + 1
                if found is None or script[n][0] == "D":
                    found = script[n]
        return found

    def route_of(self, rcpt: Recipient) -> Route:
        if self._by_rcpt is None:
            self._by_rcpt = {id(r.recipient): r for r in self.routes}
        return self._by_rcpt[id(rcpt)]
