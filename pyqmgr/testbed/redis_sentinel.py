"""A throwaway Redis Sentinel set on loopback (issue #35): one primary, two replicas
and three sentinels, all on 127.0.0.1, for failover mid-run.

The data nodes are redis-servers (the replicas ``replicaof`` the primary, diskless
sync with no delay, so they are in sync within a second of starting); the sentinels
are Debian's ``redis-sentinel``, each with a config file of its own it may rewrite,
monitoring the primary with a quorum of 2 and short timers (down after
:data:`DOWN_AFTER_MS`, failover timeout :data:`FAILOVER_TIMEOUT_MS`), so a killed
primary is replaced within a few seconds. :meth:`SentinelSet.start` returns once each
sentinel knows both replicas and both other sentinels: a failover started earlier
could find no quorum.

:meth:`SentinelSet.kill_primary` SIGKILLs the primary (a crash: nothing said, nothing
written); :meth:`SentinelSet.wait_failover` waits until every sentinel names another
primary and that server says it is one. Every process is stopped at the end
(SIGTERM, then SIGKILL) and the directory removed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import redis

from pyqmgr.testbed import redis_common as common
from pyqmgr.testbed.instance_base import TestbedError, free_port, wait_until
from pyqmgr.testbed.redis import REDIS_SERVER

REDIS_SENTINEL = "/usr/bin/redis-sentinel"
#: A primary that has not answered for this long is down, in a sentinel's view.
DOWN_AFTER_MS = 1000
#: How long a failover may take before another is tried.
FAILOVER_TIMEOUT_MS = 3000


def available() -> bool:
    return os.access(REDIS_SENTINEL, os.X_OK) and os.access(REDIS_SERVER, os.X_OK)


class _Node:
    """One process of the set: its port, its process, the test bed's client to it."""

    def __init__(self, directory: str, name: str, argv: list[str], port: int) -> None:
        self.name = name
        self.port = port
        self.dir = os.path.join(directory, name)
        os.mkdir(self.dir)
        self.conf = os.path.join(self.dir, f"{name}.conf")
        self.process = common.ServerProcess([*argv, self.conf], self.dir,
                                            os.path.join(self.dir, f"{name}.log"),
                                            f"{name} on port {port}")
        self.client = common.sync_client(port=port)

    def write(self, lines: list[str]) -> None:
        with open(self.conf, "w") as f:
            f.write("\n".join([
                "bind 127.0.0.1", f"port {self.port}", "daemonize no",
                f"dir {self.dir}", f"logfile {self.process.log_path}", *lines]) + "\n")

    def start(self, timeout: float) -> None:
        self.process.start(lambda: common.answers(self.client), timeout)

    def stop(self) -> None:
        self.process.stop()
        self.client.close()


class SentinelSet(common.Managed):
    """A primary, ``replicas`` replicas and ``sentinels`` sentinels, ``service`` the
    name the sentinels monitor it by."""

    __test__ = False

    def __init__(self, replicas: int = 2, sentinels: int = 3,
                 service: str = "pyqmgr") -> None:
        self.service = service
        self.dir = tempfile.mkdtemp(prefix="pyqmgr-sentinel-")
        os.chmod(self.dir, 0o755)
        self.data = [_Node(self.dir, f"redis{i}", [REDIS_SERVER], free_port())
                     for i in range(1 + replicas)]
        self.sentinels = [_Node(self.dir, f"sentinel{i}", [REDIS_SENTINEL], free_port())
                          for i in range(sentinels)]
        self.quorum = sentinels // 2 + 1
        #: The port of the primary :meth:`kill_primary` killed, and when.
        self.killed: tuple[int, float] | None = None

    @property
    def url(self) -> str:
        where = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{where}/{self.service}"

    @property
    def key_file(self) -> str:
        return common.fleet_key_file(self.dir)

    def fleet_cf(self, node: str) -> dict[str, str]:
        return {"shared_state": self.url, "shared_state_node": node,
                "shared_state_key_file": self.key_file}

    def start(self, timeout: float = 30) -> SentinelSet:
        deadline = time.monotonic() + timeout
        try:
            primary = self.data[0].port
            for i, node in enumerate(self.data):
                node.write(['save ""', "appendonly no", "repl-diskless-sync yes",
                            "repl-diskless-sync-delay 0", "repl-diskless-load swapdb",
                            *([f"replicaof 127.0.0.1 {primary}"] if i else [])])
                node.start(deadline - time.monotonic())
            for s in self.sentinels:
                s.write(["protected-mode no", "sentinel resolve-hostnames no",
                         f"sentinel monitor {self.service} 127.0.0.1 {primary} "
                         f"{self.quorum}",
                         f"sentinel down-after-milliseconds {self.service} {DOWN_AFTER_MS}",
                         f"sentinel failover-timeout {self.service} {FAILOVER_TIMEOUT_MS}",
                         f"sentinel parallel-syncs {self.service} {len(self.data)}"])
                s.start(deadline - time.monotonic())
            wait_until(self._settled, max(deadline - time.monotonic(), 1),
                       "the sentinels to know every replica and each other",
                       interval=0.1, detail=self._state)
        except BaseException:
            self.stop()
            raise
        return self

    def _settled(self) -> bool:
        """Replicas in sync with the primary, and each sentinel knowing them all."""
        links = [common.info(n.client, "replication").get("master_link_status")
                 for n in self.data[1:]]
        if links != ["up"] * (len(self.data) - 1):
            return False
        for s in self.sentinels:
            replicas = common.command(s.client, "SENTINEL", "REPLICAS", self.service)
            others = common.command(s.client, "SENTINEL", "SENTINELS", self.service)
            if not (isinstance(replicas, list) and len(replicas) == len(self.data) - 1
                    and isinstance(others, list) and len(others) == len(self.sentinels) - 1):
                return False
        return True

    def _state(self) -> str:
        lines = []
        for s in self.sentinels:
            try:
                lines.append(f"{s.name}: primary {self._asked(s)}")
            except redis.RedisError as exc:
                lines.append(f"{s.name}: {exc}")
        return "; " + "; ".join(lines) + "\n" + self.sentinels[0].process.log_tail(10)

    def _asked(self, sentinel: _Node) -> int | None:
        reply = common.command(sentinel.client, "SENTINEL", "GET-MASTER-ADDR-BY-NAME",
                               self.service)
        if isinstance(reply, list) and len(reply) == 2 and isinstance(reply[1], bytes):
            return int(reply[1])
        return None

    def primary(self) -> tuple[str, int]:
        """(host, port) of the primary, as the first sentinel that answers says."""
        for s in self.sentinels:
            if not s.process.running:
                continue
            try:
                port = self._asked(s)
            except redis.RedisError:
                continue
            if port is not None:
                return "127.0.0.1", port
        raise TestbedError("no sentinel names a primary")

    def node(self, port: int) -> _Node:
        for n in self.data:
            if n.port == port:
                return n
        raise TestbedError(f"no data node on port {port}")

    def command(self, *args: str) -> common.Reply:
        """One command by hand on the primary the sentinels name now."""
        return common.command(self.node(self.primary()[1]).client, *args)

    def kill_primary(self) -> int:
        """SIGKILL the primary; its port."""
        port = self.primary()[1]
        self.node(port).process.kill()
        self.killed = (port, time.monotonic())
        return port

    def wait_failover(self, timeout: float = 30) -> float:
        """Wait until every sentinel names a new primary and it answers as one;
        the seconds since :meth:`kill_primary`."""
        if self.killed is None:
            raise TestbedError("wait_failover before kill_primary")
        old, killed = self.killed

        def done() -> bool:
            ports = {self._asked(s) for s in self.sentinels if s.process.running}
            if len(ports) != 1:
                return False
            (port,) = ports
            if port is None or port == old:
                return False
            return common.info(self.node(port).client, "replication").get("role") == "master"

        wait_until(done, timeout, f"a failover from the primary on port {old}",
                   interval=0.05, detail=self._state)
        return time.monotonic() - killed

    def stop(self) -> None:
        for node in [*self.sentinels, *self.data]:
            node.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


