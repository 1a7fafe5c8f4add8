"""A stranger's domain cannot join a provider's site (issue #45, on real Postfix).

Anyone can register a domain and publish ``MX 0`` at a host of their own and ``MX 99``
at ``aspmx.l.google.com``. smtp(8) talks to the first host first; had the Google host
named the domain's site, its deliveries would count in site ``google``, and what its
own host does would be done to Google's real customers: a tarpit that accepts and
never greets holds the site's sessions (smtp(8) waits ``smtp_helo_timeout``, 300 s),
a ``421 [TS01]`` that a response rule answers with ``suspend`` stops the site, and
refused connections with ``site_dead_scope = site`` kill it. The issue measured 0 of
300 Workspace messages delivered in 60 s under pyqmgr; stock delivered them in 1 s.

Here unbound serves four Workspace domains (Google's five hosts, as Google tells its
customers to publish) and three strangers' domains, each with its own host first and
Google's after it: one behind a tarpit, one behind a server that greets with ``421
4.7.0 [TS01]``, one behind a port where nothing listens. Their mail goes first; then
100 messages to the Workspace domains must all be delivered, at the site's full
concurrency of 10 at their sink, and ``pyqmgr status`` shows site ``google`` with the
four Workspace domains alone.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from pyqmgr.testbed import dns
from pyqmgr.testbed.instance_base import free_port
from tests.test_control import cli

pytestmark = pytest.mark.skipif(not dns.available(), reason="needs unbound (./dev installs it)")

WORKSPACE = ["acme.test", "bolt.test", "cedar.test", "delta.test"]
GOOGLE_MX = [(1, "aspmx.l.google.com"), (5, "alt1.aspmx.l.google.com"),
             (5, "alt2.aspmx.l.google.com"), (10, "alt3.aspmx.l.google.com"),
             (10, "alt4.aspmx.l.google.com")]
#: The strangers' domains: each names a host of its own first and Google's after it.
STRANGERS = {"stall.test": "tarpit", "ts01.test": "ts01", "refuse.test": "refuse"}
RECORDS = [
    *[f"{d}. 300 IN MX {pref} {host}." for d in WORKSPACE for pref, host in GOOGLE_MX],
    *[f"{host}. 300 IN A 127.0.0.1" for _, host in GOOGLE_MX],
    *[line for d in STRANGERS for line in (
        f"{d}. 300 IN MX 0 mx.{d}.", f"{d}. 300 IN MX 99 aspmx.l.google.com.",
        f"mx.{d}. 300 IN A 127.0.0.1")],
]
LIMIT = 10
RULES = "/\\[TS0[1-3]\\]/  throttle suspend=15m ttl=1h\n"


def _settle(predicate, timeout: float = 15) -> None:
    """Wait a bounded time for ``predicate``, for the test's order only (no verdict)."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)


class Tarpit:
    """Accepts connections and never says a word, until stopped."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.held.append(conn)

    def close(self) -> None:
        self.stop = True
        self.thread.join(5)
        for conn in self.held:
            conn.close()
        self.sock.close()


def test_a_strangers_domain_with_googles_mx_cannot_stall_throttle_or_kill_googles_site(
        postfix_instance, sink, tables_dir):
    rules = tables_dir / "rules"
    rules.write_text(RULES)
    rules.chmod(0o644)
    google = sink(latency=0.2, client_limit=LIMIT)
    ts01 = sink()
    ts01.greeting_refusal = "421 4.7.0 [TS01] Messages from 127.0.0.1 temporarily deferred"
    tarpit = Tarpit()
    closed = free_port()
    port = {**{d: google.port for d in WORKSPACE}, "stall.test": tarpit.port,
            "ts01.test": ts01.port, "refuse.test": closed}
    try:
        with dns.DnsServer(["test", "google.com"], RECORDS) as server:
            pf = postfix_instance(
                start=False, qmgr="pyqmgr", pyqmgr_cf={
                    "site_grouping": "mx", "site_concurrency_limit": str(LIMIT),
                    "site_dead_scope": "site", "smtp_response_rules": str(rules)},
                transports={d: f"smtp:{d}:{p}" for d, p in port.items()},
                main_cf={"smtp_host_lookup": "dns", "smtp_connection_cache_on_demand": "no",
                         "minimal_backoff_time": "3600s", "maximal_backoff_time": "3600s"})
            pf.start(prefix=server.start_prefix())
            # The strangers first, one after another: refused connections (which kill
            # their site: site_dead_scope = site), a [TS01] reply (which suspends it),
            # a tarpit (which holds every session it is given). Each wait is for the
            # order only: had a stranger joined site google, the one before would have
            # stopped the site and the next would never be tried; what must happen is
            # asserted at the end.
            pf.smtp_send([("s@relay.example", [f"r{i}@refuse.test"]) for i in range(LIMIT)])
            _settle(lambda: any("Connection refused" in ln.text for ln in pf.maillog.lines()))
            pf.smtp_send([("s@relay.example", [f"r{i}@ts01.test"]) for i in range(LIMIT)])
            _settle(lambda: ts01.snapshot().rejected_421 >= 1)
            pf.smtp_send([("s@relay.example", [f"r{i}@stall.test"]) for i in range(LIMIT)])
            _settle(lambda: len(tarpit.held) >= 1)
            began = time.monotonic()
            n = 100
            pf.smtp_send([("s@relay.example", [f"w{i}@{WORKSPACE[i % len(WORKSPACE)]}"])
                          for i in range(n)])
            members: list[int] = []  # site google's destinations, each time asked
            status: dict = {}

            def delivered() -> bool:
                nonlocal status
                proc = cli(pf, "status", "--json")
                if proc.returncode == 0:
                    got = json.loads(proc.stdout)
                    for site in got["sites"]:
                        if site["name"] == "google":
                            members.append(site["destinations"])
                            status = got
                return google.delivered_count() >= n

            pf.wait_until(delivered, 60, f"the {n} Workspace messages delivered")
            took = time.monotonic() - began
            seen = google.snapshot()
            held = len(tarpit.held)
            refused = sum(1 for ln in pf.maillog.lines()
                          if "@refuse.test>" in ln.text and "Connection refused" in ln.text)
            ts01_replies = ts01.snapshot().rejected_421
    finally:
        tarpit.close()
    print(f"\n{n} Workspace messages delivered in {took:.1f} s beside three strangers' "
          f"domains with Google's MX at 99: peak {seen.max_concurrent} sessions at the "
          f"Google sink (site limit {LIMIT}), {seen.rejected_421} refused; the tarpit "
          f"holds {held} sessions; site google's destinations as asked {members}; the "
          f"sites at the last: {json.dumps(status.get('sites'))}")
    assert held >= 1 and refused >= 1 and ts01_replies >= 1, \
        ("the control: each stranger's own host was reached", held, refused, ts01_replies)
    assert members and max(members) == len(WORKSPACE), members
    assert seen.max_concurrent == LIMIT, "the Workspace mail at the site's full concurrency"
    assert seen.rejected_421 == 0


def test_a_reply_from_a_host_that_is_not_the_sites_moves_only_its_destination(
        postfix_instance, sink, tables_dir):
    """A domain's owner can change its MX records after qmgr looked them up (an answer
    holds for its TTL): ``turn.test`` names Google's hosts when qmgr asks, so it is in
    site ``google``, then names a host of its own, which answers ``421 [TS01]`` under
    a ``suspend`` rule. The reply is not from one of the site's hosts: only
    ``turn.test`` is held back, and 100 Workspace messages after it are all delivered
    at the site's full 10 sessions. Before, the reply suspended site google for 15
    minutes."""
    rules = tables_dir / "rules"
    rules.write_text(RULES)
    rules.chmod(0o644)
    google = sink(latency=0.2, client_limit=LIMIT)
    # turn.test's own host: another loopback address, the next hop's port.
    own = sink(port=google.port, host="127.0.0.2")
    own.greeting_refusal = "421 4.7.0 [TS01] Messages from 127.0.0.1 temporarily deferred"
    google_records = [
        *[f"{d}. 300 IN MX {pref} {host}." for d in [*WORKSPACE, "turn.test"]
          for pref, host in GOOGLE_MX],
        *[f"{host}. 300 IN A 127.0.0.1" for _, host in GOOGLE_MX]]
    turned = [line for line in google_records if not line.startswith("turn.test.")] + [
        "turn.test. 300 IN MX 0 mx.turn.test.", "mx.turn.test. 300 IN A 127.0.0.2"]
    with dns.DnsServer(["test", "google.com"], google_records) as server:
        pf = postfix_instance(
            start=False, qmgr="pyqmgr", pyqmgr_cf={
                "site_grouping": "mx", "site_concurrency_limit": str(LIMIT),
                "site_dead_scope": "site", "smtp_response_rules": str(rules)},
            transports={d: f"smtp:{d}:{google.port}" for d in [*WORKSPACE, "turn.test"]},
            main_cf={"smtp_host_lookup": "dns", "smtp_connection_cache_on_demand": "no",
                     "minimal_backoff_time": "3600s", "maximal_backoff_time": "3600s"})
        pf.start(prefix=server.start_prefix())
        pf.smtp_send([("s@relay.example", ["first@turn.test"])])
        pf.wait_until(lambda: google.delivered_count() == 1, 30,
                      "turn.test's first message delivered by Google's host")
        server.serve(turned)
        pf.smtp_send([("s@relay.example", [f"t{i}@turn.test"]) for i in range(LIMIT)])
        pf.wait_until(lambda: own.snapshot().rejected_421 >= 1, 30,
                      "turn.test's own host answering [TS01]")
        began = time.monotonic()
        n = 100
        pf.smtp_send([("s@relay.example", [f"w{i}@{WORKSPACE[i % len(WORKSPACE)]}"])
                      for i in range(n)])
        pf.wait_until(lambda: google.delivered_count() >= n + 1, 60,
                      f"the {n} Workspace messages delivered")
        took = time.monotonic() - began
        proc = cli(pf, "status", "--json")
        assert proc.returncode == 0, proc.stderr
        status = json.loads(proc.stdout)
        seen = google.snapshot()
    turn = [d for d in status["destinations"] if d["name"].startswith("turn.test")]
    sites = {s["name"]: s for s in status["sites"]}
    print(f"\n{n} Workspace messages delivered in {took:.1f} s after turn.test's own host "
          f"answered [TS01]: peak {seen.max_concurrent} at the Google sink; turn.test "
          f"{turn}; site google {sites.get('google')}")
    assert seen.max_concurrent == LIMIT and seen.rejected_421 == 0
    assert turn and turn[0]["state"] != "ready", turn
    assert "google" not in sites or sites["google"]["state"] == "open", sites["google"]
