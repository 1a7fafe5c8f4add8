"""The fleet seen whole, and one configuration, on real Postfix (issue #35 items 4, 5).

Real Postfix instances with pyqmgr as qmgr share one real redis-server:

* ``pyqmgr status --fleet`` on one server lists every server of the fleet from Redis's
  roster, with the fleet sessions each holds and the deliveries each has waiting;
* a server configured looser than another (10 sessions against 5) says so in its
  maillog, naming both values and both nodes, and obeys the stricter: a sink that
  takes 5 sessions and answers 421 beyond never sees a sixth;
* its metrics show the fleet's series (Prometheus's text format, scraped by hand as
  tests/test_metrics_real.py does for its failure cases).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request

from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.instance_base import free_port
from pyqmgr.testbed.redis import RedisServer
from pyqmgr.testbed.sink import SinkServer
from tests.test_fleet_daemon import SMTP, deferred, send_all

#: Records are published every third of the lease time: a second here.
LEASE = "3s"


def node(postfix_instance, srv: SinkServer, redis: RedisServer, name: str, limit: int,
         **cf: str) -> PostfixInstance:
    return postfix_instance(
        qmgr="pyqmgr", pyqmgr_cf={
            **redis.fleet_cf(name), "shared_state_lease_time": LEASE,
            "fast_fleet_destination_concurrency_limit": str(limit), **cf},
        transports={"big.example": f"fast:[127.0.0.1]:{srv.port}"},
        master_cf_extra=["fast unix - - n - 20 smtp"], main_cf=SMTP)


def cli(pf: PostfixInstance, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pyqmgr.cli", *args, "--config-dir",
                           pf.config_dir], capture_output=True, text=True, timeout=30,
                          check=False)


def fleet_json(pf: PostfixInstance) -> dict[str, object]:
    done = cli(pf, "status", "--fleet", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_status_fleet_lists_every_server_with_its_leases(postfix_instance, sink,
                                                         redis_server):
    redis = redis_server()
    srv: SinkServer = sink(latency=1.0, client_limit=5)
    nodes = [node(postfix_instance, srv, redis, f"node{i}", 5) for i in range(3)]
    send_all(nodes, "s", 8)
    # Each server seen holding fleet sessions, and all three with mail under way or
    # waiting at one read of the roster.
    seen: dict[str, int] = {}
    busy: list[dict[str, object]] = []

    def everyone_seen_busy() -> bool:
        reply = fleet_json(nodes[0])
        servers = [s for s in reply["servers"] if isinstance(s, dict)]  # type: ignore[union-attr]
        for s in servers:
            held = sum(u["leases"] for u in s["units"])
            seen[s["node"]] = max(seen.get(s["node"], 0), held)
        if len(servers) == 3 and all(sum(u["leases"] + u["waiting"] for u in s["units"])
                                     for s in servers):
            busy.append(reply)
        return bool(busy) and all(seen.get(f"node{i}") for i in range(3))

    nodes[0].wait_until(everyone_seen_busy, 30, "each server seen holding fleet sessions "
                        "and all three busy at one read", interval=0.2)
    reply = busy[0]
    print(f"\nmost fleet sessions seen held per server: {seen}")
    servers = reply["servers"]
    assert isinstance(servers, list)
    assert [s["node"] for s in servers] == ["node0", "node1", "node2"]
    assert [s["this"] for s in servers] == [True, False, False]
    for s in servers:
        assert s["mode"] == "normal" and s["layout"] == 2 and s["lease_time"] == 3.0
        assert s["limits"]["fast"]["destination"]["sessions"] == 5  # type: ignore[index]
        assert s["last_sync_age"] is not None and s["last_sync_age"] < 5
        assert all(u["transport"] == "fast" and u["unit"] == f"[127.0.0.1]:{srv.port}"
                   for u in s["units"])
    assert reply["read"] is True and reply["differences"] == [] and reply["skipped"] == []
    # The text a person reads: the servers, then their destinations.
    text = cli(nodes[0], "status", "--fleet").stdout
    print("\n" + text)
    assert re.search(r"^fleet: 3 servers in the roster of redis://127\.0\.0\.1:\d+, read "
                     r"by node0; lease time in force 3s$", text, re.M), text
    for i in range(3):
        assert re.search(rf"^node{i}( \*)? +[0-9a-f]{{8}} +\d+ +0\.1\.0 +2 +normal ", text,
                         re.M), text
    assert f"[127.0.0.1]:{srv.port}" in text
    assert srv.snapshot().rejected_421 == 0
    # Without a fleet the option says what is missing.
    lone: PostfixInstance = postfix_instance(qmgr="pyqmgr")
    lone.wait_until(lambda: cli(lone, "status").returncode == 0, 30, "the lone daemon")
    done = cli(lone, "status", "--fleet")
    assert done.returncode == 1
    assert "--fleet needs a fleet: set shared_state in pyqmgr.cf" in done.stderr
    nodes[0].wait_until(lambda: len(srv.messages()) >= 24, 60, "all 24 at the sink")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def value(text: str, series: str) -> float:
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    assert found, f"{series} not in the scrape"
    return float(found.group(1))


def test_a_looser_server_obeys_the_stricter_limit_and_says_so(postfix_instance, sink,
                                                              redis_server):
    """node0 with 5 fleet sessions, node1 with 10: node1's maillog names both values and
    both nodes, and all of node1's mail goes out at most 5 at a time to a sink that
    answers 421 beyond 5; node1's metrics show the fleet."""
    redis = redis_server()
    srv: SinkServer = sink(latency=0.3, client_limit=5)
    port = free_port()
    node0 = node(postfix_instance, srv, redis, "node0", 5)
    node1 = node(postfix_instance, srv, redis, "node1", 10,
                 metrics_listen=f"127.0.0.1:{port}")
    warned = node1.maillog.wait_for(
        lambda ln: "fleet: node node0 publishes" in ln.text, 10, what="node1's warning")
    assert warned[0].text == ("warning: fleet: node node0 publishes "
                              "fast_fleet_destination_concurrency_limit = 5, this node 10; "
                              "obeying the stricter (5)")
    # node0 hears of node1 at its next read (a second), and keeps its own 5.
    warned = node0.maillog.wait_for(
        lambda ln: "fleet: node node1 publishes" in ln.text, 10, what="node0's warning")
    assert warned[0].text.endswith("= 10, this node 5; obeying the stricter (5)")
    total = 40
    node1.smtp_send([("s@test.example", [f"m{k}@big.example"]) for k in range(total)])
    # A session beyond the sink's five is a 421 and a deferral: each counts as tried.
    node1.wait_until(lambda: len(srv.messages()) + deferred([node1]) >= total, 60,
                     f"{total} at the sink or deferred")
    stats = srv.snapshot()
    print(f"\nnode1 (10) beside node0 (5): {total} messages, the sink at most "
          f"{stats.max_concurrent} sessions, 421s {stats.rejected_421}")
    assert stats.rejected_421 == 0 and stats.max_concurrent == 5
    assert max(stats.delivered.values()) == 1
    assert len(node1.maillog.lines(contains="fleet: node node0 publishes")) == 1, "once"
    # The same in pyqmgr status --fleet, and in the metrics.
    reply = fleet_json(node1)
    assert reply["differences"] == [
        {"node": "node0", "setting": "fast_fleet_destination_concurrency_limit",
         "theirs": "5", "ours": "10", "obeyed": "5"}]
    metrics = scrape(port)
    fleet_lines = [ln for ln in metrics.splitlines() if ln.startswith("pyqmgr_fleet_")]
    print("\n".join(fleet_lines))
    assert value(metrics, "pyqmgr_fleet_servers") == 2
    assert value(metrics, "pyqmgr_fleet_mismatches") == 1
    assert value(metrics, 'pyqmgr_fleet_failure_mode{mode="normal"}') == 1
    assert value(metrics, 'pyqmgr_fleet_failure_mode{mode="local"}') == 0
    assert value(metrics, "pyqmgr_fleet_admitted_total") >= 1
    assert value(metrics, 'pyqmgr_fleet_waits_total{reason="sessions_full"}') >= 1
    assert value(metrics, 'pyqmgr_fleet_leases_held{transport="fast"}') >= 0
    assert value(metrics, "pyqmgr_fleet_redis_round_trip_seconds_count") >= total
    assert value(metrics, "pyqmgr_fleet_redis_errors_total") == 0
    assert abs(value(metrics, "pyqmgr_fleet_last_sync_timestamp_seconds") - time.time()) < 5
    assert value(metrics, "pyqmgr_fleet_lease_time_seconds") == 3
    assert value(metrics, "pyqmgr_fleet_waits_capped_total") == 0
    node0.stop()
    # A server that stops leaves the roster at once; the other obeys its own again.
    node1.maillog.wait_for(lambda ln: ln.text == (
        "fleet: node node0 no longer differs from this node on "
        "fast_fleet_destination_concurrency_limit"), 10, what="the difference gone")
    # A scrape is served the last rendering for up to a second (the exporter's pacing,
    # issue #44): the roster's change shows in the next one.
    node1.wait_until(lambda: value(scrape(port), "pyqmgr_fleet_servers") == 1, 5,
                     "the scrape to count one fleet server")
