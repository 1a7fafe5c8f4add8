"""A sink SMTP server on loopback that plays remote destinations for the smtp transport.

It runs aiosmtpd in a thread of its own and can be made slow (per-recipient latency),
picky (chosen 4xx/5xx replies per recipient), crowded (an active per-client concurrency
limit that answers 421 and disconnects, like the seed document's experiments) or absent
(the port refuses connections). Everything it saw is recorded for tests to check.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiosmtpd.smtp import SMTP, Envelope, Session

from pyqmgr.testbed.instance import free_port

ReplyRule = Callable[[str], str | None]


@dataclass
class SinkStats:
    sessions: int = 0
    max_concurrent: int = 0
    rejected_421: int = 0
    messages: int = 0
    delivered: Counter[str] = field(default_factory=Counter)
    replies: Counter[str] = field(default_factory=Counter)


class _Handler:
    def __init__(self, sink: SinkServer) -> None:
        self.sink = sink

    async def handle_RCPT(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, rcpt_options: list[str]) -> str:
        sink = self.sink
        delay = sink.latency(address) if callable(sink.latency) else sink.latency
        if delay:
            await asyncio.sleep(delay)
        reply = sink.reply_for(address)
        if reply is not None:
            with sink.lock:
                sink.stats.replies[reply.split()[0]] += 1
            return reply
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        sink = self.sink
        with sink.lock:
            sink.stats.messages += 1
            sink.received_senders.append(envelope.mail_from or "")
            for rcpt in envelope.rcpt_tos:
                sink.stats.delivered[rcpt.lower()] += 1
        return "250 2.0.0 queued"


class _LimitedSMTP(SMTP):
    """Counts sessions per client; past the limit it answers 421 and hangs up."""

    def __init__(self, sink: SinkServer, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.sink = sink
        self._counted: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        client = peer[0] if peer else "?"
        sink = self.sink
        with sink.lock:
            sink.stats.sessions += 1
            active = sink.active.get(client, 0)
            limit = sink.client_limit
            if limit and active >= limit:
                sink.stats.rejected_421 += 1
                refuse = True
            else:
                sink.active[client] = active + 1
                self._counted = client
                total = sum(sink.active.values())
                sink.stats.max_concurrent = max(sink.stats.max_concurrent, total)
                refuse = False
        if refuse:
            transport.write(b"421 4.7.0 too many connections from your host\r\n")  # type: ignore
            transport.close()
            return
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._counted is not None:
            with self.sink.lock:
                self.sink.active[self._counted] -= 1
            self._counted = None
        super().connection_lost(exc)


class SinkServer:
    def __init__(self, port: int | None = None, latency: float | Callable[[str], float] = 0,
                 replies: dict[str, str] | ReplyRule | None = None,
                 client_limit: int = 0) -> None:
        self.port = port or free_port()
        self.latency = latency
        self.replies = replies or {}
        self.client_limit = client_limit
        self.stats = SinkStats()
        #: Envelope sender of every accepted message, in arrival order.
        self.received_senders: list[str] = []
        self.active: dict[str, int] = {}
        self.lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._thread.start()

    def reply_for(self, address: str) -> str | None:
        rule = self.replies
        if callable(rule):
            return rule(address)
        return rule.get(address.lower()) or rule.get(address.rpartition("@")[2].lower())

    def set_replies(self, replies: dict[str, str] | ReplyRule) -> None:
        self.replies = replies

    def _factory(self) -> SMTP:
        return _LimitedSMTP(self, _Handler(self), hostname="sink.test.example",
                            ident="sink", timeout=60)

    def start(self) -> SinkServer:
        async def listen() -> asyncio.base_events.Server:
            return await self._loop.create_server(self._factory, "127.0.0.1", self.port,
                                                  reuse_address=True)

        self._server = asyncio.run_coroutine_threadsafe(listen(), self._loop).result(10)
        return self

    def refuse(self) -> None:
        """Close the listening socket: clients get ECONNREFUSED until :meth:`start`."""
        server = self._server
        if server is not None:
            self._server = None

            async def close() -> None:
                server.close()

            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)

    def stop(self) -> None:
        self.refuse()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> SinkServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_delivered(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while sum(self.stats.delivered.values()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"timed out after {timeout:.0f}s waiting for {count} recipients at the "
                    f"sink (got {sum(self.stats.delivered.values())})"
                )
            time.sleep(0.05)
