"""200,000 messages in deferred/: the qmgr's scans of a big queue, stock vs pyqmgr.

After a long outage a relay's deferred/ holds hundreds of thousands of messages. Every
``queue_run_delay`` the qmgr scans it: a name and an lstat per file, a move to
active/ only for those whose retry time has come. Here 200,000 real messages (100
written by cleanup, copied by ``PostfixInstance.clone_queue_files``) wait in deferred/
with retry times an hour ahead, so each scan walks them all and takes none; each qmgr
starts on them, scans at start-up and again every ``queue_run_delay`` (20 s here).
The figures: the wall time of the first scan (from the qmgr's start until its CPU
stops rising), its CPU, and the qmgr's resident size after it and after the second.

Issue #30 asks for the first scan's time and pyqmgr's RSS at most 3x stock's. Not in
``.ci/run`` (writing 200,000 files twice takes minutes); ``./dev bench bigqueue``,
figures in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.dead_site import cpu_seconds
from benchmarks.memory import _status_kb
from benchmarks.target import Target, status
from pyqmgr.testbed.instance import PostfixInstance

RATIO = 3.0
SCAN = Target(f"pyqmgr's first scan of the big deferred queue within {RATIO:g}x of "
              "stock's time")
RSS = Target(f"pyqmgr's RSS after scanning the big deferred queue within {RATIO:g}x of "
             "stock's")
RUN_DELAY = 20
#: The qmgr is idle once its CPU has not moved for this long (seconds).
QUIET = 2.0


def templates() -> list[bytes]:
    with PostfixInstance() as pf:
        pf.start()
        pf.preload(100, recipients=lambda i: [f"r{i}@later.example"])
        return pf.queue_file_bytes("incoming")


def _until_quiet(pid: int, start: float, timeout: float) -> tuple[float, float]:
    """(seconds from ``start`` to the last CPU change, the CPU then) once it is quiet."""
    last_cpu, last_change = cpu_seconds(pid), time.monotonic()
    while time.monotonic() - start < timeout:
        time.sleep(0.1)
        now_cpu = cpu_seconds(pid)
        if now_cpu != last_cpu:
            last_cpu, last_change = now_cpu, time.monotonic()
        elif time.monotonic() - last_change >= QUIET:
            return last_change - start, last_cpu
    raise TimeoutError(f"the qmgr (pid {pid}) never went quiet in {timeout:g} s")


def scan(qmgr: str, files: list[bytes], n: int) -> tuple[float, float, int, int]:
    with PostfixInstance(qmgr=qmgr, main_cf={"queue_run_delay": f"{RUN_DELAY}s"}) as pf:
        pf.start()
        pf.disable_qmgr()
        made = time.monotonic()
        pf.clone_queue_files(files, n, queue="deferred", mtime=time.time() + 3600)
        print(f"{qmgr}: {n} files in deferred/ in {time.monotonic() - made:.0f} s",
              flush=True)
        start = time.monotonic()
        pf.release_preload()
        pid = pf.qmgr_pid()
        wall, cpu = _until_quiet(pid, start, 600)
        rss_first = _status_kb(pid, "VmRSS")
        # The second scan comes queue_run_delay after the first began.
        time.sleep(max(0.0, start + RUN_DELAY + 1 - time.monotonic()))
        _until_quiet(pid, time.monotonic(), 600)
        rss_second = _status_kb(pid, "VmRSS")
        if pf.queue_files("active"):
            raise RuntimeError(f"{qmgr} moved mail whose time had not come to active/")
        print(f"{qmgr}: first scan {wall:.1f} s, qmgr CPU {cpu:.1f} s; RSS after it "
              f"{rss_first / 1024:.1f} MiB, after the second {rss_second / 1024:.1f} MiB",
              flush=True)
        return wall, cpu, rss_first, rss_second


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=200_000)
    args = parser.parse_args(argv)
    files = templates()
    got = {q: scan(q, files, args.messages) for q in ("stock", "pyqmgr")}
    time_ratio = got["pyqmgr"][0] / got["stock"][0]
    rss_ratio = max(got["pyqmgr"][2:]) / max(got["stock"][2:])
    return status([SCAN.check(time_ratio <= RATIO, f"{time_ratio:.2f}x"),
                   RSS.check(rss_ratio <= RATIO, f"{rss_ratio:.2f}x")])


if __name__ == "__main__":
    raise SystemExit(main())
