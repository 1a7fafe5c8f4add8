"""One request, one reply, then closed: the life cycle both of the daemon's listeners share.

The control channel (:mod:`pyqmgr.daemon.control`) and the metrics endpoint
(:mod:`pyqmgr.daemon.metrics_http`) run on the event loop that also schedules
deliveries, so neither may let a client hold anything for long. Both bound a client the
same way, written here once so that a fix to it lands in both:

* at most ``max_clients`` connections are served at once (a server may bound them
  further, per peer: :meth:`BoundedServer.admit`); one more is answered at once with
  the server's "busy" reply and cut off after :data:`BUSY_LINGER` seconds whatever
  the client does, and past :data:`MAX_BUSY` such at once a connection is closed
  unanswered: however many connections a client opens, the daemon holds at most
  ``max_clients + MAX_BUSY`` descriptors for them, each briefly;
* a client has ``timeout`` seconds to send its request (then it gets the server's
  "too slow" reply), and as long again to take the reply before it is cut off;
* after the reply nothing the client sends is answered.

What a request is, and what the replies say, stays each server's own.
"""

from __future__ import annotations

import asyncio
from typing import Any, Generic, TypeVar

from pyqmgr.postfix.maillog_client import MailLog

#: Connections answered "busy" and not yet gone, at most; past it, closed unanswered.
MAX_BUSY = 32
#: Seconds a connection answered "busy" has to read the answer.
BUSY_LINGER = 0.5


class BoundedServer:
    """The bounds a :class:`OneReplyConnection` keeps, and how many clients it holds now."""

    def __init__(self, log: MailLog, max_clients: int, timeout: float, limit: int) -> None:
        self.log = log
        #: Clients served at once; ``clients`` counts those being served now.
        self.max_clients, self.clients = max_clients, 0
        #: Seconds to send the request, and again to take the reply.
        self.timeout = timeout
        #: Largest request in bytes (each server decides what happens past it).
        self.limit = limit
        #: Connections answered "busy" and not yet gone.
        self.busy = 0

    def admit(self, conn: OneReplyConnection[Any]) -> bool:
        """May ``conn`` be served now? Counted in ``clients`` when it may."""
        if self.clients >= self.max_clients:
            return False
        self.clients += 1
        return True

    def release(self, conn: OneReplyConnection[Any]) -> None:
        """``conn``, admitted earlier, is gone."""
        self.clients -= 1


ServerT = TypeVar("ServerT", bound=BoundedServer)


class OneReplyConnection(asyncio.Protocol, Generic[ServerT]):
    """One client of a :class:`BoundedServer`: counted, timed, answered once, closed.

    A subclass reads the request in ``data_received`` and answers with :meth:`_reply`;
    it says what a client over the limit gets (:meth:`_busy_reply`), what a client too
    slow to send its request gets (:meth:`_timeout_reply`), and how the reply is ended
    (:meth:`_end_reply`).
    """

    def __init__(self, server: ServerT) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.answered = False
        self.counted = False
        self.busy_counted = False
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._accepted(transport)
        server = self.server
        if not server.admit(self):
            if server.busy >= MAX_BUSY:
                transport.abort()
                return
            # Answered and cut off soon: closing at once with the request unread
            # would reset the connection before the client read why.
            server.busy += 1
            self.busy_counted = True
            self.answered = True
            self._reply(self._busy_reply())
            if self.timer is not None:
                self.timer.cancel()
            self.timer = asyncio.get_running_loop().call_later(BUSY_LINGER, self._abort)
            return
        self.counted = True
        self.timer = asyncio.get_running_loop().call_later(server.timeout, self._timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.counted:
            self.server.release(self)
            self.counted = False
        if self.busy_counted:
            self.server.busy -= 1
            self.busy_counted = False

    def _accepted(self, transport: asyncio.Transport) -> None:
        """A new connection, before it is counted: what to learn of the peer now."""

    def _busy_reply(self) -> bytes:
        raise NotImplementedError

    def _timeout_reply(self) -> bytes:
        raise NotImplementedError

    def _end_reply(self, transport: asyncio.Transport) -> None:
        """After the reply is written: end our side (close, or half-close)."""
        transport.close()

    def _reply(self, data: bytes) -> None:
        """Send the one reply; from now on the timer cuts off a client that lingers."""
        self.answered = True
        assert self.transport is not None
        self.transport.write(data)
        self._end_reply(self.transport)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = asyncio.get_running_loop().call_later(
                self.server.timeout, self._abort)

    def _timed_out(self) -> None:
        if self.answered:
            self._abort()
            return
        self._reply(self._timeout_reply())

    def _abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
