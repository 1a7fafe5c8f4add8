"""Delivery events' cost: the drain benchmark's discard drain, events on against off.

A one-off measurement (issue #46 asks for the trace service's cost per recipient),
not a CI target: CI's budget has no room left. Each pair drains the same N preloaded
one-recipient messages through discard(8) on two instances released at once (as
``drain.drain_pair`` does, for the reason it gives: side by side they meet the same
machine), one plain pyqmgr, one with ``delivery_events_file`` set. With events on,
every request carries DEL_REQ_FLAG_RECORD: discard's ``sent()`` asks the trace
service (the bounce daemon, which fsyncs each record) before it logs and replies,
and the qmgr reads each trace log and writes the events. Printed: drain time and the
qmgr's CPU, each pair's ratio, and the events written.

    .venv/bin/python -m benchmarks.events_drain --messages 5000 --pairs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import uuid

from benchmarks.drain import Drain, _loaded, _run
from pyqmgr.testbed.instance import PostfixInstance

#: Root's directory under which each run's events directory is made (not /tmp: see
#: drain.PINS_DIR; the events directory itself is made by the qmgr for mail_owner).
BASE = "/run/pyqmgr-drain-events"


def pair(n: int) -> tuple[Drain, Drain, int]:
    """(plain, events on, events written) for one side-by-side drain."""
    os.makedirs(BASE, mode=0o755, exist_ok=True)
    path = os.path.join(BASE, uuid.uuid4().hex, "delivery.jsonl")
    out: dict[str, Drain] = {}
    errors: list[BaseException] = []
    with _loaded("pyqmgr", n, None) as plain, \
            _loaded("pyqmgr", n, {"delivery_events_file": path}) as events:
        both = threading.Barrier(2)

        def run(pf: PostfixInstance, name: str) -> None:
            try:
                both.wait(30)
                out[name] = _run(pf, "pyqmgr", n)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(plain, "plain")),
                   threading.Thread(target=run, args=(events, "events"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        events.stop()
    with open(path, "rb") as f:
        written = sum(1 for _ in f)
    return out["plain"], out["events"], written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args(argv)
    cpu, wall = [], []
    for i in range(args.pairs):
        plain, events, written = pair(args.messages)
        cpu.append(events.drain_cpu / plain.drain_cpu)
        wall.append(events.wall / plain.wall)
        print(f"pair {i + 1}: plain {plain.wall:.2f} s, qmgr CPU {plain.drain_cpu:.2f} s; "
              f"events on {events.wall:.2f} s, qmgr CPU {events.drain_cpu:.2f} s; "
              f"{written} events written (ratios: wall {wall[-1]:.3f}, CPU {cpu[-1]:.3f})",
              flush=True)
    print(f"median over {args.pairs} pairs of {args.messages} messages: drain time "
          f"{statistics.median(wall):.3f}x, qmgr CPU {statistics.median(cpu):.3f}x "
          "with events on")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
