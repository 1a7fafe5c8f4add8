"""Prometheus metrics on real Postfix: a real Prometheus scrapes pyqmgr while mail flows.

The counts Prometheus stores must be the maillog's: per transport and outcome, with
a sink that accepts some recipients, defers others (450) and bounces some (550), a
second smtp transport to another sink, the error transport, and local(8) delivering
the bounce notices. Every expression of contrib/grafana/pyqmgr.json runs through
Prometheus's query API in the same test, so the dashboard cannot rot.

Then what must not happen: a bad metrics_listen starting the daemon (a fatal line
naming pyqmgr.cf and the parameter; mail waits), a port already taken stopping mail
(a warning, mail flows, the exporter binds once the port is free), and hostile HTTP
clients (garbage, oversized, half-sent and silent requests, too many at once)
slowing deliveries or a scrape.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator

import pytest

from pyqmgr.testbed import prometheus
from pyqmgr.testbed.instance import LOCAL_DOMAIN, PostfixInstance, free_port
from pyqmgr.testbed.maillog import LogLine
from pyqmgr.testbed.prometheus import PrometheusServer
from pyqmgr.testbed.sink import SinkServer

DASHBOARD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "contrib", "grafana", "pyqmgr.json")

#: What Grafana substitutes in the dashboard's expressions, made concrete.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m",
                     "$instance": ".*", "$transport": ".*"}

#: The sink's answers by recipient: "ok..." is accepted.
SINK_REPLIES = {"defer*": "450 4.2.0 try again later", "bounce*": "550 5.1.1 no such user"}

#: maillog status words and the outcome a one-recipient delivery request then has.
OUTCOME_OF_STATUS = {"sent": "final", "bounced": "final", "deferred": "deferred"}


@pytest.fixture
def prometheus_server() -> Iterator[list[PrometheusServer]]:
    """Start servers with ``made.append(PrometheusServer([...]).start())``; all stopped."""
    if not prometheus.available():
        pytest.skip(f"needs Debian's prometheus package ({prometheus.PROMETHEUS})")
    made: list[PrometheusServer] = []
    try:
        yield made
    finally:
        for server in made:
            server.stop()


def scrape(port: int, timeout: float = 5) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        assert r.status == 200
        return str(r.read().decode())


def wait_for_exporter(pf: PostfixInstance, port: int, timeout: float = 30) -> None:
    def answers() -> bool:
        try:
            return "pyqmgr_deliveries_total" in scrape(port, 2)
        except OSError:
            return False

    pf.wait_until(answers, timeout, f"the metrics exporter on 127.0.0.1:{port}")


def agent_status_lines(pf: PostfixInstance) -> list[LogLine]:
    """Delivery agents' per-recipient lines (qmgr's own status= lines are no delivery)."""
    return [ln for ln in pf.maillog.lines() if ln.status in OUTCOME_OF_STATUS
            and ln.program_name != "qmgr" and ln.to]


def dashboard_expressions() -> list[str]:
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    exprs = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            exprs.append(target["expr"])
    return exprs


def concrete(expr: str) -> str:
    for name, value in sorted(GRAFANA_VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a Grafana variable the test does not know: {expr}"
    return expr


def test_prometheus_counts_equal_the_maillogs_per_transport_and_outcome(
        postfix_instance, sink, prometheus_server):
    sink_a: SinkServer = sink(replies=SINK_REPLIES)
    sink_b: SinkServer = sink(replies=SINK_REPLIES)
    port = free_port()
    transport_of = {"a.example": "smtp", "b.example": "relay2", "e.example": "error",
                    LOCAL_DOMAIN: "local"}
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr",
        transports={"a.example": f"smtp:[127.0.0.1]:{sink_a.port}",
                    "b.example": f"relay2:[127.0.0.1]:{sink_b.port}",
                    "e.example": "error:5.1.1 mailbox unavailable here"},
        master_cf_extra=["relay2 unix - - n - - smtp"],
        # Deferred mail stays deferred for the test's length: no second attempts.
        main_cf={"minimal_backoff_time": "3600s", "maximal_backoff_time": "7200s",
                 "queue_run_delay": "3600s"},
        pyqmgr_cf={"metrics_listen": f"127.0.0.1:{port}"})
    wait_for_exporter(pf, port)
    server = PrometheusServer([f"127.0.0.1:{port}"], interval=1.0).start()
    prometheus_server.append(server)
    server.wait(server.targets_up, 30, "the first successful scrape of pyqmgr")

    # One recipient per message, so one delivery request per maillog line. Bounce
    # notices go to the local test user, through local(8).
    recipients = ([f"ok{i}@a.example" for i in range(12)]
                  + [f"defer{i}@a.example" for i in range(5)]
                  + [f"bounce{i}@a.example" for i in range(3)]
                  + [f"ok{i}@b.example" for i in range(7)]
                  + [f"defer{i}@b.example" for i in range(4)]
                  + [f"x{i}@e.example" for i in range(3)])
    bounces = 3 + 3
    pf.smtp_send_many([(pf.local_address, [r]) for r in recipients], sessions=2)
    expected_lines = len(recipients) + bounces
    pf.wait_until(lambda: len(agent_status_lines(pf)) >= expected_lines, 90,
                  f"{expected_lines} delivery agent status lines")
    pf.wait_until(lambda: not pf.queue_files("active") and not pf.queue_files("incoming"),
                  30, "the active and incoming queues empty")
    time.sleep(0.5)  # nothing else is on its way: the counts now stay put
    lines = agent_status_lines(pf)
    assert len(lines) == expected_lines, [ln.raw for ln in lines]
    from_maillog = Counter((transport_of[ln.to.rpartition("@")[2]],  # type: ignore[union-attr]
                            OUTCOME_OF_STATUS[ln.status])  # type: ignore[index]
                           for ln in lines)
    assert from_maillog == {("smtp", "final"): 15, ("smtp", "deferred"): 5,
                            ("relay2", "final"): 7, ("relay2", "deferred"): 4,
                            ("error", "final"): 3, ("local", "final"): bounces}

    stored: dict[tuple[str, str], float] = {}

    def prometheus_agrees() -> bool:
        stored.clear()
        for item in server.query("sum by (transport, outcome) (pyqmgr_deliveries_total)"):
            value = float(item["value"][1])
            if value:
                stored[(item["metric"]["transport"], item["metric"]["outcome"])] = value
        return stored == from_maillog

    server.wait(prometheus_agrees, 30, "Prometheus to store the maillog's counts",
                detail=lambda: f"Prometheus has {stored}, the maillog {dict(from_maillog)}")
    print(f"maillog and Prometheus, per transport and outcome: {dict(from_maillog)}")

    # One recipient per request: the recipient counter says the same.
    rcpts = {(i["metric"]["transport"], i["metric"]["outcome"]): float(i["value"][1])
             for i in server.query("sum by (transport, outcome) "
                                   "(pyqmgr_delivery_recipients_total) > 0")}
    assert rcpts == from_maillog
    # Every reply has a latency; final ones an age, in qshape's first column.
    latency = {i["metric"]["transport"]: float(i["value"][1])
               for i in server.query("pyqmgr_delivery_latency_seconds_count > 0")}
    assert latency == {t: float(sum(n for (tt, _o), n in from_maillog.items() if tt == t))
                       for t in ("smtp", "relay2", "error", "local")}
    young = {i["metric"]["transport"]: float(i["value"][1]) for i in server.query(
        'pyqmgr_message_age_at_delivery_seconds_bucket{le="300.0"} > 0')}
    assert young == {t: float(from_maillog[(t, "final")])
                     for t in ("smtp", "relay2", "error", "local")}
    assert not server.query("pyqmgr_metrics_errors_total > 0")

    # The dashboard: every expression runs; the delivery panels show data.
    exprs = dashboard_expressions()
    assert len(exprs) >= 20
    results = {}
    for expr in exprs:
        results[expr] = server.query(concrete(expr))  # raises with Prometheus's error
    with_data = [e for e, r in results.items() if r]
    # Counters exist (as zeros) from the first scrape, so rate() sees the deliveries.
    rates = results[exprs[0]]
    assert "rate(pyqmgr_deliveries_total" in exprs[0] and rates
    assert any(float(r["value"][1]) > 0 for r in rates), rates
    assert any("pyqmgr_transport_process_limit" in e for e in with_data)
    print(f"dashboard: {len(exprs)} expressions ran, {len(with_data)} with data")
    assert not [ln.raw for ln in pf.maillog.lines("qmgr") if ln.severity != "info"]


def test_a_bad_metrics_listen_is_fatal_and_mail_stays_queued(postfix_instance, sink):
    srv: SinkServer = sink()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", start=False, transports={"d.example": f"smtp:[127.0.0.1]:{srv.port}"})
    # Written after 'pyqmgr install', which (like 'pyqmgr check') refuses such a value:
    # what is tested here is the daemon's own refusal at start-up.
    pf.write_pyqmgr_cf({"metrics_listen": "0.0.0.0:9155"})
    pf.start()
    (qid,) = pf.smtp_send([("s@test.example", ["r@d.example"])])
    fatal = pf.maillog.wait_for(lambda ln: ln.program_name == "qmgr" and ln.severity == "fatal",
                                timeout=30, what="qmgr's fatal line")[0]
    cf = os.path.join(pf.config_dir, "pyqmgr.cf")
    assert fatal.text.startswith(f"fatal: {cf}: parameter metrics_listen: "), fatal.text
    assert "not a loopback address" in fatal.text
    assert pf.queue_path("incoming", qid) or pf.queue_path("active", qid)
    assert srv.delivered_count() == 0


def test_a_port_in_use_is_a_warning_and_mail_flows(postfix_instance, sink):
    srv: SinkServer = sink()
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    port = blocker.getsockname()[1]
    try:
        pf: PostfixInstance = postfix_instance(
            qmgr="pyqmgr", transports={"d.example": f"smtp:[127.0.0.1]:{srv.port}"},
            pyqmgr_cf={"metrics_listen": f"127.0.0.1:{port}"})
        warning = pf.maillog.wait_for(
            lambda ln: ln.program_name == "qmgr" and ln.severity == "warning",
            timeout=30, what="qmgr's warning about the port")[0]
        assert warning.text == (f"warning: metrics_listen 127.0.0.1:{port}: Address already "
                                "in use; metrics are unavailable, tried again every 10 s")
        pf.smtp_send([("s@test.example", [f"r{i}@d.example"]) for i in range(5)])
        srv.wait_delivered(5, 30)
    finally:
        blocker.close()
    # Once the port is free, the next retry takes it.
    wait_for_exporter(pf, port, timeout=30)
    pf.maillog.wait_for(lambda ln: ln.program_name == "qmgr" and ln.text == (
        f"metrics_listen 127.0.0.1:{port}: listening"), timeout=5, what="the info line")
    assert "pyqmgr_deliveries_total{outcome=\"final\",transport=\"smtp\"} 5.0" in scrape(port)


def raw(port: int, data: bytes, timeout: float = 10) -> bytes:
    """Send ``data``, half-close, read until the server closes (or resets)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        return read_all(s)


def read_all(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def test_hostile_http_clients_never_stall_scrapes_or_deliveries(postfix_instance, sink):
    srv: SinkServer = sink()
    port = free_port()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"d.example": f"smtp:[127.0.0.1]:{srv.port}"},
        pyqmgr_cf={"metrics_listen": f"127.0.0.1:{port}"})
    wait_for_exporter(pf, port)

    # Each kind of bad request gets its status line and a closed connection.
    assert raw(port, b"hello there\r\n\r\n").startswith(b"HTTP/1.0 400 ")
    assert raw(port, b"POST /metrics HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 405 ")
    assert raw(port, b"GET /secret HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.0 404 ")
    head = raw(port, b"HEAD /metrics HTTP/1.0\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200 ") and head.endswith(b"\r\n\r\n")
    assert raw(port, b"GET /metrics HTTP/1.0\r\nX-Junk: " + b"a" * 20_000).startswith(
        b"HTTP/1.0 431 ")
    # A client that keeps sending is cut off (its reply may be lost in the reset).
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        started = time.monotonic()
        with pytest.raises(OSError):
            for _ in range(1000):
                s.sendall(b"GET /metrics HTTP/1.0\r\nX-Junk: " + b"a" * 65536)
                time.sleep(0.001)
        assert time.monotonic() - started < 5

    # Silent and half-sent clients hold 14 of the 16 places for 5 s: a scrape still
    # gets one at once, two more are refused with 503, and then they are cut off.
    held = []
    try:
        for i in range(14):
            s = socket.create_connection(("127.0.0.1", port), timeout=15)
            if i % 2:
                s.sendall(b"GET /metrics HTTP/1.0\r\nHost:")
            held.append(s)
        time.sleep(0.3)
        started = time.monotonic()
        assert "pyqmgr_active_messages" in scrape(port)
        assert time.monotonic() - started < 1.0
        extra = [socket.create_connection(("127.0.0.1", port), timeout=15) for _ in range(4)]
        held += extra
        time.sleep(0.3)
        refused = 0
        for s in extra:
            s.setblocking(False)
            try:
                refused += s.recv(100).startswith(b"HTTP/1.0 503 ")
            except BlockingIOError:
                pass
            s.setblocking(True)
        assert refused == 2, "16 clients at most: two of the four extra ones are refused"
        # Mail flows meanwhile, and the silent ones get 408 and their connection closed.
        started = time.monotonic()
        pf.smtp_send([("s@test.example", [f"r{i}@d.example"]) for i in range(30)])
        srv.wait_delivered(30, 30)
        sent = time.monotonic() - started
        cut = [read_all(s) for s in held[:14]]
        assert all(c.startswith(b"HTTP/1.0 408 ") for c in cut), cut
    finally:
        for s in held:
            s.close()
    print(f"30 messages delivered in {sent:.2f} s beside 18 held clients")
    assert "pyqmgr_deliveries_total{outcome=\"final\",transport=\"smtp\"} 30.0" in scrape(port)
    # Nothing about bad requests in the maillog (a scanner must not fill it).
    assert not [ln.raw for ln in pf.maillog.lines("qmgr") if ln.severity != "info"]


def test_postfix_reload_hands_the_port_to_the_next_qmgr(postfix_instance):
    port = free_port()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", pyqmgr_cf={"metrics_listen": f"127.0.0.1:{port}"})
    wait_for_exporter(pf, port)
    old = pf.qmgr_pid()
    pf.reload()
    pf.wait_until(lambda: old not in pf.pids(), 20, f"the old qmgr {old} to exit")
    pf.qmgr_pid()  # a new one runs
    # Whoever answers now is the new qmgr; the old one may have held the port for a
    # moment, and the new one's retries meanwhile stay quiet.
    wait_for_exporter(pf, port, timeout=30)
    assert not [ln.raw for ln in pf.maillog.lines("qmgr") if ln.severity != "info"]


def test_per_recipient_queues_export_no_address(postfix_instance, sink):
    """With a destination recipient limit of 1 each recipient is a queue named
    user@nexthop; the endpoint is anyone's on the machine, so those queues are one
    series per nexthop and no address shows (issue #31, finding 7)."""
    srv: SinkServer = sink(latency=3.0)
    port = free_port()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"d.example": f"smtp:[127.0.0.1]:{srv.port}"},
        main_cf={"smtp_destination_recipient_limit": "1"},
        pyqmgr_cf={"metrics_listen": f"127.0.0.1:{port}"})
    wait_for_exporter(pf, port)
    pf.smtp_send([("s@test.example", [f"secret{i}@d.example" for i in range(6)])])
    nexthop = f"[127.0.0.1]:{srv.port}"
    series: dict[str, float] = {}

    def in_flight() -> bool:
        for line in scrape(port).splitlines():
            if line.startswith("pyqmgr_destination_") and 'transport="smtp"' in line:
                series[line.rsplit(" ", 1)[0]] = float(line.rsplit(" ", 1)[1])
        return series.get(f'pyqmgr_destination_in_flight{{destination="{nexthop}",'
                          f'transport="smtp"}}', 0) + series.get(
            f'pyqmgr_destination_queued_recipients{{destination="{nexthop}",'
            f'transport="smtp"}}', 0) == 6

    pf.wait_until(in_flight, 20, "six recipients in one nexthop's series")
    text = scrape(port)
    assert "secret" not in text and "@d.example" not in text, [
        ln for ln in text.splitlines() if "secret" in ln]
    assert 'pyqmgr_transport_destinations{transport="smtp"} 1.0' in text
    srv.wait_delivered(6, 60)


def test_tenants_beyond_the_limit_sum_into_other_in_prometheus(
        postfix_instance, sink, prometheus_server):
    """Issue #44: with metrics_tenant_limit = 1 the most active tenant keeps its series
    and the others are summed as tenant="_other"; what Debian's Prometheus stores adds
    up to the maillog's deliveries, with two tenant series whatever the tenants."""
    import smtplib  # noqa: PLC0415

    srv: SinkServer = sink()
    port = free_port()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"dest.example": f"smtp:[127.0.0.1]:{srv.port}"},
        pyqmgr_cf={"tenant_key": "header:X-Tenant", "metrics_listen": f"127.0.0.1:{port}",
                   "metrics_tenant_limit": "1"})
    wait_for_exporter(pf, port)
    server = PrometheusServer([f"127.0.0.1:{port}"], interval=1.0).start()
    prometheus_server.append(server)
    server.wait(server.targets_up, 30, "the first successful scrape of pyqmgr")

    def send(tenants: list[str], first: int) -> None:
        with smtplib.SMTP("127.0.0.1", pf.smtpd_port, timeout=60) as smtp:
            for i, tenant in enumerate(tenants, first):
                raw = (f"From: news@one.example\r\nTo: r{i}@dest.example\r\n"
                       f"X-Tenant: {tenant}\r\n\r\nhi\r\n")
                smtp.sendmail("news@one.example", [f"r{i}@dest.example"], raw.encode())

    # "big" first, alone: it takes the one place, and stays the most active.
    send(["big"] * 6, 0)
    pf.wait_until(lambda: srv.delivered_count() >= 6, 60, "big's 6 messages delivered")
    send(["a", "a", "b", "c"], 6)
    pf.wait_until(lambda: srv.delivered_count() >= 10, 60, "all 10 messages delivered")
    stored: dict[str, float] = {}

    def prometheus_agrees() -> bool:
        stored.clear()
        for item in server.query('sum by (tenant) '
                                 '(pyqmgr_tenant_deliveries_total{outcome="final"})'):
            stored[item["metric"]["tenant"]] = float(item["value"][1])
        return stored == {"big": 6.0, "_other": 4.0}

    server.wait(prometheus_agrees, 30, "Prometheus to store big's 6 and _other's 4",
                detail=lambda: f"Prometheus has {stored}")
    sent = len([ln for ln in agent_status_lines(pf) if ln.status == "sent"])
    assert sent == 10
    print(f"tenants in Prometheus with metrics_tenant_limit = 1: {stored}")
    assert not [ln.raw for ln in pf.maillog.lines("qmgr") if ln.severity != "info"]
