"""4 MB messages: the same 400 real messages through discard, stock qmgr vs pyqmgr.

A queue manager reads a message's envelope, never its content: stock reads the
envelope records and seeks past the content (``data_offset``). pyqmgr read every file
whole, and again for each recipient batch, so 200 messages of 4 MB with 20 recipients
each cost it 10x the CPU of stock and 3.3x the time (issue #30); it reads through a
window now (``pyqmgr.postfix.queue_file.FileWindow``).

Ten real messages of each size are written by a test bed's cleanup (SMTP, 20
recipients each, a 4 MB body of 76-character lines, or a one-line body), and copied
to 400 per drain (``PostfixInstance.clone_queue_files``), so every contender drains
the same bytes. Each round drains both sizes under stock and pyqmgr, in rotating
order. The figure a message is the qmgr's CPU after its first ``removed`` line (its
start-up apart), the least of the rounds: other work on a shared machine only ever
adds to it.

Issue #30's bars are printed as goals, not enforced, each beside what decides it:

* pyqmgr's 4 MB CPU a message within 1.2x of its own for 1 KB. What 4 MB adds to any
  qmgr is the kernel's: unlinking a delivered 4 MB file frees its page cache (122 µs
  against 4 µs for 1 KB, measured alone), and that cost goes to whichever process
  lets go of the file last. Stock's qmgr unlinks so soon after the agent's reply that
  the agent often still holds the file and pays; pyqmgr, slower to get there, pays
  more often: 4 MB added 45 µs a message to stock and 149 µs to pyqmgr in one run,
  with stock's own 4 MB / 1 KB at 1.35x and pyqmgr's at 1.31x. So the figure printed
  is what 4 MB adds to each. What pyqmgr itself reads of a 4 MB file (at most 128
  KiB, never the content) is held by tests/test_queue_file_window.py in every run.
* pyqmgr's drain of the 4 MB messages within 1.2x of stock's time: with the body no
  longer read it is the drain's own ratio (issue #24, blocked on a Python qmgr's CPU
  a message).

The benchmark fails only if a drain fails.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

from benchmarks.drain import Drain, _run, round_order
from benchmarks.target import Target, status
from pyqmgr.testbed.instance import PostfixInstance, wait_until

RATIO = 1.2
CPU = Target(f"pyqmgr's qmgr CPU a message for 4 MB within {RATIO:g}x of its own for 1 KB",
             goal="big-cpu")
TIME = Target(f"pyqmgr's drain of the 4 MB messages within {RATIO:g}x of stock's time",
              goal="big-time")
RECIPIENTS = 20
TEMPLATES = 10
BIG_LINES = 4 * 1024 * 1024 // 77  # 76 characters and a newline: 4 MiB of body
CONTENDERS = ("stock-4MB", "pyqmgr-4MB", "stock-1KB", "pyqmgr-1KB")


def templates(body: str) -> list[bytes]:
    """Real queue files: ``TEMPLATES`` messages written by cleanup, read back."""
    with PostfixInstance() as pf:
        pf.start()
        pf.set_main(in_flow_delay="0")
        pf.disable_qmgr()
        messages = [(f"s{k}@test.example",
                     [f"r{k}-{j}@discard.example" for j in range(RECIPIENTS)])
                    for k in range(TEMPLATES)]
        pf.smtp_send(messages, body=body)
        wait_until(lambda: len(pf.queue_files("incoming")) >= TEMPLATES, 120,
                   f"{TEMPLATES} messages in incoming/")
        return pf.queue_file_bytes("incoming")


def drain(qmgr: str, files: list[bytes], n: int) -> Drain:
    with PostfixInstance(qmgr=qmgr, transports={"discard.example": "discard:"}) as pf:
        pf.start()
        pf.disable_qmgr()
        pf.clone_queue_files(files, n)
        return _run(pf, qmgr, n)


def least_cpu(drains: list[Drain]) -> float:
    """The least CPU after the first removal of the rounds that have one.

    Beside the suite's lanes the maillog's watcher may see stock's first ``removed``
    line only after its whole 1 KB drain (0.3 s): that round measured nothing (0 s,
    seen in a clean clone's CI, where the ratio then divided by it). Such a round is
    left out; none left gives NaN, printed as such."""
    measured = [d.drain_cpu for d in drains if d.drain_cpu > 0]
    return min(measured) if measured else math.nan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    started = time.monotonic()
    big = templates(("x" * 76 + "\n") * BIG_LINES)
    small = templates("hello\n")
    print(f"templates: {len(big)} of {len(big[0]) / 2**20:.1f} MiB, {len(small)} of "
          f"{len(small[0])} bytes ({time.monotonic() - started:.0f} s)", flush=True)
    runs: dict[str, list[Drain]] = {c: [] for c in CONTENDERS}
    for r in range(args.rounds):
        for name in round_order(CONTENDERS, r):
            qmgr, size = name.split("-")
            d = drain(qmgr, big if size == "4MB" else small, args.messages)
            runs[name].append(d)
            print(f"round {r + 1}: {name:11s} drain {d.wall:6.2f} s, qmgr CPU {d.cpu:5.2f} s "
                  f"({d.drain_cpu / args.messages * 1e6:6.0f} us a message after the "
                  f"first removed)", flush=True)
    wall = {c: statistics.median(d.wall for d in runs[c]) for c in CONTENDERS}
    per = {c: least_cpu(runs[c]) / args.messages for c in CONTENDERS}
    for c in CONTENDERS:
        print(f"{c:11s} median drain {wall[c]:6.2f} s, qmgr CPU {per[c] * 1e6:6.0f} us "
              "a message (least of the rounds)", flush=True)
    time_ratio = wall["pyqmgr-4MB"] / wall["stock-4MB"]
    body = {q: per[f"{q}-4MB"] - per[f"{q}-1KB"] for q in ("stock", "pyqmgr")}
    ratio = {q: per[f"{q}-4MB"] / per[f"{q}-1KB"] for q in ("stock", "pyqmgr")}
    print(f"what 4 MB adds a message: stock {body['stock'] * 1e6:.0f} us, pyqmgr "
          f"{body['pyqmgr'] * 1e6:.0f} us; 4 MB / 1 KB: stock {ratio['stock']:.2f}x, "
          f"pyqmgr {ratio['pyqmgr']:.2f}x; pyqmgr/stock drain time, 4 MB: "
          f"{time_ratio:.2f}x", flush=True)
    CPU.check(ratio["pyqmgr"] <= RATIO,
              f"{ratio['pyqmgr']:.2f}x; stock's own {ratio['stock']:.2f}x")
    TIME.check(time_ratio <= RATIO, f"{time_ratio:.2f}x")
    return status([])


if __name__ == "__main__":
    raise SystemExit(main())
