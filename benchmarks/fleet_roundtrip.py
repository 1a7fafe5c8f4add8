"""The fleet's round trips per delivery, client against client (issue #35).

Each delivery under a fleet limit costs the qmgr an admission and a release (one
Lua script each). This times them on their own, without Postfix: a node's
:class:`pyqmgr.fleet.shared.Shared` admits and releases ``--deliveries`` times against
a local redis-server, one delivery at a time and 50 at once, and the process's CPU
(user + system) per delivery is what it costs the qmgr. ``--tree DIR`` (repeatable)
runs the same against another checkout's ``pyqmgr`` (``git worktree add /tmp/old
a7fcf4e`` is the hand-written client of issue #23), each in its own interpreter,
alternating, in the same run: ``./dev bench fleetrt --tree /tmp/old``. The drain
benchmark's ``fleet`` contender measures the same inside a real drain (CI prints it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import time

#: Concurrent deliveries per measurement: one at a time, and a busy destination's.
CONCURRENCY = (1, 50)
LIMIT = 1000


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _measure(port: int, deliveries: int, concurrency: int) -> tuple[float, float]:
    from pyqmgr.fleet.client import Endpoint, RedisClient
    from pyqmgr.fleet.shared import Shared

    client = RedisClient(Endpoint(host="127.0.0.1", port=port), timeout=5)
    node = Shared(client, "rt:", "bench", 60)
    while True:  # a new fleet's first start waits out the recount
        first = await node.admit("smtp", "rt.example", LIMIT)
        if first.admitted:
            await node.release("smtp", "rt.example", first.lease, LIMIT)
            break
        await asyncio.sleep(first.wait)

    async def one() -> None:
        answer = await node.admit("smtp", "rt.example", LIMIT)
        await node.release("smtp", "rt.example", answer.lease, LIMIT)

    cpu, wall = _cpu(), time.perf_counter()
    for _ in range(deliveries // concurrency):
        await asyncio.gather(*(one() for _ in range(concurrency)))
    cpu, wall = _cpu() - cpu, time.perf_counter() - wall
    await client.close()
    return 1e6 * cpu / deliveries, 1e6 * wall / deliveries


def _child(argv: list[str]) -> None:
    port, deliveries, concurrency = (int(a) for a in argv)
    cpu, wall = asyncio.run(_measure(port, deliveries, concurrency))
    print(f"{cpu:.1f} {wall:.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./dev bench fleetrt", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[],
                        help="another checkout whose pyqmgr to time beside this one")
    parser.add_argument("--deliveries", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = [here, *args.tree]
    from pyqmgr.testbed.redis import RedisServer

    got: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with RedisServer() as server:
        for _ in range(args.rounds):
            for concurrency in CONCURRENCY:
                for tree in trees:
                    out = subprocess.run(
                        [sys.executable, "-m", "benchmarks.fleet_roundtrip", "--child",
                         str(server.port), str(args.deliveries), str(concurrency)],
                        env={**os.environ, "PYTHONPATH": f"{tree}:{here}"}, cwd=here,
                        capture_output=True, text=True, check=True).stdout.split()
                    got.setdefault((tree, concurrency), []).append(
                        (float(out[0]), float(out[1])))
    for tree in trees:
        name = "this checkout" if tree == here else tree
        for concurrency in CONCURRENCY:
            runs = got[(tree, concurrency)]
            cpu = statistics.median(c for c, _ in runs)
            wall = statistics.median(w for _, w in runs)
            print(f"{name}: {concurrency:2d} at once: qmgr CPU {cpu:.0f} us a delivery "
                  f"(admit + release; runs {', '.join(f'{c:.0f}' for c, _ in runs)}), "
                  f"wall {wall:.0f} us")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2:])
    else:
        sys.exit(main())
