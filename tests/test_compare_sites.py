"""pyqmgr compare with destinations that name an MX host (issue #33), on real Postfix.

A workload's ``mx = "HOST"`` says where a domain's mail really goes. compare plays it as
``./dev bench sites`` does: one sink per MX host, shared by the domains that name it,
a real DNS server (unbound on loopback) answering their MX records, and Postfix's own
smtp(8) looking them up (next hop ``DOMAIN:PORT``). Here eight domains name one server
of 5 sessions that answers 421 beyond; two more name a second host that bounces a
share of one domain's recipients; one destination has no MX host and keeps its own
sink. Stock counts eight destinations of five sessions and meets the 421s; pyqmgr
with ``site_grouping = mx`` and ``site_concurrency_limit = 5`` counts one site.

What must hold, whatever the timing: the routing is by the MX records (the maillog's
relay= names the host); stock is refused sessions and defers a large share; pyqmgr
with sites defers nothing and the server never sees more than 5 sessions at once;
each domain's replies at a shared sink stay its own; the DNS server and the instances
are gone afterwards. Without unbound such a workload is refused, not routed otherwise.

With the DNS server stopped while pyqmgr looks its domains up (issue #43), pyqmgr
learns no site, and the report must lead with that, not show a comparison of sites
that never took effect: the run's mail still drains once the server is back.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pyqmgr.compare import RunError, ScenarioError, compare, load_plan
from pyqmgr.testbed import dns

ONE = "mx.one.example"
TWO = "mx.two.example"
LIMITED = [f"d{i}.example" for i in range(8)]
PER_DOMAIN = 10
STOCK = "stock"
SITES = "pyqmgr:nqmgr,site_grouping=mx,site_concurrency_limit=5"


def _workload() -> str:
    """Eight domains at ONE (5 sessions, 421 beyond, 0.1 s a message), two at TWO (no
    limit; e0's recipients bounced one in four), plain.example on a sink of its own."""
    lines = ['title = "Eight domains at one MX host of 5 sessions, two at another"',
             "seed = 3", "[compare]", "time_scale = 1", "timeout = 120",
             "[compare.main_cf]", 'minimal_backoff_time = "2s"',
             'maximal_backoff_time = "4s"', 'queue_run_delay = "1s"']
    for d in [*LIMITED, "e0.example", "e1.example", "plain.example"]:
        lines += ["[[messages]]", f"count = {PER_DOMAIN}", f'destination = "{d}"']
    for d in LIMITED:
        lines += [f'[destinations."{d}"]', "latency = 0.1", "server_limit = 5",
                  'overload = "421"', f'mx = "{ONE}"']
    lines += ['[destinations."e0.example"]', "latency = 0.02", "rcpt_5xx = 0.25",
              f'mx = "{TWO}"', '[destinations."e1.example"]', "latency = 0.02",
              f'mx = "{TWO}"', '[destinations."plain.example"]', "latency = 0.02"]
    return "\n".join(lines) + "\n"


def _base_dir() -> str:
    # Postfix's daemons must traverse it: pytest's tmp_path is 0700.
    path = tempfile.mkdtemp(prefix="pyqmgr-compare-sites-", dir="/tmp")
    os.chmod(path, 0o755)
    return path


@pytest.fixture(scope="module")
def ran() -> Iterator[tuple[dict[str, Any], dict[str, dict[str, Any]], float]]:
    """One compare of stock against pyqmgr with sites: the report, each run's run.json
    (by contender), and the seconds it took."""
    base, instances = _base_dir(), _base_dir()
    try:
        path = os.path.join(base, "mx.toml")
        with open(path, "w") as f:
            f.write(_workload())
        out = os.path.join(base, "out")
        began = time.monotonic()
        report = compare(path, [STOCK, SITES], out, base_dir=instances)
        took = time.monotonic() - began
        records = {}
        for label, run in report["runs"].items():
            with open(os.path.join(out, run["run_dir"], "run.json")) as f:
                records[label] = json.load(f)
            with open(os.path.join(out, run["run_dir"], "maillog"), errors="replace") as f:
                records[label]["maillog_text"] = f.read()
        assert os.listdir(instances) == [], "every instance directory is removed"
        yield report, records, took
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(instances, ignore_errors=True)


def _tried(run: dict[str, Any], domains: list[str]) -> tuple[int, int, int]:
    """(sent, deferred lines, all lines) over these destinations."""
    sent = sum(run["destinations"][d]["sent"] for d in domains)
    deferred = sum(run["destinations"][d]["deferred"] for d in domains)
    bounced = sum(run["destinations"][d]["bounced"] for d in domains)
    return sent, deferred, sent + deferred + bounced


def _first_try_deferred(maillog_text: str, domains: list[str]) -> int:
    """Recipients of these domains whose first delivery line is a deferral."""
    first: dict[str, str] = {}
    for line in maillog_text.splitlines():
        if "to=<" not in line or "status=" not in line:
            continue
        to = line.split("to=<", 1)[1].split(">", 1)[0]
        if to.rpartition("@")[2] in domains:
            first.setdefault(to, line.split("status=", 1)[1].split()[0])
    return sum(1 for status in first.values() if status == "deferred")


def test_stock_meets_the_421s_and_pyqmgr_with_sites_none(ran):
    report, records, took = ran
    stock, ours = report["runs"][STOCK], report["runs"][SITES]
    s_sent, s_deferred, s_lines = _tried(stock, LIMITED)
    o_sent, o_deferred, _ = _tried(ours, LIMITED)
    s_host, o_host = stock["mx_hosts"][ONE], ours["mx_hosts"][ONE]
    n = len(LIMITED) * PER_DOMAIN
    s_first = _first_try_deferred(records[STOCK]["maillog_text"], LIMITED)
    o_first = _first_try_deferred(records[SITES]["maillog_text"], LIMITED)
    print(f"\n{n} messages to {len(LIMITED)} domains at one MX host (5 sessions, 421 "
          f"beyond, 0.1 s a message): stock {s_first / n:.0%} deferred on the first try, "
          f"{s_deferred} of {s_lines} delivery lines deferred, "
          f"{s_host['sink']['refused_421']} sessions refused, peak "
          f"{s_host['sink']['max_concurrent']}, drained in {stock['drain_time']} s; pyqmgr "
          f"with sites {o_first} deferred on the first try, {o_deferred} lines deferred, "
          f"{o_host['sink']['refused_421']} refused, peak "
          f"{o_host['sink']['max_concurrent']} sessions (mean {o_host['in_flight_mean']}), "
          f"drained in {ours['drain_time']} s; compare took {took:.1f} s")
    assert stock["drained"] and ours["drained"], (stock["error"], ours["error"])
    # The control: stock's eight destinations of five sessions meet the server's limit.
    assert s_deferred >= 0.3 * s_lines, (s_deferred, s_lines)
    assert s_host["sink"]["refused_421"] > 0
    assert s_sent == n and s_host["sink"]["accepted"] == n
    # One site of five: nothing deferred anywhere, no session refused, never above 5.
    assert ours["deferred"] == 0 and o_deferred == 0 and o_first == 0
    assert o_sent == n and o_host["sink"]["accepted"] == n
    assert o_host["sink"]["refused_421"] == 0 and o_host["replies_4xx"] == {}
    assert o_host["sink"]["max_concurrent"] <= 5 and o_host["in_flight_peak"] <= 5
    assert any(f"at MX host {ONE}" in d and "421" in d for d in report["differences"]), \
        report["differences"]
    # The control of the DNS test below: lookups that worked are not reported.
    assert ours["not_in_effect"] == [] and not any("site" in d and "learnt" in d
                                                   for d in report["differences"])


def test_the_mail_went_by_the_mx_records(ran):
    _, records, _ = ran
    for label, rec in records.items():
        port_one = rec["mx_hosts"][ONE]["port"]
        port_two = rec["mx_hosts"][TWO]["port"]
        plain = rec["sinks"]["plain.example"]
        assert rec["main_cf"]["smtp_host_lookup"] == "dns", label
        assert rec["transports"]["d0.example"] == f"smtp:d0.example:{port_one}"
        assert rec["transports"]["e1.example"] == f"smtp:e1.example:{port_two}"
        assert rec["transports"]["plain.example"] == f"smtp:[127.0.0.1]:{plain['port']}"
        assert "d0.example. 300 IN MX 10 mx.one.example." in rec["dns"]["records"]
        assert f"{ONE}. 300 IN A 127.0.0.1" in rec["dns"]["records"]
        # smtp(8) looked the MX up itself: relay= names the host the record names.
        relays: dict[str, set[str]] = {}
        for line in rec["maillog_text"].splitlines():
            if "status=sent" in line and "relay=" in line:
                domain = line.split("to=<", 1)[1].split(">", 1)[0].rpartition("@")[2]
                relays.setdefault(domain, set()).add(
                    line.split("relay=", 1)[1].split(",", 1)[0])
        for d in LIMITED:
            assert relays[d] == {f"{ONE}[127.0.0.1]:{port_one}"}, (label, d, relays[d])
        assert relays["e0.example"] == {f"{TWO}[127.0.0.1]:{port_two}"}, label
        assert relays["plain.example"] == {f"127.0.0.1[127.0.0.1]:{plain['port']}"}
        assert plain["kind"] == "sink" and plain["accepted"] == PER_DOMAIN, label
        # The DNS server is stopped: its address's port 53 is free again.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((rec["dns"]["address"], 53))


def test_each_domain_keeps_its_own_replies_at_a_shared_sink(ran):
    report, records, _ = ran
    for label, run in report["runs"].items():
        e0, e1 = run["destinations"]["e0.example"], run["destinations"]["e1.example"]
        sinks = records[label]["sinks"]
        # rcpt_5xx = 0.25 is e0's alone, though e1's mail meets the same sink.
        assert e0["bounced"] > 0 and e1["bounced"] == 0, (label, e0, e1)
        assert sinks["e0.example"]["replies"] == {"550": e0["bounced"]}, label
        assert sinks["e1.example"]["replies"] == {}, label
        assert sinks["e0.example"]["accepted"] == e0["sent"] == PER_DOMAIN - e0["bounced"]
        assert sinks["e1.example"]["accepted"] == e1["sent"] == PER_DOMAIN
        assert run["mx_hosts"][TWO]["sink"]["accepted"] == e0["sent"] + e1["sent"]


def test_an_mx_workload_without_unbound_is_refused_before_anything_runs(
        monkeypatch, tmp_path):
    path = tmp_path / "mx.toml"
    path.write_text(_workload())
    monkeypatch.setattr(dns, "available", lambda: False)
    out = tmp_path / "out"
    with pytest.raises(RunError, match="unbound is not installed"):
        compare(str(path), [STOCK], str(out))
    assert not (out / "runs").exists()


def test_the_domains_of_one_mx_host_must_agree_on_the_server(tmp_path):
    path = tmp_path / "mx.toml"
    path.write_text(_workload().replace('[destinations."d3.example"]\nlatency = 0.1\n'
                                        'server_limit = 5',
                                        '[destinations."d3.example"]\nlatency = 0.1\n'
                                        'server_limit = 6'))
    with pytest.raises(ScenarioError, match=r'line \d+: destinations."d3.example": its '
                                            r"server_limit \(6\)"):
        load_plan(str(path))


def _small_workload() -> str:
    """Two domains at one MX host, three messages each: the smallest that has a site."""
    lines = ['title = "Two domains at one MX host"', "seed = 3", "[compare]",
             "time_scale = 1", "timeout = 30", "[compare.main_cf]",
             'minimal_backoff_time = "1s"', 'maximal_backoff_time = "2s"',
             'queue_run_delay = "1s"']
    for d in LIMITED[:2]:
        lines += ["[[messages]]", "count = 3", f'destination = "{d}"',
                  f'[destinations."{d}"]', "latency = 0.02", "server_limit = 5",
                  'overload = "421"', f'mx = "{ONE}"']
    return "\n".join(lines) + "\n"


def _maillog_shows(instances: str, text: str, count: int) -> bool:
    found = 0
    for path in glob.glob(os.path.join(instances, "*", "maillog")):
        with open(path, errors="replace") as f:
            found += f.read().count(text)
    return found >= count


def test_with_the_dns_server_stopped_the_report_says_no_site_was_learnt(monkeypatch):
    """unbound is started as compare starts it, then stopped before any mail comes: the
    daemon's MX lookups fail (site_dns_timeout = 1s). Once both domains' failures are
    in the maillog the server is started again, so smtp(8) delivers on its next try
    and the run drains: a run whose figures look whole, but without sites. Its report
    leads with "learnt no site". PYQMGR_RECORD_DNS_STOPPED=DIR keeps the run's
    run.json and maillog (tests/data/compare-dns-stopped/ is one)."""
    made: list[dns.DnsServer] = []
    real_start = dns.DnsServer.start

    def start_then_stop(self: dns.DnsServer, timeout: float = 20) -> dns.DnsServer:
        real_start(self, timeout)
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(10)
        assert not self.query_ok(), "the DNS server still answers"
        made.append(self)
        return self

    monkeypatch.setattr(dns.DnsServer, "start", start_then_stop)
    base, instances = _base_dir(), _base_dir()
    failures: list[BaseException] = []

    def back_up_after_the_failures() -> None:
        try:
            deadline = time.monotonic() + 30
            while not (made and _maillog_shows(instances, "MX lookup failed", 2)):
                if time.monotonic() > deadline:
                    raise TimeoutError("no two 'MX lookup failed' lines within 30 s")
                time.sleep(0.1)
            real_start(made[0])
        except BaseException as exc:  # noqa: BLE001 - said by the test below
            failures.append(exc)

    watcher = threading.Thread(target=back_up_after_the_failures, daemon=True)
    try:
        path = os.path.join(base, "small.toml")
        with open(path, "w") as f:
            f.write(_small_workload())
        out = os.path.join(base, "out")
        watcher.start()
        report = compare(path, [SITES + ",site_dns_timeout=1s"], out, base_dir=instances)
        watcher.join(35)
        assert not failures, failures
        (label, run), = report["runs"].items()
        with open(os.path.join(out, "summary.md")) as f:
            summary = f.read()
        with open(os.path.join(out, "report.html")) as f:
            page = f.read()
        record = os.environ.get("PYQMGR_RECORD_DNS_STOPPED")
        if record:
            os.makedirs(record, exist_ok=True)
            for name in ("run.json", "maillog"):
                shutil.copy(os.path.join(out, run["run_dir"], name), record)
    finally:
        for server in made:
            server.stop()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(instances, ignore_errors=True)
    print(f"\nDNS server stopped for the lookups: {report['differences']}")
    assert run["drained"] and run["sent"] == 6, (run["drained"], run["sent"])
    lead = (f"{label} learnt no site: 2 of 2 MX lookups failed (first: d")
    assert report["differences"][0].startswith(lead), report["differences"]
    assert "timeout after 1s" in report["differences"][0]
    assert report["differences"][0].endswith("the comparison does not show sites")
    assert summary.split("## Differences that matter\n\n", 1)[1].startswith(f"- {lead}")
    assert page.split("<ul class=diffs>", 1)[1].startswith("<li class=missed>"
                                                            + lead.replace("'", "&#x27;"))
