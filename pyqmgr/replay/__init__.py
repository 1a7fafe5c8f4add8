"""``pyqmgr replay``: a real maillog made into a workload, and replayed.

:mod:`pyqmgr.postfix.maillog` reads the files, :mod:`.derive` turns lines into
arrivals and destination behaviour, :mod:`.workload` writes them as a scenario, and
the simulator runs that scenario under each chosen scheduler; :mod:`.report` holds
each run's figures against the log's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pyqmgr.compare.contender import Contender
from pyqmgr.postfix.maillog import Reader
from pyqmgr.replay.derive import Derived, Deriver
from pyqmgr.replay.report import as_dict, log_figures, sim_figures
from pyqmgr.replay.workload import build
from pyqmgr.simulator.engine import simulate
from pyqmgr.simulator.scenario import Scenario


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


Progress = Callable[[str], None]


def derive(paths: list[str], opts: Options,
           progress: Progress | None = None) -> tuple[Reader, dict[str, Derived]]:
    reader = Reader(paths, opts.year)
    deriver = Deriver(opts.hash_addresses, opts.hash_key, opts.seed)
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
        for d in instances.values():
            d.end = reader.last
    if opts.instances:
        instances = {k: v for k, v in instances.items()
                     if k in opts.instances or k.partition("/")[2] in opts.instances}
    return reader, instances


def replay(paths: list[str], opts: Options, progress: Progress | None = None,
           workloads: dict[str, Scenario] | None = None) -> dict[str, Any]:
    """Read, derive, simulate; the report as a JSON-ready dict.

    ``workloads`` (if given) receives each instance's scenario, for writing out.
    """
    reader, instances = derive(paths, opts, progress)
    report: dict[str, Any] = {
        "input": {"files": reader.files, "lines": reader.lines,
                  "skipped": dict(reader.skipped), "paths": reader.paths},
        "instances": []}
    for name, derived in sorted(instances.items()):
        sc, models, names = build(derived, opts.main_cf, opts.process_limits, opts.seed)
        if workloads is not None:
            workloads[name] = sc
        inst: dict[str, Any] = {
            "instance": name, "span": round(max(derived.end - derived.origin, 0.0), 3),
            "messages": dict(derived.messages), "lines": dict(derived.lines),
            "model": [{"destination": m.destination, "transport": m.transport,
                       "notes": m.notes} for m in models],
            "figures": {"log": as_dict(log_figures(derived, names))}, "runs": {}}
        if sc.trace:
            for contender in opts.contenders:
                sc.pyqmgr_cf = contender.simulator_policy(sc)
                if progress is not None:
                    progress(f"{name}: simulating {len(sc.trace):,} messages under "
                             f"{contender.label}")
                t0 = time.monotonic()
                res = simulate(sc, record=False)
                inst["figures"][contender.label] = as_dict(sim_figures(res))
                inst["runs"][contender.label] = {
                    "seconds": round(time.monotonic() - t0, 3),
                    "deliveries": sum(res.sent.values()) + sum(res.deferred.values())
                    + sum(res.bounced.values()),
                    "decisions": res.decisions}
            sc.pyqmgr_cf = {}
        report["instances"].append(inst)
    return report
