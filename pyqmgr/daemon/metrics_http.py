"""A minimal HTTP/1.0 server on the daemon's event loop, for Prometheus's scrapes.

Why not prometheus_client's own ``start_http_server``: it serves from a thread, which
would read the scheduler's structures while the event loop changes them (a torn
snapshot, or an exception mid-walk), and a thread holding the GIL while it formats
100 destinations' series is time taken from deliveries anyway, only less visibly.
Here a scrape is answered in one event-loop turn, between two scheduler events, so it
always sees a consistent state and needs no lock.

What a scraper gets: ``GET /metrics`` (or ``HEAD``), any query string ignored, answered
``200`` with the text exposition format and ``Connection: close``; one request per
connection, as HTTP/1.0 has it (Prometheus opens a connection per scrape either way).

What no client can do is stall deliveries or grow the daemon:

* a request (line and headers) is at most :data:`MAX_REQUEST` bytes: more is answered
  ``431`` and the connection closed; a body is never read;
* a client has :data:`REQUEST_TIMEOUT` seconds to send its request (``408`` after
  that), and as long again to take the reply before it is cut off;
* at most :data:`MAX_CLIENTS` connections at once; more are answered ``503`` at once;
* anything that is not ``METHOD TARGET HTTP/1.x`` is ``400``, another method ``405``,
  another path ``404``;
* connections are accepted at most :data:`ACCEPT_RATE` a second (after a burst of
  :data:`ACCEPT_BURST`): past that the listening socket is not read until the next
  one is due, and the kernel holds the rest in its backlog (issue #44). Clients that
  scrape in a loop then wait in ``connect()``, not on the event loop: what the whole
  port can cost deliveries is ACCEPT_RATE connections a second, each answered from
  the exporter's cached rendering (:class:`.metrics_exporter.Pacer`), whatever the
  clients do. A local user can thereby make scrapes wait, never deliveries; the
  clients of a loopback port are all 127.0.0.1, so there is no fair share per client
  to keep.

Nothing is logged for a bad request: the port may be reachable by anything on the
host (or beyond, with ``metrics_allow_remote``), and a scanner must not be able to
fill the maillog. A failure to build the reply is logged (at most once a minute) and
answered ``500``.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Protocol

from pyqmgr.daemon.bounded_server import BoundedServer, OneReplyConnection
from pyqmgr.postfix.maillog_client import MailLog

MAX_REQUEST = 8192
REQUEST_TIMEOUT = 5.0
MAX_CLIENTS = 16
#: Connections accepted a second at most, and at once after a quiet while. A
#: connection costs the loop about 0.5 ms on a small machine (accept, epoll, send and
#: close on loopback, measured), so 5 a second is 0.3% of a core: a Prometheus server
#: scraping every second, or several every 15 s, never meet the bound, and 16 clients
#: in a loop get 5 answers a second between them (issue #44). The burst
#: lets a few clients at once (a dashboard, an admin's curl) through without waiting.
ACCEPT_RATE = 5.0
ACCEPT_BURST = 32
#: Seconds before the listening socket is read again after accept() failed for want
#: of descriptors (EMFILE, ENFILE, ENOBUFS, ENOMEM).
ACCEPT_BACKOFF = 0.5
#: Seconds between two logged failures to build the reply.
ERROR_LOG_INTERVAL = 60.0

PATH = "/metrics"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 503: "Service Unavailable"}


def response(code: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
             head: bool = False, extra: str = "") -> bytes:
    """A complete HTTP/1.0 response; ``head`` leaves the body out (not its length)."""
    header = (f"HTTP/1.0 {code} {_REASONS[code]}\r\nContent-Type: {content_type}\r\n"
              f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n")
    return header.encode("ascii") + (b"" if head else body)


def parse_request(data: bytes) -> tuple[int, str, bool]:
    """The answer to a complete request head: (status, path, head-only).

    ``data`` is everything up to the blank line. Headers are not interpreted: a scrape
    needs none of them, and every header is a way to be wrong.
    """
    line = data.split(b"\n", 1)[0].rstrip(b"\r")
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        return 400, "", False
    method, target = parts[0], parts[1]
    try:
        path = target.decode("ascii").split("?", 1)[0]
    except UnicodeDecodeError:
        return 400, "", False
    if method not in (b"GET", b"HEAD"):
        return 405, path, False
    head = method == b"HEAD"
    if path != PATH:
        return 404, path, head
    return 200, path, head


class Body(Protocol):
    """Where the exposition comes from (:class:`.metrics_exporter.Pacer`)."""

    def body(self) -> bytes | None:
        """The exposition now, or None while the first one is being gathered."""

    def when_ready(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once :meth:`body` has an answer."""


class MetricsHttpServer(BoundedServer):
    """Serves ``source.body()`` (the exposition, bytes) to scrapers; bounded as described."""

    def __init__(self, source: Body, log: MailLog, *,
                 max_clients: int = MAX_CLIENTS, timeout: float = REQUEST_TIMEOUT,
                 limit: int = MAX_REQUEST, rate: float = ACCEPT_RATE,
                 burst: int = ACCEPT_BURST) -> None:
        super().__init__(log, max_clients, timeout, limit)
        self.source = source
        self._last_error = -ERROR_LOG_INTERVAL
        self.rate, self.burst = rate, burst
        self.tokens, self.filled = float(burst), 0.0
        self.sock: socket.socket | None = None
        #: The timer that reads the listening socket again (paced, or after EMFILE).
        self.resume: asyncio.TimerHandle | None = None
        #: Connections being set up (the loop keeps only weak references to tasks).
        self.starting: set[asyncio.Task[object]] = set()
        #: Connections accepted, for the benchmark's and the tests' figures.
        self.accepted = 0

    def reply_for(self, code: int, head: bool) -> bytes | None:
        """The whole reply; None while the exposition is not there yet (ask again
        when :meth:`Body.when_ready` says)."""
        if code != 200:
            text = f"{code} {_REASONS[code]}\n".encode()
            extra = "Allow: GET, HEAD\r\n" if code == 405 else ""
            return response(code, text, head=head, extra=extra)
        try:
            body = self.source.body()
        except Exception as exc:  # noqa: BLE001 - a bug must not take the daemon down
            now = time.monotonic()
            if now - self._last_error >= ERROR_LOG_INTERVAL:
                self._last_error = now
                self.log.warning(f"metrics: cannot build the reply: "
                                 f"{type(exc).__name__}: {exc}")
            return response(500, b"500 Internal Server Error\n", head=head)
        if body is None:
            return None
        return response(200, body, CONTENT_TYPE, head=head)

    def protocol(self) -> asyncio.Protocol:
        return _Connection(self)

    def serve(self, sock: socket.socket) -> None:
        """Accept on ``sock`` (bound, listening, non-blocking), paced as described."""
        self.sock = sock
        self.filled = asyncio.get_running_loop().time()
        self._listen()

    def _listen(self) -> None:
        self.resume = None
        if self.sock is not None:
            asyncio.get_running_loop().add_reader(self.sock.fileno(), self._accept)

    def _pause(self, delay: float) -> None:
        loop = asyncio.get_running_loop()
        assert self.sock is not None
        loop.remove_reader(self.sock.fileno())
        self.resume = loop.call_later(delay, self._listen)

    def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        self.tokens = min(float(self.burst), self.tokens + (now - self.filled) * self.rate)
        self.filled = now
        sock = self.sock
        assert sock is not None
        while self.tokens >= 1.0:
            try:
                conn, _peer = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                # Out of descriptors or memory: the connections wait in the backlog.
                self._pause(ACCEPT_BACKOFF)
                return
            self.tokens -= 1.0
            self.accepted += 1
            conn.setblocking(False)
            task = loop.create_task(loop.connect_accepted_socket(self.protocol, conn))
            self.starting.add(task)
            task.add_done_callback(self._started)
        self._pause((1.0 - self.tokens) / self.rate)

    def _started(self, task: asyncio.Task[object]) -> None:
        self.starting.discard(task)
        if not task.cancelled():
            task.exception()  # a peer gone before its transport was made: nothing to do

    def close(self) -> None:
        if self.resume is not None:
            self.resume.cancel()
            self.resume = None
        if self.sock is not None:
            try:
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
            except RuntimeError:
                pass  # no loop any more: nothing reads it
            self.sock.close()
            self.sock = None


class _Connection(OneReplyConnection[MetricsHttpServer]):
    """One client: one request, one reply, then closed; bounded in bytes and time."""

    def __init__(self, server: MetricsHttpServer) -> None:
        super().__init__(server)
        self.buffer = b""

    def _busy_reply(self) -> bytes:
        return response(503, b"503 Service Unavailable\n")

    def _timeout_reply(self) -> bytes:
        return response(408, b"408 Request Timeout\n")

    def data_received(self, data: bytes) -> None:
        if self.answered:
            return  # whatever follows the request (a body, pipelining) is not read
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            end = self.buffer.find(b"\n\n")
        if end < 0 or end > self.server.limit:
            if len(self.buffer) > self.server.limit:
                self._reply(response(431, b"431 Request Header Fields Too Large\n"))
            return
        code, _path, head = parse_request(self.buffer[:end])
        self.buffer = b""
        reply = self.server.reply_for(code, head)
        if reply is None:
            # The first exposition is still being gathered: this client waits for
            # it (within its timeout), read no further.
            self.answered = True
            self.server.source.when_ready(lambda: self._late(head))
            return
        self._reply(reply)

    def _late(self, head: bool) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        reply = self.server.reply_for(200, head)
        self._reply(reply if reply is not None else response(
            503, b"503 Service Unavailable\n", head=head))

    def eof_received(self) -> bool:
        if not self.answered:
            # A request cut short: nothing to answer, and nobody left to read it.
            self._close()
        return False

    def _end_reply(self, transport: asyncio.Transport) -> None:
        # close() sends what is buffered, then FIN; a client that never takes its
        # reply is aborted by the timer, armed again for that.
        transport.close()

    def _close(self) -> None:
        self.answered = True
        if self.transport is not None:
            self.transport.close()
