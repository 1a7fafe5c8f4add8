"""A throwaway Redis Cluster on loopback (issue #35): three primaries, no replicas.

Each node is a redis-server with ``cluster-enabled yes``, its client port and its
cluster bus port (``cluster-port``) both free ports of 127.0.0.1, its ``nodes.conf`` in
a directory of its own. ``redis-cli --cluster create`` joins them and shares the 16384
slots out; :meth:`RedisCluster.start` returns once every node says ``cluster_state:ok``
and knows every node and every slot, which is when a client's first ``CLUSTER SLOTS``
sees the whole map.

With ``acl`` the nodes have the fleet's ACL user (:func:`pyqmgr.fleet.acl.acl_rules`)
and an administrator, and ``default`` off, as on :class:`~pyqmgr.testbed.redis_tls.
TlsRedisServer`: the commands a cluster client sends on connecting are checked too.
Every node is stopped at the end (SIGTERM, then SIGKILL) and the directory removed.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
import time

import redis
from redis.cluster import ClusterNode
from redis.cluster import RedisCluster as ClusterClient

from pyqmgr.fleet.acl import acl_rules
from pyqmgr.testbed import redis_common as common
from pyqmgr.testbed.instance_base import TestbedError, free_port, wait_until
from pyqmgr.testbed.redis import REDIS_SERVER

REDIS_CLI = "/usr/bin/redis-cli"
SLOTS = 16384


def available() -> bool:
    return os.access(REDIS_CLI, os.X_OK) and os.access(REDIS_SERVER, os.X_OK)


class RedisCluster(common.Managed):
    """``nodes`` cluster primaries on 127.0.0.1; ``acl``: the fleet's ACL user."""

    __test__ = False

    def __init__(self, nodes: int = 3, acl: bool = False, user: str = "pyqmgr",
                 prefix: str = "pyqmgr:") -> None:
        self.acl = acl
        self.user = user
        self.prefix = prefix
        self.dir = tempfile.mkdtemp(prefix="pyqmgr-cluster-")
        os.chmod(self.dir, 0o755)
        self.ports = [free_port() for _ in range(nodes)]
        self.bus_ports = [free_port() for _ in range(nodes)]
        self.password = secrets.token_hex(16)
        self.admin_password = secrets.token_hex(16)
        self.password_file = common.write_secret(os.path.join(self.dir, "fleet.pw"), self.password)
        self.processes: list[common.ServerProcess] = []
        self.clients: list[redis.Redis] = []
        for port in self.ports:
            node_dir = os.path.join(self.dir, str(port))
            os.mkdir(node_dir)
            self.processes.append(common.ServerProcess(
                [REDIS_SERVER, os.path.join(node_dir, "redis.conf")], node_dir,
                os.path.join(node_dir, "redis.log"), f"cluster node on port {port}"))
            self.clients.append(common.sync_client(port=port, **self._admin()))
        self._cluster: ClusterClient | None = None

    def _admin(self) -> dict[str, str]:
        return {"username": "admin", "password": self.admin_password} if self.acl else {}

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    @property
    def key_file(self) -> str:
        return common.fleet_key_file(self.dir)

    def fleet_cf(self, node: str) -> dict[str, str]:
        cf = {"shared_state": self.url, "shared_state_node": node,
              "shared_state_key_file": self.key_file}
        if self.acl:
            cf.update(shared_state_user=self.user,
                      shared_state_password_file=self.password_file)
        return cf

    def _write_config(self, port: int, bus: int, proc: common.ServerProcess) -> None:
        lines = ["bind 127.0.0.1", f"port {port}", "cluster-enabled yes",
                 f"cluster-port {bus}", "cluster-config-file nodes.conf",
                 "cluster-node-timeout 2000", 'save ""', "appendonly no",
                 f"dir {proc.cwd}", f"logfile {proc.log_path}", "daemonize no"]
        if self.acl:
            lines += ["user default off",
                      f"user admin on >{self.admin_password} ~* &* +@all",
                      " ".join(["user", self.user, "on", f">{self.password}",
                                *acl_rules(self.prefix)])]
        with open(os.path.join(proc.cwd, "redis.conf"), "w") as f:
            f.write("\n".join(lines) + "\n")

    def start(self, timeout: float = 30) -> RedisCluster:
        deadline = time.monotonic() + timeout
        try:
            for port, bus, proc, client in zip(self.ports, self.bus_ports, self.processes,
                                               self.clients, strict=True):
                self._write_config(port, bus, proc)
                proc.start(lambda client=client: common.answers(client),  # type: ignore[misc]
                           deadline - time.monotonic())
            self._create(deadline - time.monotonic())
            wait_until(self._ok, max(deadline - time.monotonic(), 1),
                       "cluster_state:ok with every slot on every node", interval=0.1,
                       detail=self._state)
        except BaseException:
            self.stop()
            raise
        return self

    def _create(self, timeout: float) -> None:
        args = [REDIS_CLI, "--cluster", "create",
                *(f"127.0.0.1:{p}" for p in self.ports),
                "--cluster-replicas", "0", "--cluster-yes"]
        if self.acl:
            args += ["--user", "admin", "--pass", self.admin_password, "--no-auth-warning"]
        try:
            proc = subprocess.run(args, capture_output=True, text=True,
                                  timeout=max(timeout, 1), check=False)
        except subprocess.TimeoutExpired as exc:
            raise TestbedError(f"redis-cli --cluster create did not finish in "
                               f"{timeout:.0f} s") from exc
        if proc.returncode != 0:
            raise TestbedError(f"redis-cli --cluster create failed ({proc.returncode}):\n"
                               f"{(proc.stdout + proc.stderr)[-2000:]}")

    def _ok(self) -> bool:
        for client in self.clients:
            state = common.info(client, "cluster-info")
            if (state.get("cluster_state") != "ok"
                    or state.get("cluster_slots_ok") != str(SLOTS)
                    or state.get("cluster_known_nodes") != str(len(self.ports))):
                return False
        return True

    def _state(self) -> str:
        out = []
        for port, client in zip(self.ports, self.clients, strict=True):
            try:
                state = common.info(client, "cluster-info")
                out.append(f"{port}: {state.get('cluster_state')}, slots "
                           f"{state.get('cluster_slots_ok')}, nodes "
                           f"{state.get('cluster_known_nodes')}")
            except redis.RedisError as exc:
                out.append(f"{port}: {exc}")
        return "; " + "; ".join(out)

    def client(self) -> ClusterClient:
        """redis-py's cluster client, as the administrator (keyed commands go to the
        node that holds the key's slot)."""
        if self._cluster is None:
            self._cluster = ClusterClient(
                startup_nodes=[ClusterNode("127.0.0.1", p) for p in self.ports],
                socket_timeout=common.COMMAND_TIMEOUT,
                socket_connect_timeout=common.COMMAND_TIMEOUT,
                username="admin" if self.acl else None,
                password=self.admin_password if self.acl else None)
        return self._cluster

    def node_command(self, index: int, *args: str) -> common.Reply:
        """One command by hand on one node (a keyed one answers MOVED if the key's slot
        is another node's)."""
        return common.command(self.clients[index], *args)

    def keys(self, pattern: str) -> list[bytes]:
        """``KEYS pattern`` on every node, together."""
        found: list[bytes] = []
        for client in self.clients:
            reply = common.command(client, "KEYS", pattern)
            found += [k for k in reply if isinstance(k, bytes)] if isinstance(reply, list) \
                else []
        return found

    def stop(self) -> None:
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None
        for proc, client in zip(self.processes, self.clients, strict=True):
            proc.stop()
            client.close()
        shutil.rmtree(self.dir, ignore_errors=True)


