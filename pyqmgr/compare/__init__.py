"""``pyqmgr compare``: one workload, several queue managers, each on real Postfix.

A workload is a scenario file (:mod:`pyqmgr.simulator.scenario`): :mod:`.plan` makes
it concrete, :mod:`.contender` names who runs it, :mod:`.runner` runs one contender on
a fresh sandboxed instance with a sink per destination (per MX host, behind real MX
records, for destinations that name one) and leaves the raw record (the maillog,
``run.json``), :mod:`.figures` computes one run's figures from that record, and
:mod:`.report` compares the runs and writes report.json, summary.md and report.html.
:func:`compare` does all of it in order.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from pyqmgr import extras
from pyqmgr.compare.contender import Contender, ContenderError, parse_contenders
from pyqmgr.compare.figures import run_figures
from pyqmgr.compare.plan import Plan, make_plan
from pyqmgr.compare.report import build, markdown, to_html
from pyqmgr.compare.runner import RunError, dns_lacking, run_contender
from pyqmgr.output import open_new, output_dir
from pyqmgr.simulator.scenario import Scenario, ScenarioError, load, locate

__all__ = ["ContenderError", "RunError", "ScenarioError", "compare", "load_plan"]

#: Contenders when neither --with nor the workload's [compare] contenders say.
DEFAULT_CONTENDERS = ["stock", "pyqmgr"]


def load_plan(path: str, scale: float | None = None) -> Plan:
    """The workload file as a concrete run; errors name the file and the line."""
    sc = load(path)
    try:
        return make_plan(sc, scale)
    except ScenarioError as exc:
        at = None
        if exc.key:
            with open(path, encoding="utf-8") as f:
                at = locate(f.read(), exc.key)
        raise ScenarioError(f"{path}, line {at}: {exc}" if at else f"{path}: {exc}",
                            exc.key, at) from None


def expected_seconds(sc: Scenario, contender: Contender, plan: Plan) -> float | None:
    """What the simulator predicts for the run (its first delivery pass), scaled.

    Only a hint for the progress display: the simulator does not retry deferred mail
    unless the workload models it, and real Postfix adds its own overheads.
    """
    from pyqmgr.simulator import simulate

    if plan.recipients > 100_000:
        return None
    try:
        trial = Scenario(**{**sc.__dict__, "pyqmgr_cf": contender.simulator_policy(sc)})
        return simulate(trial).end_time * plan.scale
    except Exception:
        return None


class Progress:
    """One line per contender on a terminal, rewritten in place; nothing otherwise."""

    def __init__(self, stream: TextIO, enabled: bool) -> None:
        self.stream = stream
        self.enabled = enabled
        self.expected: float | None = None
        self._last = 0.0

    def start(self, label: str, expected: float | None) -> None:
        self.expected = expected
        self._last = 0.0
        self.update(label, 0.0, 0, 0, force=True, state="starting Postfix")

    def update(self, label: str, elapsed: float, settled: int, total: int,
               force: bool = False, state: str = "running") -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.2:
            return
        self._last = now
        hint = f" / ~{self.expected:.0f} s" if self.expected else ""
        count = f", {settled}/{total} recipients done" if total else ""
        self.stream.write(f"\r\x1b[K{label:<28} {state}: {elapsed:6.1f} s{hint}{count}")
        self.stream.flush()

    def finish(self, label: str, text: str) -> None:
        if self.enabled:
            self.stream.write(f"\r\x1b[K{label:<28} {text}\n")
            self.stream.flush()


def compare(path: str, contenders: list[str] | None, out_dir: str,
            scale: float | None = None, timeout: float | None = None, keep: bool = False,
            progress: Progress | None = None, base_dir: str | None = None,
            on_run: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run every contender in turn and write the report; return report.json's content.

    Bad input raises ScenarioError or ContenderError before anything starts; a run that
    cannot be made (the testbed extra missing, Postfix not starting...) raises RunError
    after its clean-up.
    """
    plan = load_plan(path, scale)
    sc = plan.scenario
    if contenders:
        chosen = parse_contenders(contenders)
    else:
        chosen = parse_contenders(sc.compare.contenders or DEFAULT_CONTENDERS, sc.base_dir)
    limit = sc.compare.timeout if timeout is None else timeout
    # A run that cannot be made, said as such: else the first sink's import of aiosmtpd
    # would end the run with a bare ModuleNotFoundError.
    lacking = extras.missing("testbed")
    if lacking is not None:
        raise RunError(lacking)
    # Destinations that name MX hosts need unbound: said before the first run starts.
    lacking = dns_lacking(plan)
    if lacking is not None:
        raise RunError(f"{path}: {lacking}")
    output_dir(out_dir)
    runs = []
    for i, c in enumerate(chosen):
        run_dir = os.path.join(out_dir, "runs", f"{i + 1}-{c.slug}")
        if progress is not None:
            progress.start(c.label, expected_seconds(sc, c, plan))
        tick = (lambda label, e, s, n: progress.update(label, e, s, n)) if progress else None
        record = run_contender(plan, c, run_dir, limit, tick, keep, base_dir)
        with open(os.path.join(run_dir, "maillog"), encoding="utf-8",
                  errors="replace") as f:
            figures = run_figures(record, f.read())
        figures["run_dir"] = os.path.relpath(run_dir, out_dir)
        runs.append(figures)
        if progress is not None:
            done = (f"drained in {figures['drain_time']:.1f} s" if figures["drained"]
                    else f"NOT drained after {record.get('elapsed', 0):.0f} s")
            progress.finish(c.label, f"{done}, {figures['sent']} sent, "
                                     f"{figures['deferred']} deferred lines")
        if on_run is not None:
            on_run(figures)
    workload = {
        "path": os.path.relpath(path) if not os.path.isabs(path) else path,
        "title": sc.title, "time_scale": plan.scale, "seed": sc.seed,
        "messages": len(plan.arrivals), "recipients": plan.recipients,
        "destinations": sorted(plan.destinations), "main_cf": plan.main_cf,
        "classes": sorted({a.klass for a in plan.arrivals}),
        "servers": sc.fleet_servers,
        "mx_hosts": plan.mx_hosts,
        # Each MX host's session limit (its destinations agree on it), drawn on its
        # chart.
        "mx_limits": {host: plan.destinations[doms[0]].server_limit
                      for host, doms in plan.mx_hosts.items() if doms},
    }
    report = build(workload, runs, {c.label: limit for c in chosen})
    with open_new(os.path.join(out_dir, "report.json")) as f:
        json.dump(report, f, indent=1)
    with open_new(os.path.join(out_dir, "summary.md")) as f:
        f.write(markdown(report))
    with open_new(os.path.join(out_dir, "report.html")) as f:
        f.write(to_html(report))
    return report


def stderr_progress() -> Progress:
    return Progress(sys.stderr, sys.stderr.isatty())
