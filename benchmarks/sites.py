"""Sites side by side on real Postfix (issue #33): fifty domains at one server.

``./dev bench sites [--messages N] [--domains D]``: D domains (50) whose MX records,
served by unbound on loopback, all name one SMTP sink that takes 5 sessions and
answers 421 beyond; N one-recipient messages (2,000) spread over the domains,
preloaded into incoming/ and released at once. Postfix's own smtp(8) looks the MX
records up (next hop ``domain:PORT``). Connection caching is off: the server counts
an idle cached session as one of its five while a site's limit counts deliveries,
so with caching on a new delivery that does not find the idle session opens a sixth
(measured with caching on: 30 of 2,000 refused, 1.5%; docs/sites.md says so).

Three runs, each on a fresh instance, each until every message was tried once (a
deferred one waits an hour, so a deferral is counted, not retried):

* **capacity**: stock qmgr and all mail for one domain at that server with
  ``smtp_destination_concurrency_limit = 5``: one destination that fits the server,
  the rate at which it takes mail (first to last accepted message);
* **stock**: the D domains, stock qmgr: its deferral share and the sessions the
  server refused;
* **sites**: the D domains, pyqmgr with ``site_grouping = mx`` and
  ``site_concurrency_limit = 5``.

The targets are the issue's: pyqmgr with sites defers under 1%, the server never
sees more than 5 sessions at once (none refused), and pyqmgr delivers at least 90%
of the server's capacity as measured in the same run.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from benchmarks.target import Target, status
from pyqmgr.testbed import dns
from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.sink import SinkServer

SESSIONS = 5
#: Seconds the server takes a message (at RCPT).
LATENCY = 0.05
DEFERRED = Target("pyqmgr with sites defers under 1% of the messages to D domains at "
                  "one server of 5 sessions")
SEEN = Target("the server never sees more than 5 sessions at once from pyqmgr with "
              "sites (no session refused)")
CAPACITY = Target("pyqmgr with sites delivers at least 90% of the server's capacity "
                  "(one destination that fits it, under stock, in the same run)")


@dataclass
class Run:
    sent: int
    deferred: int
    refused: int
    peak: int
    rate: float
    took: float


def _tried(pf: PostfixInstance) -> tuple[int, int]:
    sent = deferred = 0
    for ln in pf.maillog.lines():
        if ".test>" in ln.text:
            sent += "status=sent" in ln.text
            deferred += "status=deferred" in ln.text
    return sent, deferred


def run(server: dns.DnsServer, qmgr: str, domains: list[str], n: int,
        pyqmgr_cf: dict[str, str] | None, limit: str = "20") -> Run:
    sink = SinkServer(latency=LATENCY, client_limit=SESSIONS)
    sink.start()
    try:
        with PostfixInstance(
                qmgr=qmgr, pyqmgr_cf=pyqmgr_cf,
                transports={d: f"smtp:{d}:{sink.port}" for d in domains},
                main_cf={"smtp_host_lookup": "dns", "minimal_backoff_time": "3600s",
                         "maximal_backoff_time": "3600s",
                         "smtp_connection_cache_on_demand": "no",
                         "smtp_destination_concurrency_limit": limit}) as pf:
            pf.start(prefix=server.start_prefix())
            pf.preload(n, recipients=lambda i: [f"r{i}@{domains[i % len(domains)]}"])
            began = time.monotonic()
            pf.release_preload()
            pf.wait_until(lambda: sum(_tried(pf)) >= n, 600,
                          f"{n} messages tried once")
            took = time.monotonic() - began
            sent, deferred = _tried(pf)
    finally:
        sink.stop()
    st = sink.snapshot()
    times = sorted(m.time for m in sink.messages())
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    return Run(sent, deferred, st.rejected_421, st.max_concurrent, rate, took)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="./dev bench sites", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--domains", type=int, default=50)
    args = ap.parse_args(argv)
    if not dns.available():
        print("./dev bench sites: unbound is not installed (./dev installs it)")
        return 1
    n = args.messages
    domains = [f"d{i}.test" for i in range(args.domains)]
    records = ["mx.site.test. 300 IN A 127.0.0.1", "one.test. 300 IN MX 10 mx.site.test.",
               *[f"{d}. 300 IN MX 10 mx.site.test." for d in domains]]
    with dns.DnsServer(["test"], records) as server:
        cap = run(server, "stock", ["one.test"], n, None, limit=str(SESSIONS))
        print(f"capacity: stock, one destination of {SESSIONS} sessions: {cap.sent} sent, "
              f"{cap.deferred} deferred, {cap.refused} sessions refused, "
              f"{cap.rate:.1f} messages a second ({cap.took:.1f} s)", flush=True)
        stock = run(server, "stock", domains, n, None)
        print(f"stock, {len(domains)} domains at one server: {stock.deferred / n:.1%} "
              f"deferred on the first try, {stock.refused} sessions refused, peak "
              f"{stock.peak} accepted at once, {stock.rate:.1f} messages a second "
              f"({stock.took:.1f} s)", flush=True)
        ours = run(server, "pyqmgr", domains, n,
                   {"site_grouping": "mx", "site_concurrency_limit": str(SESSIONS)})
        print(f"pyqmgr with sites: {ours.deferred / n:.1%} deferred, {ours.refused} "
              f"sessions refused, peak {ours.peak} accepted at once, {ours.rate:.1f} "
              f"messages a second, {ours.rate / cap.rate:.1%} of the capacity "
              f"({ours.took:.1f} s)", flush=True)
    return status([
        DEFERRED.check(ours.deferred < 0.01 * n, f"{ours.deferred} of {n}; stock "
                       f"{stock.deferred} ({stock.deferred / n:.1%})"),
        SEEN.check(ours.refused == 0, f"{ours.refused} refused, peak {ours.peak}; stock "
                   f"{stock.refused} refused"),
        CAPACITY.check(ours.rate >= 0.9 * cap.rate, f"{ours.rate:.1f} of {cap.rate:.1f} "
                       f"messages a second: {ours.rate / cap.rate:.1%}"),
    ])


if __name__ == "__main__":
    raise SystemExit(main())
