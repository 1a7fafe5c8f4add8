"""The fleet on Redis as operators run it (issue #35): three real Postfix servers with
pyqmgr against one sink that takes 5 sessions and answers 421 beyond, through

(a) redis-server over TLS only, as an ACL user holding exactly pyqmgr/fleet/acl.py's
    rules, with a client certificate the server requires;
(b) a Sentinel set (a primary, two replicas, three sentinels) whose primary is
    SIGKILLed while mail flows;
(c) a 3-node Redis Cluster, as the same ACL user;
(d) Valkey, Debian 13's valkey-server.

In each, the sink never sees a sixth session (no 421), and no mail is lost or
delivered twice: every recipient reaches the sink exactly once and every queue is
empty at the end. The deployments are the test bed's (pyqmgr/testbed/redis_tls.py,
redis_sentinel.py, redis_cluster.py, valkey.py); the workload and the nodes are
tests/test_fleet_daemon.py's.

Beside them, every operation the fleet makes on Redis runs once through pyqmgr's own
client as the ACL user, on TLS and on a Cluster, with nothing in ACL LOG: the fleet's
ACL (pyqmgr/fleet/acl.py) is enough, and each rule in it was needed when written.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

import pytest

from pyqmgr.fleet.client import Endpoint, RedisClient, Subscriber
from pyqmgr.fleet.roster import Record, Roster
from pyqmgr.fleet.settings import fleet_settings
from pyqmgr.fleet.shared import KEY_LAYOUT, Shared, bucket
from pyqmgr.pyqmgr_cf import from_text
from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.redis_cluster import RedisCluster
from pyqmgr.testbed.redis_common import command
from pyqmgr.testbed.redis_sentinel import SentinelSet
from pyqmgr.testbed.redis_sentinel import available as sentinel_available
from pyqmgr.testbed.redis_tls import TlsRedisServer
from pyqmgr.testbed.sink import SinkServer, SinkStats
from pyqmgr.testbed.valkey import ValkeyServer
from tests.test_fleet_daemon import (
    LATENCY,
    NODES,
    PER_NODE,
    SINK_SESSIONS,
    SMTP,
    answers,
    deferred,
    reply_fleet,
    run_workload,
    send_all,
    start_nodes,
)

LIMIT = {"fast_fleet_destination_concurrency_limit": str(SINK_SESSIONS)}
TOTAL = NODES * PER_NODE
#: What each server's ``pyqmgr status`` counts of its dealings with the fleet.
COUNTERS = ("asked", "admitted", "errors", "sessions_full", "recount_wait",
            "leases_recounted", "handed", "kept")


def up(nodes: list[PostfixInstance]) -> list[PostfixInstance]:
    """Each server's qmgr answering its control socket: one that dies at start-up
    (its reason on stderr, which master(8) drops) fails here in 20 s, not after the
    workload's two minutes."""
    for pf in nodes:
        pf.wait_until(lambda pf=pf: answers(pf), 20, "pyqmgr answering its control socket")
    return nodes


def all_delivered_once(nodes: list[PostfixInstance], srv: SinkServer,
                       timeout: float = 60) -> SinkStats:
    """Every recipient at the sink exactly once and every queue empty, within
    ``timeout``; the sink's counters. A message deferred on the way is retried by a
    flush rather than after its backoff."""
    def done() -> bool:
        if len(srv.snapshot().delivered) >= TOTAL:
            return True
        if deferred(nodes):
            for pf in nodes:
                pf.postqueue("-f")
        return False

    nodes[0].wait_until(done, timeout, f"all {TOTAL} recipients at the sink")
    for pf in nodes:
        # The sink has the last message before smtp(8)'s reply reaches qmgr and qmgr
        # removes its file: wait for that, bounded.
        pf.wait_queue_empty(30)
    stats = srv.snapshot()
    assert len(stats.delivered) == TOTAL and max(stats.delivered.values()) == 1, \
        "a recipient delivered twice"
    assert stats.rejected_421 == 0 and stats.max_concurrent <= SINK_SESSIONS, \
        f"{stats.rejected_421} sessions beyond the sink's {SINK_SESSIONS}"
    return stats


def fleet_is_quiet(nodes: list[PostfixInstance]) -> None:
    """Redis answered all along: no failure mode, no fatal error, nothing refused."""
    for pf in nodes:
        assert not pf.maillog.lines(contains="shared state"), pf.maillog.tail(10)
        assert not pf.maillog.lines(contains="fatal"), pf.maillog.tail(10)


def report(name: str, srv: SinkServer, nodes: list[PostfixInstance], took: float,
           busy: float) -> None:
    stats = srv.snapshot()
    opened = sorted(stats.opened)
    gap, at = max((b - a, a - opened[0]) for a, b in zip(opened, opened[1:], strict=False))
    print(f"\n{name}: {TOTAL} messages from {NODES} servers in {took:.1f} s; sink at most "
          f"{stats.max_concurrent} sessions, busy {busy:.0%} of {SINK_SESSIONS}; 421s "
          f"{stats.rejected_421} of {stats.sessions} sessions; deferrals {deferred(nodes)}; "
          f"sessions over {opened[-1] - opened[0]:.1f} s, the longest pause {gap:.1f} s "
          f"({at:.1f} s after the first)")
    for i, fleet in enumerate(reply_fleet(nodes)):
        print(f"  node{i}: " + ", ".join(f"{k} {fleet.get(k)}" for k in COUNTERS))


async def every_fleet_operation(endpoint: Endpoint) -> list[str]:
    """Every operation the fleet makes on Redis, once, through pyqmgr's own client as
    ``endpoint`` says; what failed (none when the ACL allows all of it)."""
    client = RedisClient(endpoint, timeout=2.0)
    listener = RedisClient(endpoint, timeout=2.0, max_connections=4)
    shared = Shared(client, "pyqmgr:", "acl", 60.0)
    # A fresh Redis has every start wait for a recount: short here.
    shared.recount_ms = 50
    heard: list[bytes] = []
    ears = Subscriber(listener, shared.channel, heard.append, timeout=2.0)
    task = asyncio.ensure_future(ears.run())
    failed: list[str] = []

    async def step(name: str, op: Awaitable[object]) -> object:
        try:
            return await op
        except Exception as exc:  # noqa: BLE001 - each step's failure is the finding
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
            return None

    try:
        try:
            await asyncio.wait_for(ears.subscribed.wait(), 10)
        except TimeoutError:
            why = (repr(task.exception()) if task.done() and not task.cancelled()
                   else f"last error {ears.last_error!r}")
            failed.append(f"subscribe: not confirmed within 10 s ({why})")
        await step("admit (recount)", shared.admit("smtp", "example.com", 1))
        await asyncio.sleep(0.2)
        first = await step("admit", shared.admit("smtp", "example.com", 1, 1.0, 2))
        await step("admit refused", shared.admit("smtp", "example.com", 1, more=True))
        lease = getattr(first, "lease", "")
        await step("renew", shared.renew("smtp", "example.com", [lease]))
        await step("holders", shared.holders("smtp", "example.com"))
        await step("release", shared.release("smtp", "example.com", lease, 1, True))
        await step("pass on", shared.pass_on("smtp", "example.com"))
        await step("throttling news", shared.tell_throttling("{}"))
        await step("suspend", shared.set_suspension("x.example", '{"a": 1}', "{}"))
        await step("suspensions", shared.suspensions())
        await step("restore", shared.restore_suspension("y.example", '{"a": 2}'))
        await step("forget", shared.forget_suspension("y.example", b'{"a": 2}'))
        roster = Roster(client, "pyqmgr:")
        record = Record(node="acl", instance=shared.instance, pid=1, version="test",
                        layout=KEY_LAYOUT, sent=time.time(), lease_time=60.0,
                        failure="local", failing=False, errors=0, last_sync=None)
        await step("roster publish", roster.publish(record, 60.0, time.time()))
        await step("roster read", roster.read(time.time()))
        await step("roster remove", roster.remove(record.member))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()
        await listener.close()
    return failed


def endpoint_of(cf: dict[str, str]) -> Endpoint:
    """The endpoint the daemon would build from these pyqmgr.cf lines."""
    settings = fleet_settings(from_text("".join(f"{k} = {v}\n" for k, v in cf.items())),
                              "acl.test")
    assert settings is not None
    return settings.endpoint


@pytest.mark.parametrize("deployment", [
    "tls", "cluster"])
def test_every_fleet_operation_is_within_the_acl(deployment):
    """pyqmgr/fleet/acl.py is the fleet user's whole ACL: every operation pyqmgr makes
    (admissions, releases, renewals, handing on, throttling news, fleet suspensions,
    the roster, subscriptions, and what redis-py sends on connecting, to one server
    or to a Cluster) goes through with nothing in ACL LOG."""
    if deployment == "tls":
        with TlsRedisServer(require_client_cert=True) as server:
            # Database 1: the fleet's user selects it on connecting.
            cf = {**server.fleet_cf("acl"), "shared_state": f"{server.url}/1"}
            failed = asyncio.run(every_fleet_operation(endpoint_of(cf)))
            refused = server.acl_log()
            keys = command(server.client(), "KEYS", "*")
            assert keys == [], "the fleet's keys went to database 0"
    else:
        with RedisCluster(acl=True) as cluster:
            failed = asyncio.run(every_fleet_operation(endpoint_of(cluster.fleet_cf("acl"))))
            refused = [str(cluster.node_command(i, "ACL", "LOG"))
                       for i in range(len(cluster.ports))
                       if cluster.node_command(i, "ACL", "LOG")]
    assert not failed, failed
    assert not refused, refused


def test_tls_with_an_acl_user_and_a_client_certificate(postfix_instance, sink):
    """rediss:// to a server with no plaintext port, ``default`` off, the fleet's user
    held to acl.py's rules, and client certificates required."""
    srv: SinkServer = sink(latency=LATENCY, client_limit=SINK_SESSIONS)
    with TlsRedisServer(require_client_cert=True) as redis:
        nodes = up(start_nodes(postfix_instance, srv, {**redis.fleet_cf("-"), **LIMIT}))
        busy, took = run_workload(nodes, srv, "t")
        all_delivered_once(nodes, srv)
        report("TLS + ACL user", srv, nodes, took, busy)
        fleet_is_quiet(nodes)
        refused = redis.acl_log()
        assert not refused, f"the fleet's user was refused: {refused}"
        # The fleet's keys are under its prefix, and its sessions were counted there.
        keys = command(redis.client(), "KEYS", "*")
        assert isinstance(keys, list) and keys
        assert all(k.startswith(b"pyqmgr:") for k in keys if isinstance(k, bytes)), keys


def test_redis_cluster_of_three(postfix_instance, sink):
    """redis+cluster:// to three primaries (the fleet's user with acl.py's rules): a
    destination's keys share one slot, so the scripts run on the node that holds it."""
    srv: SinkServer = sink(latency=LATENCY, client_limit=SINK_SESSIONS)
    with RedisCluster(acl=True) as cluster:
        nodes = up(start_nodes(postfix_instance, srv, {**cluster.fleet_cf("-"), **LIMIT}))
        busy, took = run_workload(nodes, srv, "c")
        all_delivered_once(nodes, srv)
        report("Redis Cluster of 3", srv, nodes, took, busy)
        fleet_is_quiet(nodes)
        for i in range(len(cluster.ports)):
            assert cluster.node_command(i, "ACL", "LOG") == [], f"node {i} refused"
        # The destination's epoch is its bucket's, under the bucket's hash tag (the
        # queue is named after the nexthop, as on every node).
        epoch = f"pyqmgr:{{{bucket('fast', f'[127.0.0.1]:{srv.port}')}}}:epoch".encode()
        assert epoch in cluster.keys("pyqmgr:*"), "the fleet counted nothing on the cluster"


def test_valkey_from_debian_13(postfix_instance, sink):
    srv: SinkServer = sink(latency=LATENCY, client_limit=SINK_SESSIONS)
    with ValkeyServer() as valkey:
        nodes = up(start_nodes(postfix_instance, srv, {**valkey.fleet_cf("-"), **LIMIT}))
        busy, took = run_workload(nodes, srv, "v")
        all_delivered_once(nodes, srv)
        report(f"Valkey {valkey.version()}", srv, nodes, took, busy)
        fleet_is_quiet(nodes)


#: The Sentinel test's lease time, the default: a delivery that ends while the primary
#: is down gives its session back once the promoted replica answers (at the next
#: renewal, which the recount brings), not when its lease runs out; before that fix
#: the fleet paused for the whole lease (62.8 s with 60 s).
SENTINEL_LEASE = 60.0
#: The recount's pause after the failover (pyqmgr.fleet.shared.RECOUNT_MS) and slack.
AFTER_FAILOVER = 3.0 + 3.0
#: Messages sent to a second destination just after the primary is killed.
LATE = 10


def fleet_of_three(postfix_instance, cf: dict[str, str],
                   transports: dict[str, str]) -> list[PostfixInstance]:
    return [postfix_instance(
        qmgr="pyqmgr", pyqmgr_cf={**cf, "shared_state_node": f"node{i}"},
        transports=transports, master_cf_extra=["fast unix - - n - 20 smtp"], main_cf=SMTP)
        for i in range(NODES)]


@pytest.mark.skipif(not sentinel_available(),
                    reason="needs Debian's redis-sentinel (./dev installs it)")
def test_sentinel_failover_mid_run(postfix_instance, sink):
    """The primary SIGKILLed while mail flows. Mail for a second destination, sent
    right then, meets ``hold``: nothing of it starts before the sentinels have
    promoted a replica and it answers. Throughout, neither sink sees a sixth session,
    and every message arrives once."""
    srv: SinkServer = sink(latency=LATENCY, client_limit=SINK_SESSIONS)
    late: SinkServer = sink(latency=0.05, client_limit=SINK_SESSIONS)
    with SentinelSet() as sentinels:
        nodes = up(fleet_of_three(postfix_instance, {
            **sentinels.fleet_cf("-"), **LIMIT, "shared_state_failure": "hold",
            "shared_state_timeout": "200ms",
            "shared_state_lease_time": f"{SENTINEL_LEASE:g}s"}, {
            "big.example": f"fast:[127.0.0.1]:{srv.port}",
            "late.example": f"fast:[127.0.0.1]:{late.port}"}))
        started = time.monotonic()
        send_all(nodes, "s")
        nodes[0].wait_until(lambda: len(srv.messages()) >= 40, 60, "40 at the sink")
        before = len(srv.messages())
        old = sentinels.kill_primary()
        killed = time.monotonic()
        nodes[1].smtp_send([("s@test.example", [f"late{k}@late.example"])
                            for k in range(LATE)])
        failover = sentinels.wait_failover(30)
        at_failover = len(srv.messages())
        stats = all_delivered_once(nodes, srv, timeout=120)
        late.wait_delivered(LATE, 30)
        took = time.monotonic() - started
        said = [f"node{i}: {line.text}" for i, pf in enumerate(nodes)
                for line in pf.maillog.lines(contains="shared state")]
        opened = sorted(stats.opened)
        gap, at = max((b - a, a) for a, b in zip(opened, opened[1:], strict=False))
        first_late = min(late.snapshot().opened) - killed
        print(f"\nSentinel: primary on port {old} killed after {before} messages; "
              f"sentinels promoted port {sentinels.primary()[1]} {failover:.1f} s later, "
              f"{at_failover - before} delivered meanwhile; the late destination's first "
              f"session {first_late:.1f} s after the kill; all {TOTAL} in {took:.1f} s; "
              f"sink at most {stats.max_concurrent} sessions, 421s {stats.rejected_421}; "
              f"deferrals {deferred(nodes)}; longest pause between sessions {gap:.1f} s, "
              f"{at - killed:+.1f} s from the kill")
        for text in said[:12]:
            print(f"  {text}")
        for i, fleet in enumerate(reply_fleet(nodes)):
            print(f"  node{i}: " + ", ".join(f"{k} {fleet.get(k)}" for k in COUNTERS))
        late_stats = late.snapshot()
        assert late_stats.rejected_421 == 0 and max(late_stats.delivered.values()) == 1
        # hold: no failover completes within down-after-milliseconds (1 s) of the
        # kill, and the late mail's first start waits for the new primary.
        assert first_late >= 1.0, f"late mail started {first_late:.2f} s after the kill"
        assert any("shared_state_failure = hold" in text for text in said), said
        assert any("answering again" in text for text in said), said
        # Sessions whose release was lost with the primary are given back to the
        # promoted replica once it answers: the fleet's pause is the failover and the
        # recount, not a lease time.
        assert gap <= failover + AFTER_FAILOVER, (gap, failover)
