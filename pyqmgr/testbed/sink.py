"""A sink SMTP server on loopback that plays remote destinations for the smtp transport.

A queue manager is judged by how it reacts to destinations: slow ones (per-recipient
latency), picky ones (chosen 4xx/5xx replies per recipient), crowded ones (an active
per-client concurrency limit that answers ``421`` and hangs up, which is what makes
qmgr's concurrency feedback back off) and absent ones (nothing listening, so
connections are refused). This server plays all four, can switch between them while
mail flows, and records what it saw so tests can compare stock qmgr with pyqmgr.

It runs aiosmtpd on an event loop in a thread of its own, so a test can drive Postfix
synchronously while the sink answers. The listening port is bound at construction, so
a port number handed to Postfix can never be taken by somebody else in between.
"""

from __future__ import annotations

import asyncio
import copy
import fnmatch
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiosmtpd.smtp import SMTP, Envelope, Session

from pyqmgr.testbed.loop_thread import LoopThreadServer, bound_socket
from pyqmgr.testbed.replies import ACCEPT_DATA, ACCEPT_RCPT, RATE_LIMITED, TOO_MANY

#: A reply rule: a mapping from recipient address, domain or glob pattern to an SMTP
#: reply line ("450 4.2.0 try later"), or a callable returning the reply or None.
ReplyRule = Mapping[str, str] | Callable[[str], str | None]
#: Latency: seconds for everybody, a mapping like a reply rule, or a callable.
LatencyRule = float | Mapping[str, float] | Callable[[str], float]

HOST = "127.0.0.1"


@dataclass(frozen=True)
class ReceivedMessage:
    """One message the sink accepted (after a 2xx reply to DATA)."""

    sender: str
    recipients: tuple[str, ...]
    data: bytes
    peer: str
    time: float


@dataclass
class SinkStats:
    """Counters; read them through :meth:`SinkServer.snapshot` for a consistent copy."""

    sessions: int = 0
    #: Most sessions open at once, all clients together (421'd ones not included).
    max_concurrent: int = 0
    #: Most sessions open at once from any single client address.
    max_concurrent_per_client: int = 0
    rejected_421: int = 0
    messages: int = 0
    #: Accepted deliveries per recipient (lower-cased); a count above 1 is a duplicate.
    delivered: Counter[str] = field(default_factory=Counter)
    #: Non-2xx replies given, by reply code ("450", "550", ...).
    replies: Counter[str] = field(default_factory=Counter)
    #: Every reply given for each recipient, at RCPT and DATA, in order.
    outcomes: dict[str, list[str]] = field(default_factory=dict)
    #: Sessions refused by the rate limit (``rate_limit``).
    rejected_rate: int = 0
    #: (time, sessions open) at every session start and end, all clients together.
    timeline: list[tuple[float, int]] = field(default_factory=list)
    #: When each accepted session started (time.monotonic()).
    opened: list[float] = field(default_factory=list)
    #: When each session refused by the rate limit came (time.monotonic()).
    rate_refused: list[float] = field(default_factory=list)
    #: Per client address (a source's bound address): sessions served, sessions
    #: refused with a 421 greeting, and messages accepted.
    sessions_by_client: Counter[str] = field(default_factory=Counter)
    refused_by_client: Counter[str] = field(default_factory=Counter)
    messages_by_client: Counter[str] = field(default_factory=Counter)
    #: Recipients refused at RCPT because their client had used its quota
    #: (``client_quotas``).
    over_quota_by_client: Counter[str] = field(default_factory=Counter)

    def mean_concurrency(self) -> float:
        """Time-weighted mean of sessions open while any was open."""
        total = weight = 0.0
        for (t0, n), (t1, _) in zip(self.timeline, self.timeline[1:], strict=False):
            if n > 0:
                total += n * (t1 - t0)
                weight += t1 - t0
        return total / weight if weight else 0.0


def lookup(rule: Mapping[str, Any] | Callable[[str], Any], address: str) -> Any:
    """Resolve a per-recipient rule: exact address, then domain, then glob patterns.

    Keys are compared case-insensitively, like Postfix compares addresses in tables.
    """
    if callable(rule):
        return rule(address)
    addr = address.lower()
    if addr in rule:
        return rule[addr]
    domain = addr.rpartition("@")[2]
    for key in (domain, "@" + domain):
        if key in rule:
            return rule[key]
    for key, value in rule.items():
        if any(c in key for c in "*?[") and fnmatch.fnmatchcase(addr, key.lower()):
            return value
    return None


def _lower_keys(rule: Any) -> Any:
    if isinstance(rule, Mapping):
        return {str(k).lower(): v for k, v in rule.items()}
    return rule


def _is_ok(reply: str) -> bool:
    return reply[:1] == "2"


class _Handler:
    """aiosmtpd hooks: every decision is delegated to the sink's current settings."""

    def __init__(self, sink: SinkServer) -> None:
        self.sink = sink

    async def handle_RCPT(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, rcpt_options: list[str]) -> str:
        sink = self.sink
        over = sink.quota_reply(session.peer[0] if session.peer else "?")
        if over is not None:
            sink._record_reply(address, over)
            return over
        if sink.latency_at == "rcpt":
            delay = sink.latency_for(address)
            if delay > 0:
                await asyncio.sleep(delay)
        reply = sink.reply_for(address) or ACCEPT_RCPT
        sink._record_reply(address, reply)
        if _is_ok(reply):
            envelope.rcpt_tos.append(address)
        return reply

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        sink = self.sink
        rcpts = list(envelope.rcpt_tos)
        if sink.latency_at == "data":
            delay = max((sink.latency_for(r) for r in rcpts), default=0.0)
            if delay > 0:
                await asyncio.sleep(delay)
        reply = ACCEPT_DATA
        if sink.forward is not None:
            loop = asyncio.get_running_loop()
            reply = await loop.run_in_executor(None, sink.forward, envelope.mail_from or "",
                                               rcpts, envelope.original_content or b"")
        for rcpt in rcpts:
            chosen = sink.data_reply_for(rcpt)
            if chosen is not None:
                reply = chosen
                break
        for rcpt in rcpts:
            sink._record_reply(rcpt, reply)
        if _is_ok(reply):
            data = envelope.original_content or b""
            peer = session.peer[0] if session.peer else "?"
            sink._record_message(ReceivedMessage(
                envelope.mail_from or "", tuple(rcpts), data, peer, time.time()))
        return reply


#: Loop turns a new session waits for the other sessions' QUITs that already arrived
#: to be read (a line read by aiosmtpd's handler task takes two:
#: the socket's data, then the task's step); then the limit is judged.
SETTLE_HOPS = 4


class _SinkSMTP(SMTP):
    """Counts sessions per client; past the limit it answers 421 and hangs up."""

    def __init__(self, sink: SinkServer, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.sink = sink
        self._client: str | None = None
        self._served = False

    def connection_made(self, transport: asyncio.BaseTransport, hops: int = 0) -> None:
        if hops and transport.is_closing():
            return  # the client gave up meanwhile: never a session
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if peer else "?"
        if hops < SETTLE_HOPS and self.sink.open_sessions():
            # Other sessions open: first let the loop read what already arrived on
            # them. A QUIT in a socket's buffer when this connection came frees its
            # slot (smtp_QUIT), but the loop may take the accept before that read, the
            # more so when the machine is loaded; whether the sink then refused, or
            # counted one session more at once, was chance (a clean clone's CI: 1 of
            # 200 sessions refused at a full site; a peak of 5 where the client's cap
            # let 4 run, the fifth begun after the first's QUIT was sent). A session
            # with no QUIT sent is still counted: a real overrun still shows.
            loop = asyncio.get_running_loop()
            loop.call_soon(self.connection_made, transport, hops + 1)
            return
        refusal = self.sink._session_opened(client, self)
        if refusal is not None:
            # Refused before aiosmtpd set anything up: never hand this connection to
            # the base class, whose connection_lost expects a session.
            def refuse() -> None:
                transport.write((refusal + "\r\n").encode())  # type: ignore[attr-defined]
                transport.close()

            if self.sink.reject_delay > 0:
                # A busy server takes a while to say no (connect, 421, disconnect).
                asyncio.get_running_loop().call_later(self.sink.reject_delay, refuse)
            else:
                refuse()
            return
        self._client = client
        self._served = True
        super().connection_made(transport)

    async def smtp_QUIT(self, arg: str) -> None:
        # A server's session slot is free once it answers QUIT: counting the session
        # until the connection is torn down would count the client's next session,
        # which may start the moment the 221 arrives, against the old one.
        self._end_session()
        await super().smtp_QUIT(arg)

    def _end_session(self) -> None:
        if self._client is not None:
            self.sink._session_closed(self._client, self)
            self._client = None

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._served:
            return  # refused in connection_made: aiosmtpd never set it up
        self._end_session()
        super().connection_lost(exc)


class SinkServer(LoopThreadServer):
    """The sink; use as a context manager or call :meth:`start` and :meth:`stop`.

    Every setting given here can be changed while it runs (``set_*`` methods); the
    change applies to the next command of any session.

    * ``latency``: seconds before replying, applied at RCPT (per recipient) or, with
      ``latency_at="data"``, once at DATA (the largest latency of the recipients).
    * ``replies``: reply at RCPT time for chosen recipients (see :func:`lookup`).
    * ``data_replies``: reply at DATA time, chosen by the first accepted recipient that
      has one; the message is recorded only when this reply is 2xx.
    * ``client_limit``: sessions allowed at once per client address (0 = no limit).
    * ``rate_limit``: new sessions a second per client address (0 = no limit); a
      session beyond it is greeted with ``rate_reply`` (a provider's rate limiting,
      Gmail's ``421 4.7.28`` by default) and closed.
    * ``reject_delay``: seconds before a refused session gets its 421 and is closed.
    * ``forward``: makes the sink a re-injecting content filter: after the latency,
      each message's sender, accepted recipients and content go to this function
      (in a worker thread, as it blocks on SMTP), whose reply line ("250 2.0.0 Ok:
      queued as ID") is the DATA reply.
    """

    def __init__(self, port: int | None = None, latency: LatencyRule = 0,
                 replies: ReplyRule | None = None, client_limit: int = 0,
                 data_replies: ReplyRule | None = None, latency_at: str = "rcpt",
                 rate_limit: float = 0, rate_reply: str = RATE_LIMITED,
                 reject_delay: float = 0,
                 forward: Callable[[str, list[str], bytes], str] | None = None,
                 host: str = HOST) -> None:
        self.lock = threading.Lock()
        #: The loopback address it listens on (another than 127.0.0.1 shares a port
        #: number with a sink there: two MX hosts behind one next hop's port).
        self.host = host
        self.forward = forward
        self.stats = SinkStats()
        #: Envelope sender of every accepted message, in arrival order.
        self.received_senders: list[str] = []
        #: Sessions open now, by client address.
        self.active: dict[str, int] = {}
        self._messages: list[ReceivedMessage] = []
        self._protocols: set[_SinkSMTP] = set()
        self.latency: LatencyRule = 0
        self.latency_at = "rcpt"
        self.set_latency(latency, latency_at)
        self.replies: ReplyRule = {}
        self.set_replies(replies or {})
        self.data_replies: ReplyRule = {}
        self.set_data_replies(data_replies or {})
        self.client_limit = client_limit
        self.rate_limit = rate_limit
        self.rate_reply = rate_reply
        self.reject_delay = reject_delay
        #: Every new session is greeted with this refusal and closed (None: served).
        self.greeting_refusal: str | None = None
        #: The same for one client address (a provider that blocks one source).
        self.client_refusals: dict[str, str] = {}
        #: Client address -> (messages, reply): past that many messages accepted
        #: from it, its recipients get the reply at RCPT (a provider's day limit for
        #: a new sending address: Gmail's 421 4.7.28).
        self.client_quotas: dict[str, tuple[int, str]] = {}
        #: Session start times in the last second, per client (the rate limit).
        self._starts: dict[str, list[float]] = {}
        self.port: int = port or 0
        sock = self._bind()
        super().__init__(sock)
        self.port = sock.getsockname()[1]

    # -- settings -------------------------------------------------------------------

    def set_latency(self, latency: LatencyRule, at: str | None = None) -> None:
        if at is not None:
            if at not in ("rcpt", "data"):
                raise ValueError(f"latency_at must be 'rcpt' or 'data', not {at!r}")
            self.latency_at = at
        self.latency = _lower_keys(latency)

    def set_replies(self, replies: ReplyRule) -> None:
        self.replies = _lower_keys(replies)

    def set_data_replies(self, replies: ReplyRule) -> None:
        self.data_replies = _lower_keys(replies)

    def set_client_limit(self, limit: int) -> None:
        self.client_limit = limit

    def latency_for(self, address: str) -> float:
        rule = self.latency
        if isinstance(rule, int | float):
            return float(rule)
        return float(lookup(rule, address) or 0)

    def reply_for(self, address: str) -> str | None:
        return lookup(self.replies, address)

    def data_reply_for(self, address: str) -> str | None:
        return lookup(self.data_replies, address)

    # -- bookkeeping (called on the loop thread) --------------------------------------

    def quota_reply(self, client: str) -> str | None:
        """The reply for a recipient from a client past its quota; None: within it."""
        quota = self.client_quotas.get(client)
        if quota is None:
            return None
        with self.lock:
            if self.stats.messages_by_client[client] < quota[0]:
                return None
            self.stats.over_quota_by_client[client] += 1
        return quota[1]

    def _session_opened(self, client: str, proto: _SinkSMTP) -> str | None:
        """Count a new session; the greeting that refuses it, or None to serve it."""
        with self.lock:
            self.stats.sessions += 1
            active = self.active.get(client, 0)
            refusal = self.client_refusals.get(client, self.greeting_refusal)
            if refusal is not None:
                self.stats.rejected_421 += 1
                self.stats.refused_by_client[client] += 1
                return refusal
            if self.client_limit and active >= self.client_limit:
                self.stats.rejected_421 += 1
                return TOO_MANY
            now = time.monotonic()
            if self.rate_limit:
                starts = [t for t in self._starts.get(client, []) if t > now - 1.0]
                if len(starts) >= self.rate_limit:
                    self._starts[client] = starts
                    self.stats.rejected_rate += 1
                    self.stats.rate_refused.append(now)
                    return self.rate_reply
                starts.append(now)
                self._starts[client] = starts
            self.active[client] = active + 1
            self._protocols.add(proto)
            st = self.stats
            st.sessions_by_client[client] += 1
            total = sum(self.active.values())
            st.timeline.append((now, total))
            st.opened.append(now)
            st.max_concurrent = max(st.max_concurrent, total)
            st.max_concurrent_per_client = max(st.max_concurrent_per_client, active + 1)
            return None

    def _session_closed(self, client: str, proto: _SinkSMTP) -> None:
        with self.lock:
            self.active[client] -= 1
            if not self.active[client]:
                del self.active[client]
            self._protocols.discard(proto)
            self.stats.timeline.append((time.monotonic(), sum(self.active.values())))

    def _record_reply(self, rcpt: str, reply: str) -> None:
        with self.lock:
            self.stats.outcomes.setdefault(rcpt.lower(), []).append(reply)
            if not _is_ok(reply):
                self.stats.replies[reply.split()[0]] += 1

    def _record_message(self, msg: ReceivedMessage) -> None:
        with self.lock:
            self._messages.append(msg)
            self.received_senders.append(msg.sender)
            self.stats.messages += 1
            self.stats.messages_by_client[msg.peer] += 1
            for rcpt in msg.recipients:
                self.stats.delivered[rcpt.lower()] += 1

    # -- thread-safe accessors ------------------------------------------------------

    def snapshot(self) -> SinkStats:
        """A consistent copy of the counters."""
        with self.lock:
            return copy.deepcopy(self.stats)

    def messages(self) -> list[ReceivedMessage]:
        """Every accepted message so far, in arrival order."""
        with self.lock:
            return list(self._messages)

    def outcomes(self, rcpt: str) -> list[str]:
        """Every reply given for one recipient, in order."""
        with self.lock:
            return list(self.stats.outcomes.get(rcpt.lower(), []))

    def delivered_count(self) -> int:
        with self.lock:
            return sum(self.stats.delivered.values())

    def open_sessions(self) -> int:
        with self.lock:
            return sum(self.active.values())

    def reset(self) -> None:
        """Forget what was recorded (settings and open sessions stay)."""
        with self.lock:
            active = sum(self.active.values())
            self.stats = SinkStats(max_concurrent=active,
                                   max_concurrent_per_client=max(self.active.values(),
                                                                 default=0))
            self._messages.clear()
            self.received_senders.clear()

    # -- life cycle -----------------------------------------------------------------

    def _bind(self) -> socket.socket:
        return bound_socket((self.host, self.port))

    def _thread_name(self) -> str:
        return f"sink:{self.port}"

    def _factory(self) -> SMTP:
        assert self._loop is not None
        return _SinkSMTP(self, _Handler(self), hostname="sink.test.example", ident="sink",
                         timeout=60, auth_require_tls=False, loop=self._loop)

    async def _serve(self, sock: socket.socket) -> asyncio.AbstractServer:
        loop = asyncio.get_running_loop()
        return await loop.create_server(self._factory, sock=sock, backlog=128)

    def refuse_sessions(self, greeting: str | None) -> None:
        """Greet every new session with ``greeting`` (a 421, say Yahoo's ``[TSS04]``)
        and close it; None serves them again."""
        with self.lock:
            self.greeting_refusal = greeting

    def refuse_client(self, client: str, greeting: str | None) -> None:
        """Greet every new session from ``client`` (an address) with ``greeting`` and
        close it, as a provider that rate-limits one sending address; None serves it."""
        with self.lock:
            if greeting is None:
                self.client_refusals.pop(client, None)
            else:
                self.client_refusals[client] = greeting

    def refuse(self) -> None:
        """Stop listening: new connections get ECONNREFUSED until :meth:`start`.

        Sessions already open carry on, as they would at a real host whose MTA is
        being shut down.
        """
        self._close_listener()

    def reopen(self) -> SinkServer:
        """Listen again after :meth:`refuse` (the same as :meth:`start`)."""
        return self.start()

    async def _drop_sessions(self) -> None:
        with self.lock:
            protos = list(self._protocols)
        for proto in protos:
            if proto.transport is not None:
                proto.transport.close()
        await asyncio.sleep(0)

    # -- waiting --------------------------------------------------------------------

    def wait_delivered(self, count: int, timeout: float) -> None:
        """Wait until ``count`` recipient deliveries were accepted in all."""
        self.wait(lambda: self.delivered_count() >= count, timeout,
                  f"{count} recipients at the sink")

    def wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                st = self.snapshot()
                raise TimeoutError(
                    f"timed out after {timeout:g}s waiting for {what} (sink saw "
                    f"{st.sessions} sessions, {sum(st.delivered.values())} deliveries, "
                    f"replies {dict(st.replies)}, {st.rejected_421} x 421)")
            time.sleep(0.02)
