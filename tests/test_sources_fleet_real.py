"""The warm-up's counts shared by a fleet, on real Postfix (issue #46 item 2).

Two Postfix servers with pyqmgr, one Redis between them (``shared_state``), each with
the same pool of three sources bound to the same addresses 127.0.0.21-23 (as two
relays behind one NAT, or a floating IP, send from one address) and the same plan: a
cold src1 with 100 messages a day at the site. The sink sees every message from both
and counts them per client address. Without the fleet's count each server would send
its own 100 from 127.0.0.21; with it, the two together send the plan.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from pyqmgr.control.client import request
from pyqmgr.control.render import status_lines
from pyqmgr.testbed import dns
from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.instance_base import free_port
from pyqmgr.testbed.redis import RedisServer
from pyqmgr.testbed.sink import SinkServer
from tests.test_metrics_real import scrape, wait_for_exporter
from tests.test_sources_real import DOMAIN, RECORDS, SOURCES, _master_cf, _today

pytestmark = pytest.mark.skipif(not dns.available(), reason="needs unbound (./dev installs it)")

PLAN = 100
PER_SERVER = 300  # src1's share of 600 by weight would be 200: the plan binds midway
#: Messages each server has before node0's reload: src1's share of them, 40, is under
#: the plan, so the reload comes while the fleet still grants.
FIRST = 60


def _server(postfix_instance, redis: RedisServer, dns_server: dns.DnsServer, port: int,
            node: str, metrics_port: int) -> PostfixInstance:
    pf: PostfixInstance = postfix_instance(
        start=False, qmgr="pyqmgr", master_cf_extra=_master_cf(),
        transports={DOMAIN: f"smtp:{DOMAIN}:{port}"},
        # Two sessions a source: the run lasts long enough for a reload midway.
        main_cf={"smtp_host_lookup": "dns", "minimal_backoff_time": "3600s",
                 "maximal_backoff_time": "3600s", "default_destination_concurrency_limit": "2"})
    plan_path = os.path.join(pf.config_dir, "pyqmgr-warmup")
    with open(plan_path, "w") as f:
        f.write(f"0 {PLAN}\n30 warm\n")
    pf.write_pyqmgr_cf({
        "site_grouping": "mx", "message_classes": "bulk", "source_pools": "bulk",
        "bulk_sources": " ".join(SOURCES), "source_pool_maps": "inline:{ bulk=bulk }",
        "source_warmup_plan": plan_path, "src1_source_warmup_start": _today(),
        "shared_state": redis.url, "shared_state_node": node,
        "metrics_listen": f"127.0.0.1:{metrics_port}"})
    pf.start(prefix=dns_server.start_prefix())
    return pf


def _sent_and_deferred(pf: PostfixInstance) -> tuple[int, int]:
    lines = pf.maillog.lines()
    return (sum(1 for ln in lines if "status=sent" in ln.text),
            sum(1 for ln in lines if "status=deferred" in ln.text))


def _fleet_count(redis: RedisServer) -> int:
    """The fleet's count of src1 at the site (the one warm-up key of the run)."""
    keys = redis.command("KEYS", "pyqmgr:*warmup*")
    assert isinstance(keys, list) and len(keys) <= 1, keys
    value = redis.command("GET", keys[0].decode()) if keys else b"0"
    assert isinstance(value, bytes), value
    return int(value)


def _fleet_metrics(pf: PostfixInstance, port: int) -> dict[str, float]:
    """One scrape's fleet credit series (the exporter is up long before the run ends)."""
    wait_for_exporter(pf, port, 10)
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1])
            for ln in scrape(port).splitlines() if ln.startswith("pyqmgr_source_fleet_")}


def _send_both(servers: list[PostfixInstance], first: int, last: int) -> None:
    """Messages ``first`` to ``last`` - 1 to each server at once, as busy relays get."""
    errors: list[BaseException] = []

    def send(i: int, pf: PostfixInstance) -> None:
        try:
            pf.smtp_send_many([("s@relay.test", [f"n{i}r{k}@{DOMAIN}"])
                               for k in range(first, last)])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(i, pf)) for i, pf in enumerate(servers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _fleet_run(postfix_instance, sink, redis_server) -> tuple[dict[str, int], dict, str, int,
                                                              list[int], str]:
    redis: RedisServer = redis_server()
    srv: SinkServer = sink(latency=0.05)
    day = _today()
    with dns.DnsServer(["test"], RECORDS) as dns_server:
        ports = [free_port() for _ in range(2)]
        servers = [_server(postfix_instance, redis, dns_server, srv.port, f"node{i}", port)
                   for i, port in enumerate(ports)]
        # Each server's first message goes warm and has the MX looked up: the site.
        for i, pf in enumerate(servers):
            pf.smtp_send([("s@relay.test", [f"n{i}r0@{DOMAIN}"])])
        servers[0].wait_until(lambda: srv.snapshot().messages == 2, 20, "the first two")
        _send_both(servers, 1, FIRST)
        # node0 reloads midway: its qmgr gives back the credits it holds and the
        # recipients it never sent, and the new one asks afresh. Then the second
        # half of the mail comes to both.
        cold = SOURCES["src1"]
        servers[0].wait_until(lambda: srv.snapshot().messages_by_client[cold] >= PLAN // 4,
                              40, f"{PLAN // 4} messages from the cold source")
        before = _fleet_count(redis)
        first = servers[0].qmgr_pid()
        at_reload = srv.snapshot().messages_by_client[cold]
        servers[0].reload()
        servers[0].wait_until(lambda: servers[0].qmgr_pid() != first, 20,
                              "a new qmgr after the reload")
        _send_both(servers, FIRST, PER_SERVER)
        total = 2 * PER_SERVER
        servers[0].wait_until(lambda: sum(_sent_and_deferred(pf)[0] for pf in servers)
                              >= total, 40, f"{total} messages sent")
        deferred = [_sent_and_deferred(pf)[1] for pf in servers]
        replies = [request(os.path.join(pf.queue_dir, "pyqmgr", "control"), "status",
                           timeout=10) for pf in servers]
        scraped = time.monotonic()
        metrics = [_fleet_metrics(pf, port) for pf, port in zip(servers, ports, strict=True)]
        scraped = time.monotonic() - scraped
        text = "\n".join(ln for ln in status_lines(replies[0])
                         if "warm-up" in ln or "src1" in ln or "SOURCE" in ln)
        for pf in servers:
            pf.stop()
        # Both gave back what they held at exit: the fleet's count is what was sent.
        keys = redis.command("KEYS", "pyqmgr:*warmup*")
        assert isinstance(keys, list) and len(keys) == 1, keys
        fleet_count = _fleet_count(redis)
        key = keys[0].decode()
    by_client = dict(srv.snapshot().messages_by_client)
    status = [r["sources"] for r in replies]
    twice = {r: [m.peer for m in srv.messages() if r in m.recipients]
             for r, n in srv.snapshot().delivered.items() if n > 1}
    return (by_client, {"status": status, "deferred": deferred, "at_reload": at_reload,
                        "twice": twice, "fleet_at_reload": before, "metrics": metrics,
                        "scrape_seconds": round(scraped, 3)},
            text, fleet_count,
            [s["credits_granted"] for s in status], key if day == _today() else "")


def test_two_servers_share_a_cold_sources_plan(postfix_instance, sink, redis_server) -> None:
    started = time.monotonic()
    by_client, got, text, fleet_count, granted, key = _fleet_run(postfix_instance, sink,
                                                                 redis_server)
    if not key:  # the UTC day changed mid-run: the plan's window rolled over
        by_client, got, text, fleet_count, granted, key = _fleet_run(
            postfix_instance, sink, redis_server)
    cold = by_client.get(SOURCES["src1"], 0)
    per_server = [next((c["counted"] for c in s["counts"] if c["source"] == "src1"), 0)
                  for s in got["status"]]
    print(f"\n2 servers x {PER_SERVER} messages to {DOMAIN}, src1 cold with a plan of "
          f"{PLAN} a day shared through Redis: messages by source address {by_client}; "
          f"src1 counted {per_server[0]} + {per_server[1]} by the servers, credits granted "
          f"{granted[0]} + {granted[1]}, the fleet's count after both stopped "
          f"{fleet_count} ({key}); node0 reloaded when src1 had sent {got['at_reload']} "
          f"(the fleet's count {got['fleet_at_reload']}); "
          f"{time.monotonic() - started:.1f} s")
    print("node0's pyqmgr status says:\n" + text)
    assert abs(cold - PLAN) <= PLAN * 0.02, by_client
    assert cold <= PLAN, "the fleet never passes the plan"
    assert all(n > 0 for n in per_server), "both servers sent from the cold address"
    assert sum(per_server) == cold
    assert sum(by_client.values()) == 2 * PER_SERVER and got["deferred"] == [0, 0]
    assert by_client[SOURCES["src2"]] + by_client[SOURCES["src3"]] == 2 * PER_SERVER - cold
    assert got["fleet_at_reload"] < PLAN, "the reload came while the fleet still granted"
    assert got["twice"] == {}, "a recipient delivered twice"
    assert fleet_count == cold, "credits held at exit (and the reload) went back to the fleet"
    for s in got["status"]:
        assert s["shared"] is True and s["fleet_unavailable"] is False
    assert "warm-up counts: the fleet's (shared_state)" in text
    assert "FLEET" in text and "CREDITS" in text
    # The metrics say what status says: after the last recipient nothing asks, so the
    # counters stand still; credits held may go back meanwhile (held + given back stays).
    # The reloaded node0's new qmgr may find the plan all granted already (0 granted).
    print(f"metrics ({got['scrape_seconds']} s for both scrapes):", got["metrics"])
    assert sum(m["pyqmgr_source_fleet_credits_granted_total"] for m in got["metrics"]) > 0
    for s, m in zip(got["status"], got["metrics"], strict=True):
        assert m["pyqmgr_source_fleet_credits_granted_total"] == s["credits_granted"], m
        assert m["pyqmgr_source_fleet_credits_asked_total"] == s["credits_asked"], m
        assert m['pyqmgr_source_fleet_credits_held{source="src1"}'] + \
            m["pyqmgr_source_fleet_credits_given_back_total"] == \
            s["credits_held"] + s["credits_given_back"], (m, s)
        assert m["pyqmgr_source_fleet_unavailable"] == int(s["fleet_unavailable"]) == 0
        assert m["pyqmgr_source_fleet_credits_errors_total"] == s["credits_errors"], m
    _ = json.dumps(got)  # the status reply is JSON all through
