"""A throwaway Redis server on loopback, for the fleet's tests (issue #23).

The fleet's shared state is only worth testing against the real server: Debian's
``redis-server`` runs the same Lua and answers with the same errors as in production.
Each server gets a directory of its own (its unix socket, its log), listens on
127.0.0.1 only, persists nothing, and is always stopped: :meth:`stop` (also the
context manager's exit) sends SIGTERM to its process, then SIGKILL, and removes the
directory. :meth:`stop` and :meth:`start` again on the same port and socket are how a
test takes Redis away mid-run and brings it back; :meth:`freeze` and :meth:`thaw`
(SIGSTOP, SIGCONT) make it a server that accepts and never answers.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile

from pyqmgr.fleet.resp import Parser, Reply, encode
from pyqmgr.testbed.instance_base import TestbedError, file_tail, free_port, wait_until

REDIS_SERVER = "/usr/bin/redis-server"


def available() -> bool:
    return os.access(REDIS_SERVER, os.X_OK)


class RedisServer:
    """``redis-server`` on 127.0.0.1 and a unix socket; ``password`` sets requirepass."""

    __test__ = False

    def __init__(self, password: str | None = None) -> None:
        self.password = password
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="pyqmgr-redis-")
        os.chmod(self.dir, 0o755)
        self.socket_path = os.path.join(self.dir, "redis.sock")
        self.log_path = os.path.join(self.dir, "redis.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.frozen = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def key_file(self) -> str:
        """A fleet key for the servers that share this Redis (root's, mode 0600, made on
        first use): every fleet the test bed starts signs its notices, as a real one
        must to share throttling."""
        path = os.path.join(self.dir, "fleet.key")
        if not os.path.exists(path):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
        return path

    def fleet_cf(self, node: str) -> dict[str, str]:
        """pyqmgr.cf's fleet settings for the server called ``node`` in this fleet."""
        return {"shared_state": self.url, "shared_state_node": node,
                "shared_state_key_file": self.key_file}

    def start(self, timeout: float = 20) -> RedisServer:
        if self.proc is not None and self.proc.poll() is None:
            # A second server on the same port would fail, and the first would be
            # left running with nobody to stop it.
            raise TestbedError(f"redis-server on port {self.port} runs already")
        args = [REDIS_SERVER, "--bind", "127.0.0.1", "--port", str(self.port),
                "--unixsocket", self.socket_path, "--unixsocketperm", "777",
                "--save", "", "--appendonly", "no", "--dir", self.dir,
                "--logfile", self.log_path, "--daemonize", "no",
                "--protected-mode", "no" if self.password else "yes"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     cwd=self.dir, start_new_session=True)
        try:
            wait_until(self._ready, timeout, "redis-server to answer PING",
                       detail=lambda: f"redis log:\n{self.log_tail()}")
        except BaseException:
            self.stop(remove=False)
            raise
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise TestbedError(f"redis-server exited ({self.proc.returncode}):\n"
                               f"{self.log_tail()}")
        try:
            return self.command("PING") == "PONG"
        except OSError:
            return False

    def command(self, *args: str) -> Reply:
        """One command by hand (AUTH first when there is a password); its reply."""
        commands = ([("AUTH", self.password)] if self.password else []) + [args]
        parser = Parser()
        replies: list[Reply] = []
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(b"".join(encode(*cmd) for cmd in commands))
            while len(replies) < len(commands):
                chunk = s.recv(65536)
                if not chunk:
                    raise OSError("redis-server closed the connection")
                parser.feed(chunk)
                replies += parser.replies()
        return replies[-1]

    def log_tail(self, n: int = 20) -> str:
        return file_tail(self.log_path, n)

    def freeze(self) -> None:
        """SIGSTOP: the server keeps its connections and answers nothing."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP)
            self.frozen = True

    def thaw(self) -> None:
        if self.proc is not None and self.frozen:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.frozen = False

    def stop(self, remove: bool = True) -> None:
        """Stop the server (the directory stays unless ``remove``, for a restart)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            if self.frozen:
                os.kill(proc.pid, signal.SIGCONT)
                self.frozen = False
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
