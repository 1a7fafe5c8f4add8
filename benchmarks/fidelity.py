"""Replay fidelity held out: fitted on one real run, checked on the others.

``./dev bench fidelity [--runs K] [--seeds N] [--shape NAME ...] [--keep DIR]`` runs each
workload shape K times under stock qmgr on a fresh real Postfix (``pyqmgr compare``),
replays the first run's maillog alone (its model fitted on that run only) under stock
over N seeds, and sets per destination the replay's range (the lowest and highest of
its runs) beside every other real run's figure and the real runs' own spread.

A real run is one draw of what a log cannot fix (agent hand-offs, which session meets
a 421, the second a scan falls in): two stock runs of one seeded workload near a 421
limiter can defer 39 and 80 times. So the replay's answer is a range, and the check is
statistical: per destination, each held-out run's deferrals, p50, p95 and bounces must
fall inside the range (widened by the log's own resolution: 10% or 0.5 s for delays,
one try for counts), and the range must be no wider than the real runs' spread plus
10% (or 0.5 s, one try): a range that holds everything says nothing.

The exit status is 1 when any check misses (the figures are printed either way). Not
in ``.ci/run`` yet: a content filter needs a re-injecting filter in the test bed, and
the first measurement (benchmarks/README.md, "Replay fidelity held out")
says where the simulation's range is narrower than real runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: name -> workload file.
SHAPES = {"limiter-near-capacity": os.path.join(ROOT, "tests", "data", "replay-fidelity.toml"),
          "mixed": os.path.join(HERE, "fidelity_shapes", "mixed.toml")}
FIGURES = ("deferred", "bounced", "p50", "p95")
PYQMGR = [sys.executable, "-c", "import sys; from pyqmgr.cli import main; sys.exit(main())"]


def slack(key: str, value: float | None) -> float:
    """What a log's resolution leaves open: a try for counts, 10% or 0.5 s for delays."""
    if key in ("deferred", "bounced"):
        return 1.0
    return max(0.5, 0.1 * abs(value or 0.0))


def real_runs(workload: str, k: int, out: str) -> list[str]:
    """K stock runs of the workload on real Postfix; their maillogs' directories."""
    from pyqmgr.compare import compare

    dirs = []
    for i in range(k):
        run_out = os.path.join(out, f"run{i + 1}")
        base = tempfile.mkdtemp(prefix="pyqmgr-fidelity-", dir="/tmp")
        os.chmod(base, 0o755)  # Postfix's daemons must traverse it
        try:
            report = compare(workload, ["stock"], run_out, base_dir=base)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        if not report["runs"]["stock"]["drained"]:
            raise RuntimeError(f"{workload}: run {i + 1} did not drain")
        dirs.append(os.path.join(run_out, "runs", "1-stock"))
        print(f"  real run {i + 1} of {k} done", flush=True)
    return dirs


def settings(run_dir: str) -> list[str]:
    with open(os.path.join(run_dir, "run.json")) as f:
        main_cf = json.load(f)["main_cf"]
    return [x for k, v in sorted(main_cf.items()) for x in ("-o", f"{k}={v}")]


def replay(run_dir: str, seeds: int) -> dict[str, Any]:
    proc = subprocess.run([*PYQMGR, "replay", os.path.join(run_dir, "maillog"), "--json",
                           "--runs", str(seeds), *settings(run_dir)],
                          capture_output=True, text=True, timeout=1800, check=True)
    [inst] = json.loads(proc.stdout)["instances"]
    return inst


def check(name: str, dirs: list[str], seeds: int) -> list[str]:
    fitted = replay(dirs[0], seeds)
    logs = [fitted["figures"]["log"]] + [replay(d, 1)["figures"]["log"] for d in dirs[1:]]
    ranges = fitted["ranges"]["stock"]
    misses = []
    print(f"{name}: fitted on run 1, {seeds} seeds; held out: runs 2-{len(dirs)}")
    print(f"  {'destination':<16} {'figure':<8} {'real runs':<28} {'real spread':<14} "
          f"{'replay range':<16}")
    for dest in sorted(logs[0]):
        for key in FIGURES:
            real = [log[dest][key] for log in logs if log.get(dest, {}).get(key) is not None]
            lo, hi = ranges.get(dest, {}).get(key, [None, None])
            if not real or lo is None or hi is None:
                continue
            spread = max(real) - min(real)
            width_ok = (hi - lo) <= 1.1 * spread + slack(key, max(real))
            held = real[1:]
            inside = all(lo - slack(key, v) <= v <= hi + slack(key, v) for v in held)
            mark = "" if inside and width_ok else "  MISSED" + (
                "" if inside else " (a held-out run outside)") + (
                "" if width_ok else " (range wider than the real spread)")
            print(f"  {dest:<16} {key:<8} {', '.join(f'{v:g}' for v in real):<28} "
                  f"{spread:<14.3g} {lo:g}-{hi:g}{mark}")
            if mark:
                misses.append(f"{name} {dest} {key}")
    return misses


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="./dev bench fidelity")
    ap.add_argument("--runs", type=int, default=3, help="real stock runs per shape")
    ap.add_argument("--seeds", type=int, default=5, help="simulated runs of the replay")
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES))
    ap.add_argument("--keep", metavar="DIR", help="keep the runs' maillogs there")
    args = ap.parse_args(argv)
    if os.geteuid() != 0 or shutil.which("postfix") is None:
        print("./dev bench fidelity: needs root and Debian's postfix package",
              file=sys.stderr)
        return 1
    out = args.keep or tempfile.mkdtemp(prefix="pyqmgr-bench-fidelity-")
    misses: list[str] = []
    try:
        for name in args.shape or sorted(SHAPES):
            try:
                dirs = real_runs(SHAPES[name], args.runs, os.path.join(out, name))
            except RuntimeError as exc:
                print(f"./dev bench fidelity: {exc}")
                misses.append(f"{name} (no runs)")
                continue
            misses += check(name, dirs, args.seeds)
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    print(f"held out within the replay's range: {'met' if not misses else 'MISSED'}"
          + (f" ({len(misses)}: {', '.join(misses)})" if misses else ""))
    return 1 if misses else 0
