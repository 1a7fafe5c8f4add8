"""``pyqmgr replay``: a real maillog made into a workload, and replayed.

:mod:`pyqmgr.postfix.maillog` reads the files, :mod:`.derive` turns lines into
arrivals and destination behaviour, :mod:`.workload` writes them as a scenario, and
the simulator runs that scenario under each chosen scheduler; :mod:`.report` holds
each run's figures against the log's.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pyqmgr.compare.contender import Contender
from pyqmgr.postfix.maillog import Reader
from pyqmgr.replay.derive import GAP, Derived, Deriver, relay_nexthop
from pyqmgr.replay.report import as_dict, log_figures, sim_figures, sim_ranges
from pyqmgr.replay.sources import members, sim_rows, without_pools
from pyqmgr.replay.timing import retry_timing
from pyqmgr.replay.workload import build, sites_of
from pyqmgr.simulator.engine import simulate
from pyqmgr.simulator.scenario import Destination, Scenario


@dataclass
class Options:
    contenders: list[Contender]
    main_cf: dict[str, str] = field(default_factory=dict)
    process_limits: dict[str, int] = field(default_factory=dict)
    hash_addresses: bool = True
    hash_key: bytes | None = None
    year: int | None = None
    #: Instances to replay ("host/syslog_name" or "syslog_name"); empty: all.
    instances: list[str] = field(default_factory=list)
    seed: int = 1
    #: Simulations per contender, seeds ``seed``, ``seed + 1``...; None: as many as
    #: fit in AUTO_RECIPIENTS (at most AUTO_RUNS).
    runs: int | None = None
    #: A silence this long (seconds) cuts the log into stretches replayed apart.
    gap: float = GAP
    #: Fit destinations' limits on these logs (another day's, another run's) rather
    #: than on the log replayed, whose figures they are then held against.
    fit_on: list[str] = field(default_factory=list)
    #: Group destinations by the servers their relay= fields name (issue #33): each
    #: workload destination names its server as ``mx``.
    sites: bool = False
    #: The logged relay's source pools (pyqmgr.cf's, :func:`.sources.pool_settings`):
    #: its members' tries are read per source and server, and replayed through the
    #: pools (sites on: the rules are per server). Empty: no pools, as before.
    pools: dict[str, str] = field(default_factory=dict)


#: One simulation is one draw of the replayed system's chance (agent hand-offs,
#: the shares of unscripted answers), and a destination at its limit turns small
#: differences into different retries: the figures are pooled over several runs,
#: as many as keep the recipients simulated under this (a busy day's log: one).
AUTO_RECIPIENTS = 200_000
AUTO_RUNS = 5


def runs_for(sc: Scenario, runs: int | None) -> int:
    if runs is not None:
        return max(1, runs)
    recipients = sum(n for m in sc.trace for _, n, _ in m.recipients)
    return max(1, min(AUTO_RUNS, AUTO_RECIPIENTS // max(1, recipients)))


Progress = Callable[[str], None]


def derive(paths: list[str], opts: Options,
           progress: Progress | None = None) -> tuple[Reader, dict[str, Derived]]:
    reader = Reader(paths, opts.year)
    pool = frozenset(members(opts.pools))
    deriver = Deriver(opts.hash_addresses, opts.hash_key, opts.seed, opts.gap,
                      relay_nexthop(opts.main_cf.get("relayhost", "")),
                      opts.sites or bool(pool), pool)
    if progress is None:
        deriver.feed(reader)
    else:
        def counted() -> Any:
            for n, line in enumerate(reader, 1):
                if n % 200_000 == 0:
                    progress(f"read {n:,} Postfix lines")
                yield line
        deriver.feed(counted())
    instances = deriver.finish()
    if reader.last is not None:
        # The log's end (other instances' lines too) for each instance's last
        # stretch; an earlier stretch ends at its own last line.
        last: dict[str, str] = {}
        for k in sorted(instances, key=lambda x: int(x.partition("#")[2] or 1)):
            last[k.partition("#")[0]] = k
        for k in last.values():
            instances[k].end = reader.last
    if opts.instances:
        def wanted(k: str) -> bool:
            base = k.partition("#")[0]
            return base in opts.instances or base.partition("/")[2] in opts.instances
        instances = {k: v for k, v in instances.items() if wanted(k)}
    return reader, instances


def replay(paths: list[str], opts: Options, progress: Progress | None = None,
           workloads: dict[str, Scenario] | None = None) -> dict[str, Any]:
    """Read, derive, simulate; the report as a JSON-ready dict.

    ``workloads`` (if given) receives each instance's scenario, for writing out.
    """
    reader, instances = derive(paths, opts, progress)
    fits: dict[str, Destination] | None = None
    fitted_on = "this log"
    if opts.fit_on:
        fits, fitted_on = fit(opts, progress), ", ".join(opts.fit_on)
    report: dict[str, Any] = {
        "input": {"files": reader.files, "lines": reader.lines,
                  "skipped": dict(reader.skipped), "paths": reader.paths},
        "instances": []}
    for name, derived in sorted(instances.items()):
        sc, models, names = build(derived, opts.main_cf, opts.process_limits, opts.seed,
                                  fits, fitted_on, opts.pools)
        if workloads is not None:
            workloads[name] = sc
        inst: dict[str, Any] = {
            "instance": name, "span": round(max(derived.end - derived.origin, 0.0), 3),
            "messages": dict(derived.messages), "lines": dict(derived.lines),
            "read": derived.read, "unused": dict(derived.unused),
            "warnings": list(derived.warnings), "notes": derived.notes,
            "fitted_on": fitted_on,
            "model": [{"destination": m.destination, "transport": m.transport,
                       "notes": m.notes} for m in models],
            "figures": {"log": as_dict(log_figures(derived, names))}, "runs": {},
            "ranges": {}}
        # The log's own retry timers against the replay's: a contradiction is said
        # with the -o that fits (issue #43), before any figure is read.
        timing = retry_timing(derived.retries, sc.main_cf)
        if timing is not None:
            inst["retry_timing"] = timing.as_dict()
            said = timing.warning()
            if said is not None:
                inst["warnings"].append(said)
        if opts.sites or derived.source_report is not None:
            inst["sites"] = sites_of(sc)
        if derived.source_report is not None:
            inst["sources"] = derived.source_report
        if sc.trace:
            k = runs_for(sc, opts.runs)
            pools = sc.pyqmgr_cf
            for contender in opts.contenders:
                # Postfix's own queue managers have no pools: trivial-rewrite's
                # transport, the default address, no server's rule for a source.
                run_sc = sc if contender.qmgr == "pyqmgr" or not pools else \
                    without_pools(sc)
                run_sc.pyqmgr_cf = contender.simulator_policy(run_sc)
                t0 = time.monotonic()
                results = []
                for i in range(k):
                    if progress is not None:
                        progress(f"{name}: simulating {len(sc.trace):,} messages under "
                                 f"{contender.label}" + (f" ({i + 1}/{k})" if k > 1 else ""))
                    results.append(simulate(run_sc, seed=opts.seed + i, record=False))
                if run_sc is sc:
                    sc.pyqmgr_cf = pools
                if derived.source_report is not None:
                    derived.source_report["figures"][contender.label] = sim_rows(
                        [r.sources for r in results if r.sources is not None],
                        functools.partial(_server_of, sc))
                inst["figures"][contender.label] = as_dict(sim_figures(results))
                inst["ranges"][contender.label] = sim_ranges(results)
                inst["runs"][contender.label] = {
                    "seconds": round(time.monotonic() - t0, 3), "runs": k,
                    "seeds": [opts.seed + i for i in range(k)],
                    "deliveries": sum(sum(r.sent.values()) + sum(r.deferred.values())
                                      + sum(r.bounced.values()) for r in results) // k,
                    "decisions": sum(r.decisions for r in results) // k,
                    "expired": round(sum(r.expired for r in results) / k)}
        report["instances"].append(inst)
    return report


def _server_of(sc: Scenario, site: str) -> str:
    """The server of a simulated site: its destination's MX host where the site is a
    destination (sites off), else the site as named (the MX host)."""
    dest = sc.destinations.get(site)
    return (dest.mx or site) if dest is not None else site


def fit(opts: Options, progress: Progress | None = None) -> dict[str, Destination]:
    """Each destination's limits as fitted on ``opts.fit_on`` (by log domain; where
    instances disagree, the one that saw the destination most)."""
    fit_opts = dataclasses.replace(opts, fit_on=[])
    _, instances = derive(opts.fit_on, fit_opts, progress)
    best: dict[str, tuple[int, Destination]] = {}
    for derived in instances.values():
        sc, _, names = build(derived, opts.main_cf, opts.process_limits, opts.seed)
        for name, dom in names.items():
            obs = derived.destinations[dom]
            tries = obs.sent + obs.deferred + obs.bounced
            if dom not in best or tries > best[dom][0]:
                best[dom] = (tries, sc.destinations[name])
    return {dom: dest for dom, (_, dest) in best.items()}


def on_postfix(inst: dict[str, Any], sc: Scenario, contenders: list[str], out_dir: str,
               scale: float, timeout: float | None = None,
               compare_progress: Any = None) -> dict[str, Any]:
    """Run the replayed instance's workload on real Postfix, each contender in turn
    (``pyqmgr compare``), and add each run's figures, read back from its own maillog
    as the log's were, to ``inst`` under "LABEL on Postfix". The compare report
    (HTML, JSON, each run's maillog) is in ``out_dir``; its report.json is returned.

    A run lasts ``scale`` times the log's time, so its delays are divided by it to
    stand next to the log's. The runs go on until the queue drains, where the
    simulation stops at the log's end: mail the log left deferred is delivered.
    """
    from pyqmgr.compare import compare
    from pyqmgr.compare.plan import seconds
    from pyqmgr.postfix.config import QmgrConfig
    from pyqmgr.replay.workload import write

    # The retry timers run at the same speed-up as everything else, or retried mail
    # would wait in the run's seconds what it waited in the log's.
    cfg = QmgrConfig.from_text("".join(f"{k} = {v}\n" for k, v in sc.main_cf.items()),
                               hostname="replay.example")
    timers = {"minimal_backoff_time": cfg.minimal_backoff_time,
              "maximal_backoff_time": cfg.maximal_backoff_time,
              "queue_run_delay": cfg.queue_run_delay}
    run_sc = dataclasses.replace(sc, compare=dataclasses.replace(
        sc.compare, main_cf={k: seconds(v * scale) for k, v in timers.items()},
        timeout=timeout if timeout is not None else sc.duration * scale * 2 + 300))
    path = write(run_sc, os.path.join(out_dir, "workload"))
    report = compare(path, contenders, out_dir, scale, timeout, progress=compare_progress)
    for label, run in report["runs"].items():
        t0 = time.monotonic()
        maillog = os.path.join(out_dir, run["run_dir"], "maillog")
        _, runs = derive([maillog], Options([]))
        figures: dict[str, dict[str, Any]] = {}
        for derived in runs.values():
            names = {dom: dom for dom in derived.destinations}
            for dest, f in as_dict(log_figures(derived, names)).items():
                for key in ("p50", "p95"):
                    if f[key] is not None:
                        f[key] = round(f[key] / scale, 3)
                figures[dest] = f
        key = f"{label} on Postfix"
        inst["figures"][key] = figures
        inst["runs"][key] = {
            "seconds": round(run.get("drain_time") or 0.0, 3), "on_postfix": True,
            "drained": run["drained"], "read_in": round(time.monotonic() - t0, 3),
            "run_dir": os.path.join(out_dir, run["run_dir"])}
    inst["compare_report"] = os.path.join(out_dir, "report.html")
    return report
