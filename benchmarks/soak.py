"""An hour of a bad day, stock qmgr and pyqmgr side by side: by hand, for the curves.

The dead site's backlog of the deadsite benchmark (20,000 one-line messages for a
destination that refuses connections, backoff 5-10 s, ``queue_run_delay = 5s``), with
fresh mail arriving all the while for a live destination (``FRESH_BATCH`` messages
every ``FRESH_EVERY`` seconds, over SMTP) and a ``postfix reload`` every ten minutes,
which makes master start a new qmgr: what a production relay meets in an outage's
first hour. Every minute the benchmark samples each qmgr's resident size, the CPU of
every qmgr process the run has had (summed, so a reload does not reset the curve), the
deferral lines of each maillog and the fresh mail delivered, with its slowest delay in
that minute.

Issue #30 asks for the RSS and CPU curves beside stock's in benchmarks/README.md; it
is run by hand (``./dev bench soak``, 60 minutes by default) and not in CI, whose
whole budget is 45 minutes. ``--csv`` writes the samples, ``--plot`` a PNG of the
three curves. It exits 1 if a qmgr exited other than by a reload, if pyqmgr's RSS
grew by more than 5% from the second sample after a reload to the last sample before
the next (the dead-site benchmark's bar, per qmgr life), or if fresh mail waited more
than ``FRESH_LIMIT`` seconds after the first minute (the start-up, when the backlog is
read in from incoming/ and fresh mail waits behind it: printed apart).
"""

from __future__ import annotations

import argparse
import csv
import re
import socket
import time
from typing import NamedTuple

from benchmarks.dead_site import BACKOFF, MESSAGES, LineCounter, cpu_seconds, templates
from benchmarks.memory import _status_kb
from benchmarks.target import Target, status
from pyqmgr.testbed.instance import PostfixInstance

SAMPLE_EVERY = 60.0
RELOAD_EVERY = 600.0
FRESH_EVERY = 5.0
FRESH_BATCH = 5
FRESH_LIMIT = 2.0
GROWTH = 0.05
_DELAY = re.compile(rb"\bdelay=([0-9.]+)")

ALIVE = Target("each qmgr ran from reload to reload (master started one after each)")
FLAT = Target(f"pyqmgr's RSS within each qmgr life not growing by more than {GROWTH:.0%} "
              "from its second sample to its last")
FRESH_OUT = Target(f"fresh mail behind the backlog delivered by pyqmgr within "
                   f"{FRESH_LIMIT:g} s, through the reloads (after the first minute)")


class Sample(NamedTuple):
    seconds: float
    pid: int
    rss_kb: int
    cpu: float
    deferrals: int
    fresh: int
    fresh_max_delay: float


class FreshCounter(LineCounter):
    """Fresh deliveries and the slowest ``delay=`` among those read since last asked."""

    def __init__(self, path: str) -> None:
        super().__init__(path, b"@fresh.example>")
        self.slowest = 0.0

    def update(self) -> int:
        for ln in self.new_lines():
            if self.needle in ln and b"status=sent" in ln:
                self.count += 1
                if (m := _DELAY.search(ln)) is not None:
                    self.slowest = max(self.slowest, float(m.group(1)))
        return self.count

    def take_slowest(self) -> float:
        s, self.slowest = self.slowest, 0.0
        return s


class QmgrCpu:
    """CPU of every qmgr process an instance has had: a reload starts a new one."""

    def __init__(self, pf: PostfixInstance) -> None:
        self.pf = pf
        self.seen: dict[int, float] = {}

    def sample(self) -> tuple[int, float]:
        pid = self.pf.qmgr_pid(timeout=30)
        try:
            self.seen[pid] = cpu_seconds(pid)
        except FileNotFoundError:  # it just ended: the next sample sees its successor
            pass
        return pid, sum(self.seen.values())

    def before_reload(self) -> None:
        """The outgoing qmgr's last reading: what it used after it is not counted."""
        for pid in list(self.seen):
            try:
                self.seen[pid] = cpu_seconds(pid)
            except FileNotFoundError:
                pass


def soak(files: list[bytes], n: int, minutes: float, reload_every: float = RELOAD_EVERY
         ) -> dict[str, list[Sample]]:
    refused = socket.socket()  # bound, never listening: connections are refused
    refused.bind(("127.0.0.1", 0))
    transports = {"dead.example": f"smtp:[127.0.0.1]:{refused.getsockname()[1]}",
                  "fresh.example": "discard:"}
    try:
        with PostfixInstance(qmgr="stock", main_cf=BACKOFF, transports=transports) as st, \
                PostfixInstance(qmgr="pyqmgr", main_cf=BACKOFF, transports=transports) as py:
            instances = {"stock": st, "pyqmgr": py}
            for pf in instances.values():
                pf.start()
                pf.disable_qmgr()
                pf.clone_queue_files(files, n)
            deferrals = {q: LineCounter(pf.maillog_path, b"status=deferred")
                         for q, pf in instances.items()}
            fresh = {q: FreshCounter(pf.maillog_path) for q, pf in instances.items()}
            start = time.monotonic()
            for pf in instances.values():
                pf.release_preload()
            cpus = {q: QmgrCpu(pf) for q, pf in instances.items()}
            runs: dict[str, list[Sample]] = {q: [] for q in instances}
            next_sample, next_reload, sent = SAMPLE_EVERY, reload_every, 0
            end = minutes * 60
            while True:
                now = time.monotonic() - start
                if now >= next_reload and now < end:
                    for q, pf in instances.items():
                        cpus[q].before_reload()
                        pf.reload()
                    print(f"{now:5.0f} s: postfix reload", flush=True)
                    next_reload += reload_every
                if now >= next_sample:
                    for q in instances:
                        pid, cpu = cpus[q].sample()
                        s = Sample(now, pid, _status_kb(pid, "VmRSS"), cpu,
                                   deferrals[q].update(), fresh[q].update(),
                                   fresh[q].take_slowest())
                        runs[q].append(s)
                        print(f"{q:6s} {s.seconds / 60:5.1f} min: pid {pid}, RSS "
                              f"{s.rss_kb / 1024:6.1f} MiB, qmgr CPU {s.cpu:7.1f} s, "
                              f"deferrals {s.deferrals}, fresh {s.fresh}/{sent} "
                              f"(slowest {s.fresh_max_delay:g} s)", flush=True)
                    next_sample += SAMPLE_EVERY
                    if now >= end:
                        return runs
                for pf in instances.values():
                    pf.smtp_send([("s@test.example", [f"f{sent + i}@fresh.example"])
                                  for i in range(FRESH_BATCH)])
                sent += FRESH_BATCH
                time.sleep(max(0.0, start + now + FRESH_EVERY - time.monotonic()))
    finally:
        refused.close()


def lives(samples: list[Sample]) -> list[list[Sample]]:
    """The samples split by qmgr process."""
    out: list[list[Sample]] = []
    for s in samples:
        if not out or out[-1][-1].pid != s.pid:
            out.append([])
        out[-1].append(s)
    return out


def plot(runs: dict[str, list[Sample]], path: str, messages: int, reload_minutes: float
         ) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for q, samples in runs.items():
        t = [s.seconds / 60 for s in samples]
        axes[0].plot(t, [s.rss_kb / 1024 for s in samples], label=q)
        axes[1].plot(t, [s.cpu for s in samples], label=q)
        rate = [0.0] + [(b.deferrals - a.deferrals) / (b.seconds - a.seconds) * 60
                        for a, b in zip(samples, samples[1:], strict=False)]
        axes[2].plot(t, rate, label=q)
    for ax, label in zip(axes, ("qmgr RSS (MiB)", "qmgr CPU, cumulative (s)",
                                "deferrals a minute"), strict=True):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[2].set_xlabel(f"minutes (postfix reload every {reload_minutes:g})")
    fig.suptitle(f"A dead site's backlog of {messages:,}, fresh mail, reloads: "
                 "stock vs pyqmgr")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=MESSAGES)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--reload-every", type=float, default=RELOAD_EVERY / 60,
                        help="minutes between reloads (default 10)")
    parser.add_argument("--csv", help="write every sample to this CSV file")
    parser.add_argument("--plot", help="write a PNG of RSS, CPU and deferrals to this file")
    args = parser.parse_args(argv)
    if args.minutes < 3:
        parser.error("--minutes must be at least 3")
    runs = soak(templates(), args.messages, args.minutes, args.reload_every * 60)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["qmgr", *Sample._fields])
            for q, samples in runs.items():
                w.writerows([q, *s] for s in samples)
    if args.plot:
        plot(runs, args.plot, args.messages, args.reload_every)
    py, st = runs["pyqmgr"], runs["stock"]
    growths = []
    for life in lives(py):
        if len(life) >= 3:
            growths.append(life[-1].rss_kb / life[1].rss_kb - 1)
    expected_lives = 1 + int((args.minutes * 60 - 1) // (args.reload_every * 60))
    ok_lives = all(len(lives(r)) == expected_lives for r in runs.values())
    # The first minute is the start-up: the 20,000 are read in from incoming/ and fresh
    # mail waits its turn behind them (pyqmgr reads them at its per-message cost).
    slowest = max(s.fresh_max_delay for s in py[1:])
    print("fresh mail in the first minute (behind the start-up's intake of the backlog): "
          + ", ".join(f"{q} slowest {r[0].fresh_max_delay:g} s" for q, r in runs.items()),
          flush=True)
    for q, r in runs.items():
        print(f"{q}: RSS {min(s.rss_kb for s in r) / 1024:.1f}-"
              f"{max(s.rss_kb for s in r) / 1024:.1f} MiB, qmgr CPU {r[-1].cpu:.1f} s, "
              f"{r[-1].deferrals / (r[-1].seconds / 60):.0f} deferrals a minute, "
              f"fresh {r[-1].fresh} delivered, slowest {max(s.fresh_max_delay for s in r):g} s",
              flush=True)
    print(f"pyqmgr / stock: qmgr CPU {py[-1].cpu / st[-1].cpu:.2f}x, deferrals "
          f"{py[-1].deferrals / st[-1].deferrals:.0%}", flush=True)
    return status([
        ALIVE.check(ok_lives, ", ".join(f"{q} {len(lives(r))} qmgr processes"
                                        for q, r in runs.items())
                    + f" (expected {expected_lives})"),
        FLAT.check(all(g <= GROWTH for g in growths),
                   ", ".join(f"{g:+.1%}" for g in growths) or "no life of 3 samples"),
        FRESH_OUT.check(slowest <= FRESH_LIMIT, f"slowest {slowest:g} s"),
    ])


if __name__ == "__main__":
    raise SystemExit(main())
