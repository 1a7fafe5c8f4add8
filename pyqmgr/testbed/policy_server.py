"""A fake policy server that answers well or badly, on loopback or a UNIX socket, for tests.

A delivery policy service that misbehaves must cost pyqmgr a warning and the default
action, never a stuck scheduler or lost mail. Real servers misbehave in a handful of
ways, and each is a mode here, switchable while clients are connected:

==============  ===========================================================================
``reply``       reads a request, answers ``action=<action>`` (plus ``extra`` attributes),
                after ``delay`` seconds when one is set (a slow server)
``garbage``     answers a line without ``=``
``oversized``   answers an ``action=`` line of 100,000 bytes
``binary``      answers an action that is not UTF-8
``noaction``    answers a well-formed reply without ``action=``
``stray``       answers twice for one request (out of step)
``partial``     sends half a reply and then nothing
``silent``      reads requests and never answers
``hangup``      reads a request and closes the connection without an answer
``close``       closes every connection at once, before reading anything
==============  ===========================================================================

:meth:`refuse` stops listening and closes the open connections (the service died);
:meth:`start` listens again on the same address (it came back). The server counts
connections and keeps every request it read, so a test can check that connections
are reused and that nothing was asked twice.

Like the sink it runs an event loop in a thread of its own, so a test's own event loop
(the client under test) and this server never block each other; the listening socket
is bound at construction, so its port cannot be taken in between.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Callable, Sequence

from pyqmgr.testbed.loop_thread import LoopThreadServer, bound_socket

HOST = "127.0.0.1"
MODES = ("reply", "garbage", "oversized", "binary", "noaction", "stray", "partial",
         "silent", "hangup", "close")
#: The oversized reply's length: far over the client's 8192-byte line limit.
OVERSIZED = 100_000

#: The action to answer: fixed text, or chosen from the request's attributes.
ActionRule = str | Callable[[dict[str, str]], str]


class FakePolicyServer(LoopThreadServer):
    """See the module docstring. Use as a context manager or :meth:`start`/:meth:`stop`."""

    def __init__(self, mode: str = "reply", *, action: ActionRule = "DUNNO",
                 delay: float = 0.0, extra: Sequence[tuple[str, str]] = (),
                 unix_path: str | None = None) -> None:
        self.lock = threading.Lock()
        self.mode = "reply"
        self.action: ActionRule = "DUNNO"
        self.delay = 0.0
        self.extra: tuple[tuple[str, str], ...] = ()
        self.set_mode(mode, action=action, delay=delay, extra=extra)
        self.unix_path = unix_path
        #: Connections accepted so far.
        self.connections = 0
        #: Every complete request read, as a dict of its attributes, in arrival order.
        self.requests: list[dict[str, str]] = []
        self._writers: set[asyncio.StreamWriter] = set()
        sock = self._bind()
        super().__init__(sock)
        self.port: int = 0 if unix_path else sock.getsockname()[1]

    # -- settings ---------------------------------------------------------------------

    def set_mode(self, mode: str, *, action: ActionRule | None = None,
                 delay: float | None = None,
                 extra: Sequence[tuple[str, str]] | None = None) -> None:
        """Change how the next request (on any connection) is answered."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
        with self.lock:
            self.mode = mode
            if action is not None:
                self.action = action
            if delay is not None:
                self.delay = delay
            if extra is not None:
                self.extra = tuple(extra)

    @property
    def endpoint(self) -> str:
        """The ``delivery_policy_service`` value for this server."""
        if self.unix_path:
            return f"unix:{self.unix_path}"
        return f"inet:{HOST}:{self.port}"

    def request_count(self) -> int:
        with self.lock:
            return len(self.requests)

    def open_connections(self) -> int:
        with self.lock:
            return len(self._writers)

    # -- serving (on the server's own loop) --------------------------------------------

    def _answer(self, mode: str, attrs: dict[str, str]) -> bytes:
        if mode == "garbage":
            return b"this is not a policy reply\n\n"
        if mode == "oversized":
            return b"action=" + b"x" * OVERSIZED + b"\n\n"
        if mode == "binary":
            return b"action=DEFER \xff\xfe not utf-8\n\n"
        if mode == "noaction":
            return b"result=DUNNO\n\n"
        if mode == "partial":
            return b"action=DUN"
        action = self.action(attrs) if callable(self.action) else self.action
        lines = [f"action={action}"] + [f"{k}={v}" for k, v in self.extra]
        reply = ("\n".join(lines) + "\n\n").encode()
        return reply * 2 if mode == "stray" else reply

    async def _read_request(self, reader: asyncio.StreamReader) -> dict[str, str] | None:
        attrs: dict[str, str] = {}
        while True:
            line = await reader.readline()
            if not line:
                return None
            line = line.rstrip(b"\n")
            if not line:
                return attrs
            name, _, value = line.decode("utf-8", "replace").partition("=")
            attrs.setdefault(name, value)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self.lock:
            self.connections += 1
            mode = self.mode
            if mode != "close":
                self._writers.add(writer)
        try:
            if mode == "close":
                return
            while True:
                attrs = await self._read_request(reader)
                if attrs is None:
                    return
                with self.lock:
                    self.requests.append(attrs)
                    mode, delay = self.mode, self.delay
                if mode in ("hangup", "close"):
                    return
                if mode == "silent":
                    continue
                if delay > 0:
                    await asyncio.sleep(delay)
                writer.write(self._answer(mode, attrs))
                await writer.drain()
                if mode == "partial":
                    await asyncio.Event().wait()  # until the client or stop() closes
        except (ConnectionError, OSError, asyncio.IncompleteReadError,
                asyncio.LimitOverrunError, ValueError):
            return  # a client that gave up: nothing to answer
        finally:
            with self.lock:
                self._writers.discard(writer)
            writer.close()

    # -- life cycle -------------------------------------------------------------------------

    def _bind(self) -> socket.socket:
        # At construction there is no port yet: the system picks one.
        return bound_socket(self.unix_path or (HOST, getattr(self, "port", 0)))

    def _thread_name(self) -> str:
        return f"policy-fake:{self.endpoint}"

    async def _serve(self, sock: socket.socket) -> asyncio.AbstractServer:
        if self.unix_path:
            return await asyncio.start_unix_server(self._handle, sock=sock)
        return await asyncio.start_server(self._handle, sock=sock, backlog=64)

    def close_connections(self) -> None:
        """Close every open connection (as a restarting server does); keep listening."""
        if self._loop is None:
            return

        async def close_all() -> None:
            with self.lock:
                writers = list(self._writers)
            for writer in writers:
                writer.close()
            await asyncio.sleep(0)

        self._call(close_all())

    def refuse(self) -> None:
        """Stop listening and close open connections: the service is down.

        New connections are refused until :meth:`start`.
        """
        if self._close_listener():
            self.close_connections()
            if self.unix_path and os.path.lexists(self.unix_path):
                os.unlink(self.unix_path)
