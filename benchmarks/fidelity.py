"""Replay fidelity, judged on recorded real runs against reality's own spread (#32).

``./dev bench fidelity [--shape NAME ...] [--seeds N] [--json FILE] [--break NAME]``
replays the recorded real stock runs of each shape (benchmarks/fidelity_recordings/,
made by ``--record SHAPE``; CI never records) and asks, per destination and figure
(deferred tries, bounces, p50 and p95 delay): does the replay predict a real run it
never saw as well as the other real runs predict it?

* **Reality against itself.** Each recorded run j in turn is held out; the other
  runs are an ensemble forecast of it. Its error is the ensemble's CRPS (continuous
  ranked probability score, the fair estimator): the mean distance of the ensemble's
  members from the held-out value, less half their mean distance from each other. A
  forecast that is off pays the first term; one spread too wide pays it too, since
  its members are far from the value and the second term only takes back half.
* **The replay.** Each recorded run i in turn is replayed (its model fitted on that
  run's maillog and configuration alone, as an admin would with ``pyqmgr replay
  --config-dir``) over SEEDS fixed seeds; the seeds are the ensemble, scored the same
  way against every other run j != i. No figure is scored on the run it was fitted to.
* **The verdict.** A figure is faithful when the replay's mean score is no worse than
  reality's times (1 + TOLERANCE), plus what a log's resolution leaves open (RESOLUTION:
  a try in a count, half a second in a delay). One list of figures, one criterion; no
  exemptions. Where reality spreads wide (stock's rate limiter: 412-648 deferrals over
  ten runs of ``field``) its own score is large, and that is the yardstick there too.
  Each shape is one target; a shape the replay is known to miss is a goal
  (benchmarks/target.py GOALS, with the measurement), its figures scored all the same.

Everything is recorded input and fixed seeds, and the output has no clock in it: the
same commit prints the same bytes (tests/test_fidelity_gate.py runs it twice). The
replays run in a process pool of the machine's cores, in a fixed order.

``--break NAME`` replays a deliberately wrong model (BREAKS: each 421 limit fitted one
higher, the content filter's hop dropped, the backoff times halved); the gate must fail
it, and the suite checks that it does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from benchmarks.fidelity_record import (
    RECORDINGS,
    RecordedRun,
    load_run,
    provenance,
    record,
    stale,
)
from benchmarks.target import Target, status

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: name -> workload file.
SHAPES = {"field": os.path.join(HERE, "fidelity_shapes", "field.toml"),
          "filtered": os.path.join(HERE, "fidelity_shapes", "filtered.toml"),
          "limiter-near-capacity": os.path.join(ROOT, "tests", "data", "replay-fidelity.toml"),
          "mixed": os.path.join(HERE, "fidelity_shapes", "mixed.toml")}
#: The recorded shapes the gate replays.
DEFAULT = ("field", "filtered", "mixed", "limiter-near-capacity")
FIGURES = ("deferred", "bounced", "p50", "p95")
#: Simulated runs of each fitted replay (seeds 1..SEEDS): the replay's ensemble.
SEEDS = 10
#: How much worse than reality's own forecast the replay's may be: it is fitted on one
#: run, where reality's forecast of a run is the other nine themselves.
TOLERANCE = 0.25
#: A try in a count; half a second in a delay (the log's times are whole seconds for
#: arrivals, hundredths in delay=, and a replayed delay crosses both).
RESOLUTION = {"deferred": 1.0, "bounced": 1.0, "p50": 0.5, "p95": 0.5}
#: One target a shape: every figure of it replayed at least as faithfully as reality
#: predicts itself. A shape whose replay is known to depart is a goal (GOALS in
#: benchmarks/target.py says why), not an exemption of some of its figures: its every
#: figure is still scored and printed.
SHAPE_TARGETS = {
    shape: Target(f"every figure of {shape} replayed at least as faithfully as reality "
                  f"predicts itself, +{TOLERANCE:.0%} and a log's resolution",
                  goal={"field": "fidelity-field", "mixed": "fidelity-mixed",
                        "limiter-near-capacity": "fidelity-limiter"}.get(shape, ""))
    for shape in SHAPES}

Figures = dict[str, dict[str, float | None]]


# -- breaks: a replay made wrong on purpose, for the suite's tests of the gate ----------

def _limit_up(sc: Any) -> Any:
    """Each 421 session limit the replay fitted, one higher."""
    dests = {name: (dataclasses.replace(d, server_limit=d.server_limit + 1)
                    if d.server_limit > 0 and d.overload == "421" else d)
             for name, d in sc.destinations.items()}
    return dataclasses.replace(sc, destinations=dests)


def _no_filter_hop(sc: Any) -> Any:
    """The content filter's hop gone: its mail is never sent to the filter, and the
    copy the filter re-injected arrives when the message itself did."""
    filters = {name for name in sc.destinations if _FILTER.match(name)}
    keep: list[int] = []
    for i, m in enumerate(sc.trace):
        if not any(r[0] in filters for r in m.recipients):
            keep.append(i)
    trace = []
    for i in keep:
        m = sc.trace[i]
        if m.follows >= 0:
            first = sc.trace[m.follows]
            m = m._replace(follows=-1, gap=0.0, at=first.at, born=first.born)
        trace.append(m)
    return dataclasses.replace(sc, trace=trace,
                               destinations={k: v for k, v in sc.destinations.items()
                                             if k not in filters})


def _backoff_halved(sc: Any) -> Any:
    """minimal_backoff_time and maximal_backoff_time halved."""
    from pyqmgr.postfix.config import QmgrConfig

    cfg = QmgrConfig.from_text("".join(f"{k} = {v}\n" for k, v in sc.main_cf.items()),
                               hostname="replay.example")
    main_cf = dict(sc.main_cf, minimal_backoff_time=f"{cfg.minimal_backoff_time / 2:g}s",
                   maximal_backoff_time=f"{cfg.maximal_backoff_time / 2:g}s")
    return dataclasses.replace(sc, main_cf=main_cf)


BREAKS: dict[str, Callable[[Any], Any]] = {
    "limit+1": _limit_up, "no-filter-hop": _no_filter_hop, "backoff/2": _backoff_halved}


# -- one recorded run: its figures, and its replay's per seed ----------------------------

#: A content filter's stand-in name holds its port, which is each run's own.
_FILTER = re.compile(r"^filter-.*\.invalid$")


def _named(figures: dict[str, Any]) -> dict[str, Any]:
    return {("content filter" if _FILTER.match(k) else k): v for k, v in figures.items()}


def _config_dir(run: RecordedRun, out: str) -> str:
    """The run's main.cf and master.cf, as an admin hands replay ``--config-dir``."""
    from pyqmgr.testbed.instance import MASTER_CF_DIST

    with open(os.path.join(out, "main.cf"), "w") as f:
        f.writelines(f"{k} = {v}\n" for k, v in sorted(run.record["main_cf"].items()))
    with open(MASTER_CF_DIST) as src, open(os.path.join(out, "master.cf"), "w") as f:
        f.write(src.read())
        f.writelines(line + "\n" for line in run.record.get("master_cf_extra", []))
    return out


def replayed(run: RecordedRun, seeds: int, broken: str | None = None
             ) -> tuple[Figures, list[Figures]]:
    """The run's own figures from its maillog, and its replay's, seed by seed."""
    from pyqmgr.cli import _replay_config
    from pyqmgr.compare.contender import parse_contenders
    from pyqmgr.replay import Options, derive
    from pyqmgr.replay.report import as_dict, log_figures, sim_figures
    from pyqmgr.replay.workload import build
    from pyqmgr.simulator.engine import simulate

    with tempfile.TemporaryDirectory(prefix="pyqmgr-fidelity-") as tmp:
        path = os.path.join(tmp, "maillog")
        with open(path, "wb") as f:
            f.write(run.maillog)
        main_cf, limits = _replay_config(_config_dir(run, tmp), [])
        # Addresses unhashed: a random key would be the one thing not fixed.
        opts = Options(parse_contenders(["stock"]), main_cf, limits, hash_addresses=False)
        _, instances = derive([path], opts)
    [derived] = instances.values()
    sc, _, names = build(derived, opts.main_cf, opts.process_limits, opts.seed)
    log = _named(as_dict(log_figures(derived, names)))
    if broken is not None:
        sc = BREAKS[broken](sc)
    sc.pyqmgr_cf = opts.contenders[0].simulator_policy(sc)
    per_seed = [_named(as_dict(sim_figures([simulate(sc, seed=s, record=False)])))
                for s in range(1, seeds + 1)]
    return log, per_seed


def _replayed_job(args: tuple[str, str, int, int, str | None]
                  ) -> tuple[Figures, list[Figures]]:
    shape, where, index, seeds, broken = args
    return replayed(load_run(shape, index, where), seeds, broken)


# -- the criterion ------------------------------------------------------------------------

def crps(ensemble: Sequence[float], value: float) -> float:
    """The fair CRPS of an ensemble forecast of ``value``: 0 for members all at it."""
    m = len(ensemble)
    near = sum(abs(x - value) for x in ensemble) / m
    if m < 2:
        return near
    spread = sum(abs(x - y) for x in ensemble for y in ensemble) / (2 * m * (m - 1))
    return near - spread


def _central(values: Sequence[float], share: float = 0.8) -> tuple[float, float]:
    """The central ``share`` of the values (nearest rank), for the coverage columns."""
    v = sorted(values)
    k = int((1 - share) / 2 * len(v))
    return v[k], v[len(v) - 1 - k]


def score(figure: str, real: Sequence[float | None],
          replays: Sequence[Sequence[float | None]]) -> dict[str, Any] | None:
    """One figure of one destination: reality's leave-one-out score and the replay's.

    ``real[j]`` is run j's value; ``replays[i]`` the seeds' values of run i's replay.
    """
    res = RESOLUTION[figure]
    real_scores, real_in = [], 0
    for j, x in enumerate(real):
        others = [y for k, y in enumerate(real) if k != j and y is not None]
        if x is None or len(others) < 2:
            continue
        real_scores.append(crps(others, x))
        lo, hi = _central(others)
        real_in += lo - res <= x <= hi + res
    replay_scores, replay_in = [], 0
    for i, seeds in enumerate(replays):
        ens = [y for y in seeds if y is not None]
        if not ens:
            continue
        lo, hi = _central(ens)
        for j, x in enumerate(real):
            if j == i or x is None:
                continue
            replay_scores.append(crps(ens, x))
            replay_in += lo - res <= x <= hi + res
    if not real_scores or not replay_scores:
        return None
    s_real = sum(real_scores) / len(real_scores)
    s_replay = sum(replay_scores) / len(replay_scores)
    bar = s_real * (1 + TOLERANCE) + res
    values = [x for x in real if x is not None]
    return {"figure": figure, "real": list(real),
            "real_min": min(values), "real_median": statistics.median_high(values),
            "real_max": max(values),
            "replay_median": statistics.median_high(
                [y for s in replays for y in s if y is not None]),
            "score_real": round(s_real, 3), "score_replay": round(s_replay, 3),
            "bar": round(bar, 3),
            "covered_real": round(real_in / len(real_scores), 3),
            "covered_replay": round(replay_in / len(replay_scores), 3),
            "faithful": s_replay <= bar}


def judge(shape: str, where: str = RECORDINGS, seeds: int = SEEDS,
          broken: str | None = None, workers: int | None = None) -> list[dict[str, Any]]:
    """Every figure's row for one recorded shape."""
    runs = int(provenance(shape, where)["runs"])
    jobs = [(shape, where, i, seeds, broken) for i in range(runs)]
    n = workers or min(len(jobs), os.cpu_count() or 1)
    if n > 1:
        with ProcessPoolExecutor(n) as pool:
            results = list(pool.map(_replayed_job, jobs))
    else:
        results = [_replayed_job(j) for j in jobs]
    logs = [log for log, _ in results]
    rows = []
    for dest in sorted(set().union(*logs)):
        for figure in FIGURES:
            real = [log.get(dest, {}).get(figure) for log in logs]
            replays = [[f.get(dest, {}).get(figure) for f in per_seed]
                       for _, per_seed in results]
            row = score(figure, real, replays)
            if row is not None:
                rows.append({"shape": shape, "destination": dest, **row})
    return rows


def _g(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def table(shape: str, prov: dict[str, Any], rows: list[dict[str, Any]],
          seeds: int, broken: str | None) -> list[str]:
    """The shape's figures as text: no clock, no path, the same bytes every time."""
    out = [f"{shape}: {prov['runs']} real runs recorded {prov['date']} "
           f"(Postfix {prov['postfix']}, {prov['machine']['cores']} cores); "
           f"each replayed over {seeds} seeds, held against the other runs"
           + (f"; BROKEN: {broken}" if broken else ""),
           f"  {'destination':<22} {'figure':<8} {'real min-median-max':<22} "
           f"{'replay median':>13} {'score real':>10} {'replay':>8} {'bar':>8} "
           f"{'in 80% real':>11} {'replay':>6}"]
    for r in rows:
        real = f"{_g(r['real_min'])}-{_g(r['real_median'])}-{_g(r['real_max'])}"
        out.append(f"  {r['destination']:<22} {r['figure']:<8} {real:<22} "
                   f"{_g(r['replay_median']):>13} {r['score_real']:>10.3f} "
                   f"{r['score_replay']:>8.3f} {r['bar']:>8.3f} "
                   f"{r['covered_real']:>11.0%} {r['covered_replay']:>6.0%}"
                   + ("" if r["faithful"] else "  MISSED"))
    return out


def markdown(shape: str, prov: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """The shape's table for benchmarks/README.md."""
    out = [f"**{shape}** ({prov['runs']} real runs, {prov['date']}, Postfix "
           f"{prov['postfix']}; scores: mean CRPS, lower is better)", "",
           "| destination | figure | real runs min-median-max | replay median | "
           "real against real | replay against real | bar | in central 80%: real, "
           "replay | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['destination']} | {r['figure']} | {_g(r['real_min'])}-"
                   f"{_g(r['real_median'])}-{_g(r['real_max'])} | {_g(r['replay_median'])} "
                   f"| {r['score_real']:.3f} | {r['score_replay']:.3f} | {r['bar']:.3f} | "
                   f"{r['covered_real']:.0%}, {r['covered_replay']:.0%} | "
                   f"{'faithful' if r['faithful'] else '**missed**'} |")
    return out + [""]


def gate(shapes: Sequence[str], where: str = RECORDINGS, seeds: int = SEEDS,
         broken: str | None = None) -> tuple[list[str], list[dict[str, Any]], list[str]]:
    """The verdict's text, every row, and the figures missed."""
    lines: list[str] = []
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        shape_rows = judge(shape, where, seeds, broken)
        lines += table(shape, provenance(shape, where), shape_rows, seeds, broken)
        rows += shape_rows
    missed = [f"{r['shape']} {r['destination']} {r['figure']}" for r in rows
              if not r["faithful"]]
    return lines, rows, missed


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="./dev bench fidelity",
        description="Replay fidelity on recorded real runs: each run's replay against "
                    "the runs it never saw, scored as the real runs score each other.")
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES),
                    help=f"a shape (repeat; default: {', '.join(DEFAULT)})")
    ap.add_argument("--seeds", type=int, default=SEEDS, help="simulated runs per replay")
    ap.add_argument("--json", metavar="FILE", help="also write every row there")
    ap.add_argument("--markdown", metavar="FILE",
                    help="also write each shape's table there, for benchmarks/README.md")
    ap.add_argument("--recordings", default=RECORDINGS, metavar="DIR",
                    help="where the recordings are (default: %(default)s)")
    ap.add_argument("--break", dest="broken", choices=sorted(BREAKS),
                    help="replay a deliberately wrong model: the gate must fail it")
    ap.add_argument("--record", metavar="SHAPE", choices=sorted(SHAPES),
                    help="make a new recording of SHAPE (real stock runs; root and "
                         "Postfix) instead of judging")
    ap.add_argument("--runs", type=int, default=10,
                    help="real runs a recording makes (with --record)")
    args = ap.parse_args(argv)
    if args.record:
        if args.runs < 3:
            ap.error("--runs must be 3 or more: each run is held out against the others")
        print(record(args.record, SHAPES[args.record], args.runs,
                     os.path.join(args.recordings, args.record)))
        return 0
    shapes = args.shape or list(DEFAULT)
    for shape in shapes:
        try:
            why = stale(shape, SHAPES[shape], args.recordings)
        except RuntimeError as exc:
            print(f"./dev bench fidelity: {exc}", file=sys.stderr)
            return 1
        if why:
            print(f"./dev bench fidelity: {why}", file=sys.stderr)
            return 1
    lines, rows, missed = gate(shapes, args.recordings, args.seeds, args.broken)
    for line in lines:
        print(line)
    if args.markdown:
        with open(args.markdown, "w") as f:
            for shape in shapes:
                f.writelines(line + "\n" for line in markdown(
                    shape, provenance(shape, args.recordings),
                    [r for r in rows if r["shape"] == shape]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seeds": args.seeds, "tolerance": TOLERANCE, "rows": rows}, f,
                      indent=1)
    checks = []
    for shape in shapes:
        mine = [r for r in rows if r["shape"] == shape]
        out = [f"{r['destination']} {r['figure']}" for r in mine if not r["faithful"]]
        checks.append(SHAPE_TARGETS[shape].check(
            not out, f"{len(out)} of {len(mine)} missed" + (f": {', '.join(out)}" if out else "")))
    return status(checks)
