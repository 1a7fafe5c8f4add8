"""The life cycle the test bed's fake servers share: an asyncio listener in a thread.

The sink SMTP server and the fake policy server both run an event loop in a thread of
their own, so a test can drive Postfix (or a client's own event loop) synchronously
while the server answers. Both bind their socket at construction (a port handed out
can never be taken by somebody else in between), can stop listening and listen again
on the same address (a destination or service that goes away and comes back), and
must end every session and the thread on :meth:`LoopThreadServer.stop`. That life
cycle is one piece of code here; each server says only how it serves a socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from typing import Any, Self


def bound_socket(address: str | tuple[str, int]) -> socket.socket:
    """A stream socket bound to ``address``: a UNIX path (a stale file there is removed
    first) or an (IPv4 host, port) pair, bound with SO_REUSEADDR so a server can come
    back on its port while old connections linger in TIME_WAIT."""
    if isinstance(address, str):
        if os.path.lexists(address):
            os.unlink(address)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


class LoopThreadServer:
    """A listener served on an event loop of its own thread; see the module docstring.

    A subclass says how to serve a socket (:meth:`_serve`), how to bind its address
    (:meth:`_bind`, again after :meth:`refuse`), what its thread is called, and what to close
    before the loop's tasks are cancelled at :meth:`stop` (:meth:`_drop_sessions`).
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock: socket.socket | None = sock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None

    def _thread_name(self) -> str:
        raise NotImplementedError

    def _bind(self) -> socket.socket:
        """A socket bound to the server's address (its port, once it has one)."""
        raise NotImplementedError

    async def _serve(self, sock: socket.socket) -> asyncio.AbstractServer:
        """Start serving ``sock`` (runs on the server's own loop)."""
        raise NotImplementedError

    async def _drop_sessions(self) -> None:
        """Close the open sessions at :meth:`stop`; by default the tasks' cancellation
        is enough."""

    def _call(self, coro: Any, timeout: float = 10) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def listening(self) -> bool:
        return self._server is not None

    def start(self) -> Self:
        """Listen (again, on the same address); idempotent."""
        if self._server is not None:
            return self
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever,
                                            name=self._thread_name(), daemon=True)
            self._thread.start()
        sock = self._sock if self._sock is not None else self._bind()
        self._sock = None
        try:
            self._server = self._call(self._serve(sock))
        except BaseException:
            sock.close()
            raise
        return self

    def _close_listener(self) -> bool:
        """Stop listening; True if a server was listening, False if at most the socket
        bound at construction (never served) had to be closed."""
        server, self._server = self._server, None
        if server is None:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            return False

        async def close() -> None:
            server.close()

        self._call(close())
        return True

    def refuse(self) -> None:
        """Stop listening: new connections are refused until :meth:`start`."""
        self._close_listener()

    def stop(self) -> None:
        """Close the listener and every open session, and end the thread."""
        self.refuse()
        loop, self._loop = self._loop, None
        if loop is None:
            return

        async def shutdown() -> None:
            await self._drop_sessions()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        if not loop.is_running():
            loop.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
