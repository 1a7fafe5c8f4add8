"""A throwaway Redis server on loopback, for the fleet's tests (issue #23).

The fleet's shared state is only worth testing against the real server: Debian's
``redis-server`` runs the same Lua and answers with the same errors as in production.
Each server gets a directory of its own (its unix socket, its log), listens on
127.0.0.1 only, persists nothing, and is always stopped: :meth:`stop` (also the
context manager's exit) sends SIGTERM to its process, then SIGKILL, and removes the
directory. :meth:`stop` and :meth:`start` again on the same port and socket are how a
test takes Redis away mid-run and brings it back; :meth:`freeze` and :meth:`thaw`
(SIGSTOP, SIGCONT) make it a server that accepts and never answers.

Commands by hand (:meth:`command`) go through redis-py's synchronous client
(:mod:`pyqmgr.testbed.redis_common`). :class:`~pyqmgr.testbed.valkey.ValkeyServer`
is the same server run from Debian 13's Valkey, with this class's interface.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import redis

from pyqmgr.testbed import redis_common as common
from pyqmgr.testbed.instance_base import free_port

REDIS_SERVER = "/usr/bin/redis-server"


def available() -> bool:
    return os.access(REDIS_SERVER, os.X_OK)


class RedisServer(common.OneServer):
    """``redis-server`` on 127.0.0.1 and a unix socket; ``password`` sets requirepass."""

    __test__ = False
    #: What the process is called in errors.
    name = "redis-server"

    def __init__(self, password: str | None = None) -> None:
        self.password = password
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="pyqmgr-redis-")
        os.chmod(self.dir, 0o755)
        self.socket_path = os.path.join(self.dir, "redis.sock")
        self.log_path = os.path.join(self.dir, "redis.log")
        self.process = common.ServerProcess(self.argv(), self.dir, self.log_path,
                                            f"{self.name} on port {self.port}")
        self._client: redis.Redis | None = None

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.process.proc

    @property
    def frozen(self) -> bool:
        return self.process.frozen

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def key_file(self) -> str:
        """A fleet key for the servers that share this Redis (root's, mode 0600, made on
        first use)."""
        return common.fleet_key_file(self.dir)

    def fleet_cf(self, node: str) -> dict[str, str]:
        """pyqmgr.cf's fleet settings for the server called ``node`` in this fleet."""
        return {"shared_state": self.url, "shared_state_node": node,
                "shared_state_key_file": self.key_file}

    def argv(self) -> list[str]:
        """The server's command line (the same at every start)."""
        args = [REDIS_SERVER, "--bind", "127.0.0.1", "--port", str(self.port),
                "--unixsocket", self.socket_path, "--unixsocketperm", "777",
                "--save", "", "--appendonly", "no", "--dir", self.dir,
                "--logfile", self.log_path, "--daemonize", "no",
                "--protected-mode", "no" if self.password else "yes"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        return args

    def start(self, timeout: float = 20) -> RedisServer:
        self.process.start(lambda: common.answers(self.client()), timeout)
        return self

    def client(self) -> redis.Redis:
        """The test bed's own client (AUTH first when there is a password)."""
        if self._client is None:
            self._client = common.sync_client(port=self.port, password=self.password)
        return self._client

    def command(self, *args: str) -> common.Reply:
        """One command by hand; its reply."""
        return common.command(self.client(), *args)

    def log_tail(self, n: int = 20) -> str:
        return self.process.log_tail(n)

    def freeze(self) -> None:
        """SIGSTOP: the server keeps its connections and answers nothing."""
        self.process.freeze()

    def thaw(self) -> None:
        self.process.thaw()
