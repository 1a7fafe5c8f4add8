"""The destinations' side of a simulated delivery: their SMTP servers.

A destination in a scenario is a server with a number of processes, a listen queue
(backlog), a rate limit, replies at RCPT by shares or by a replayed log's scripts, and
times when it is dead. An agent that connects is served, waits in the listen queue
until a process frees up or its greeting timeout passes, or is refused, as the
destination's settings say; each outcome comes back to the engine as a finished
delivery at the time it would end.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from pyqmgr.scheduler.queue import Dsn
from pyqmgr.simulator.message import SimMessage, SimServer, Waiter

if TYPE_CHECKING:
    from pyqmgr.scheduler.entry import Entry
    from pyqmgr.simulator.scenario import Destination, Scenario


class Host(Protocol):
    """What the servers need of the engine: the clock, timers and the delivery's end."""

    @property
    def now(self) -> float: ...

    @property
    def sc(self) -> Scenario: ...

    def at(self, when: float, action: Callable[[], None]) -> None: ...
    def _finish(self, entry: Entry, start: float, window: int, dest: str, outcome: str,
                hop: Dsn | None, session: bool,
                replies: list[str] | None = None) -> Callable[[], None]: ...


class Provider(Protocol):
    """The servers' rules per source (simulator/sources.py's ProviderRules)."""

    def refusal(self, dest: Destination, source: str, recipients: int,
                now: float) -> str | None: ...


def said(dest: Destination, text: str) -> Dsn:
    """The hop status of a reply the server gave at once (a provider's 421)."""
    status = text.split()[1] if len(text.split()) > 1 else "4.7.0"
    return Dsn(status, f"host {dest.host}[192.0.2.1] said: {text}")


def server_of(dest: Destination) -> str:
    """The server a destination's sessions go to: its MX host's (destinations that
    name one host share it, issue #33), else its own."""
    return dest.mx or dest.name


class Remote:
    """Every destination's server, made on first contact."""

    def __init__(self, host: Host, rng: random.Random) -> None:
        self.host = host
        #: The run's random numbers (latencies, RCPT replies), shared with the engine
        #: so that a seed draws the same sequence as before.
        self.rng = rng
        self.servers: dict[str, SimServer] = {}
        #: The servers' rules per source (simulator/sources.py), None: no pools.
        self.provider: Provider | None = None

    def connect(self, entry: Entry, start: float, window: int, dest: Destination,
                msg: SimMessage) -> None:
        """An agent connects to ``dest`` for ``entry``: served, queued, refused or failed,
        as the destination's server would have it."""
        failure = msg.whole_failure(entry.recipients)
        if failure is not None:
            self.fail_whole(entry, start, window, dest, failure)
            return
        if dest.is_dead(self.host.now):
            if dest.dead and dest.dead_mode == "timeout":
                hop = Dsn("4.4.1", f"connect to {dest.host}[192.0.2.1]:25: Connection timed out")
                self._end(dest.timeout, entry, start, window, dest.name, "deferred", hop, False)
                return
            hop = Dsn("4.4.1", f"connect to {dest.host}[192.0.2.1]:25: Connection refused")
            self._end(0.0, entry, start, window, dest.name, "deferred", hop, False)
            return
        provider = self.provider
        if provider is not None and dest.sources:
            text = provider.refusal(dest, entry.queue.transport.name, len(entry.recipients),
                                    self.host.now)
            if text is not None:
                self._end(dest.reject_time, entry, start, window, dest.name, "deferred",
                          said(dest, text), False)
                return
        server = self.servers.setdefault(server_of(dest), SimServer())
        if dest.rate_limit > 0:
            # A provider's rate limiting: more than rate_limit sessions in the last
            # second are answered rate_reply at once.
            starts = server.starts
            while starts and starts[0] <= self.host.now - 1.0:
                starts.popleft()
            if len(starts) >= dest.rate_limit:
                self._end(dest.reject_time, entry, start, window, dest.name, "deferred",
                          said(dest, dest.rate_reply), False)
                return
            starts.append(self.host.now)
        if not dest.server_limit or server.sessions < dest.server_limit:
            self.serve(entry, start, window, dest)
            return
        if dest.overload == "421":
            hop = Dsn("4.7.0", f"host {dest.host}[192.0.2.1] refused to talk to me: "
                               "421 4.7.0 too many connections")
            self._end(dest.reject_time, entry, start, window, dest.name, "deferred", hop, False)
            return
        backlog = dest.backlog
        if backlog < 0 or len(server.queue) < backlog:
            # In the listen queue: served when a server process frees up, unless the
            # client's greeting timeout comes first.
            waiter = Waiter(entry, start, window)
            server.queue.append(waiter)
            self.host.at(self.host.now + dest.timeout, self.greeting_timeout(waiter, dest))
            return
        if dest.overload == "connect-timeout":
            hop = Dsn("4.4.1", f"connect to {dest.host}[192.0.2.1]:25: Connection timed out")
        else:
            hop = Dsn("4.4.2", f"conversation with {dest.host}[192.0.2.1] timed out "
                               "while receiving the initial server greeting")
        self._end(dest.timeout, entry, start, window, dest.name, "deferred", hop, False)


    def fail_whole(self, entry: Entry, start: float, window: int, dest: Destination,
                    failure: tuple[str, float | None]) -> None:
        """A replayed try that failed as a whole (before or outside RCPT): as the log
        had it, whatever the schedule; a 4xx throttles the site as stock's agent
        reports a site failure, a 5xx bounces without one."""
        code, secs = failure
        took = secs if secs is not None else 0.0
        if code == "D":
            hop = Dsn("4.4.2", f"conversation with {dest.host}[192.0.2.1] failed "
                               "(replayed from the log)")
            self._end(took, entry, start, window, dest.name, "deferred", hop, False)
        else:
            self._end(took, entry, start, window, dest.name, "sent", None, False,
                      ["5xx"] * len(entry.recipients))

    def serve(self, entry: Entry, start: float, window: int, dest: Destination) -> None:
        self.servers[server_of(dest)].sessions += 1
        msg: SimMessage = entry.message.owner
        if msg.scripts is not None:
            self.serve_scripted(entry, start, window, dest, msg)
            return
        duration = sum(dest.latency.draw(self.rng) for _ in range(len(entry.recipients)))
        replies: list[str] | None = None
        if dest.rcpt_4xx or dest.rcpt_5xx:
            # The server's answer to each RCPT: a recipient-level 4xx defers only that
            # recipient and a 5xx bounces it; neither is a failure of the site.
            replies = [self.reply(dest) for _ in entry.recipients]
        self._end(duration, entry, start, window, dest.name, "sent", None, True, replies)

    def serve_scripted(self, entry: Entry, start: float, window: int, dest: Destination,
                        msg: SimMessage) -> None:
        """A replayed message: each recipient answers and takes as its script says
        (others as the destination's shares and latency would have them)."""
        duration = 0.0
        replies = []
        for rcpt in entry.recipients:
            scripted = msg.answer(rcpt)
            if scripted is not None:
                reply, secs = scripted
                duration += secs if secs is not None else dest.latency.draw(self.rng)
                replies.append(reply)
                continue
            duration += dest.latency.draw(self.rng)
            replies.append(self.reply(dest))
        self._end(duration, entry, start, window, dest.name, "sent", None, True, replies)

    def reply(self, dest: Destination) -> str:
        """A drawn answer at RCPT, by the destination's 4xx and 5xx shares."""
        draw = self.rng.random()
        return ("4xx" if draw < dest.rcpt_4xx else
                "5xx" if draw < dest.rcpt_4xx + dest.rcpt_5xx else "2xx")

    def session_end(self, dest: str) -> None:
        destinations = self.host.sc.destinations
        server = self.servers[server_of(destinations[dest])]
        server.sessions -= 1
        if server.queue:
            waiter = server.queue.popleft()
            waiter.served = True
            # The server's next in line may be another destination's (one MX host).
            self.serve(waiter.entry, waiter.start, waiter.window,
                       destinations.get(waiter.entry.queue.name, destinations[dest]))

    def greeting_timeout(self, waiter: Waiter, dest: Destination) -> Callable[[], None]:
        def expire() -> None:
            if waiter.served:
                return
            self.servers[server_of(dest)].queue.remove(waiter)
            hop = Dsn("4.4.2", f"conversation with {dest.host}[192.0.2.1] timed out "
                               "while receiving the initial server greeting")
            self.host._finish(waiter.entry, waiter.start, waiter.window, dest.name, "deferred",
                         hop, False)()
        return expire

    def _end(self, after: float, entry: Entry, start: float, window: int, dest: str,
             outcome: str, hop: Dsn | None, session: bool,
             replies: list[str] | None = None) -> None:
        """The delivery ends ``after`` seconds from now, as ``outcome``."""
        host = self.host
        host.at(host.now + after, host._finish(entry, start, window, dest, outcome, hop,
                                               session, replies))
