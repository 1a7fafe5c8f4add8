"""Drain benchmark: the same preloaded messages through discard, stock qmgr vs pyqmgr.

Each round preloads N one-recipient messages into incoming/ while no qmgr runs (copies
of the files one instance's smtpd and cleanup wrote, :func:`_templates`), then
starts the chosen qmgr and times from the reload until the last ``removed`` line's
file is gone. Each round runs every contender once, in rotating order, so all see the
same machine state; the ratio of the medians is reported.

A third contender, the *floor* (``benchmarks/floor_qmgr.py``), runs in the same rounds
unless ``--no-floor``: a stand-in qmgr on pyqmgr's own start-up, event loop and protocol
layer that does only the unavoidable per-message I/O, with no scheduler and no
bookkeeping. Its ratio to stock is how close any Python qmgr built this way can get here.

A fourth contender, *metrics*, is pyqmgr with its Prometheus exporter on
(``metrics_listen`` in pyqmgr.cf) and 16 clients scraping it in a loop, as fast as
it lets them, from a process of their own (:mod:`benchmarks.scrapers`; issue #44:
local users hammering the port must not slow delivery), unless ``--no-metrics``. It
drains side by side with a plain pyqmgr on a second instance, both released at once
(``drain_pair``, twice a round): one drain after another on this shared 2-core
machine differ by up to 30% in CPU time from nothing but the moment they ran
(benchmarks/README.md), while two at once meet the same moments. The target
(``METRICS``, checked at the end; a miss exits 1) is within 5%: the median over the
pairs of the qmgr CPU ratio, counted after each qmgr's first ``removed`` line, so
that the exporter's one-off start-up (prometheus_client, ssl, the trust check of
its files) is reported apart, not spread over the messages. The pairs' drain times
are printed beside it, with the scrapes answered a second.

A fifth contender, *delegation*, is pyqmgr asking a local delivery policy service
before every delivery (``delivery_policy_service`` in pyqmgr.cf, against the test bed's
policy server answering ``DUNNO`` on loopback from a thread of this benchmark), unless
``--no-delegation``: its qmgr CPU and drain time against plain pyqmgr are what
delegation costs a delivery.

A *sites* contender is pyqmgr with provider sites on (``site_grouping``, issue #33)
for the discard transport, its one domain pinned to a site whose limit never binds:
a warm cache, no DNS. It drains side by side with a plain pyqmgr, twice a round, and
its target (``SITES``, checked at the end) is within 5% in qmgr CPU, as the metrics'.

A sixth contender, *compiled*, is pyqmgr's compiled build (mypyc, ``./dev compiled``)
when ``--compiled PYTHON`` names its interpreter (``.ci/run`` gives .venv-compiled's):
the same source installed from that venv, whose launcher the instance's qmgr service
runs. Its drain and CPU are reported beside stock's and the pure build's (issue #30).

A seventh, *before*, when ``--before PYTHON`` names another installation
(``./dev before REV`` makes .venv-before with pyqmgr as of commit REV): this checkout's
pyqmgr drains side by side with that one, ``BEFORE_PAIRS_PER_ROUND`` a round, and its
target (``BEFORE``) is
within 5% of it in qmgr CPU (issue #44: the drain within 5% of the commit before the
change, side by side in one run; .ci/run gives the commit before #44).

Every drain also reports its start-up: the time from the release (master spawns the
qmgr) to its first ``removed`` line and the qmgr's CPU by then, stock's and pyqmgr's
(issue #24's time to the first delivery).

Each round also reports the qmgr process's own scheduler accounting
(``/proc/PID/schedstat``): time on a CPU, and time runnable but waiting for one. Their
sum against the wall time says whether the qmgr was busy or waiting on other
processes, and CPU time varies less than wall time on a shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import NamedTuple

import pyqmgr
from benchmarks import floor_qmgr
from benchmarks.scrapers import Hammer
from benchmarks.target import Target, status
from pyqmgr.testbed.instance import PostfixInstance, free_port, wait_until
from pyqmgr.testbed.policy_server import FakePolicyServer
from pyqmgr.testbed.redis import RedisServer
from pyqmgr.testbed.redis import available as redis_available

#: Each round runs every contender once; the order rotates so none always goes first.
CONTENDERS = ("stock", "pyqmgr", "metrics", "delegation", "floor", "fleet", "sites",
              "compiled", "before")
#: The fleet contender's sessions to the discard destination, fleet-wide: one server,
#: so every delivery takes a session and passes it on, at the node's own
#: destination_concurrency_limit (20).
FLEET_SESSIONS = 20
#: Side-by-side pairs of plain pyqmgr and a fleet of one in each round.
FLEET_PAIRS_PER_ROUND = 1
#: Side-by-side pairs of plain pyqmgr and pyqmgr with metrics in each round.
PAIRS_PER_ROUND = 2
#: Clients scraping the metrics contender in a loop (issue #44).
SCRAPERS = 16
#: What the metrics may cost: the qmgr's CPU with them on, at most this share above off.
METRICS_COST = 0.05
METRICS = Target(f"pyqmgr with metrics on and {SCRAPERS} clients scraping it in a loop "
                 f"within {METRICS_COST:.0%} of metrics off in qmgr CPU after the first "
                 "message removed (start-up apart), median of the pairs drained side by "
                 "side, two a round")
#: Side-by-side pairs of plain pyqmgr and pyqmgr with sites on in each round.
SITE_PAIRS_PER_ROUND = 2
#: What sites may cost the drain with a warm cache (issue #33).
SITES_COST = 0.05
SITES = Target(f"pyqmgr with sites on (a warm cache: the domain pinned to its site) "
               f"within {SITES_COST:.0%} of sites off in qmgr CPU after the first message "
               "removed, median of the pairs drained side by side, two a round")


#: Side-by-side pairs of this checkout's pyqmgr and another commit's in each round.
BEFORE_PAIRS_PER_ROUND = 1
#: What this checkout may cost against the other commit's (issue #44).
BEFORE_COST = 0.05
BEFORE = Target(f"this checkout's pyqmgr within {BEFORE_COST:.0%} of --before's in qmgr CPU "
                "after the first message removed, median of the pairs drained side by "
                f"side, {BEFORE_PAIRS_PER_ROUND} a round")


def schedstat(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable waiting for one) of a live process."""
    with open(f"/proc/{pid}/schedstat") as f:
        on_cpu, waiting, _ = f.read().split()
    return int(on_cpu) / 1e9, int(waiting) / 1e9


class Drain(NamedTuple):
    """One drain's figures. The qmgr starts at the release (master spawns it then), so
    its start-up is inside the totals; ``startup_*`` are taken at its first
    ``removed`` line, so that the drain's own per-message cost is the rest."""

    wall: float
    cpu: float
    runnable: float
    #: Seconds from the release to the first message removed, and the qmgr's CPU then.
    startup_wall: float
    startup_cpu: float

    @property
    def drain_cpu(self) -> float:
        return self.cpu - self.startup_cpu


class LogTail:
    """A growing log's complete lines written since the last look: each poll costs
    only the new bytes, however long the log has grown."""

    def __init__(self, path: str, offset: int = 0) -> None:
        self.path = path
        self.offset = offset
        self.pending = b""

    def new_lines(self) -> list[bytes]:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        lines = (self.pending + data).split(b"\n")
        self.pending = lines.pop()
        return lines


class FirstRemoval(LogTail):
    """Watches the maillog's new lines for the qmgr's first ``removed``, from where
    the file ended at the release."""

    def __init__(self, path: str) -> None:
        super().__init__(path, os.path.getsize(path))

    def seen(self) -> bool:
        return any(b"postfix/qmgr[" in ln and ln.endswith(b": removed")
                   for ln in self.new_lines())


def drain_once(qmgr: str, n: int, compiled: str | None = None) -> Drain:
    """One drain of ``n`` preloaded messages by ``qmgr`` (``compiled``: the compiled
    build's interpreter, for the compiled contender)."""
    service = FakePolicyServer(action="DUNNO").start() if qmgr == "delegation" else None
    pyqmgr_cf = {"delivery_policy_service": service.endpoint} if service else None
    try:
        with _loaded(qmgr, n, pyqmgr_cf, compiled if qmgr == "compiled" else None) as pf:
            d = _run(pf, qmgr, n)
        if service is not None and service.request_count() != n:
            raise RuntimeError(f"the policy service was asked {service.request_count()} "
                               f"times for {n} deliveries")
        return d
    finally:
        if service is not None:
            service.stop()


def drain_pair(n: int, other: str = "metrics", redis: RedisServer | None = None,
               before: str | None = None) -> tuple[Drain, Drain]:
    """Plain pyqmgr and pyqmgr with ``other`` on (metrics scraped, or a fleet of one
    on ``redis``), draining at the same time on two instances: (plain, other).

    Side by side they meet the same machine at every moment, which two drains one
    after the other do not: on this shared machine back-to-back drains of the same
    qmgr differ by up to 30% in CPU time (benchmarks/README.md), far more than the
    5% the metrics may cost. Both share the two cores alike, so their ratio is the
    metrics' cost.
    """
    port = free_port()
    if other == "fleet":
        assert redis is not None
        # A deadline of 2 s, not 500 ms: two qmgrs draining side by side keep both
        # cores busy, and what is measured is the round trips' CPU, not the deadline
        # (CI once saw the fleet's node give up on Redis in round 1, not reproduced).
        other_cf = {"shared_state": redis.url, "shared_state_timeout": "2s",
                    "discard_fleet_destination_concurrency_limit": str(FLEET_SESSIONS)}
    elif other == "sites":
        other_cf = sites_cf()
    elif other == "before":
        other_cf = None
    else:
        other_cf = {"metrics_listen": f"127.0.0.1:{port}"}
    with _loaded("pyqmgr", n, None) as plain, \
            _loaded(other, n, other_cf, before if other == "before" else None) as second:
        both = threading.Barrier(2)
        out: dict[str, Drain] = {}
        errors: list[BaseException] = []

        def run(pf: PostfixInstance, name: str, scrape: int | None) -> None:
            try:
                both.wait(30)
                out[name] = _run(pf, name, n, scrape)
            except BaseException as exc:  # noqa: BLE001 - reported by the caller
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(plain, "pyqmgr", None)),
                   threading.Thread(target=run, args=(
                       second, other, port if other == "metrics" else None))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        lost = second.maillog.lines(contains="shared state") if other == "fleet" else []
        if lost:
            raise RuntimeError("the fleet's node lost Redis during the drain: "
                               + "; ".join(line.text for line in lost[:3]))
        return out["pyqmgr"], out[other]


def sites_cf() -> dict[str, str]:
    """pyqmgr.cf with sites on for the discard transport, its one domain pinned to a
    site (the warm cache: no lookup) whose limit never binds, so that the drain pays
    for every site's bookkeeping (join, count, settle) and nothing else differs."""
    pins = os.path.join(PINS_DIR, "site-pins")
    os.makedirs(PINS_DIR, exist_ok=True)
    with open(pins, "w") as f:
        f.write("discard.example  discard-site\n")
    os.chmod(pins, 0o644)
    return {"site_grouping": "mx", "site_transports": "discard",
            "site_concurrency_limit": "100000", "site_pins": pins}


#: (scrapes answered, connections failed, seconds) of each metrics drain's scrapers.
SCRAPES: list[tuple[int, int, float]] = []

#: Where the sites contender's pin file is written (root's, read at start-up). Not
#: under /tmp: the daemon reads no file on a path others can change (trust.RootFiles,
#: issue #45), and anyone can make names in /tmp; /run is root's alone.
PINS_DIR = "/run/pyqmgr-drain-sites"


@contextlib.contextmanager
def _loaded(qmgr: str, n: int, pyqmgr_cf: dict[str, str] | None,
            qmgr_python: str | None = None) -> Iterator[PostfixInstance]:
    """A started instance with ``n`` messages preloaded and no qmgr yet; stopped after."""
    if qmgr_python is not None:
        build, where = subprocess.run(
            [qmgr_python, "-I", "-c", "import os, pyqmgr, pyqmgr.build as b; "
             "print(b.name()); print(os.path.realpath(os.path.dirname(pyqmgr.__file__)))"],
            capture_output=True, text=True, check=True, timeout=60).stdout.splitlines()
        if qmgr == "compiled" and not build.startswith("compiled"):
            raise RuntimeError(f"{qmgr_python} runs pyqmgr's {build} build, not the compiled")
        if qmgr == "before" and where == os.path.realpath(os.path.dirname(pyqmgr.__file__)):
            raise RuntimeError(f"{qmgr_python} runs this checkout's pyqmgr ({where}), not "
                               "another commit's")
    with PostfixInstance(qmgr="stock" if qmgr == "stock" else "pyqmgr",
                         transports={"discard.example": "discard:"},
                         pyqmgr_cf=pyqmgr_cf, qmgr_python=qmgr_python) as pf:
        if qmgr == "floor":
            floor_qmgr.install(pf)
        pf.start()
        pf.disable_qmgr()
        pf.clone_queue_files(_templates(n), n)
        yield pf


#: The queue files every drain copies, by message count (:func:`_templates`).
_TEMPLATES: dict[int, list[bytes]] = {}


def _templates(n: int) -> list[bytes]:
    """``n`` messages' incoming/ files as a real smtpd and cleanup wrote them, once a
    run, on an instance of their own: every drain gets byte-for-byte copies under new
    queue ids (``clone_queue_files``) instead of ``n`` SMTP transactions of its own.
    Those took 5.5 s an instance, 14 instances a round, more than the drains (issue
    #32: CI under 45 minutes). No contender drains its own SMTP's files: a drain right
    after 5,000 transactions (cleanup's fsyncs) took 1.3x as long for stock and
    pyqmgr alike (ratios 2.6-2.9 either way, three pairs measured), so one contender
    among copies would be measured apart."""
    files = _TEMPLATES.get(n)
    if files is None:
        with PostfixInstance(qmgr="stock", transports={"discard.example": "discard:"}) as pf:
            pf.start()
            pf.preload([("s@discard.example", [f"r{i}@discard.example"]) for i in range(n)])
            files = _TEMPLATES[n] = pf.queue_file_bytes("incoming")
        if len(files) != n:
            raise RuntimeError(f"{len(files)} queue files for {n} messages preloaded")
    return files


def _run(pf: PostfixInstance, qmgr: str, n: int, scrape: int | None = None) -> Drain:
    """Release the preloaded mail and time the drain (scraping port ``scrape``)."""
    scraper = Hammer(scrape, SCRAPERS) if scrape is not None else None
    first = FirstRemoval(pf.maillog_path)
    if scraper is not None:
        scraper.start()  # its clients retry until the new qmgr listens
    start = time.monotonic()
    pf.release_preload()
    try:
        pid = pf.qmgr_pid()
        up: list[float] = []

        def started() -> bool:
            if first.seen():
                up[:] = [time.monotonic() - start, schedstat(pid)[0]]
                return True
            return False

        wait_until(started, 60, f"the first message removed by {qmgr}", interval=0.005)
        wait_until(pf.queue_empty, 600, f"{n} messages drained by {qmgr}", interval=0.01)
        elapsed = time.monotonic() - start
        on_cpu, runnable = schedstat(pid)
    finally:
        if scraper is not None:
            scraper.close()
    if scraper is not None:
        # The exporter answered during the drain and counts every delivery (within
        # the interval its rendering is served again).
        want = f'pyqmgr_deliveries_total{{outcome="final",transport="discard"}} {n}.0'
        if scraper.answered == 0:
            raise RuntimeError("no scrape of the metrics exporter succeeded")
        url = f"http://127.0.0.1:{scrape}/metrics"
        final: list[str] = []

        def counted() -> bool:
            with urllib.request.urlopen(url, timeout=5) as r:
                final[:] = [r.read().decode()]
            return want in final[0]

        wait_until(counted, 10, f"the exporter to show {want}", interval=0.25)
        SCRAPES.append((scraper.answered, scraper.failed, scraper.elapsed))
    removed = len(pf.maillog.lines("postfix/qmgr", contains=": removed"))
    if removed != n:
        wait_until(lambda: len(pf.maillog.lines("postfix/qmgr", contains=": removed")) >= n,
                   30, "all removed lines")
    return Drain(elapsed, on_cpu, runnable, up[0], up[1])


def _pairs(r: int, label: str, count: int, n: int,
           make: Callable[[], tuple[Drain, Drain]],
           names: tuple[str, str]) -> list[tuple[Drain, Drain]]:
    """``count`` side-by-side drains (the baseline, the one measured against it), each
    printed with the measured one's qmgr CPU over the baseline's."""
    out: list[tuple[Drain, Drain]] = []
    for k in range(count):
        base, other = make()
        out.append((base, other))
        print(f"round {r + 1} {label} pair {k + 1}: side by side, {n} messages each; qmgr "
              f"CPU after the first removal: {names[0]} {base.drain_cpu:.2f} s, {names[1]} "
              f"{other.drain_cpu:.2f} s, ratio {other.drain_cpu / base.drain_cpu:.3f} "
              f"(walls {base.wall:.2f} and {other.wall:.2f} s)", flush=True)
    return out


def round_order(contenders: tuple[str, ...], r: int) -> list[str]:
    """Round ``r``'s order: every contender once, rotated so none always goes first."""
    k = r % len(contenders)
    return list(contenders[k:] + contenders[:k])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-floor", action="store_true",
                        help="leave out the floor (a qmgr with no scheduler)")
    parser.add_argument("--no-metrics", action="store_true",
                        help="leave out pyqmgr with its Prometheus exporter on and 16 clients "
                             "scraping it in a loop")
    parser.add_argument("--no-delegation", action="store_true",
                        help="leave out pyqmgr asking a local policy service")
    parser.add_argument("--no-fleet", action="store_true",
                        help="leave out pyqmgr with shared_state on a local redis-server")
    parser.add_argument("--no-sites", action="store_true",
                        help="leave out pyqmgr with sites on (site_grouping)")
    parser.add_argument("--compiled", metavar="PYTHON",
                        help="add the compiled build, installed in PYTHON's venv "
                             "(./dev compiled: .venv-compiled/bin/python)")
    parser.add_argument("--before", metavar="PYTHON",
                        help="add pyqmgr as another commit has it, in PYTHON's venv "
                             "(./dev before REV: .venv-before/bin/python), drained side "
                             "by side with this checkout's")
    args = parser.parse_args(argv)
    if not args.no_fleet and not redis_available():
        parser.error("the fleet contender needs Debian's redis-server (./dev installs it); "
                     "or give --no-fleet")
    contenders = tuple(c for c in CONTENDERS if not (c == "floor" and args.no_floor)
                       and not (c == "metrics" and args.no_metrics)
                       and not (c == "delegation" and args.no_delegation)
                       and not (c == "fleet" and args.no_fleet)
                       and not (c == "sites" and args.no_sites)
                       and not (c == "compiled" and not args.compiled)
                       and not (c == "before" and not args.before))
    with contextlib.ExitStack() as stack:
        redis = (stack.enter_context(RedisServer()) if "fleet" in contenders
                 else None)
        return _rounds(args, contenders, redis)


def _rounds(args: argparse.Namespace, contenders: tuple[str, ...],
            redis: RedisServer | None) -> int:
    times: dict[str, list[float]] = {name: [] for name in contenders}
    cpu: dict[str, list[float]] = {name: [] for name in contenders}
    drains: dict[str, list[Drain]] = {name: [] for name in contenders}
    #: (plain pyqmgr, pyqmgr with metrics) drained side by side.
    pairs: list[tuple[Drain, Drain]] = []
    #: (plain pyqmgr, a fleet of one, redis-server's CPU seconds) side by side.
    fleet_pairs: list[tuple[Drain, Drain, float]] = []
    #: (plain pyqmgr, pyqmgr with sites on) side by side.
    site_pairs: list[tuple[Drain, Drain]] = []
    #: (--before's pyqmgr, this checkout's) side by side.
    before_pairs: list[tuple[Drain, Drain]] = []
    for r in range(args.rounds):
        for qmgr in round_order(contenders, r):
            if qmgr == "fleet":
                assert redis is not None and redis.proc is not None
                for k in range(FLEET_PAIRS_PER_ROUND):
                    before = schedstat(redis.proc.pid)[0]
                    plain, fleet = drain_pair(args.messages, "fleet", redis)
                    spent = schedstat(redis.proc.pid)[0] - before
                    fleet_pairs.append((plain, fleet, spent))
                    drains["fleet"].append(fleet)
                    print(f"round {r + 1} fleet pair {k + 1}: side by side, "
                          f"{args.messages} messages each; qmgr CPU after the first "
                          f"removal: pyqmgr {plain.drain_cpu:.2f} s, with shared_state "
                          f"{fleet.drain_cpu:.2f} s, ratio "
                          f"{fleet.drain_cpu / plain.drain_cpu:.3f}; redis-server CPU "
                          f"{spent:.2f} s (walls {plain.wall:.2f} and {fleet.wall:.2f} s)",
                          flush=True)
                continue
            if qmgr == "sites":
                new = _pairs(r, "sites", SITE_PAIRS_PER_ROUND, args.messages,
                             lambda: drain_pair(args.messages, "sites"),
                             ("pyqmgr", "with sites"))
                site_pairs += new
                drains["sites"] += [sited for _, sited in new]
                continue
            if qmgr == "before":
                # (--before's, this checkout's): the ratio is this checkout's cost.
                new = _pairs(r, "before", BEFORE_PAIRS_PER_ROUND, args.messages,
                             lambda: drain_pair(args.messages, "before",
                                                before=args.before)[::-1],
                             ("before", "this checkout"))
                before_pairs += new
                drains["before"] += [theirs for theirs, _ in new]
                continue
            if qmgr == "metrics":
                for k in range(PAIRS_PER_ROUND):
                    plain, metrics = drain_pair(args.messages)
                    pairs.append((plain, metrics))
                    drains["metrics"].append(metrics)
                    print(f"round {r + 1} pair {k + 1}: side by side, {args.messages} "
                          f"messages each; qmgr CPU after the first removal: pyqmgr "
                          f"{plain.drain_cpu:.2f} s, with metrics {metrics.drain_cpu:.2f} s, "
                          f"ratio {metrics.drain_cpu / plain.drain_cpu:.3f} (walls "
                          f"{plain.wall:.2f} and {metrics.wall:.2f} s; start-up CPU "
                          f"{plain.startup_cpu:.3f} and {metrics.startup_cpu:.3f} s)",
                          flush=True)
                continue
            d = drain_once(qmgr, args.messages, args.compiled)
            times[qmgr].append(d.wall)
            cpu[qmgr].append(d.cpu)
            drains[qmgr].append(d)
            print(f"round {r + 1} {qmgr:7s}: {args.messages} messages in {d.wall:.2f} s "
                  f"({args.messages / d.wall:.0f} msg/s); qmgr on CPU {d.cpu:.2f} s, "
                  f"waiting for a CPU {d.runnable:.2f} s; first removed after "
                  f"{d.startup_wall:.3f} s, qmgr CPU {d.startup_cpu:.3f} s by then",
                  flush=True)
    stock = statistics.median(times["stock"])
    ours = statistics.median(times["pyqmgr"])
    stock_cpu = statistics.median(cpu["stock"])
    ours_cpu = statistics.median(cpu["pyqmgr"])
    print(f"median stock {stock:.2f} s, pyqmgr {ours:.2f} s, ratio pyqmgr/stock "
          f"{ours / stock:.2f}")
    print(f"median qmgr CPU: stock {stock_cpu:.2f} s, pyqmgr {ours_cpu:.2f} s, ratio "
          f"{ours_cpu / stock_cpu:.2f} ({1e6 * ours_cpu / args.messages:.0f} us vs "
          f"{1e6 * stock_cpu / args.messages:.0f} us a message)")
    for name in contenders:
        ds = drains[name]
        if not ds:
            continue
        per_message = 1e6 * statistics.median(d.drain_cpu for d in ds) / args.messages
        print(f"start-up {name}: from the release (master spawns the qmgr) to the first "
              f"message removed {statistics.median(d.startup_wall for d in ds):.3f} s, "
              f"qmgr CPU by then {statistics.median(d.startup_cpu for d in ds):.3f} s; "
              f"qmgr CPU after it {per_message:.0f} us a message (median of the rounds"
              f"{'; drained side by side with plain pyqmgr' if name == 'metrics' else ''})")
    checks: list[bool] = []
    if pairs:
        # The exporter's one-off start-up (prometheus_client, ssl, the trust check of
        # the library's files: about 70 ms of CPU) is in the start-up line above; the
        # target is what it costs the drain, after the first removal.
        paired = [m.drain_cpu / p.drain_cpu for p, m in pairs]
        cost = statistics.median(paired)
        extra = statistics.median(m.drain_cpu - p.drain_cpu for p, m in pairs)
        walls = [m.wall / p.wall for p, m in pairs]
        rate = statistics.median(a / e for a, _f, e in SCRAPES) if SCRAPES else 0.0
        print(f"metrics on and {SCRAPERS} clients scraping in a loop "
              f"({rate:.0f} scrapes answered a second), side by side with plain pyqmgr: "
              f"median qmgr CPU ratio {cost:.3f}, {1e6 * extra / args.messages:+.0f} us a "
              f"message; drain time ratio {statistics.median(walls):.3f} (pairs "
              + ", ".join(f"{x:.3f}" for x in walls) + ")")
        checks.append(METRICS.check(cost <= 1 + METRICS_COST, "pairs' ratios " + ", ".join(
            f"{x:.3f}" for x in paired) + f"; median {cost:.3f}"))
    if site_pairs:
        paired = [x.drain_cpu / p.drain_cpu for p, x in site_pairs]
        cost = statistics.median(paired)
        extra = statistics.median(x.drain_cpu - p.drain_cpu for p, x in site_pairs)
        print(f"sites on (the domain pinned), side by side with plain pyqmgr: median qmgr "
              f"CPU ratio {cost:.3f}, {1e6 * extra / args.messages:+.0f} us a message")
        checks.append(SITES.check(cost <= 1 + SITES_COST, "pairs' ratios " + ", ".join(
            f"{x:.3f}" for x in paired) + f"; median {cost:.3f}"))
    if before_pairs:
        paired = [o.drain_cpu / b.drain_cpu for b, o in before_pairs]
        cost = statistics.median(paired)
        extra = statistics.median(o.drain_cpu - b.drain_cpu for b, o in before_pairs)
        wall_ratio = statistics.median(o.wall / b.wall for b, o in before_pairs)
        print(f"this checkout against --before, side by side: median qmgr CPU ratio "
              f"{cost:.3f}, {1e6 * extra / args.messages:+.0f} us a message; drain time "
              f"ratio {wall_ratio:.3f}")
        checks.append(BEFORE.check(cost <= 1 + BEFORE_COST, "pairs' ratios " + ", ".join(
            f"{x:.3f}" for x in paired) + f"; median {cost:.3f}"))
    if fleet_pairs:
        ratio = statistics.median(f.drain_cpu / p.drain_cpu for p, f, _ in fleet_pairs)
        extra = statistics.median(f.drain_cpu - p.drain_cpu for p, f, _ in fleet_pairs)
        spent = statistics.median(r for _, _, r in fleet_pairs)
        print(f"shared_state on a local redis-server (a fleet of one, "
              f"discard_fleet_destination_concurrency_limit = {FLEET_SESSIONS}), side by "
              f"side with plain pyqmgr: median qmgr CPU ratio {ratio:.3f}, "
              f"{1e6 * extra / args.messages:+.0f} us a message; redis-server "
              f"{1e6 * spent / args.messages:.0f} us a message")
    if "delegation" in times:
        asked = statistics.median(times["delegation"])
        asked_cpu = statistics.median(cpu["delegation"])
        print(f"median pyqmgr asking a local policy service (DUNNO) {asked:.2f} s, ratio "
              f"delegation/pyqmgr {asked / ours:.3f}, {1e6 * (asked - ours) / args.messages:+.0f}"
              f" us a delivery; qmgr CPU {asked_cpu:.2f} s, ratio {asked_cpu / ours_cpu:.3f}, "
              f"{1e6 * (asked_cpu - ours_cpu) / args.messages:+.0f} us a delivery")
    if "compiled" in times:
        built = statistics.median(times["compiled"])
        built_cpu = statistics.median(cpu["compiled"])
        print(f"median compiled build {built:.2f} s, ratio compiled/stock {built / stock:.2f} "
              f"(pure {ours / stock:.2f}); qmgr CPU {built_cpu:.2f} s, ratio compiled/stock "
              f"{built_cpu / stock_cpu:.2f}, compiled/pure {built_cpu / ours_cpu:.3f} "
              f"({1e6 * built_cpu / args.messages:.0f} us a message)")
    if "floor" in times:
        floor = statistics.median(times["floor"])
        floor_cpu = statistics.median(cpu["floor"])
        print(f"median floor {floor:.2f} s, ratio floor/stock {floor / stock:.2f}; floor "
              f"qmgr CPU {floor_cpu:.2f} s, ratio {floor_cpu / stock_cpu:.2f} "
              f"({1e6 * floor_cpu / args.messages:.0f} us a message)")
    return status(checks)


if __name__ == "__main__":
    raise SystemExit(main())
