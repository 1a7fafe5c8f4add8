"""SMTP benchmark: mail to SMTP sinks that answer after a fixed latency, stock vs pyqmgr.

The drain benchmark (``drain.py``) measures the qmgr alone: discard(8) answers at
once, so the queue manager's own CPU is the whole run. Real mail goes to SMTP servers
that take a while to answer, and there the question is whether pyqmgr keeps as many
deliveries in flight as stock does, and whether its extra CPU, on a machine whose
cores are shared with the smtp(8) processes, shows in the time mail takes.

Each run preloads N one-recipient messages (1,500 by default) into incoming/ while no
qmgr runs, spread evenly over D destinations (15), each an SMTP sink of the test bed
on loopback that answers every RCPT after the given latency; then starts the qmgr and
times from the release until the queue is empty, and checks that every sink got its
share, once. Every latency (20 ms and 200 ms by default) runs ``--rounds`` rounds, a
fresh instance for each contender, which of stock and pyqmgr goes first alternating.

Printed: each run's wall time and qmgr CPU, the medians and their ratio pyqmgr/stock.
Issue #24 asks for pyqmgr within 1.05x of stock's time at 20 ms and 1.02x at 200 ms;
those are printed as goals (met or not), not enforced (the issue is blocked on its CPU
figures; benchmarks/README.md, "smtp"), so ``./dev bench smtp`` exits 0 whatever they
say unless a run fails.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import NamedTuple

from benchmarks.drain import schedstat
from benchmarks.target import Target
from pyqmgr.testbed.instance import PostfixInstance, wait_until
from pyqmgr.testbed.sink import SinkServer

#: Latency (seconds a recipient) -> issue #24's bar for pyqmgr's time against stock's.
GOALS = {0.02: 1.05, 0.2: 1.02}
#: Those bars as goals (benchmarks/target.py GOALS["smtp-time"]), one a latency.
TIME = {latency: Target(f"pyqmgr within {goal:g}x of stock's time at {latency * 1000:g} ms",
                        goal="smtp-time") for latency, goal in GOALS.items()}
CONTENDERS = ("stock", "pyqmgr")


class Run(NamedTuple):
    wall: float
    #: The qmgr's time on a CPU (``/proc/PID/schedstat``).
    cpu: float


def run_once(qmgr: str, latency: float, messages: int, destinations: int) -> Run:
    """One drain of ``messages`` preloaded messages to ``destinations`` sinks."""
    sinks: list[SinkServer] = []
    try:
        for _ in range(destinations):
            sinks.append(SinkServer(latency=latency).start())
        transports = {f"d{i}.example": f"smtp:[127.0.0.1]:{s.port}"
                      for i, s in enumerate(sinks)}
        with PostfixInstance(qmgr=qmgr, transports=transports) as pf:
            pf.start()
            pf.preload([("s@test.example", [f"r{k}@d{k % destinations}.example"])
                        for k in range(messages)], timeout=600)
            start = time.monotonic()
            pf.release_preload()
            pid = pf.qmgr_pid()
            wait_until(pf.queue_empty, 900, f"{messages} messages delivered by {qmgr}",
                       interval=0.02)
            wall = time.monotonic() - start
            cpu = schedstat(pid)[0]
        got = [len(s.snapshot().delivered) for s in sinks]
        want = [len(range(i, messages, destinations)) for i in range(destinations)]
        if got != want:
            raise RuntimeError(f"{qmgr}: the sinks got {got} recipients, not {want}")
        return Run(wall, cpu)
    finally:
        for s in sinks:
            s.stop()


def order(r: int) -> tuple[str, ...]:
    """Round ``r``'s order: stock first in even rounds, pyqmgr first in odd ones."""
    return CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev bench smtp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=1500)
    parser.add_argument("--destinations", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency", type=float, action="append",
                        help="seconds a recipient at the sinks (repeat; default 0.02 "
                             "and 0.2)")
    args = parser.parse_args(argv)
    for latency in args.latency or sorted(GOALS):
        runs: dict[str, list[Run]] = {name: [] for name in CONTENDERS}
        for r in range(args.rounds):
            for qmgr in order(r):
                run = run_once(qmgr, latency, args.messages, args.destinations)
                runs[qmgr].append(run)
                print(f"{latency * 1000:g} ms, round {r + 1} {qmgr:6s}: {args.messages} "
                      f"messages to {args.destinations} sinks in {run.wall:.2f} s; qmgr "
                      f"CPU {run.cpu:.2f} s", flush=True)
        wall = {q: statistics.median(x.wall for x in runs[q]) for q in CONTENDERS}
        cpu = {q: statistics.median(x.cpu for x in runs[q]) for q in CONTENDERS}
        ratio = wall["pyqmgr"] / wall["stock"]
        print(f"{latency * 1000:g} ms: median stock {wall['stock']:.2f} s, pyqmgr "
              f"{wall['pyqmgr']:.2f} s, ratio pyqmgr/stock {ratio:.3f}; qmgr CPU stock "
              f"{cpu['stock']:.2f} s, pyqmgr {cpu['pyqmgr']:.2f} s", flush=True)
        if latency in TIME:
            TIME[latency].check(ratio <= GOALS[latency], f"{ratio:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
