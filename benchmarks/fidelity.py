"""Replay fidelity held out: fitted on one real run, checked on the others.

``./dev bench fidelity [--runs K] [--seeds N] [--shape NAME ...] [--keep DIR]`` runs each
workload shape K times under stock qmgr on a fresh real Postfix (``pyqmgr compare``),
replays the first run's maillog alone (its model fitted on that run only, given the
run's main.cf and master.cf as an admin gives ``--config-dir``) under stock over N
seeds, and sets per destination the replay's range (the lowest and highest of its
runs) beside every other real run's figure and the real runs' own spread.

A real run is one draw of what a log cannot fix (agent hand-offs, which session meets
a 421, the millisecond a try lands in a rate limiter's second): two stock runs of one
seeded workload near a 421 limiter can defer 39 and 80 times. So the replay's answer
is a range, and the check is statistical: per destination, each held-out run's
deferrals, p50, p95 and bounces must fall inside the range (widened by the log's own
resolution: 10% or 0.5 s for delays, one try for counts, 5% for deferral counts in
the hundreds), and the range must be no wider than the real runs' spread plus 10%
(and that resolution): a range that holds everything says nothing.

The default shapes (``field`` and ``filtered``, benchmarks/fidelity_shapes/) are the
ones issue #20's held-out test names, each run short enough (three and a half, one
and a half minutes) for CI to afford three; ``limiter-near-capacity`` and ``mixed`` are
the longer first measurements, kept to be run by name. .ci/run runs it: the exit
status is 1 when a check misses that ALLOWED_MISSES (or, for a range's width alone,
ALLOWED_WIDE) does not excuse (``--strict``: any miss), and the figures are printed
either way; benchmarks/README.md ("Replay fidelity held out") has why those are
listed. ``--json FILE`` writes the figures for
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from benchmarks.target import Target, status

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: name -> workload file.
SHAPES = {"field": os.path.join(HERE, "fidelity_shapes", "field.toml"),
          "filtered": os.path.join(HERE, "fidelity_shapes", "filtered.toml"),
          "limiter-near-capacity": os.path.join(ROOT, "tests", "data", "replay-fidelity.toml"),
          "mixed": os.path.join(HERE, "fidelity_shapes", "mixed.toml")}
#: The shapes #20 names, each short enough for CI to afford three real runs.
DEFAULT = ("field", "filtered")
FIGURES = ("deferred", "bounced", "p50", "p95")
#: Figures whose miss is reported but does not fail the run (``--strict`` fails it):
#: where stock holds a site dead, chance decides how often, and three real runs are
#: too few to bound the replay's range; at the two 421 limiters the replay leans one
#: refusal low, for a cause not found yet (issue #20, blocked; benchmarks/README.md,
#: "Replay fidelity held out", the nine runs' table and the near limiter's lean).
ALLOWED_MISSES = {
    ("field", "rate.example", figure): "stock holds this 4.7.28 limiter dead by chance: "
    "nine real runs deferred 182-670 times, p50 18-150 s; three runs spread 156-327"
    for figure in ("deferred", "p50", "p95")} | {
    ("field", "down.example", "deferred"): "the same dead-site holds: nine real runs "
    "deferred 35-45 times, three runs spread 0-10",
    ("field", "below.example", "deferred"): "8-14 refused sessions in nine real runs; "
    "the replay's five seeds ended one try short of a held-out run in two of three sets",
    ("field", "near.example", "deferred"): "eleven real runs refused 44-47 sessions "
    "(mean 45.6), replays of five of them 43-46 (about 44.3): the simulation leans one "
    "refusal low at a 421 limiter, as at below.example; a QUIT race at the sink, "
    "modelled, moved it 0.3 (benchmarks/README.md)"}
#: Figures whose replay range may be wider than the real runs' spread, where the log
#: itself leaves the answer open; a held-out run outside the range still fails. The
#: down host's coming-up time: a log shows only that it was down at its last refused
#: connection and up at its first session (up to 12 s apart), and this workload's
#: delays flip between two values inside that span (benchmarks/README.md, "the down
#: host's two delays").
ALLOWED_WIDE = {
    ("field", "down.example", figure): "the log leaves the host's coming-up time open "
    "between its last refused connection and its first session; up before about 38.5 s "
    "the deferred mail's returns find it up (p50 18 s, not 35 s), which each simulated "
    "run may draw, where the real runs (up at 40 s) cannot"
    for figure in ("p50", "p95")}
#: The target: ``check``'s tests (inside the range, a range no wider than the real
#: runs' spread) on every held-out figure, ALLOWED_MISSES and ALLOWED_WIDE aside
#: (``--strict``: none).
HELD = Target("every held-out run's figures within the replay's range")
PYQMGR = [sys.executable, "-c", "import sys; from pyqmgr.cli import main; sys.exit(main())"]


def slack(key: str, value: float | None) -> float:
    """What a log's resolution leaves open: a try (or 5% of hundreds) for counts, 10%
    or 0.5 s for delays."""
    if key in ("deferred", "bounced"):
        return max(1.0, 0.05 * abs(value or 0.0))
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


def config_dir(run_dir: str) -> str:
    """The run's main.cf and master.cf, as an admin hands replay ``--config-dir``."""
    from pyqmgr.testbed.instance import MASTER_CF_DIST

    with open(os.path.join(run_dir, "run.json")) as f:
        record = json.load(f)
    out = os.path.join(run_dir, "config")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "main.cf"), "w") as f:
        f.writelines(f"{k} = {v}\n" for k, v in sorted(record["main_cf"].items()))
    with open(MASTER_CF_DIST) as src, open(os.path.join(out, "master.cf"), "w") as f:
        f.write(src.read())
        f.writelines(line + "\n" for line in record.get("master_cf_extra", []))
    return out


def replay(run_dir: str, seeds: int) -> dict[str, Any]:
    proc = subprocess.run([*PYQMGR, "replay", os.path.join(run_dir, "maillog"), "--json",
                           "--runs", str(seeds), "--config-dir", config_dir(run_dir)],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"replay of {run_dir} failed ({proc.returncode}): "
                           f"{proc.stderr.strip()[-500:]}")
    [inst] = json.loads(proc.stdout)["instances"]
    return inst


#: A content filter's stand-in name holds its port, which is each run's own.
_FILTER = re.compile(r"^filter-.*\.invalid$")


def _named(figures: dict[str, Any]) -> dict[str, Any]:
    return {("content filter" if _FILTER.match(k) else k): v for k, v in figures.items()}


def check(name: str, dirs: list[str], seeds: int) -> tuple[list[str], list[dict[str, Any]]]:
    fitted = replay(dirs[0], seeds)
    logs = [_named(fitted["figures"]["log"])] + [
        _named(replay(d, 1)["figures"]["log"]) for d in dirs[1:]]
    ranges = _named(fitted["ranges"]["stock"])
    misses = []
    rows = []
    print(f"{name}: fitted on run 1, {seeds} seeds; held out: runs 2-{len(dirs)}")
    print(f"  {'destination':<31} {'figure':<8} {'real runs':<24} {'real spread':<12} "
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
            print(f"  {dest:<31} {key:<8} {', '.join(f'{v:g}' for v in real):<24} "
                  f"{spread:<12.3g} {lo:g}-{hi:g}{mark}")
            rows.append({"shape": name, "destination": dest, "figure": key, "real": real,
                         "range": [lo, hi], "inside": inside, "width_ok": width_ok})
            if mark:
                misses.append(f"{name} {dest} {key}")
    return misses, rows


def verdict(misses: list[str], rows: list[dict[str, Any]],
            strict: bool) -> tuple[list[str], list[str]]:
    """The misses that fail the run, and those ALLOWED_MISSES (or, for a range too wide
    but holding every held-out run, ALLOWED_WIDE) excuses, with why."""
    if strict:
        return misses, []
    allowed = {}
    for r in rows:
        key = (r["shape"], r["destination"], r["figure"])
        if r["inside"] and r["width_ok"]:
            continue
        if key in ALLOWED_MISSES:
            allowed[" ".join(key)] = f"{' '.join(key)}: {ALLOWED_MISSES[key]}"
        elif r["inside"] and key in ALLOWED_WIDE:
            allowed[" ".join(key)] = f"{' '.join(key)} (its width only): {ALLOWED_WIDE[key]}"
    return [m for m in misses if m not in allowed], list(allowed.values())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="./dev bench fidelity",
        description="Replay fidelity held out: real stock runs of each workload shape, "
                    "the first one's maillog replayed, the others held against the "
                    "replay's range.")
    ap.add_argument("--runs", type=int, default=3, help="real stock runs per shape (2+)")
    ap.add_argument("--seeds", type=int, default=5, help="simulated runs of the replay")
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES),
                    help=f"a shape to run (repeat; default: {', '.join(DEFAULT)})")
    ap.add_argument("--keep", metavar="DIR", help="keep the runs' maillogs there")
    ap.add_argument("--json", metavar="FILE", help="also write every figure there")
    ap.add_argument("--strict", action="store_true",
                    help="fail on every miss, also those of ALLOWED_MISSES")
    args = ap.parse_args(argv)
    if args.runs < 2:
        ap.error("--runs must be 2 or more: one run is fitted, the others held out")
    if os.geteuid() != 0 or shutil.which("postfix") is None:
        print("./dev bench fidelity: needs root and Debian's postfix package",
              file=sys.stderr)
        return 1
    out = args.keep or tempfile.mkdtemp(prefix="pyqmgr-bench-fidelity-")
    misses: list[str] = []
    rows: list[dict[str, Any]] = []
    try:
        for name in args.shape or DEFAULT:
            try:
                dirs = real_runs(SHAPES[name], args.runs, os.path.join(out, name))
                shape_misses, shape_rows = check(name, dirs, args.seeds)
            except RuntimeError as exc:
                print(f"./dev bench fidelity: {exc}")
                misses.append(f"{name} (no runs)")
                continue
            misses += shape_misses
            rows += shape_rows
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": args.runs, "seeds": args.seeds, "rows": rows}, f, indent=1)
    misses, allowed = verdict(misses, rows, args.strict)
    for line in allowed:
        print(f"  allowed to miss: {line}")
    return status([HELD.check(not misses, (f"{len(misses)} missed: {', '.join(misses)}"
                                           if misses else "")
                              + ("; " if misses and allowed else "")
                              + (f"{len(allowed)} allowed misses" if allowed else ""))])
