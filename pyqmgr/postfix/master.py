"""How a trigger-type service lives under master(8): argv, status, triggers, flow tokens.

master starts the qmgr service with fixed file descriptors (3/4 the shared mail-flow
pipe, 5 this service's status channel, 6 the ``public/qmgr`` listen socket), an argv
built from master.cf, and ``GENERATION`` in octal. Everything here mirrors Postfix's
trigger server skeleton closely because master is unforgiving: a status write that is
not exactly 12 bytes desynchronises its stream, a child that reads a trigger until EOF
hangs the client (which never closes), and a child that ignores EOF on fd 5 never
restarts on ``postfix reload``.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import os
import select
import socket
import struct
import termios
from collections.abc import Callable
from dataclasses import dataclass, field

from pyqmgr.postfix.config import ConfigError, option_nameval
from pyqmgr.postfix.getopt import MISSING_ARGUMENT, UNKNOWN, GetOpt

FLOW_READ_FD = 3
FLOW_WRITE_FD = 4
STATUS_FD = 5
LISTEN_FD = 6

STAT_TAKEN = 0
STAT_AVAIL = 1

#: Postfix's TRIGGER_BUF_SIZE: one read of at most this many bytes per trigger.
TRIGGER_BUF_SIZE = 1024
#: How long the skeleton waits for an accepted trigger connection to become readable.
TRIGGER_READ_WAIT = 10.0
#: How long to wait for the NUL that follows a trigger request in a second write.
TRIGGER_NUL_WAIT = 1.0

_STATUS = struct.Struct("=iIi")


class UsageError(Exception):
    """Bad command line; the text is what stock logs after ``fatal: ``."""


@dataclass
class ServerOptions:
    """What master told us on the command line (see master_trigger_logging.md §1.1)."""

    progname: str
    service_name: str
    transport: str | None = None
    alone: bool = False
    unprivileged: bool = False
    chroot: bool = False
    debug: bool = False
    verbose: int = 0
    log_stderr: bool = False
    stand_alone: bool = False
    overrides: list[tuple[str, str]] = field(default_factory=list)
    args: list[str] = field(default_factory=list)


def parse_argv(argv: list[str]) -> ServerOptions:
    """Parse argv like the skeleton's ``getopt("+...")``: stop at the first non-option."""
    progname = os.path.basename(argv[0]) if argv else "qmgr"
    opts = ServerOptions(progname=progname, service_name=progname)
    options = GetOpt(argv, optind=1)
    for letter, value in options:
        if letter == UNKNOWN:
            raise UsageError(f"invalid option -- '{value}'")
        if letter == MISSING_ARGUMENT:
            raise UsageError(f"option requires an argument -- '{value}'")
        _apply_option(opts, letter, value)
    opts.args = argv[options.optind:]
    return opts


#: The skeleton's switches: the option letter and the flag it turns on.
_SWITCHES = {
    "c": "chroot",
    "d": "debug",
    "l": "alone",
    "S": "stand_alone",
    "u": "unprivileged",
    "V": "log_stderr",
}


def _apply_option(opts: ServerOptions, letter: str, value: str | None) -> None:
    switch = _SWITCHES.get(letter)
    if switch is not None:
        setattr(opts, switch, True)
    elif letter == "n":
        assert value is not None
        opts.service_name = value
    elif letter == "o":
        assert value is not None
        try:
            opts.overrides.append(option_nameval(value))
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
    elif letter == "t":
        opts.transport = value
    elif letter == "v":
        opts.verbose += 1
    # -D, -i, -m, -s, -z: accepted and without effect for qmgr (it is persistent and has
    # exactly one listen socket), as in stock.


def generation_from_env(environ: dict[str, str] | os._Environ[str]) -> int:
    """master exports the fork generation in octal; echo it in every status update."""
    text = environ.get("GENERATION")
    if text is None:
        return 0
    if not text.isdigit():
        raise UsageError(f"bad generation: {text}")
    return int(text, 8)


class MasterStatus:
    """The 12-byte TAKEN/AVAIL updates on fd 5 that keep master's bookkeeping right."""

    __slots__ = ("fd", "pid", "generation")

    def __init__(self, fd: int, pid: int, generation: int) -> None:
        self.fd = fd
        self.pid = pid
        self.generation = generation

    def notify(self, avail: int) -> bool:
        """Write one status record in a single write; False when master is gone."""
        try:
            return os.write(self.fd, _STATUS.pack(self.pid, self.generation, avail)) == 12
        except OSError:
            return False


class FlowControl:
    """The in_flow_delay token bucket shared by master and all its children.

    cleanup takes one token per message it accepts and waits in_flow_delay when none is
    there; qmgr, the consumer of new mail, puts them back. Without tokens every new
    message would wait a second in cleanup.
    """

    __slots__ = ("read_fd", "write_fd")

    def __init__(self, read_fd: int = FLOW_READ_FD, write_fd: int = FLOW_WRITE_FD) -> None:
        self.read_fd = read_fd
        self.write_fd = write_fd

    def count(self) -> int:
        buf = array.array("i", [0])
        try:
            fcntl.ioctl(self.read_fd, termios.FIONREAD, buf, True)
        except OSError:
            return -1
        return buf[0]

    def put(self, n: int) -> None:
        if n > 0:
            with contextlib.suppress(OSError):
                os.write(self.write_fd, b"\0" * n)

    def get(self, n: int) -> None:
        if n > 0:
            with contextlib.suppress(OSError):
                os.read(self.read_fd, n)

    def balance(self, limit: int) -> None:
        """Top the bucket up to ``limit`` tokens, or drain the excess above it."""
        count = self.count()
        if count < 0:
            return
        if count < limit:
            self.put(limit - count)
        elif count > limit:
            self.get(count - limit)


class TriggerServer:
    """Accept triggers on the listen socket and watch the status channel.

    One trigger per connection: accept, wait at most 10 s for data, do exactly one read
    (the client writes its request plus a NUL and then waits for us to close; it never
    closes first), report TAKEN before and AVAIL after, close.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        on_trigger: Callable[[bytes], None],
        on_master_gone: Callable[[], None],
        status: MasterStatus | None,
        listen_fd: int = LISTEN_FD,
        status_fd: int = STATUS_FD,
    ) -> None:
        self.loop = loop
        self.on_trigger = on_trigger
        self.on_master_gone = on_master_gone
        self.status = status
        self.listen_sock = socket.socket(fileno=listen_fd)
        self.status_fd = status_fd

    def start(self) -> None:
        for fd in (self.listen_sock.fileno(), self.status_fd, FLOW_READ_FD, FLOW_WRITE_FD):
            with contextlib.suppress(OSError):
                os.set_inheritable(fd, False)
        self.loop.add_reader(self.listen_sock.fileno(), self._accept)
        self.loop.add_reader(self.status_fd, self._gone)

    def _gone(self) -> None:
        self.close()
        self.on_master_gone()

    def _master_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.status_fd], [], [], 0)
        except OSError:
            return True
        return bool(readable)

    def _accept(self) -> None:
        # On reload master first closes our status channel, then sends the new qmgr
        # its wakeup on this same socket. If both are pending, accepting here would
        # swallow that wakeup and no new qmgr would start until the next timer: leave
        # the connection for our successor.
        if self._master_gone():
            self._gone()
            return
        # master created the listen socket non-blocking; that flag lives in the shared
        # open file description, so it must not be flipped here.
        try:
            conn, _ = self.listen_sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return
        conn.setblocking(False)
        self.loop.create_task(self._serve(conn))

    async def _readable(self, conn: socket.socket, timeout: float) -> bool:
        readable: asyncio.Future[None] = self.loop.create_future()

        def wake() -> None:
            if not readable.done():
                readable.set_result(None)

        self.loop.add_reader(conn.fileno(), wake)
        try:
            await asyncio.wait_for(readable, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            self.loop.remove_reader(conn.fileno())

    async def _serve(self, conn: socket.socket) -> None:
        try:
            if not await self._readable(conn, TRIGGER_READ_WAIT):
                return
            if self.status is not None:
                self.status.notify(STAT_TAKEN)
            try:
                data = conn.recv(TRIGGER_BUF_SIZE)
            except OSError:
                data = b""
            # The client (unix_trigger) writes its request and then, separately, a
            # NUL. Closing between the two would kill postkick/postqueue with SIGPIPE
            # (seen under load; stock has the same window, only narrower): when the
            # NUL is not here yet, give it a moment, still without waiting for EOF.
            if data and not data.endswith(b"\0") and await self._readable(
                    conn, TRIGGER_NUL_WAIT):
                with contextlib.suppress(OSError):
                    data += conn.recv(TRIGGER_BUF_SIZE)
            self.on_trigger(data)
            if self.status is not None and not self.status.notify(STAT_AVAIL):
                self.on_master_gone()
        finally:
            conn.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self.listen_sock.fileno())
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self.status_fd)
