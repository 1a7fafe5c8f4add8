"""pyqmgr explain on real Postfix: each constraint made real, named with its setting.

The core's unit tests (tests/unit/test_explain.py) make every situation directly;
these make three of them happen on a running instance, with real agents and a sink,
and read the answer through the control channel as an admin would.
"""

from __future__ import annotations

import json

from pyqmgr.testbed.instance import PostfixInstance, free_port
from pyqmgr.testbed.sink import SinkServer
from tests.test_control import cli, wait_for_channel


def reasons_for(pf: PostfixInstance, target: str) -> list[dict]:
    proc = cli(pf, "explain", target, "--json")
    assert proc.returncode == 0, proc.stderr
    reply = json.loads(proc.stdout)
    return reply["reasons"]


def wait_for_reason(pf: PostfixInstance, target: str, constraint: str) -> dict:
    found: list[dict] = []

    def present() -> bool:
        found[:] = [r for r in reasons_for(pf, target) if r["constraint"] == constraint]
        return bool(found)

    pf.wait_until(present, 30, f"explain {target} naming '{constraint}'")
    return found[0]


def test_a_full_window_at_its_limit(postfix_instance, sink):
    srv: SinkServer = sink(latency=2.0)
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"w.example": f"smtp:[127.0.0.1]:{srv.port}"},
        main_cf={"smtp_destination_concurrency_limit": "2",
                 "smtp_connection_cache_on_demand": "no"})
    wait_for_channel(pf)
    pf.smtp_send([("s@test.example", [f"r{i}@w.example"]) for i in range(6)])
    full = wait_for_reason(pf, f"[127.0.0.1]:{srv.port}", "window full")
    assert full["setting"] == "smtp_destination_concurrency_limit", full
    assert full["window"] == 2 and full["limit"] == 2
    pf.wait_until(lambda: srv.delivered_count() >= 6, 60, "the six deliveries")


def test_a_dead_destination_with_its_cohorts_and_retry_time(postfix_instance):
    port = free_port()  # nothing listens: every connection is refused
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"dead.example": f"smtp:[127.0.0.1]:{port}"},
        main_cf={"initial_destination_concurrency": "1",
                 "smtp_destination_concurrency_failed_cohort_limit": "1",
                 "minimal_backoff_time": "600s", "maximal_backoff_time": "1200s"})
    wait_for_channel(pf)
    pf.smtp_send([("s@test.example", [f"r{i}@dead.example"]) for i in range(3)])
    dead = wait_for_reason(pf, f"[127.0.0.1]:{port}", "dead destination")
    assert dead["setting"] == "minimal_backoff_time", dead
    assert dead["fail_cohorts"] == 1.0
    assert 0 < dead["retry_in"] <= 600, dead
    assert "refused" in dead["text"].lower() or "connect" in dead["text"].lower(), dead


def test_a_transport_at_its_process_limit(postfix_instance, sink):
    srv_a: SinkServer = sink(latency=3.0)
    srv_b: SinkServer = sink(latency=0.1)
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr",
        transports={"a.example": f"one:[127.0.0.1]:{srv_a.port}",
                    "b.example": f"one:[127.0.0.1]:{srv_b.port}"},
        master_cf_extra=["one unix - - n - 1 smtp"],
        main_cf={"one_connection_cache_on_demand": "no"})
    wait_for_channel(pf)
    pf.smtp_send([("s@test.example", ["r0@a.example"])])
    pf.wait_until(lambda: srv_a.open_sessions() >= 1, 20, "the slow delivery under way")
    pf.smtp_send([("s@test.example", ["r1@b.example"])])
    limit = wait_for_reason(pf, f"[127.0.0.1]:{srv_b.port}", "process limit")
    assert limit["setting"] == "master.cf one maxproc", limit
    assert limit["limit"] == 1
    pf.wait_until(lambda: srv_b.delivered_count() >= 1, 30, "b delivered after a")
