"""Drain benchmark: the same preloaded messages through discard, stock qmgr vs pyqmgr.

Each round preloads N one-recipient messages into incoming/ while no qmgr runs, then
starts the chosen qmgr and times from the reload until the last ``removed`` line's
file is gone. Rounds alternate stock and pyqmgr in one run so both see the same
machine state; the ratio of the medians is reported.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pyqmgr.testbed.instance import PostfixInstance, wait_until


def drain_once(qmgr: str, n: int) -> float:
    with PostfixInstance(qmgr=qmgr, transports={"discard.example": "discard:"}) as pf:
        pf.start()
        pf.preload([("s@discard.example", [f"r{i}@discard.example"]) for i in range(n)])
        start = time.monotonic()
        pf.release_preload()
        wait_until(pf.queue_empty, 600, f"{n} messages drained by {qmgr}", interval=0.01)
        elapsed = time.monotonic() - start
        removed = len(pf.maillog.lines("postfix/qmgr", contains=": removed"))
        if removed != n:
            wait_until(lambda: len(pf.maillog.lines("postfix/qmgr", contains=": removed")) >= n,
                       30, "all removed lines")
        return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {"stock": [], "pyqmgr": []}
    for r in range(args.rounds):
        for qmgr in ("stock", "pyqmgr") if r % 2 == 0 else ("pyqmgr", "stock"):
            t = drain_once(qmgr, args.messages)
            times[qmgr].append(t)
            print(f"round {r + 1} {qmgr:6s}: {args.messages} messages in {t:.2f} s "
                  f"({args.messages / t:.0f} msg/s)", flush=True)
    stock = statistics.median(times["stock"])
    ours = statistics.median(times["pyqmgr"])
    print(f"median stock {stock:.2f} s, pyqmgr {ours:.2f} s, ratio pyqmgr/stock "
          f"{ours / stock:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
