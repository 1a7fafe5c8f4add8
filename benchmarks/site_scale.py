"""A provider's site at scale on real Postfix (issue #44): qmgr's CPU a message.

``./dev bench sitescale``: one provider MX (an SMTP sink taking 10 sessions, 20 ms a
message, 421 beyond) behind the MX records of 30 and of 3,000 domains, served by
unbound on loopback; 1,000 and 10,000 one-recipient messages spread over the domains
and queued at once (copies of real queue files, as the drain benchmark's). Each cell
runs on a fresh instance:

* **sites**: pyqmgr with ``site_grouping = mx`` and ``site_concurrency_limit = 10``:
  the share deferred on the first try, the sessions the sink refused, and qmgr's CPU
  a message;
* **off**: the same mail, pyqmgr without pyqmgr.cf and a sink without a limit: the
  CPU a message of the same work with no site to keep.

Cells run one after another, each alone on the machine: two at once (tried) took
every core, the lookups of 3,000 new domains fell behind their 200 ms wait and 57 of
10,000 sessions were refused, where alone none ever was. A cell of 1,000 messages
(8 s) runs ``REPEATS`` times and counts its least CPU, as the decisions benchmark
does: another process only ever adds to a run's cost, and one short run alone varied
by 15%. A 10,000-message cell (80 s with sites) runs once, its sites-off cell (15 s)
just before and just after it, their mean counted: the machine's speed drifts by more
than the bars' margins within the hour.

Before #44 a site at its limit closed and opened at every delivery by walking every
member domain: 0.6 ms a message with 1,000 queued, 1.7 ms with 10,000, against
0.34-0.37 ms with sites off, and 3,000 domains 55-79% more than 30.

qmgr's CPU is counted from its first ``(queue active)`` line, the first message it
read (start-up apart: it is the same in every cell), until every message was tried
once (a deferred one waits an hour, so a deferral is counted, not retried), from
``/proc/PID/schedstat``. Until 2026-11-29 it was counted from the first ``removed``
line, as the drain benchmark counts: that left out what qmgr does before its first
delivery ends, at a 10-session site about 80 ms in which it reads a few hundred
messages: 0.12-0.14 ms a message of a 1,000-message cell, a tenth of that of a
10,000-message one, so the small cells looked cheaper than they were and the bar
across queue sizes measured the bias (1.30-1.35x counted from the first removal, the
same runs 0.95-1.09x counted from the first read). With
sites the MX lookups run in a helper process (daemon/site_lookupd.py), whose CPU
over the same span is counted and printed beside qmgr's with their sum: the bars
are the issue's, on qmgr's CPU, and the sum says what the lookups still cost.

Targets (a miss exits 1): with sites, under 1% deferred and no session refused in
every cell, and the issue's three CPU bars: within ``SPREAD`` times from 1,000 to
10,000 queued at each domain count (before #44: 0.6 ms to 1.7 ms, 2.8x), within
``SPREAD`` times across 30 and 3,000 domains (each new domain costs one MX lookup,
the helper's, and qmgr a line written and one read, and a queue and its site made and
dropped: 1,000 messages to 1,000 domains pay them once a message), and within
``OFF_RATIO`` times the same mail with sites off (whose sink takes a hundred sessions
at once, so that qmgr handles several replies a turn of its loop where a 10-session
site hands it one: most of the difference is that pacing, not the site's books;
``--paced`` measures it). They were goals until the start of the count moved to the
first read (above); measured since: 0.95-1.12x, 1.18-1.20x and 1.38-1.45x. The first
and the third fail the run when missed; the one across domains is still a goal
(benchmarks/target.py, ``sitescale-domains``): a clean clone's CI measured 1.20x, a
hair over its bar, where a run beside other work had 1.18x.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

from benchmarks.drain import LogTail, schedstat
from benchmarks.target import Target, status
from pyqmgr.testbed import dns
from pyqmgr.testbed.instance import PostfixInstance, wait_until
from pyqmgr.testbed.sink import SinkServer

SESSIONS = 10
#: Seconds the sink takes a message (at RCPT).
LATENCY = 0.02
DOMAINS = (30, 3_000)
QUEUED = (1_000, 10_000)
#: The most the CPU a message may differ across the cells with sites (largest over
#: smallest), and against the same mail with sites off.
SPREAD = 1.2
OFF_RATIO = 1.5
MX = "mx.provider.test"
DEFERRED = Target(f"pyqmgr with sites defers under 1% of the mail to one MX of {SESSIONS} "
                  "sessions, every cell")
REFUSED = Target(f"the MX of {SESSIONS} sessions refuses no session of pyqmgr with sites, "
                 "every cell")
FLAT = Target(f"qmgr's CPU a message with sites within {SPREAD}x from "
              f"{' to '.join(f'{q:,}' for q in QUEUED)} queued, at each domain count")
ACROSS = Target(f"qmgr's CPU a message with sites within {SPREAD}x across "
                f"{' and '.join(f'{d:,}' for d in DOMAINS)} domains",
                goal="sitescale-domains")
NEAR_OFF = Target(f"qmgr's CPU a message with sites within {OFF_RATIO}x of the same mail "
                  "with sites off, every cell")
#: Runs of a cell of at most 1,000 messages; its least CPU a message counts.
REPEATS = 3


@dataclass
class Cell:
    sent: int
    deferred: int
    refused: int
    peak: int
    #: qmgr's CPU seconds a message from its first message read.
    cpu: float
    took: float
    #: The MX lookup helper's CPU seconds a message over the same span (0: no helper).
    helper: float = 0.0


class FirstRead(LogTail):
    """Watches the maillog's new lines, from where the file ended at the release, for
    the qmgr's first message into the active queue (its ``(queue active)`` line)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, os.path.getsize(path))

    def seen(self) -> bool:
        return any(b"postfix/qmgr[" in ln and ln.endswith(b"(queue active)")
                   for ln in self.new_lines())


class Tried(LogTail):
    """Counts the smtp delivery attempts' status lines as the maillog grows."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.sent = self.deferred = 0

    def count(self) -> int:
        for ln in self.new_lines():
            if b"postfix/smtp[" in ln:
                self.sent += b"status=sent" in ln
                self.deferred += b"status=deferred" in ln
        return self.sent + self.deferred


def templates(domains: list[str], port: int) -> list[bytes]:
    """One real queue file a domain, as smtpd and cleanup wrote them."""
    with PostfixInstance(qmgr="stock", transports=_transports(domains, port)) as pf:
        pf.start()
        pf.preload(len(domains), recipients=lambda i: [f"r{i}@{domains[i]}"])
        files = pf.queue_file_bytes("incoming")
    if len(files) != len(domains):
        raise RuntimeError(f"{len(files)} queue files for {len(domains)} messages preloaded")
    return files


def _transports(domains: list[str], port: int) -> dict[str, str]:
    # smtp(8) looks the MX records up (a next hop without brackets), at the sink's port.
    return {d: f"smtp:{d}:{port}" for d in domains}


@contextlib.contextmanager
def _sink(limit: int) -> Iterator[SinkServer]:
    sink = SinkServer(latency=LATENCY, client_limit=limit)
    sink.start()
    try:
        yield sink
    finally:
        sink.stop()


def cell(server: dns.DnsServer, domains: list[str], files: list[bytes], n: int,
         sites: bool, profile: str = "", paced: bool = False) -> Cell:
    """One run: ``n`` messages over ``domains``, sites on (a limited sink) or off; off
    and ``paced``, the limited sink and every service at 10 processes (stock's way to
    hold one MX at 10 sessions), so that only the site's bookkeeping differs."""
    with _sink(SESSIONS if sites or paced else 0) as sink:
        cf = {"site_grouping": "mx", "site_concurrency_limit": str(SESSIONS)} if sites \
            else None
        with PostfixInstance(
                qmgr="pyqmgr", pyqmgr_cf=cf, transports=_transports(domains, sink.port),
                main_cf={"smtp_host_lookup": "dns", "minimal_backoff_time": "3600s",
                         "maximal_backoff_time": "3600s",
                         # Cached sessions count at the sink but not at a site
                         # (docs/sites.md): off, as in the sites benchmark.
                         "smtp_connection_cache_on_demand": "no",
                         # smtp(8) waits for QUIT's reply, so that a session has ended
                         # at the sink when qmgr hears the delivery ended: by default
                         # it closes at once, the sink (a thread of this process)
                         # may read the close after the next session's connect, and
                         # 1 in 10,000 sessions was refused as one too many. The site
                         # keeps such a race small (site.QUIT_GRACE); this run holds
                         # the limit itself, the sink's timing apart.
                         "smtp_skip_quit_response": "no",
                         **({"default_process_limit": str(SESSIONS)} if paced else {}),
                         **_profiled(profile)}) as pf:
            pf.start(prefix=server.start_prefix())
            pf.disable_qmgr()
            pf.clone_queue_files(files, n)
            first = FirstRead(pf.maillog_path)
            tried = Tried(pf.maillog_path)
            began = time.monotonic()
            pf.release_preload()
            pid = pf.qmgr_pid()
            at_first: list[float] = []

            found: list[int] = []

            def helped() -> bool:
                found[:] = helper_pid(pid)
                return bool(found)

            if sites:  # spawned at qmgr's start-up, perhaps not yet
                wait_until(helped, 10, f"qmgr {pid}'s MX lookup helper", interval=0.01)
            helper = found[0] if found else 0

            def cpus() -> tuple[float, float]:
                return schedstat(pid)[0], schedstat(helper)[0] if helper else 0.0

            def started() -> bool:
                if first.seen():
                    at_first[:] = cpus()
                    return True
                return False

            wait_until(started, 60, "the first message read into the active queue",
                       interval=0.005)
            wait_until(lambda: tried.count() >= n, 600, f"{n} messages tried once",
                       interval=0.05)
            now = cpus()
            cpu, helper_cpu = now[0] - at_first[0], now[1] - at_first[1]
            took = time.monotonic() - began
    st = sink.snapshot()
    return Cell(tried.sent, tried.deferred, st.rejected_421, st.max_concurrent, cpu / n,
                took, helper_cpu / n)


def helper_pid(qmgr: int) -> list[int]:
    """The qmgr's MX lookup helper (daemon/site_lookupd.py): its child that runs
    Python with that module, if it has one yet."""
    with open(f"/proc/{qmgr}/task/{qmgr}/children") as f:
        children = [int(p) for p in f.read().split()]
    for child in children:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"site_lookupd" in f.read():
                    return [child]
        except OSError:
            continue
    return []


def _profiled(path: str) -> dict[str, str]:
    """main.cf's import_environment that hands qmgr PYQMGR_PROFILE (daemon/startup.py)."""
    if not path:
        return {}
    return {"import_environment": "MAIL_CONFIG MAIL_DEBUG MAIL_LOGTAG TZ XAUTHORITY "
                                  "DISPLAY LANG=C POSTLOG_SERVICE POSTLOG_HOSTNAME "
                                  f"PYQMGR_PROFILE={path}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="./dev bench sitescale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--domains", type=int, nargs="+", default=list(DOMAINS),
                    help="domain counts (default: %(default)s)")
    ap.add_argument("--queued", type=int, nargs="+", default=list(QUEUED),
                    help="messages queued at once (default: %(default)s)")
    ap.add_argument("--profile", metavar="DIR", default="",
                    help="write each sites-on run's cProfile stats of qmgr into DIR "
                         "(DOMAINS-QUEUED.prof), for finding where the time goes")
    ap.add_argument("--paced", action="store_true",
                    help="also run each cell with sites off, the same 10-session sink and "
                         "default_process_limit = 10 (printed, no target): what the site's "
                         "own bookkeeping costs against the same pacing")
    args = ap.parse_args(argv)
    if not dns.available():
        print("./dev bench sitescale: unbound is not installed (./dev installs it)")
        return 1
    most = max(args.domains)
    every = [f"d{i}.test" for i in range(most)]
    records = [f"{MX}. 300 IN A 127.0.0.1",
               *[f"{d}. 300 IN MX 10 {MX}." for d in every]]
    on: dict[tuple[int, int], Cell] = {}
    off: dict[tuple[int, int], Cell] = {}
    with dns.DnsServer(["test"], records) as server:
        for count in args.domains:
            files = templates(every[:count], 25)
            for n in args.queued:
                if args.paced:
                    p = min((cell(server, every[:count], files, n, False, paced=True)
                             for _ in range(REPEATS if n <= 1000 else 1)),
                            key=lambda r: r.cpu)
                    print(f"{count:>5,} domains, {n:>6,} queued, sites off, paced at "
                          f"{SESSIONS}: {p.cpu * 1e3:.3f} ms qmgr CPU a message, "
                          f"{p.deferred} deferred, {p.refused} sessions refused", flush=True)
                # A long cell runs once, its sites-off cell just before and just after
                # it (ABA): the machine's speed drifts over minutes (a clean clone's
                # CI, 2026-11-30: 1.52x on/off at 30 domains and 10,000 queued, where
                # the run before had 1.38x), and the mean of the two brackets it.
                before = [cell(server, every[:count], files, n, False)] if n > 1000 else []
                for sites, into in ((True, on), (False, off)):
                    runs = [cell(server, every[:count], files, n, sites,
                                 f"{args.profile}/{count}-{n}.prof"
                                 if args.profile and sites else "")
                            for _ in range(REPEATS if n <= 1000 else 1)]
                    if before and not sites:
                        runs = before + runs
                        counted = replace(runs[0], cpu=sum(r.cpu for r in runs) / len(runs))
                    else:
                        # The least CPU counts; every run's deferrals and refusals do.
                        counted = min(runs, key=lambda r: r.cpu)
                    c = into[(count, n)] = replace(
                        counted,
                        deferred=max(r.deferred for r in runs),
                        refused=sum(r.refused for r in runs),
                        peak=max(r.peak for r in runs))
                    also = (f" ({'mean' if before and not sites else 'least'} of "
                            f"{', '.join(f'{r.cpu * 1e3:.3f}' for r in runs)})"
                            if len(runs) > 1 else "")
                    helped = (f" + {c.helper * 1e3:.3f} ms the lookup helper's = "
                              f"{(c.cpu + c.helper) * 1e3:.3f} ms" if sites else "")
                    print(f"{count:>5,} domains, {n:>6,} queued, sites "
                          f"{'on ' if sites else 'off'}: {c.cpu * 1e3:.3f} ms qmgr CPU a "
                          f"message{also}{helped}, {c.deferred} deferred "
                          f"({c.deferred / n:.1%}), "
                          f"{c.refused} sessions refused, peak {c.peak} at once, "
                          f"{c.took:.1f} s", flush=True)
    return status(check(on, off))


def check(on: dict[tuple[int, int], Cell], off: dict[tuple[int, int], Cell]) -> list[bool]:
    """The targets against the cells, keyed by (domains, queued)."""
    worst_deferred = max(on, key=lambda k: on[k].deferred / k[1])
    refused = sum(c.refused for c in on.values())
    counts = sorted({k[0] for k in on})
    sizes = sorted({k[1] for k in on})

    def name(k: tuple[int, int]) -> str:
        return f"{k[0]:,} domains, {k[1]:,} queued"

    def spread(keys: list[tuple[int, int]]) -> tuple[float, str]:
        hi = max(keys, key=lambda k: on[k].cpu)
        lo = min(keys, key=lambda k: on[k].cpu)
        return on[hi].cpu / on[lo].cpu, (f"{on[hi].cpu * 1e3:.3f} ms ({name(hi)}) against "
                                          f"{on[lo].cpu * 1e3:.3f} ({name(lo)})")

    by_size = [spread([(d, q) for q in sizes]) for d in counts]
    by_count = [spread([(d, q) for d in counts]) for q in sizes]
    size_worst = max(by_size)
    count_worst = max(by_count)
    ratio = {k: on[k].cpu / off[k].cpu for k in on}
    worst = max(ratio, key=ratio.__getitem__)
    if len(counts) > 1:
        # The same spread with sites off (a figure, no bar): the part of the across-
        # domains bar that is the mail and the machine, not a site's new domain.
        for q in sizes:
            lo, hi = off[(counts[0], q)].cpu, off[(counts[-1], q)].cpu
            with_sites = on[(counts[-1], q)].cpu / on[(counts[0], q)].cpu
            print(f"figure: sites off, {q:,} queued: {counts[-1]:,} domains "
                  f"{hi * 1e3:.3f} ms against {counts[0]:,} domains {lo * 1e3:.3f} ms, "
                  f"{hi / lo:.2f}x (sites on {with_sites:.2f}x)", flush=True)
    return [
        DEFERRED.check(all(c.deferred < 0.01 * k[1] for k, c in on.items()),
                       f"at most {on[worst_deferred].deferred} of {worst_deferred[1]:,} "
                       f"({name(worst_deferred)})"),
        REFUSED.check(refused == 0, f"{refused} refused in all, peaks "
                      f"{max(c.peak for c in on.values())}"),
        FLAT.check(size_worst[0] <= SPREAD, f"at most {size_worst[0]:.2f}x: {size_worst[1]}"),
        ACROSS.check(count_worst[0] <= SPREAD,
                     f"at most {count_worst[0]:.2f}x: {count_worst[1]}"),
        NEAR_OFF.check(ratio[worst] <= OFF_RATIO,
                       f"at most {ratio[worst]:.2f}x ({name(worst)}: "
                       f"{on[worst].cpu * 1e3:.3f} against {off[worst].cpu * 1e3:.3f} ms)"),
    ]


if __name__ == "__main__":
    raise SystemExit(main())
