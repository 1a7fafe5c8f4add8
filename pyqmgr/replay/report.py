"""The replay's figures, the log's and each simulated choice's, side by side.

Per destination: recipients sent, deferred (one per deferred try, as the log has a
line per recipient and try), bounced, and the p50 and p95 delay of sent recipients
from their message's arrival (Postfix's ``delay``). Mail queued before the log
began is left out of the delays on both sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pyqmgr.compare.figures import percentile
from pyqmgr.replay.derive import Derived
from pyqmgr.replay.sources import text_lines
from pyqmgr.simulator.engine import Result


@dataclass
class Figures:
    sent: int = 0
    deferred: int = 0
    bounced: int = 0
    p50: float | None = None
    p95: float | None = None


def _pct(values: Sequence[float], p: float) -> float | None:
    v = percentile(list(values), p)
    return None if v is None else round(v, 3)


def log_figures(derived: Derived, names: dict[str, str]) -> dict[str, Figures]:
    """Per workload destination name, from the log."""
    by_domain = {dom: name for name, dom in names.items()}
    out = {}
    for dom, obs in derived.destinations.items():
        out[by_domain[dom]] = Figures(obs.sent, obs.deferred, obs.bounced,
                                      _pct(obs.delays, 50), _pct(obs.delays, 95))
    return out


def sim_figures(results: Sequence[Result]) -> dict[str, Figures]:
    """Per destination, over one or more runs: the counts' means (rounded) and the
    percentiles of all runs' delays together."""
    out = {}
    k = len(results)
    dests = set().union(*(set(r.sent) | set(r.deferred) | set(r.bounced) for r in results))
    for dest in dests:
        delays = [x for r in results for x in r.delays.get(dest, [])]
        out[dest] = Figures(round(sum(r.sent.get(dest, 0) for r in results) / k),
                            round(sum(r.deferred.get(dest, 0) for r in results) / k),
                            round(sum(r.bounced.get(dest, 0) for r in results) / k),
                            _pct(delays, 50), _pct(delays, 95))
    return out


def sim_ranges(results: Sequence[Result]) -> dict[str, dict[str, list[float | None]]]:
    """Per destination, the lowest and highest of each figure over the runs: what the
    replayed system's chance alone spreads one log's figures over (a destination near
    a limit can defer half again as often from one real run to the next)."""
    out: dict[str, dict[str, list[float | None]]] = {}
    per_run = [sim_figures([r]) for r in results]
    for dest in sorted(set().union(*(set(f) for f in per_run))):
        row: dict[str, list[float | None]] = {}
        for key in ("sent", "deferred", "bounced", "p50", "p95"):
            vals = [getattr(f[dest], key) for f in per_run if dest in f]
            vals = [v for v in vals if v is not None]
            row[key] = [min(vals), max(vals)] if vals else [None, None]
        out[dest] = row
    return out


def as_dict(figures: dict[str, Figures]) -> dict[str, dict[str, Any]]:
    return {name: asdict(f) for name, f in sorted(figures.items())}


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _span(lo_hi: list[float | None]) -> str:
    lo, hi = lo_hi
    if lo is None or hi is None:
        return "-"
    return _num(lo) if lo == hi else f"{_num(lo)}-{_num(hi)}"


def _ratio(sim: float | None, log: float | None) -> str:
    if sim is None or log is None:
        return ""
    if log == 0:
        return "" if sim == 0 else "(+)"
    return f"({sim / log - 1:+.0%})"


#: Destinations in the text report: the busiest in the log.
ROWS = 25


def text(report: dict[str, Any], rows: int = ROWS) -> list[str]:
    """The report for a person: what was read, then each instance's table (its
    ``rows`` busiest destinations; 0: all)."""
    inp = report["input"]
    skipped = sum(inp["skipped"].values())
    names = {i["instance"].partition("#")[0] for i in report["instances"]}
    stretches = len(report["instances"])
    out = [f"pyqmgr replay: {inp['files']} file(s), {inp['lines']} lines, {skipped} "
           f"skipped, {len(names)} Postfix instance(s)"
           + (f" in {stretches} stretches" if stretches > len(names) else "")]
    for reason, n in sorted(inp["skipped"].items(), key=lambda kv: -kv[1]):
        out.append(f"  skipped: {n} {reason}")
    for inst in report["instances"]:
        out += [""] + _instance(inst, rows)
    return out


def _accounts(inst: dict[str, Any]) -> list[str]:
    """What became of the instance's messages and lines: warnings, messages by what
    became of them, what was fitted instance-wide, lines skipped or not used."""
    msgs = inst["messages"]
    out: list[str] = []
    for warning in inst.get("warnings", []):
        out.append(f"  warning: {warning}")
    replayed_as = ("queued before the log", "in the active queue as the log began",
                   "missing qmgr line", "re-injected by a content filter")
    not_replayed = ("never queued", "no delivery lines")
    for what, n in sorted(msgs.items()):
        if what != "replayed" and n:
            how = ("of them " if what in replayed_as
                   else "not replayed: " if what in not_replayed else "")
            out.append(f"  {n} {how}{what}")
    for note in inst.get("notes", []):
        out.append(f"  {note}")
    for what, n in sorted(inst["lines"].items()):
        out.append(f"  skipped: {n} {what}")
    unused = inst.get("unused", {})
    if unused:
        total = sum(unused.values())
        read = max(inst.get("read", 0), 1)
        out.append(f"  not used: {total} of {inst.get('read', 0)} lines ({total / read:.0%}), "
                   "by kind:")
        for what, n in sorted(unused.items(), key=lambda kv: (-kv[1], kv[0])):
            out.append(f"    {n} {what}")
    return out


def _instance(inst: dict[str, Any], rows: int) -> list[str]:
    msgs = inst["messages"]
    out = [f"{inst['instance']}: {msgs.get('replayed', 0)} messages replayed over "
           f"{inst['span']:.0f} s of log"]
    out += _accounts(inst)
    runs = inst["runs"]
    if not inst["figures"]["log"]:
        out.append("  nothing to replay")
        return out
    labels = ["log"] + list(runs)
    width = max(21, *(len(d) for d in inst["figures"]["log"]))
    head = f"{'destination':<{width}}"
    sub = " " * width
    for label in labels:
        head += f" | {label[:44]:<44}"
        sub += f" | {'sent':>6} {'deferred':>8} {'bounced':>7} {'p50 s':>9} {'p95 s':>9}"
    out += ["", head, sub]
    log = inst["figures"]["log"]
    busiest = sorted(log, key=lambda d: (-(log[d]["sent"] + log[d]["deferred"]), d))
    shown = sorted(busiest[:rows]) if rows else sorted(log)
    ranges = inst.get("ranges", {})
    spread = any(runs.get(label, {}).get("runs", 1) > 1 for label in ranges)
    for dest in shown:
        row = f"{dest:<{width}}"
        span = f"{'  range over the runs':<{width}}"
        for label in labels:
            f = inst["figures"][label].get(dest, {})
            base = log[dest]
            row += f" | {f.get('sent', 0):>6} {f.get('deferred', 0):>8} {f.get('bounced', 0):>7}"
            p50 = _num(f.get("p50")) + ("" if label == "log" else _ratio(f.get("p50"),
                                                                          base["p50"]))
            p95 = _num(f.get("p95")) + ("" if label == "log" else _ratio(f.get("p95"),
                                                                          base["p95"]))
            row += f" {p50:>9} {p95:>9}"
            r = ranges.get(label, {}).get(dest)
            span += " | " + (" ".join(f"{_span(r[k]):>{w}}" for k, w in (
                ("sent", 6), ("deferred", 8), ("bounced", 7), ("p50", 9), ("p95", 9)))
                if r is not None else " " * 43)
        out.append(row)
        if spread:
            out.append(span.rstrip())
    if len(shown) < len(log):
        out.append(f"... and {len(log) - len(shown)} more destinations (--all or --json "
                   "for every one)")
    fitted = any(("server_limit" in n or "rate_limit" in n) for m in inst["model"]
                 for n in m["notes"])
    out += ["", "what the log shows of each destination (the simulation plays it):"]
    if fitted and inst.get("fitted_on", "this log") == "this log":
        out.append("  (limits fitted on this log itself, whose figures they are held against: "
                   "--fit-on another day's log to hold them apart)")
    elif inst.get("fitted_on", "this log") != "this log":
        out.append(f"  (limits fitted on {inst['fitted_on']}, not on this log)")
    for m in inst["model"]:
        if m["destination"] not in shown:
            continue
        notes = "; ".join(m["notes"]) or "accepted every session"
        out.append(f"  {m['destination']} ({m['transport']}): {notes}")
    for label, run in runs.items():
        if run.get("on_postfix"):
            how = (f"drained in {run['seconds']:.1f} s" if run["drained"]
                   else "did NOT drain within the timeout")
            out.append(f"{label}: {how}; its maillog and report: {run['run_dir']}")
            continue
        runs_note = (f"{run['runs']} runs, seeds {run['seeds'][0]}-{run['seeds'][-1]}, "
                     "counts their mean and delays all together; "
                     if run.get("runs", 1) > 1 else "")
        out.append(f"{label}: simulated in {run['seconds']:.1f} s ({runs_note}"
                   f"{run['deliveries']} deliveries, {run['decisions']} scheduling "
                   "decisions a run" + (f"; {run['expired']} messages expired" if
                                        run.get("expired") else "") + ")")
    if "compare_report" in inst:
        out.append(f"the runs on Postfix side by side: {inst['compare_report']}")
    if "sources" in inst:
        out += text_lines(inst["sources"], rows)
    return out
