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

Where the drain's extra time goes: the qmgr's CPU is its main thread's, as
``drain._run`` counts it (``/proc/PID/schedstat`` is one thread's); its other
threads (the events writer) are counted apart, at the drain's end; the rest of each
instance's processes (master, discard, the bounce daemon as trace service,
cleanup...) are counted apart, each instance in a cgroup of its own (cgroup v1
``cpuacct``, which keeps the CPU of processes that exited, as discard does after 100
requests): ``others`` is that CPU less the qmgr's (all its threads), from the release
to the drain's end. The qmgr's ``idle`` is the wall time it was neither on a CPU nor
waiting for one: waiting for the agents' replies.

``--qmgr-python`` runs both contenders from another installation (``./dev before
REV`` makes one) to measure an earlier commit the same way.

    .venv/bin/python -m benchmarks.events_drain --messages 5000 --pairs 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import threading
import time
import uuid
from collections.abc import Iterator

from benchmarks.drain import Drain, _loaded, _run
from pyqmgr.testbed.instance import PostfixInstance

#: Root's directory under which each run's events directory is made (not /tmp: see
#: drain.PINS_DIR; the events directory itself is made by the qmgr for mail_owner).
BASE = "/run/pyqmgr-drain-events"
#: cgroup v1's CPU accounting hierarchy (absent: the others' CPU is not reported).
CPUACCT = "/sys/fs/cgroup/cpuacct"


class CpuGroup:
    """One instance's processes in a cpuacct cgroup of their own: master's children
    inherit it, and it keeps counting what exited processes used."""

    def __init__(self) -> None:
        self.path = ""
        if os.path.isdir(CPUACCT):
            path = os.path.join(CPUACCT, f"pyqmgr-events-{uuid.uuid4().hex[:12]}")
            with contextlib.suppress(OSError):
                os.mkdir(path)
                self.path = path

    def add(self, pids: list[int]) -> None:
        if not self.path:
            return
        for pid in pids:
            with contextlib.suppress(OSError), open(os.path.join(self.path, "cgroup.procs"),
                                                    "w") as f:
                f.write(f"{pid}\n")

    def usage(self) -> float:
        """Seconds of CPU its processes used (NaN without a cgroup)."""
        if not self.path:
            return float("nan")
        with open(os.path.join(self.path, "cpuacct.usage")) as f:
            return int(f.read()) / 1e9

    def remove(self) -> None:
        """Gone once its processes are (the instance is stopped before)."""
        if not self.path:
            return
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except OSError:
                with open(os.path.join(self.path, "cgroup.procs")) as f:
                    left = f.read().split()
                with contextlib.suppress(OSError), open(
                        os.path.join(CPUACCT, "cgroup.procs"), "w") as f:
                    for pid in left:
                        f.write(f"{pid}\n")
                time.sleep(0.1)


@contextlib.contextmanager
def _grouped() -> Iterator[CpuGroup]:
    """A :class:`CpuGroup`, removed after (after the instance, made inside it)."""
    group = CpuGroup()
    try:
        yield group
    finally:
        group.remove()


def threads_cpu(pid: int) -> float:
    """Seconds on a CPU of the process's threads other than its main one."""
    total = 0.0
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            if int(task) != pid:
                with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[0]) / 1e9
    return total


def pair(n: int, qmgr_python: str | None = None
         ) -> tuple[Drain, Drain, int, dict[str, float], dict[str, float]]:
    """(plain, events on, events written, each one's qmgr threads' CPU, each one's
    others' CPU) for one side-by-side drain."""
    os.makedirs(BASE, mode=0o755, exist_ok=True)
    path = os.path.join(BASE, uuid.uuid4().hex, "delivery.jsonl")
    out: dict[str, Drain] = {}
    others: dict[str, float] = {}
    threads: dict[str, float] = {}
    errors: list[BaseException] = []
    with _grouped() as g_plain, _grouped() as g_events, \
            _loaded("pyqmgr", n, None, qmgr_python) as plain, \
            _loaded("pyqmgr", n, {"delivery_events_file": path}, qmgr_python) as events:
        both = threading.Barrier(2)

        def run(pf: PostfixInstance, name: str, group: CpuGroup) -> None:
            try:
                group.add(pf.pids())
                both.wait(30)
                before = group.usage()
                out[name] = _run(pf, "pyqmgr", n)
                threads[name] = threads_cpu(pf.qmgr_pid())
                others[name] = group.usage() - before - out[name].cpu - threads[name]
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        runs = [threading.Thread(target=run, args=(plain, "plain", g_plain)),
                threading.Thread(target=run, args=(events, "events", g_events))]
        for t in runs:
            t.start()
        for t in runs:
            t.join()
        if errors:
            raise errors[0]
        events.stop()
    written = 0
    with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
        written = sum(1 for _ in f)
    return out["plain"], out["events"], written, threads, others


def _idle(d: Drain) -> float:
    """The qmgr's wall time neither on a CPU nor waiting for one."""
    return d.wall - d.cpu - d.runnable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--qmgr-python", default=None,
                        help="another pyqmgr installation's interpreter for both contenders")
    args = parser.parse_args(argv)
    cpu, wall, extra_qmgr, extra_threads, extra_others = [], [], [], [], []
    for i in range(args.pairs):
        plain, events, written, threads, others = pair(args.messages, args.qmgr_python)
        o_plain, o_events = others["plain"], others["events"]
        cpu.append(events.drain_cpu / plain.drain_cpu)
        extra_threads.append((threads["events"] - threads["plain"]) / args.messages)
        wall.append(events.wall / plain.wall)
        extra_qmgr.append((events.drain_cpu - plain.drain_cpu) / args.messages)
        extra_others.append((o_events - o_plain) / args.messages)
        print(f"pair {i + 1}: plain {plain.wall:.2f} s, qmgr CPU {plain.drain_cpu:.2f} s "
              f"(runnable {plain.runnable:.2f}, idle {_idle(plain):.2f}), others' CPU "
              f"{o_plain:.2f} s; events on {events.wall:.2f} s, qmgr CPU "
              f"{events.drain_cpu:.2f} s (runnable {events.runnable:.2f}, idle "
              f"{_idle(events):.2f}, other threads {threads['events']:.2f}), others' CPU "
              f"{o_events:.2f} s; {written} events "
              f"written (ratios: wall {wall[-1]:.3f}, CPU {cpu[-1]:.3f}, others' CPU "
              f"{o_events / o_plain:.3f})", flush=True)
    print(f"median over {args.pairs} pairs of {args.messages} messages: drain time "
          f"{statistics.median(wall):.3f}x, qmgr CPU {statistics.median(cpu):.3f}x "
          f"with events on; a message costs the qmgr "
          f"{1e6 * statistics.median(extra_qmgr):+.0f} us of CPU (its other threads "
          f"{1e6 * statistics.median(extra_threads):+.0f} us) and the other processes "
          f"{1e6 * statistics.median(extra_others):+.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
