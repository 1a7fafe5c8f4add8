"""``pyqmgr replay --sites``: sites learnt from a log's relay= servers (issue #33).

tests/data/replay-sites-run1.log.gz is a maillog real Postfix wrote (Debian's
Postfix, the test bed's stock qmgr; made by ``record`` below, with
PYQMGR_RECORD_SITES_LOG=PATH set for ``test_a_fresh_real_log``): three domains
routed to one sink (``smtp:[127.0.0.1]:PORT``), a fourth to a sink of its own, and
two to a port nobody listens on (``relay=none``, ``connect to 127.0.0.1[127.0.0.1]:
PORT: Connection refused``). ``--sites`` must make the three one server, the two
that never connected another, and leave everything else as a replay without it has
it; without ``--sites`` the output is as before (no ``mx`` anywhere).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from pyqmgr.replay.sites import (
    CACHE,
    HOSTS_KEPT,
    Relays,
    connect_host,
    group,
    nexthop_host,
    relay_host,
)
from pyqmgr.simulator import load, simulate

HERE = os.path.dirname(os.path.abspath(__file__))
LOG = os.path.join(HERE, "data", "replay-sites-run1.log.gz")
PYQMGR = [sys.executable, "-c", "import sys; from pyqmgr.cli import main; sys.exit(main())"]
SHARED = ("a.test", "b.test", "c.test")
ALONE = "d.test"
DOWN = ("down1.test", "down2.test")


# -- the relay= field ------------------------------------------------------------------

@pytest.mark.parametrize("relay, host", [
    ("mx1.example.net[192.0.2.1]:25", "mx1.example.net"),
    ("MX1.Example.NET.[192.0.2.1]:25", "mx1.example.net"),
    # A name's port is not its server's: MX records name hosts only.
    ("mx1.example.net[192.0.2.1]:2525", "mx1.example.net"),
    ("mx1.example.net[192.0.2.1]", "mx1.example.net"),
    ("mx[2001:db8::1]:25", "mx"),
    ("mx.example[2001:DB8:0:0::1]:587", "mx.example"),
    # Addresses, localhost, loopback: the address and the port.
    ("127.0.0.1[127.0.0.1]:2525", "127.0.0.1:2525"),
    ("127.0.0.1[127.0.0.1]", "127.0.0.1:25"),
    ("localhost[127.0.0.1]:10024", "127.0.0.1:10024"),
    ("localhost.localdomain[127.0.0.1]:10025", "127.0.0.1:10025"),
    ("mx.site.test[127.0.0.1]:40001", "127.0.0.1:40001"),
    ("localhost[::1]:10024", "[::1]:10024"),
    ("2001:db8::7[2001:db8::7]:25", "[2001:db8::7]:25"),
    ("192.0.2.9[192.0.2.9]:25", "192.0.2.9:25"),
    # Anonymised or odd addresses behind a name: the name still says the server.
    ("mx.its.monash.info[130.194.11.1.123]:25", "mx.its.monash.info"),
])
def test_relay_host(relay: str, host: str) -> None:
    assert relay_host(relay) == host


@pytest.mark.parametrize("relay", [
    "none", "local", "virtual", "dovecot", "", "[]", "[192.0.2.1]:25",
    "mx.example",                        # no brackets
    "mx.example[192.0.2.1",              # a bracket missing
    "mx.example192.0.2.1]:25",
    "mx.example[192.0.2.1]:",            # a port missing
    "mx.example[192.0.2.1]:25 garbage",  # garbage after the field
    "mx.example[192.0.2.1]:25:25",
    "mx.example[192.0.2.1]:99999",       # no such port
    "mx.example[192.0.2.1]:0",
    "mx.example[private/dovecot-lmtp]",  # lmtp over a unix socket: no network server
    "mx..example[192.0.2.1]:25",         # an empty label
    "-mx.example[192.0.2.1]:25",
    "mx exa mple[192.0.2.1]:25",
    "mx.example[[192.0.2.1]]:25",
    "127.0.0.1[garbage]:25",             # an address name needs its address
    "localhost[not-an-address]:25",
    "mx:x.example[192.0.2.1]:25",        # a colon in a name that is no address
    "mx.example[192.0.2.1%eth0]:25",
    "\x00mx.example[192.0.2.1]:25",
    "mx.\u00e9xample[192.0.2.1]:25",
    "a" * 64 + ".example[192.0.2.1]:25",  # a label longer than DNS allows
    ".".join(["a" * 60] * 5) + "[192.0.2.1]:25",  # a name longer than DNS allows
    "m" * 100_000 + "[192.0.2.1]:25",
    "mx.example[" + "1" * 100_000 + "]:25",
])
def test_relay_host_refuses_what_names_no_server(relay: str) -> None:
    assert relay_host(relay) is None


def test_connect_host_reads_failed_connections() -> None:
    assert connect_host("connect to mx.example[192.0.2.1]:25: Connection refused") == \
        "mx.example"
    assert connect_host("connect to 127.0.0.1[127.0.0.1]:41000: Connection refused") == \
        "127.0.0.1:41000"
    assert connect_host("connect to mx[2001:db8::1]:25: Connection timed out") == "mx"
    for text in ("Host or domain name not found. Name service error for name=x.example "
                 "type=MX: Host not found, try again",
                 "connect to mx.example: Connection refused",
                 "connect to mx.example[192.0.2.1]:25 Connection refused",
                 "connect to " + "m" * 10_000 + "[192.0.2.1]:25: Connection refused",
                 "delivery temporarily suspended: connect to mx.example[192.0.2.1]:25: "
                 "Connection refused"):
        assert connect_host(text) is None, text


def test_nexthop_host_keys_a_content_filter_as_its_deliveries() -> None:
    assert nexthop_host("[127.0.0.1]:10024") == relay_host("localhost[127.0.0.1]:10024")
    assert nexthop_host("[::1]:10024") == relay_host("localhost[::1]:10024")
    assert nexthop_host("[mail.example]:587") == "mail.example"
    assert nexthop_host("example.org") is None


def test_relays_count_sessions_and_failed_connections_apart() -> None:
    r = Relays()
    r.seen("a.test", "127.0.0.1[127.0.0.1]:2525", "250 2.0.0 Ok")
    r.seen("a.test", "none", "connect to 127.0.0.1[127.0.0.1]:2526: Connection refused")
    r.seen("a.test", "none", "Host or domain name not found")
    r.seen("a.test", "mx.example[192.0.2.1", "cut short")
    r.seen("a.test", "private/dovecot-lmtp", "")
    assert r.tried == {"a.test": Counter({"127.0.0.1:2525": 1})}
    assert r.failed == {"a.test": Counter({"127.0.0.1:2526": 1})}
    assert r.unread == 2


def test_relays_stay_bounded() -> None:
    """A destination meeting a thousand servers keeps HOSTS_KEPT; a log naming ten
    thousand keeps at most CACHE keys remembered."""
    r = Relays()
    for i in range(10_000):
        r.seen("pool.test", f"mx{i}.pool.example[192.0.2.1]:25", "")
    assert len(r.tried["pool.test"]) == HOSTS_KEPT
    assert len(r._keys) <= CACHE
    r.seen("pool.test", "mx0.pool.example[192.0.2.1]:25", "")
    assert r.tried["pool.test"]["mx0.pool.example"] == 2


def _relays(tried: dict[str, dict[str, int]],
            failed: dict[str, dict[str, int]] | None = None) -> Relays:
    r = Relays()
    r.tried = {d: Counter(h) for d, h in tried.items()}
    r.failed = {d: Counter(h) for d, h in (failed or {}).items()}
    return r


def test_group_by_shared_servers() -> None:
    got = group(_relays({
        # mx1 and mx2 of one provider, used in turns: one group, named by its busiest.
        "p1.test": {"mx1.p.example": 6, "mx2.p.example": 4},
        "p2.test": {"mx2.p.example": 7, "mx1.p.example": 3},
        "p3.test": {"mx2.p.example": 1},
        # A backup MX met once in fifty tries does not join its group to the backup's.
        "q1.test": {"mx.q.example": 49, "backup.example": 1},
        "r1.test": {"backup.example": 5},
        # Only failed connections: grouped by the server it could not reach.
        "down.test": {},
    }, {"down.test": {"mx.q.example": 3}, "p1.test": {"dead.example": 9}}))
    # mx2 took 12 of the group's tries, mx1 9.
    assert got == {"p1.test": "mx2.p.example", "p2.test": "mx2.p.example",
                   "p3.test": "mx2.p.example", "q1.test": "mx.q.example",
                   "r1.test": "backup.example", "down.test": "mx.q.example"}


def test_group_leaves_content_filters_out() -> None:
    got = group(_relays({"a.test": {"127.0.0.1:10024": 3},
                         "b.test": {"127.0.0.1:10024": 1, "mx.b.example": 1}}),
                {"127.0.0.1:10024"})
    assert got == {"b.test": "mx.b.example"}


# -- a maillog real Postfix wrote ------------------------------------------------------

def record(postfix_instance: Any, sink: Any, out: Path) -> str:
    """A maillog of real Postfix (stock qmgr): three domains at one sink, one at a sink
    of its own, two at a port nobody listens on; each message tried once."""
    from pyqmgr.testbed.instance_base import free_port

    shared, alone, closed = sink(latency=0.02), sink(latency=0.02), free_port()
    transports = {d: f"smtp:[127.0.0.1]:{shared.port}" for d in SHARED}
    transports[ALONE] = f"smtp:[127.0.0.1]:{alone.port}"
    transports.update({d: f"smtp:[127.0.0.1]:{closed}" for d in DOWN})
    pf = postfix_instance(qmgr="stock", transports=transports,
                          main_cf={"minimal_backoff_time": "3600s",
                                   "maximal_backoff_time": "3600s"})
    domains = [*SHARED, ALONE, *DOWN]
    n = 5 * len(domains)
    pf.smtp_send([("s@sender.example", [f"r{i}@{domains[i % len(domains)]}"])
                  for i in range(n)])

    def tried() -> int:
        return len([ln for ln in pf.maillog.lines()
                    if re.search(r"status=(sent|deferred)", ln.text)])
    pf.wait_until(lambda: tried() >= n, 60, f"{n} recipients tried once")
    pf.stop()
    path = out / "maillog.gz"
    with open(pf.maillog_path, "rb") as f, gzip.open(path, "wb") as g:
        g.write(f.read())
    return str(path)


def replay(log: str, tmp: Path, *args: str) -> tuple[dict[str, Any], str, str]:
    """The JSON report, the workload.toml and arrivals.csv it wrote."""
    wl = tmp / ("wl" + "".join(a.strip("-") for a in args))
    proc = subprocess.run([*PYQMGR, "replay", log, "--json", "--runs", "1", "--hash-key",
                           "k", "--write-workload", str(wl), *args],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return (json.loads(proc.stdout), (wl / "workload.toml").read_text(),
            (wl / "arrivals.csv").read_text())


def _sinks(log: str) -> dict[str, set[str]]:
    """Each domain's relay= (or failed connection) in the log, as a grep sees it."""
    out: dict[str, set[str]] = {}
    with gzip.open(log, "rt") as f:
        for line in f:
            m = re.search(r"to=<[^@>]*@([^>]*)>, relay=([^,]*),.*?status=\w+ \((.*)\)$",
                          line)
            if m is not None:
                text = m[3].removeprefix("delivery temporarily suspended: ")
                where = m[2] if m[2] != "none" else text.split(": ")[0]
                out.setdefault(m[1], set()).add(where)
    return out


def check(log: str, tmp: Path) -> None:
    sinks = _sinks(log)
    # The log is what the test is about: three domains at one sink, one at another.
    assert len({s for d in SHARED for s in sinks[d]}) == 1, sinks
    assert sinks[ALONE].isdisjoint(sinks[SHARED[0]]), sinks
    assert all(s.startswith("connect to 127.0.0.1[127.0.0.1]:") for d in DOWN
               for s in sinks[d]), sinks
    port = next(iter(sinks[SHARED[0]])).rpartition(":")[2]

    plain, plain_toml, plain_csv = replay(log, tmp)
    sites, sites_toml, sites_csv = replay(log, tmp, "--sites")
    # Without --sites: no server named anywhere, and the report has no sites.
    assert "mx =" not in plain_toml
    [inst] = plain["instances"]
    assert "sites" not in inst
    assert not any("--sites" in n for n in inst["notes"])
    # With it: the three are one server, keyed by address and port.
    [inst_sites] = sites["instances"]
    by_server = inst_sites["sites"]
    assert by_server[f"127.0.0.1:{port}"] == list(SHARED)
    assert len(by_server) == 3, by_server
    [(down_server, down)] = [(h, d) for h, d in by_server.items() if DOWN[0] in d]
    assert down == list(DOWN) and down_server not in (f"127.0.0.1:{port}",)
    assert [h for h, d in by_server.items() if d == [ALONE]] != []
    wl = tomllib.loads(sites_toml)
    assert {d: wl["destinations"][d].get("mx") for d in SHARED} == {
        d: f"127.0.0.1:{port}" for d in SHARED}
    # Everything else is as the replay without --sites has it.
    assert sites_csv == plain_csv
    assert re.sub(r'\nmx = "[^"\n]*"', "", sites_toml) == plain_toml
    assert inst_sites["figures"]["log"] == inst["figures"]["log"]
    assert inst_sites["figures"]["stock"] == inst["figures"]["stock"]
    assert [n for n in inst_sites["notes"] if "--sites" not in n] == inst["notes"]
    # A replay with site_grouping sees the three as one site: at most one delivery
    # in flight over all three with a site limit of one, where they had three.
    sc = load(str(tmp / "wlsites" / "workload.toml"))
    sc.pyqmgr_cf = {"scheduler_policy": "nqmgr", "site_grouping": "mx",
                    "site_concurrency_limit": "1"}
    assert _peak(simulate(sc, seed=1, record=True), SHARED) == 1
    sc.pyqmgr_cf = {"scheduler_policy": "nqmgr"}
    assert _peak(simulate(sc, seed=1, record=True), SHARED) > 1


def _peak(res: Any, dests: tuple[str, ...]) -> int:
    """The most deliveries in flight at once to any of ``dests``."""
    events = sorted((t, step) for d in res.deliveries if d.destination in dests
                    for t, step in ((d.start, 1), (d.end, -1)))
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def test_a_recorded_real_log(tmp_path: Path) -> None:
    check(LOG, tmp_path)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("postfix") is None,
                    reason="needs root and Debian's postfix package")
def test_a_fresh_real_log(postfix_instance: Any, sink: Any, tmp_path: Path) -> None:
    log = record(postfix_instance, sink, tmp_path)
    keep = os.environ.get("PYQMGR_RECORD_SITES_LOG")
    if keep:
        shutil.copyfile(log, keep)
    check(log, tmp_path)


# -- what is never grouped, and a shared server's limit ----------------------------------

def _line(t: str, qid: str, rcpt: str, relay: str, tail: str, prog: str = "smtp") -> str:
    return (f"Nov 24 00:00:{t} mx postfix/{prog}[200]: {qid}: to=<{rcpt}>, relay={relay}, "
            f"delay=0.5, delays=0/0/0.1/0.4, dsn=2.0.0, status=sent ({tail})")


def _message(t: str, qid: str, rcpt: str, relay: str, tail: str = "250 2.0.0 Ok",
             prog: str = "smtp") -> list[str]:
    return [f"Nov 24 00:00:{t} mx postfix/smtpd[100]: {qid}: client=c.example[192.0.2.1]",
            f"Nov 24 00:00:{t} mx postfix/qmgr[102]: {qid}: from=<a@b.example>, size=100, "
            "nrcpt=1 (queue active)",
            _line(t, qid, rcpt, relay, tail, prog),
            f"Nov 24 00:00:{t} mx postfix/qmgr[102]: {qid}: removed"]


def _derived(tmp: Path, lines: list[str], relayhost: str = "") -> Any:
    from pyqmgr.replay import Options, derive

    path = tmp / "mail.log"
    path.write_text("".join(x + "\n" for x in lines))
    main_cf = {"relayhost": relayhost} if relayhost else {}
    _, instances = derive([str(path)], Options([], main_cf, year=2026, sites=True))
    [derived] = instances.values()
    return derived


def test_relayhost_mail_and_local_delivery_are_never_grouped(tmp_path: Path) -> None:
    lines = (_message("01", "AAAAA1", "x@one.test", "smtp.relay.example[192.0.2.5]:587")
             + _message("02", "AAAAA2", "y@two.test", "smtp.relay.example[192.0.2.5]:587")
             + _message("03", "AAAAA3", "z@here.test", "local", "delivered to mailbox",
                        "local"))
    derived = _derived(tmp_path, lines, "[smtp.relay.example]:587")
    assert derived.relays.tried == {} and derived.relays.failed == {}
    derived = _derived(tmp_path, lines)
    assert set(derived.relays.tried) == {"one.test", "two.test"}


def test_a_content_filter_is_no_site(tmp_path: Path) -> None:
    """amavis at 127.0.0.1:10024 re-injecting: the hop to it is a bracketed next hop,
    and its server groups no domain even where a try to it was a domain's own."""
    from pyqmgr.replay.workload import build, sites_of

    lines = [
        "Nov 24 00:00:01 mx postfix/smtpd[100]: BBBBB1: client=c.example[192.0.2.1]",
        "Nov 24 00:00:01 mx postfix/qmgr[102]: BBBBB1: from=<a@b.example>, size=100, "
        "nrcpt=1 (queue active)",
        "Nov 24 00:00:02 mx postfix/smtpd[110]: BBBBB2: client=localhost[127.0.0.1]",
        "Nov 24 00:00:02 mx postfix/qmgr[102]: BBBBB2: from=<a@b.example>, size=100, "
        "nrcpt=1 (queue active)",
        _line("02", "BBBBB1", "x@one.test", "127.0.0.1[127.0.0.1]:10024",
              "250 2.0.0 Ok: queued as BBBBB2"),
        "Nov 24 00:00:02 mx postfix/qmgr[102]: BBBBB1: removed",
        _line("03", "BBBBB2", "x@one.test", "mx.one.example[192.0.2.7]:25", "250 Ok"),
        "Nov 24 00:00:03 mx postfix/qmgr[102]: BBBBB2: removed",
        *_message("04", "BBBBB3", "y@two.test", "127.0.0.1[127.0.0.1]:10024", "250 Ok"),
    ]
    derived = _derived(tmp_path, lines)
    sc, _, _ = build(derived, {}, {})
    assert sites_of(sc) == {"mx.one.example": ["one.test"]}


def test_a_shared_servers_limit_is_read_off_all_its_destinations(tmp_path: Path) -> None:
    """Two domains at one server of 2 sessions, each with one session at a time and
    the 421s: the limit's first guess is the server's 2, not each domain's 1."""
    from pyqmgr.replay.workload import build

    lines: list[str] = []
    for i in range(10):
        t = f"{10 + 2 * i:02d}"
        for j, dom in enumerate(("one.test", "two.test")):
            qid = f"CCCC{i}{j}"
            lines += [f"Nov 24 00:00:{t} mx postfix/smtpd[100]: {qid}: client=c[192.0.2.1]",
                      f"Nov 24 00:00:{t} mx postfix/qmgr[102]: {qid}: from=<a@b.example>, "
                      "size=100, nrcpt=2 (queue active)",
                      f"Nov 24 00:00:{t} mx postfix/smtp[20{j}]: {qid}: to=<r@{dom}>, "
                      "relay=mx.shared.example[192.0.2.9]:25, delay=1.9, "
                      "delays=0/0/0.1/1.8, dsn=2.0.0, status=sent (250 Ok)",
                      f"Nov 24 00:00:{t} mx postfix/smtp[30{j}]: {qid}: to=<s@{dom}>, "
                      "relay=mx.shared.example[192.0.2.9]:25, delay=0.1, "
                      "delays=0/0/0.1/0, dsn=4.7.0, status=deferred (host mx.shared.example"
                      "[192.0.2.9] refused to talk to me: 421 4.7.0 too many connections)",
                      f"Nov 24 00:00:{t} mx postfix/qmgr[102]: {qid}: removed"]
    derived = _derived(tmp_path, lines)
    # Only the first guess matters here: the fit is the existing calibration's.
    from pyqmgr.replay import workload

    guesses: dict[str, int] = {}

    def first_guess(sc: Any, name: str, key: str, estimate: int, obs: Any) -> Any:
        guesses[name] = estimate
        return estimate, False
    real = workload.calibrate
    workload.calibrate = first_guess  # type: ignore[assignment]
    try:
        sc, _, _ = build(derived, {}, {})
    finally:
        workload.calibrate = real  # type: ignore[assignment]
    assert guesses == {"one.test": 2, "two.test": 2}
    assert {d.mx for d in sc.destinations.values()} == {"mx.shared.example"}
