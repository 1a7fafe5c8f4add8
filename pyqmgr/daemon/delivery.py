"""One delivery: connect to a transport's agent, wait for it, send a request, read the reply.

A plain state machine driven by fd callbacks, without tasks, futures or per-read timers:
qmgr runs thousands of these a second and each asyncio layer costs measurable CPU.
Deadlines (``daemon_timeout``) are checked by the daemon's once-a-second sweep.

The wait for the agent's announcement is where master(8)'s process limit throttles
deliveries: the connection sits in the listen queue until an agent process is free.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from pyqmgr.postfix.attr import AttrError, AttrParser, check_announcement
from pyqmgr.postfix.deliver_request import PROTOCOL, DeliveryReply, decode_reply
from pyqmgr.scheduler.entry import Entry

if TYPE_CHECKING:
    from pyqmgr.postfix.maillog_client import MailLog

CONNECT_RETRY_DELAY = 0.01


class Pending:
    """What ``on_ready`` returns while a policy service is being asked about the entry.

    The call then waits in state ``policy`` (reader off, no deadline: the policy
    client's own timeout bounds the wait) until the daemon calls :meth:`AgentCall.resume`.
    """

    __slots__ = ()


PENDING = Pending()


class AgentCall:
    """States: connecting -> waiting for the agent -> waiting for the reply -> done.

    Between the agent's announcement and the request, ``rate`` (transport_rate_delay)
    and ``policy`` (a delivery policy service is asked first) keep the agent waiting.
    """

    __slots__ = ("loop", "path", "sock", "parser", "deadline", "state", "out",
                 "on_ready", "on_reply", "on_unavailable", "on_send_failed", "entry",
                 "rate_delay", "timeout", "selected")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        path: str,
        timeout: float,
        on_ready: Callable[[AgentCall], bytes | Pending | None],
        on_reply: Callable[[AgentCall, DeliveryReply | None, str | None], None],
        on_unavailable: Callable[[AgentCall, str], None],
        on_send_failed: Callable[[AgentCall, str], None],
        rate_delay: float = 0.0,
    ) -> None:
        self.loop = loop
        self.path = path
        self.sock: socket.socket | None = None
        self.parser = AttrParser()
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.state = "connect"
        self.out = b""
        self.on_ready = on_ready
        self.on_reply = on_reply
        self.on_unavailable = on_unavailable
        #: The request could not be written: stock puts the entry back and defers
        #: the transport, which is not what a crashed agent gets.
        self.on_send_failed = on_send_failed
        self.entry: object = None
        #: transport_rate_delay: wait this long after the announcement before asking
        #: the scheduler for an entry (stock's qmgr_transport_rate_event).
        self.rate_delay = rate_delay
        #: When the scheduler chose the entry (monotonic): delivery latency's start.
        self.selected = 0.0

    def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(self.path)
        except BlockingIOError:
            # The listen backlog is full: master is not keeping up; try again shortly.
            sock.close()
            self.loop.call_later(CONNECT_RETRY_DELAY, self.start)
            return
        except OSError as exc:
            sock.close()
            self.state = "done"
            # Report from the event loop, not from inside the caller's dispatch loop.
            why = exc.strerror or errno.errorcode.get(exc.errno or 0, "?")
            self.loop.call_soon(self.on_unavailable, self, why)
            return
        self.sock = sock
        self.state = "announce"
        self.loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        sock = self.sock
        assert sock is not None
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        try:
            if data:
                self.parser.feed(data)
            attrs = self.parser.pop()
        except AttrError as exc:
            self._fail(str(exc))
            return
        if attrs is None:
            if not data:
                self._fail("premature disconnect")
            return
        if self.state == "announce":
            try:
                check_announcement(attrs, PROTOCOL)
            except AttrError as exc:
                self.close()
                self.on_unavailable(self, str(exc))
                return
            if self.rate_delay > 0:
                self.state = "rate"
                self.loop.remove_reader(sock.fileno())
                self.loop.call_later(self.rate_delay, self._request)
                return
            self._request()
        elif self.state == "reply":
            try:
                reply = decode_reply(attrs)
            except AttrError:
                self._fail("malformed response")
                return
            self.close()
            self.on_reply(self, reply, None)

    def _request(self) -> None:
        """Ask the scheduler for an entry and send it (after any rate delay)."""
        sock = self.sock
        if sock is None:
            return
        request = self.on_ready(self)
        if request is None:
            self.close()
            return
        if isinstance(request, Pending):
            if self.state != "rate":
                self.loop.remove_reader(sock.fileno())
            self.state = "policy"
            return
        if self.state == "rate":
            self.deadline = time.monotonic() + self.timeout
            self.loop.add_reader(sock.fileno(), self._readable)
        self.state = "reply"
        self._send(request)

    def resume(self, request: bytes | None) -> None:
        """After a policy service answered: send ``request``, or close (nothing to do)."""
        sock = self.sock
        if sock is None or self.state != "policy":
            return
        if request is None:
            self.close()
            return
        self.deadline = time.monotonic() + self.timeout
        self.loop.add_reader(sock.fileno(), self._readable)
        self.state = "reply"
        self._send(request)

    def _send(self, data: bytes) -> None:
        """Write the request; a large one in several goes, reading nothing meanwhile.

        Stock writes the whole request before it reads, so an agent that goes away
        early shows up as a failed write (``write to process``), not as a missing
        reply: the reader is off until the last byte is out.
        """
        sock = self.sock
        assert sock is not None
        try:
            sent = sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self.close()
            self.on_send_failed(self, exc.strerror or str(exc))
            return
        was_partial = bool(self.out)
        self.out = data[sent:]
        if self.out:
            if not was_partial:
                self.loop.remove_reader(sock.fileno())
                self.loop.add_writer(sock.fileno(), self._writable)
        elif was_partial:
            self.loop.remove_writer(sock.fileno())
            self.loop.add_reader(sock.fileno(), self._readable)

    def _writable(self) -> None:
        assert self.sock is not None
        self._send(self.out)

    def _fail(self, why: str) -> None:
        state = self.state
        self.close()
        if state == "announce":
            self.on_unavailable(self, why)
        else:
            self.on_reply(self, None, why)

    def expired(self, now: float) -> bool:
        return self.state in ("announce", "reply") and now > self.deadline

    def close(self) -> None:
        self.state = "done"
        sock = self.sock
        if sock is not None:
            if self.out:
                self.loop.remove_writer(sock.fileno())
                self.out = b""
            else:
                self.loop.remove_reader(sock.fileno())
            sock.close()
            self.sock = None


def expire_calls(calls: Iterable[AgentCall], log: MailLog) -> None:
    """An agent silent for daemon_timeout is fatal, as in stock.

    Stock's watchdogs (qmgr_transport_abort, qmgr_deliver_abort) call msg_fatal:
    the qmgr exits, master starts a new one, and start-up recovery puts the
    message back in the queue. Nothing is lost; the transport is not throttled.
    """
    now = time.monotonic()
    for call in [c for c in calls if c.expired(now)]:
        if call.state == "announce":
            log.fatal(f"timeout connecting to transport: {call.entry}")
        else:
            entry = call.entry
            assert isinstance(entry, Entry)
            log.fatal(f"{entry.message.queue_id}: timeout receiving delivery "
                      f"status from transport: {entry.transport}")
        os._exit(1)
