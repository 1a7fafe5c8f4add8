"""Drain benchmark: the same preloaded messages through discard, stock qmgr vs pyqmgr.

Each round preloads N one-recipient messages into incoming/ while no qmgr runs, then
starts the chosen qmgr and times from the reload until the last ``removed`` line's
file is gone. Each round runs every contender once, in rotating order, so all see the
same machine state; the ratio of the medians is reported.

A third contender, the *floor* (``benchmarks/floor_qmgr.py``), runs in the same rounds
unless ``--no-floor``: a stand-in qmgr on pyqmgr's own start-up, event loop and protocol
layer that does only the unavoidable per-message I/O, with no scheduler and no
bookkeeping. Its ratio to stock is how close any Python qmgr built this way can get here.

A fourth contender, *metrics*, is pyqmgr with its Prometheus exporter on
(``metrics_listen`` in pyqmgr.cf) and scraped once a second by a thread of this
benchmark, as a Prometheus server would, unless ``--no-metrics``: its ratio to plain
pyqmgr in the same rounds is what the metrics cost. The target (``METRICS``, checked
at the end; a miss exits 1) is within 5%, on the qmgr's CPU time, the median over
all the pairs of each pair's ratio of the two: a drain's wall time on a shared 2-core
machine spreads over +-10% from one run to the next and its CPU time over +-5% when
quiet, and far more under other jobs' load, which comes and goes within a run (see
benchmarks/README.md). So the two run back to back twice in every round
(``round_order``, A B B A) and each pair is compared: they met the same machine.

A fifth contender, *delegation*, is pyqmgr asking a local delivery policy service
before every delivery (``delivery_policy_service`` in pyqmgr.cf, against the test bed's
policy server answering ``DUNNO`` on loopback from a thread of this benchmark), unless
``--no-delegation``: its qmgr CPU and drain time against plain pyqmgr are what
delegation costs a delivery.

Each round also reports the qmgr process's own scheduler accounting
(``/proc/PID/schedstat``): time on a CPU, and time runnable but waiting for one. Their
sum against the wall time says whether the qmgr was busy or waiting on other
processes, and CPU time varies less than wall time on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import urllib.request

from benchmarks import floor_qmgr
from benchmarks.target import Target, status
from pyqmgr.testbed.instance import PostfixInstance, free_port, wait_until
from pyqmgr.testbed.policy_server import FakePolicyServer

#: Each round runs every contender once; the order rotates so none always goes first.
CONTENDERS = ("stock", "pyqmgr", "metrics", "delegation", "floor")
#: Seconds between two scrapes of the metrics contender (Prometheus's tightest usual).
SCRAPE_INTERVAL = 1.0
#: What the metrics may cost: the qmgr's CPU with them on, at most this share above off.
METRICS_COST = 0.05
METRICS = Target(f"pyqmgr with metrics on and scraped within {METRICS_COST:.0%} of "
                 "metrics off in qmgr CPU, median of the back-to-back pairs, two a round")


class Scraper:
    """GET /metrics every SCRAPE_INTERVAL s from a thread, as Prometheus would."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.stop = threading.Event()
        self.ok = 0
        self.failed = 0
        self.last = b""
        self.thread = threading.Thread(target=self._run, name="scraper", daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=5) as r:
                    self.last = r.read()
                self.ok += 1
            except OSError:
                self.failed += 1  # the new qmgr does not listen yet
            # Soon again until the first scrape works, then at the interval.
            self.stop.wait(SCRAPE_INTERVAL if self.ok else 0.05)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def _schedstat(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable waiting for one) of a live process."""
    with open(f"/proc/{pid}/schedstat") as f:
        on_cpu, waiting, _ = f.read().split()
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def drain_once(qmgr: str, n: int) -> tuple[float, float, float]:
    """(wall seconds, qmgr CPU seconds, qmgr run-queue seconds) for one drain."""
    port = free_port()
    pyqmgr_cf = {"metrics_listen": f"127.0.0.1:{port}"} if qmgr == "metrics" else None
    service = FakePolicyServer(action="DUNNO").start() if qmgr == "delegation" else None
    if service is not None:
        pyqmgr_cf = {"delivery_policy_service": service.endpoint}
    try:
        return _drain(qmgr, n, port, pyqmgr_cf, service)
    finally:
        if service is not None:
            service.stop()


def _drain(qmgr: str, n: int, port: int, pyqmgr_cf: dict[str, str] | None,
           service: FakePolicyServer | None) -> tuple[float, float, float]:
    with PostfixInstance(qmgr="stock" if qmgr == "stock" else "pyqmgr",
                         transports={"discard.example": "discard:"},
                         pyqmgr_cf=pyqmgr_cf) as pf:
        if qmgr == "floor":
            floor_qmgr.install(pf)
        pf.start()
        pf.preload([("s@discard.example", [f"r{i}@discard.example"]) for i in range(n)])
        scraper = Scraper(port) if qmgr == "metrics" else None
        start = time.monotonic()
        pf.release_preload()
        if scraper is not None:
            scraper.start()
        try:
            pid = pf.qmgr_pid()
            wait_until(pf.queue_empty, 600, f"{n} messages drained by {qmgr}",
                       interval=0.01)
            elapsed = time.monotonic() - start
            on_cpu, runnable = _schedstat(pid)
        finally:
            if scraper is not None:
                scraper.close()
        if scraper is not None:
            # The exporter answered during the drain and counted every delivery.
            want = f'pyqmgr_deliveries_total{{outcome="final",transport="discard"}} {n}.0'
            if scraper.ok == 0:
                raise RuntimeError("no scrape of the metrics exporter succeeded")
            with urllib.request.urlopen(scraper.url, timeout=5) as r:
                final = r.read().decode()
            if want not in final:
                raise RuntimeError(f"the exporter does not show {want}")
        if service is not None and service.request_count() != n:
            raise RuntimeError(f"the policy service was asked {service.request_count()} "
                               f"times for {n} deliveries")
        removed = len(pf.maillog.lines("postfix/qmgr", contains=": removed"))
        if removed != n:
            wait_until(lambda: len(pf.maillog.lines("postfix/qmgr", contains=": removed")) >= n,
                       30, "all removed lines")
        return elapsed, on_cpu, runnable


def round_order(contenders: tuple[str, ...], r: int) -> list[str]:
    """Round ``r``'s order: the contenders rotated so none always goes first, pyqmgr
    and metrics run twice each, back to back as A B B A (which of the two first
    alternating by round), so that the metrics' cost is read off pairs of drains that
    met the same machine, two pairs a round, and a drift within the four cancels."""
    units: list[tuple[str, ...]] = []
    for name in contenders:
        if name == "metrics" and "pyqmgr" in contenders:
            continue
        if name == "pyqmgr" and "metrics" in contenders:
            a, b = ("pyqmgr", "metrics") if r % 2 == 0 else ("metrics", "pyqmgr")
            units.append((a, b, b, a))
        else:
            units.append((name,))
    k = r % len(units)
    return [name for unit in units[k:] + units[:k] for name in unit]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-floor", action="store_true",
                        help="leave out the floor (a qmgr with no scheduler)")
    parser.add_argument("--no-metrics", action="store_true",
                        help="leave out pyqmgr with its Prometheus exporter on and scraped")
    parser.add_argument("--no-delegation", action="store_true",
                        help="leave out pyqmgr asking a local policy service")
    args = parser.parse_args(argv)
    contenders = tuple(c for c in CONTENDERS if not (c == "floor" and args.no_floor)
                       and not (c == "metrics" and args.no_metrics)
                       and not (c == "delegation" and args.no_delegation))
    times: dict[str, list[float]] = {name: [] for name in contenders}
    cpu: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(args.rounds):
        for qmgr in round_order(contenders, r):
            t, on_cpu, runnable = drain_once(qmgr, args.messages)
            times[qmgr].append(t)
            cpu[qmgr].append(on_cpu)
            print(f"round {r + 1} {qmgr:7s}: {args.messages} messages in {t:.2f} s "
                  f"({args.messages / t:.0f} msg/s); qmgr on CPU {on_cpu:.2f} s, "
                  f"waiting for a CPU {runnable:.2f} s", flush=True)
    stock = statistics.median(times["stock"])
    ours = statistics.median(times["pyqmgr"])
    stock_cpu = statistics.median(cpu["stock"])
    ours_cpu = statistics.median(cpu["pyqmgr"])
    print(f"median stock {stock:.2f} s, pyqmgr {ours:.2f} s, ratio pyqmgr/stock "
          f"{ours / stock:.2f}")
    print(f"median qmgr CPU: stock {stock_cpu:.2f} s, pyqmgr {ours_cpu:.2f} s, ratio "
          f"{ours_cpu / stock_cpu:.2f} ({1e6 * ours_cpu / args.messages:.0f} us vs "
          f"{1e6 * stock_cpu / args.messages:.0f} us a message)")
    checks: list[bool] = []
    if "metrics" in times:
        with_metrics = statistics.median(times["metrics"])
        metrics_cpu = statistics.median(cpu["metrics"])
        print(f"median pyqmgr with metrics on and scraped every {SCRAPE_INTERVAL:g} s "
              f"{with_metrics:.2f} s, ratio metrics/pyqmgr {with_metrics / ours:.3f}; "
              f"qmgr CPU {metrics_cpu:.2f} s, ratio {metrics_cpu / ours_cpu:.3f}, "
              f"{1e6 * (metrics_cpu - ours_cpu) / args.messages:+.0f} us a message")
        paired = [m / p for m, p in zip(cpu["metrics"], cpu["pyqmgr"], strict=True)]
        cost = statistics.median(paired)
        checks.append(METRICS.check(cost <= 1 + METRICS_COST, "pairs' ratios " + ", ".join(
            f"{x:.3f}" for x in paired) + f"; median {cost:.3f}"))
    if "delegation" in times:
        asked = statistics.median(times["delegation"])
        asked_cpu = statistics.median(cpu["delegation"])
        print(f"median pyqmgr asking a local policy service (DUNNO) {asked:.2f} s, ratio "
              f"delegation/pyqmgr {asked / ours:.3f}, {1e6 * (asked - ours) / args.messages:+.0f}"
              f" us a delivery; qmgr CPU {asked_cpu:.2f} s, ratio {asked_cpu / ours_cpu:.3f}, "
              f"{1e6 * (asked_cpu - ours_cpu) / args.messages:+.0f} us a delivery")
    if "floor" in times:
        floor = statistics.median(times["floor"])
        floor_cpu = statistics.median(cpu["floor"])
        print(f"median floor {floor:.2f} s, ratio floor/stock {floor / stock:.2f}; floor "
              f"qmgr CPU {floor_cpu:.2f} s, ratio {floor_cpu / stock_cpu:.2f} "
              f"({1e6 * floor_cpu / args.messages:.0f} us a message)")
    return status(checks)


if __name__ == "__main__":
    raise SystemExit(main())
