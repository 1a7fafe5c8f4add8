"""The Google/Microsoft case on real Postfix (issue #33; docs/sites.md's worked example).

A relay's customers: four Google Workspace domains, whose MX records all name
Google's own hosts (``aspmx.l.google.com`` and its four alternates, the set Google
tells every Workspace customer to publish), three Microsoft 365 tenants, whose MX
records each name a host of their own under ``mail.protection.outlook.com``, and one
domain with its own mail server. A real DNS server (unbound on loopback) serves those
records and the hosts' addresses (127.0.0.1); behind each provider one sink stands in
for its servers: 5 sessions (Microsoft's 3), ``421`` beyond, as a provider's
per-client limit. Each
domain's next hop is ``domain:PORT`` (its provider's sink), so Postfix's smtp(8)
looks the MX up itself.

Stock qmgr sees eight destinations of twenty sessions each. pyqmgr with
``site_grouping = mx``, ``site_concurrency_limit = 5`` and Microsoft's own 3
(``site_concurrency_limit_maps``) sees three sites: the
Workspace domains group by their MX set alone (site ``google`` by the shipped
provider table), the tenants by the table's ``protection.outlook.com`` line (site
``microsoft``), and the last domain is a site of its own. The test prints what
``pyqmgr status`` and ``pyqmgr explain`` say mid-run, for the documentation.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from pyqmgr.testbed import dns
from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.sink import SinkServer
from tests.test_control import cli

pytestmark = pytest.mark.skipif(not dns.available(), reason="needs unbound (./dev installs it)")

WORKSPACE = ["acme.test", "bolt.test", "cedar.test", "delta.test"]
TENANTS = ["echo.test", "fjord.test", "gale.test"]
OWN = "harbor.test"
GOOGLE_MX = [(1, "aspmx.l.google.com"), (5, "alt1.aspmx.l.google.com"),
             (5, "alt2.aspmx.l.google.com"), (10, "alt3.aspmx.l.google.com"),
             (10, "alt4.aspmx.l.google.com")]
RECORDS = [
    *[f"{d}. 300 IN MX {pref} {host}." for d in WORKSPACE for pref, host in GOOGLE_MX],
    *[f"{host}. 300 IN A 127.0.0.1" for _, host in GOOGLE_MX],
    *[f"{d}. 300 IN MX 0 {d.replace('.', '-')}.mail.protection.outlook.com."
      for d in TENANTS],
    *[f"{d.replace('.', '-')}.mail.protection.outlook.com. 300 IN A 127.0.0.1"
      for d in TENANTS],
    f"{OWN}. 300 IN MX 10 mail.{OWN}.", f"mail.{OWN}. 300 IN A 127.0.0.1",
]
PER_DOMAIN = 25
#: What each provider's server takes at once; 421 beyond.
SESSIONS = {"google": 5, "microsoft": 3, OWN: 5}
#: pyqmgr.cf: five a site, and Microsoft's three of its own (a hash table, built by
#: postmap, which the daemon reads with postmap -s at start-up).
SITES_CF = {"site_grouping": "mx", "site_concurrency_limit": "5"}


def site_limits(tables_dir) -> str:
    (tables_dir / "main.cf").write_text("")
    table = tables_dir / "site-limits"
    table.write_text("microsoft  3\n")
    subprocess.run(["postmap", "-c", str(tables_dir), f"hash:{table}"], check=True,
                   capture_output=True, timeout=30)
    return f"hash:{table}"
LATENCY = 0.2


def _run(postfix_instance, sink, server: dns.DnsServer, qmgr: str,
         pyqmgr_cf: dict[str, str] | None
         ) -> tuple[PostfixInstance, dict[str, SinkServer], int]:
    sinks: dict[str, SinkServer] = {
        name: sink(latency=LATENCY, client_limit=SESSIONS[name])
        for name in ("google", "microsoft", OWN)}
    port = {**{d: sinks["google"].port for d in WORKSPACE},
            **{d: sinks["microsoft"].port for d in TENANTS}, OWN: sinks[OWN].port}
    pf: PostfixInstance = postfix_instance(
        start=False, qmgr=qmgr, pyqmgr_cf=pyqmgr_cf,
        transports={d: f"smtp:{d}:{p}" for d, p in port.items()},
        main_cf={"smtp_host_lookup": "dns", "smtp_connection_cache_on_demand": "no",
                 "minimal_backoff_time": "3600s", "maximal_backoff_time": "3600s"})
    pf.start(prefix=server.start_prefix())
    domains = list(port)
    n = PER_DOMAIN * len(domains)
    pf.smtp_send([("s@relay.example", [f"r{i}@{domains[i % len(domains)]}"])
                  for i in range(n)])
    return pf, sinks, n


def _tried(pf: PostfixInstance) -> tuple[int, int]:
    lines = pf.maillog.lines()
    sent = sum(1 for ln in lines if "status=sent" in ln.text and ".test>" in ln.text)
    deferred = sum(1 for ln in lines if "status=deferred" in ln.text and ".test>" in ln.text)
    return sent, deferred


def test_workspace_domains_and_microsoft_tenants_are_two_sites(postfix_instance, sink,
                                                               tables_dir):
    with dns.DnsServer(["test", "google.com", "outlook.com"], RECORDS) as server:
        pf, stock_sinks, n = _run(postfix_instance, sink, server, "stock", None)
        pf.wait_until(lambda: sum(_tried(pf)) >= n, 120, f"{n} messages tried once")
        _, stock_deferred = _tried(pf)
        stock_seen = {k: s.snapshot() for k, s in stock_sinks.items()}
        pf.stop()

        pf, sinks, n = _run(postfix_instance, sink, server, "pyqmgr", {
            **SITES_CF, "site_concurrency_limit_maps": site_limits(tables_dir)})
        status: dict = {}
        explained = ""
        deadline = time.monotonic() + 60
        # Mid-run, while the Workspace domains queue behind their site's five sessions.
        while time.monotonic() < deadline and sinks["google"].delivered_count() < 60:
            proc = cli(pf, "status", "--json")
            assert proc.returncode == 0, proc.stderr
            status = json.loads(proc.stdout)
            if any(
                    s["name"] == "google" and s["in_flight"] == 5 for s in status["sites"]):
                explained = cli(pf, "explain", f"bolt.test:{sinks['google'].port}").stdout
                if "site google" in explained:
                    break
            time.sleep(0.05)
        pf.wait_until(lambda: sum(_tried(pf)) >= n, 120, f"{n} messages tried once")
        sent, deferred = _tried(pf)
        seen = {k: s.snapshot() for k, s in sinks.items()}

    sites = {s["name"]: s for s in status["sites"]}
    print(f"\n{n} messages, {PER_DOMAIN} to each of {len(WORKSPACE)} Workspace domains, "
          f"{len(TENANTS)} Microsoft 365 tenants and {OWN}; sessions each server takes "
          f"{SESSIONS}, 421 beyond:")
    for who, st, d in (("stock", stock_seen, stock_deferred), ("pyqmgr", seen, deferred)):
        print(f"  {who}: {d} deferred on the first try; sessions refused "
              + ", ".join(f"{k} {v.rejected_421}" for k, v in st.items())
              + "; peak sessions " + ", ".join(f"{k} {v.max_concurrent}"
                                               for k, v in st.items()))
    print("  pyqmgr status, sites: " + json.dumps(status["sites"]))
    print("  pyqmgr explain bolt.test:PORT:\n" + explained)
    # harbor.test's site has left the table by then if its mail is all delivered (a
    # site with no destination is forgotten).
    assert {"google", "microsoft"} <= set(sites) <= {"google", "microsoft", f"mail.{OWN}"}
    assert sites["google"]["destinations"] == 4 and sites["microsoft"]["destinations"] == 3
    assert sites["google"]["limit"] == 5 and sites["microsoft"]["limit"] == 3
    assert "site google" in explained and "site_concurrency_limit" in explained, explained
    assert stock_deferred > 0 and stock_seen["google"].rejected_421 > 0, "the control"
    assert deferred == 0 and sent == n
    for name, st in seen.items():
        assert st.max_concurrent <= SESSIONS[name] and st.rejected_421 == 0, (name, st)
