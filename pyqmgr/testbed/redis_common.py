"""What every throwaway Redis of the test bed shares: its process, its files, and
commands by hand (issue #35).

The fleet is tested against Redis as operators run it (one server, TLS with an ACL
user, a Sentinel set, a Cluster, Valkey); each of those is a handful of
``redis-server`` (or ``redis-sentinel``, ``valkey-server``) processes. A
:class:`ServerProcess` is one of them: started in a session of its own, waited for
within a bound that names what it waited for, and always stopped (SIGTERM, then
SIGKILL after a bound), so a failed test leaves no server behind.

Commands by hand (:func:`command`) go through redis-py's synchronous client, with its
reply conversions turned off and RESP2 spoken, so a test sees what Redis answered:
bytes, integers, lists, ``None``, and a status reply as ``str`` ("OK", "PONG") as the
test bed's hand-written codec gave it before. An error reply raises
:class:`redis.exceptions.ResponseError`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Callable, Sequence
from typing import Any, Self, TypeAlias

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pyqmgr.testbed.instance_base import TestbedError, file_tail, wait_until

#: What :func:`command` returns.
Reply: TypeAlias = "bytes | str | int | None | list[Reply]"

#: Commands whose reply is a status (``+OK``, ``+PONG``): returned as str.
_STATUS_COMMANDS = frozenset({
    "PING", "SET", "FLUSHALL", "FLUSHDB", "SAVE", "SELECT", "AUTH", "MSET", "RENAME",
    "CONFIG", "ACL", "SCRIPT", "CLUSTER", "REPLICAOF", "SLAVEOF", "CLIENT", "SENTINEL",
    "DEBUG", "FAILOVER", "RESET", "SWAPDB", "LTRIM", "LSET", "HMSET", "TYPE",
})
#: How long a stopped server has after SIGTERM before SIGKILL, in seconds.
STOP_GRACE = 10.0
#: One command's bound by hand: a frozen server is an error, not a hang.
COMMAND_TIMEOUT = 2.0


def sync_client(host: str = "127.0.0.1", port: int = 0, **kw: Any) -> redis.Redis:
    """A redis-py client for commands by hand: RESP2, replies as sent, bounded, and one
    quick retry (a server restarted under a pooled connection is reconnected to)."""
    kw.setdefault("socket_timeout", COMMAND_TIMEOUT)
    kw.setdefault("socket_connect_timeout", COMMAND_TIMEOUT)
    client = redis.Redis(host=host, port=port, protocol=2, retry=Retry(NoBackoff(), 1),
                         **kw)
    client.response_callbacks.clear()
    return client


def command(client: redis.Redis, *args: str | bytes | int | float) -> Reply:
    """One command's reply as Redis sent it (an error reply raises ResponseError)."""
    reply = client.execute_command(*args)
    name = str(args[0]).upper() if args else ""
    if name in _STATUS_COMMANDS and reply in (b"OK", b"PONG"):
        if not (name == "SET" and any(str(a).upper() == "GET" for a in args[3:])):
            return reply.decode()
    return reply  # type: ignore[no-any-return]


def write_secret(path: str, text: str) -> str:
    """``text`` and a newline in a new file readable by its owner alone (a password, a
    key: pyqmgr reads such files at start-up as root and refuses looser ones)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return path


def fleet_key_file(directory: str) -> str:
    """The fleet's signing key in ``directory`` (made on first use): every fleet the
    test bed starts signs its notices, as a real one must to share throttling."""
    path = os.path.join(directory, "fleet.key")
    if not os.path.exists(path):
        write_secret(path, secrets.token_hex(32))
    return path



class Managed:
    """``with`` for a test bed's servers: started on entry (stopped again, its every
    process and directory, when the start fails: no ``__exit__`` runs then) and
    stopped on exit."""

    def __enter__(self) -> Self:
        try:
            started: Self = self.start()  # type: ignore[attr-defined]
        except BaseException:
            self.stop()  # type: ignore[attr-defined]
            raise
        return started

    def __exit__(self, *exc: object) -> None:
        self.stop()  # type: ignore[attr-defined]


class OneServer(Managed):
    """A test bed's single redis-server (plain or TLS): its process, the test bed's
    own client, its directory; how it stops, written once."""

    process: ServerProcess
    _client: redis.Redis | None
    dir: str

    def stop(self, remove: bool = True) -> None:
        """Stop the server (the directory stays unless ``remove``, for a restart)."""
        self.process.stop()
        if self._client is not None:
            self._client.close()
            self._client = None
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)


class ServerProcess:
    """One server process: its command line, the directory it runs in, its log."""

    def __init__(self, argv: Sequence[str], cwd: str, log_path: str, what: str) -> None:
        self.argv = list(argv)
        self.cwd = cwd
        self.log_path = log_path
        self.what = what
        self.proc: subprocess.Popen[bytes] | None = None
        self.frozen = False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise TestbedError(f"{self.what} is not running")
        return self.proc.pid

    def start(self, ready: Callable[[], bool], timeout: float = 20) -> None:
        """Start it and wait until ``ready()``; stopped again if it never is."""
        if self.running:
            # A second process on the same port would fail, and the first would be
            # left running with nobody to stop it.
            raise TestbedError(f"{self.what} runs already")
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     cwd=self.cwd, start_new_session=True)
        try:
            wait_until(lambda: self._exited() or ready(), timeout, f"{self.what} to answer",
                       detail=lambda: f"; its log:\n{self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def _exited(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise TestbedError(f"{self.what} exited ({self.proc.returncode}):\n"
                               f"{self.log_tail()}")
        return False

    def log_tail(self, n: int = 20) -> str:
        return file_tail(self.log_path, n)

    def freeze(self) -> None:
        """SIGSTOP: the server keeps its connections and answers nothing."""
        if self.running:
            os.kill(self.pid, signal.SIGSTOP)
            self.frozen = True

    def thaw(self) -> None:
        if self.running and self.frozen:
            os.kill(self.pid, signal.SIGCONT)
        self.frozen = False

    def kill(self) -> None:
        """SIGKILL, as a crashed or powered-off server: nothing written, nothing said."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=STOP_GRACE)
        self.frozen = False

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within :data:`STOP_GRACE`."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            if self.frozen:
                os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
            try:
                proc.wait(timeout=STOP_GRACE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_GRACE)
        self.frozen = False


def answers(client: redis.Redis) -> bool:
    """Whether a server answers PING now (a refused or reset connection: not yet)."""
    try:
        return command(client, "PING") == "PONG"
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
        return False


def info(client: redis.Redis, section: str) -> dict[str, str]:
    """``INFO section`` as a dict (``CLUSTER INFO`` too: the same ``key:value`` lines)."""
    args = ("CLUSTER", "INFO") if section == "cluster-info" else ("INFO", section)
    reply = command(client, *args)
    text = reply.decode() if isinstance(reply, bytes) else str(reply)
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and not key.startswith("#"):
            out[key.strip()] = value.strip()
    return out
