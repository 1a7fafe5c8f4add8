"""Connections to Postfix's internal UNIX-domain services, speaking the attribute protocol.

Postfix's ``mail_connect()`` opens ``private/<service>`` or ``public/<service>`` relative
to the queue directory (qmgr's working directory, also inside a chroot). This module is
the asyncio equivalent: a small ``asyncio.Protocol`` that feeds an :class:`AttrParser`, so
a request/reply exchange costs one callback per read and no per-token awaits. qmgr opens
thousands of these per second, which is why this is not built on ``StreamReader``.
"""

from __future__ import annotations

import asyncio
import socket

from pyqmgr.postfix.attr import AttrError, AttrList, AttrParser, check_announcement


class ServiceUnavailable(Exception):
    """The service socket could not be connected or did not announce itself.

    The message is the bare reason (``No such file or directory``); callers add the
    context stock qmgr logs, such as ``connect to transport private/smtp: ``.
    """


class PrematureDisconnect(Exception):
    """The peer closed the connection before a complete list arrived."""


class WakingProtocol(asyncio.Protocol):
    """A connection whose reader awaits ``waiter``: every event that may end a wait wakes it.

    The base of the attribute and the policy protocols: they differ in what they make
    of the bytes, not in how a connection opens, ends, or wakes its one reader.
    """

    __slots__ = ("transport", "waiter", "closed")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _AttrProtocol(WakingProtocol):
    __slots__ = ("parser", "error")

    def __init__(self) -> None:
        super().__init__()
        self.parser = AttrParser()
        self.error: Exception | None = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed(data)
        except AttrError as exc:
            self.error = exc
        self._wake()


class AttrConnection:
    """One connection to a Postfix service; lock-step request and reply lists."""

    __slots__ = ("path", "_proto")

    def __init__(self, path: str, proto: _AttrProtocol) -> None:
        self.path = path
        self._proto = proto

    @classmethod
    async def open(cls, path: str, protocol: str | None, timeout: float) -> AttrConnection:
        """Connect to ``path`` and, when ``protocol`` is given, check its announcement.

        The announcement wait is where master(8)'s process limit throttles deliveries:
        the connection sits in the listen queue until an agent process is free, so the
        timeout here is the daemon_timeout, not a short IPC timeout.
        """
        loop = asyncio.get_running_loop()
        proto = _AttrProtocol()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, path)
        except OSError as exc:
            sock.close()
            raise ServiceUnavailable(exc.strerror or str(exc)) from exc
        await loop.create_unix_connection(lambda: proto, sock=sock)
        conn = cls(path, proto)
        if protocol is not None:
            try:
                check_announcement(await conn.read_list(timeout), protocol)
            except (AttrError, PrematureDisconnect, TimeoutError) as exc:
                conn.close()
                raise ServiceUnavailable(f"{path}: {exc}") from exc
        return conn

    def write(self, data: bytes) -> None:
        """Queue bytes for sending; raises PrematureDisconnect if the peer is gone."""
        transport = self._proto.transport
        if transport is None or transport.is_closing():
            raise PrematureDisconnect(f"{self.path}: premature disconnect")
        transport.write(data)

    async def read_list(self, timeout: float | None) -> AttrList:
        """Wait for the next complete attribute list."""
        proto = self._proto
        while True:
            attrs = proto.parser.pop()
            if attrs is not None:
                return attrs
            if proto.error is not None:
                raise proto.error
            if proto.closed:
                raise PrematureDisconnect(f"{self.path}: premature disconnect")
            proto.waiter = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(proto.waiter, timeout)
            finally:
                proto.waiter = None

    @property
    def peer_closed(self) -> bool:
        """True when the server has closed its end (e.g. trivial-rewrite restarted)."""
        return self._proto.closed

    def close(self) -> None:
        transport = self._proto.transport
        if transport is not None:
            transport.close()
