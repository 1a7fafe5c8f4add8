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
  another path ``404``.

Nothing is logged for a bad request: the port may be reachable by anything on the
host (or beyond, with ``metrics_allow_remote``), and a scanner must not be able to
fill the maillog. A failure to build the reply is logged (at most once a minute) and
answered ``500``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pyqmgr.daemon.bounded_server import BoundedServer, OneReplyConnection
from pyqmgr.postfix.maillog_client import MailLog

MAX_REQUEST = 8192
REQUEST_TIMEOUT = 5.0
MAX_CLIENTS = 16
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


class MetricsHttpServer(BoundedServer):
    """Serves ``render()`` (the exposition, bytes) to scrapers; bounded as described."""

    def __init__(self, render: Callable[[], bytes], log: MailLog, *,
                 max_clients: int = MAX_CLIENTS, timeout: float = REQUEST_TIMEOUT,
                 limit: int = MAX_REQUEST) -> None:
        super().__init__(log, max_clients, timeout, limit)
        self.render = render
        self._last_error = -ERROR_LOG_INTERVAL
        self.server: asyncio.AbstractServer | None = None

    def reply_for(self, code: int, head: bool) -> bytes:
        if code != 200:
            text = f"{code} {_REASONS[code]}\n".encode()
            extra = "Allow: GET, HEAD\r\n" if code == 405 else ""
            return response(code, text, head=head, extra=extra)
        try:
            body = self.render()
        except Exception as exc:  # noqa: BLE001 - a bug must not take the daemon down
            now = time.monotonic()
            if now - self._last_error >= ERROR_LOG_INTERVAL:
                self._last_error = now
                self.log.warning(f"metrics: cannot build the reply: "
                                 f"{type(exc).__name__}: {exc}")
            return response(500, b"500 Internal Server Error\n", head=head)
        return response(200, body, CONTENT_TYPE, head=head)

    def protocol(self) -> asyncio.Protocol:
        return _Connection(self)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


class _Connection(OneReplyConnection[MetricsHttpServer]):
    """One client: one request, one reply, then closed; bounded in bytes and time."""

    def __init__(self, server: MetricsHttpServer) -> None:
        super().__init__(server)
        self.buffer = b""

    def _busy_reply(self) -> bytes:
        return self.server.reply_for(503, False)

    def _timeout_reply(self) -> bytes:
        return self.server.reply_for(408, False)

    def data_received(self, data: bytes) -> None:
        if self.answered:
            return  # whatever follows the request (a body, pipelining) is not read
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            end = self.buffer.find(b"\n\n")
        if end < 0 or end > self.server.limit:
            if len(self.buffer) > self.server.limit:
                self._reply(self.server.reply_for(431, False))
            return
        code, _path, head = parse_request(self.buffer[:end])
        self.buffer = b""
        self._reply(self.server.reply_for(code, head))

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
