"""The test bed's Redis deployments themselves (issue #35): each starts, answers as the
deployment it stands for, and stops leaving no process and no directory behind.

The fleet's tests on them are tests/test_fleet_deployments_real.py; these say that
what those tests run against is what it claims to be (TLS only, the ACL enforced, a
real failover, a real cluster, Debian 13's Valkey).
"""

from __future__ import annotations

import os
import time

import pytest
import redis

from pyqmgr.fleet.acl import ACL_COMMANDS
from pyqmgr.testbed.redis_cluster import RedisCluster
from pyqmgr.testbed.redis_cluster import available as cluster_available
from pyqmgr.testbed.redis_common import ServerProcess, command
from pyqmgr.testbed.redis_sentinel import SentinelSet
from pyqmgr.testbed.redis_sentinel import available as sentinel_available
from pyqmgr.testbed.redis_tls import TlsRedisServer
from pyqmgr.testbed.valkey import ValkeyServer


def gone(processes: list[ServerProcess], pids: list[int], directory: str) -> None:
    """Every process stopped and reaped, the directory removed."""
    assert not any(p.running for p in processes)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"process {pid} outlived stop()"
    assert not os.path.exists(directory), directory


#: A command the fleet's user may run (PING it may not: pyqmgr never sends it).
GET = ("GET", "pyqmgr:{1}:x")


def test_tls_server_with_the_fleets_acl_user():
    """TLS only, ``default`` off, the fleet's user held to its prefix and commands; a
    client certificate optional, then (the variant) required."""
    with TlsRedisServer() as server:
        fleet = server.client(user=server.user, password=server.password)
        assert command(fleet, "SET", "pyqmgr:{1}:x", "1") == "OK"
        assert command(fleet, "EVAL", "return redis.call('TIME')[1] ~= nil and "
                       "redis.call('INFO', 'server') ~= nil", "1", "pyqmgr:{1}:x") == 1
        for refused in (("GET", "other:x"), ("KEYS", "*"), ("FLUSHALL",), ("PING",),
                        ("PUBLISH", "other", "x"), ("CONFIG", "GET", "*")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                command(fleet, *refused)
        assert {e["reason"] for e in server.acl_log()} == {"key", "command", "channel"}
        # No plaintext port, no default user, no login without the password.
        with pytest.raises(redis.exceptions.ConnectionError):
            redis.Redis(port=server.port, socket_timeout=1, retry=None).ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            command(server.client(user=server.user, password="wrong"), *GET)
        # The certificate is optional here.
        nocert = server.client(user=server.user, password=server.password,
                               client_cert=False)
        assert command(nocert, *GET) == b"1"
        processes, pids, directory = [server.process], [server.process.pid], server.dir
    gone(processes, pids, directory)
    with TlsRedisServer(require_client_cert=True) as server:
        with pytest.raises(redis.exceptions.ConnectionError):
            command(server.client(user=server.user, password=server.password,
                                  client_cert=False), *GET)
        assert command(server.client(user=server.user, password=server.password),
                       *GET) is None
        cf = server.fleet_cf("node0")
        assert cf["shared_state"].startswith("rediss://127.0.0.1:")
        for key in ("password_file", "tls_key_file", "key_file"):
            assert os.stat(cf[f"shared_state_{key}"]).st_mode & 0o077 == 0, key


def test_a_server_that_fails_to_start_leaves_nothing():
    """A failed start in ``with`` runs no __exit__: the server cleans up itself."""
    server = TlsRedisServer(prefix="two words")
    with pytest.raises(ValueError), server:
        pass
    assert not server.process.running and not os.path.exists(server.dir)


@pytest.mark.skipif(not sentinel_available(), reason="needs Debian's redis-sentinel "
                    "(./dev installs it)")
def test_sentinel_set_fails_over_when_the_primary_is_killed():
    with SentinelSet() as sentinels:
        first = sentinels.primary()
        assert sentinels.command("SET", "k", "v") == "OK"
        killed = sentinels.kill_primary()
        took = sentinels.wait_failover(30)
        now = sentinels.primary()
        print(f"\nfailover from port {killed} to {now[1]} in {took:.1f} s")
        assert killed == first[1] != now[1]
        # The replica promoted had the data; writes go to it now.
        assert sentinels.command("GET", "k") == b"v"
        assert sentinels.command("SET", "k", "w") == "OK"
        nodes = [*sentinels.data, *sentinels.sentinels]
        processes = [n.process for n in nodes]
        pids = [p.pid for p in processes if p.running]
        directory = sentinels.dir
    gone(processes, pids, directory)


@pytest.mark.skipif(not cluster_available(), reason="needs Debian's redis-tools")
def test_three_node_cluster_with_the_fleets_acl_user():
    with RedisCluster(acl=True) as cluster:
        client = cluster.client()
        for i in range(64):
            client.set(f"pyqmgr:{{{i}}}:k", "1")
        per_node = [len(cluster.node_command(n, "KEYS", "*") or []) for n in range(3)]
        assert sum(per_node) == 64 and all(per_node), per_node
        fleet = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[0],
                                           username=cluster.user,
                                           password=cluster.password)
        try:
            assert fleet.get("pyqmgr:{7}:k") == b"1"
            with pytest.raises(redis.exceptions.NoPermissionError):
                fleet.get("other:{7}:k")
        finally:
            fleet.close()
        processes = cluster.processes
        pids = [p.pid for p in processes]
        directory = cluster.dir
    gone(processes, pids, directory)


def test_valkey_from_debian_13():
    started = time.monotonic()
    with ValkeyServer(password="s3cret") as server:
        print(f"\nvalkey {server.version()} answering {time.monotonic() - started:.2f} s "
              f"after start (root {server.root.path})")
        assert server.version().startswith("8.")
        assert server.proc is not None
        with open(f"/proc/{server.proc.pid}/comm") as f:
            assert f.read().strip() == "valkey-server"
        assert os.path.exists(server.socket_path), "the socket shows outside the root"
        assert server.command("SET", "a", "1") == "OK"
        server.stop(remove=False)
        server.start()
        assert server.command("GET", "a") is None, "nothing persisted"
        processes, pids, directory = [server.process], [server.process.pid], server.dir
    gone(processes, pids, directory)


def test_the_acl_covers_every_command_the_scripts_call():
    """Redis checks a script's every redis.call against the caller's ACL: a command
    added to a script without its rule would be NOPERM on an operator's Redis."""
    import re

    import pyqmgr.fleet.shared as shared

    with open(shared.__file__) as f:
        called = {c.lower() for c in re.findall(r"redis\.p?call\('(\w+)'", f.read())}
    assert called, "no redis.call found: the pattern no longer matches the scripts"
    assert called <= set(ACL_COMMANDS), called - set(ACL_COMMANDS)
