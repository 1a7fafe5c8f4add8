"""A fleet's limits per site (issues #23 and #33): three Postfix servers with pyqmgr,
one Redis, ten domains whose MX records name one server of 5 sessions.

Each node groups the ten domains into one site from their MX records (unbound on
loopback serves them; each node's Postfix and pyqmgr resolve through it), and
``fast_fleet_site_concurrency_limit = 5`` makes the site's deliveries count together
across the fleet, at the site's keys in Redis. Per destination, the fleet's limit
would let the three servers open fifty sessions to one server that takes five.
"""

from __future__ import annotations

import json
import os
import threading

import pytest

from pyqmgr.control.client import request
from pyqmgr.fleet.shared import bucket
from pyqmgr.testbed import dns
from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.redis import RedisServer
from pyqmgr.testbed.sink import SinkServer
from tests.test_fleet_daemon import deferred

pytestmark = pytest.mark.skipif(not dns.available(), reason="needs unbound (./dev installs it)")

NODES = 3
PER_NODE = 60
SESSIONS = 5
LATENCY = 0.2
DOMAINS = [f"d{i}.test" for i in range(10)]
RECORDS = ["mx.site.test. 300 IN A 127.0.0.1",
           *[f"{d}. 300 IN MX 10 mx.site.test." for d in DOMAINS]]


def _nodes(postfix_instance, srv: SinkServer, server: dns.DnsServer,
           redis: RedisServer) -> list[PostfixInstance]:
    nodes = []
    for i in range(NODES):
        pf: PostfixInstance = postfix_instance(
            start=False, qmgr="pyqmgr",
            pyqmgr_cf={"shared_state": redis.url, "shared_state_node": f"node{i}",
                       "site_grouping": "mx", "site_transports": "fast",
                       "fast_fleet_site_concurrency_limit": str(SESSIONS)},
            transports={d: f"fast:{d}:{srv.port}" for d in DOMAINS},
            master_cf_extra=["fast unix - - n - 20 smtp"],
            main_cf={"smtp_host_lookup": "dns", "smtp_connection_cache_on_demand": "no"})
        pf.start(prefix=server.start_prefix())
        nodes.append(pf)
    return nodes


def test_three_nodes_keep_to_a_sites_five_fleet_sessions(postfix_instance, sink,
                                                          redis_server):
    redis = redis_server()
    srv: SinkServer = sink(latency=LATENCY, client_limit=SESSIONS)
    with dns.DnsServer(["test"], RECORDS) as server:
        nodes = _nodes(postfix_instance, srv, server, redis)
        # One message each first, so that every node has learnt the site (its MX
        # lookup answered) before the burst: the burst is what is judged.
        for i, pf in enumerate(nodes):
            pf.smtp_send([("s@test.example", [f"warm{i}@d0.test"])])
        nodes[0].wait_until(lambda: len(srv.messages()) >= NODES, 30, "the warm-up messages")
        total = NODES * PER_NODE

        def send(i: int, pf: PostfixInstance) -> None:
            pf.smtp_send([("s@test.example", [f"f{i}-{k}@{DOMAINS[k % len(DOMAINS)]}"])
                          for k in range(PER_NODE)])

        threads = [threading.Thread(target=send, args=(i, pf)) for i, pf in enumerate(nodes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        keys: set[str] = set()

        def done() -> bool:
            found = redis.command("KEYS", "pyqmgr:*sessions:*")
            assert isinstance(found, list)
            keys.update(k.decode() for k in found if isinstance(k, bytes))
            return len(srv.messages()) - NODES + deferred(nodes) >= total

        nodes[0].wait_until(done, 120, f"all {total} messages at the sink or deferred")
        stats = srv.snapshot()
        defers = deferred(nodes)
        reply = request(os.path.join(nodes[0].queue_dir, "pyqmgr", "control"), "status",
                        timeout=10)
    units = {d["queue"] for d in reply["fleet"]["destinations"]}
    print(f"\nfleet of {NODES}, {total} messages to {len(DOMAINS)} domains at one server "
          f"of {SESSIONS}: sink at most {stats.max_concurrent} sessions, 421s "
          f"{stats.rejected_421} of {stats.sessions}; deferrals {defers}; node0 counts at "
          f"{sorted(units)}; Redis's session keys {sorted(keys)}")
    assert stats.rejected_421 == 0 and stats.max_concurrent <= SESSIONS
    assert defers == 0
    assert units == {"site mx.site.test"}, json.dumps(reply["fleet"])
    tag = bucket("fast", "site mx.site.test")
    assert keys == {f"pyqmgr:{{{tag}}}:site-sessions:fast:mx.site.test"}, keys
    assert max(stats.delivered.values()) == 1, "a recipient delivered twice"
    for pf in nodes:
        assert not pf.maillog.lines(contains="shared state"), "Redis was there all along"
