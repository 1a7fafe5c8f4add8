"""The printed result of a simulation: what an admin compares between two settings.

Three readers, three shapes. A person gets :func:`summary`, a table short enough to
read whole; someone debugging a scenario also gets :func:`sequence` and
:func:`windows` (``pyqmgr simulate --trace``); a script gets :func:`as_json`, the same
figures under stable snake_case keys. The per-destination figures come from one place,
:func:`destination_rows`, so the table and the JSON cannot disagree.
"""

from __future__ import annotations

from typing import Any

from pyqmgr.simulator.engine import Result
from pyqmgr.simulator.scenario import Scenario
from pyqmgr.simulator.sources import summary_lines


def policies(sc: Scenario) -> dict[str, str]:
    """The scheduler policy settings in force, with stock's default spelled out."""
    chosen = {k: v for k, v in sorted(sc.pyqmgr_cf.items())
              if k == "scheduler_policy" or k.endswith("_scheduler_policy")}
    return chosen or {"scheduler_policy": "nqmgr"}


def destination_rows(res: Result) -> list[dict[str, Any]]:
    """Per destination, in name order: the figures of the summary table.

    A dict per row (keys as :func:`as_json` names them) so that the table and the JSON
    are two renderings of one computation.
    """
    rows = []
    for dest in sorted(set(res.sent) | set(res.deferred) | set(res.bounced)):
        points = res.windows.get(dest, [])
        rows.append({"destination": dest,
                     "sent": res.sent.get(dest, 0),
                     "deferred": res.deferred.get(dest, 0),
                     "bounced": res.bounced.get(dest, 0),
                     "deferral_rate": res.deferral_rate(dest),
                     "mean_concurrency": res.mean_concurrency(dest),
                     "max_window": max((w for _, w, _ in points), default=0)})
    return rows


def summary(sc: Scenario, res: Result) -> list[str]:
    """The title, one line on the run, and the per-destination table (then the policy
    service and deferred-queue lines when the scenario models them)."""
    out = []
    if sc.title:
        out.append(sc.title)
    policy = ", ".join(f"{k} = {v}" for k, v in policies(sc).items())
    fleet = (f"; a fleet of {sc.fleet_servers} servers sharing limits, reported as one "
             "sender" if sc.fleet_servers > 1 else "")
    out.append(f"simulated {res.end_time:.1f} s, {len(res.deliveries)} deliveries, "
               f"{res.decisions} scheduling decisions ({policy}){fleet}")
    rows = destination_rows(res)
    # Wide enough for the longest name, so that the figures stay in their columns.
    width = max([24] + [len(r["destination"]) for r in rows])
    bounced = f" {'bounced':>8}" if res.bounced else ""
    out.append(f"{'destination':<{width}} {'sent':>8} {'deferred':>8}{bounced} {'rate':>7} "
               f"{'mean conc':>9} {'max window':>10}")
    for r in rows:
        bounced = f" {r['bounced']:>8}" if res.bounced else ""
        out.append(f"{r['destination']:<{width}} {r['sent']:>8} {r['deferred']:>8}"
                   f"{bounced} {r['deferral_rate']:>7.1%} "
                   f"{r['mean_concurrency']:>9.2f} {r['max_window']:>10}")
    if sc.delegation is not None:
        held = ", ".join(f"{d} {n}" for d, n in sorted(res.held_back.items())) or "none"
        out.append(f"policy service: {res.asked} questions; held back: {held}; "
                   f"messages on hold: {res.held}; recipients rejected to error(8): "
                   f"{sum(res.rejected.values())}")
    if sc.retry_deferred:
        out += deferred(res)
    if res.sources is not None:
        out += summary_lines(res.sources)
    return out


def _came_back(res: Result) -> tuple[int, int, float | None]:
    """Messages back from the deferred queue by a scan and by recovery, and when the
    last of them was delivered (None if none was)."""
    by_scan = sum(1 for _, _, how in res.retries if how == "scan")
    qids = {qid for _, qid, _ in res.retries}
    last = max((d.end for d in res.deliveries
                if d.outcome == "sent" and d.message in qids), default=None)
    return by_scan, len(res.retries) - by_scan, last


def deferred(res: Result) -> list[str]:
    """The deferred-queue model: how the deferred mail came back, and the storm size."""
    by_scan, recovered, last = _came_back(res)
    busiest = max(res.scans, key=lambda s: s[1], default=None)
    out = [f"deferred queue: {by_scan} messages came back in {len(res.scans)} scans"
           + (f" (the busiest took {busiest[1]} at {busiest[0]:.0f} s)" if busiest else "")
           + f", {recovered} brought forward by recovery; {res.still_deferred} still "
           "deferred at the end"]
    if last is not None:
        out.append(f"mail that was deferred: the last delivered at {last:.0f} s")
    out += [f"{when:10.3f} {text}" for when, _, text in res.log
            if text.startswith("deferred recovery: ")]
    return out


def sequence(res: Result) -> list[str]:
    """Each delivery: when it started and ended, where, for which message, how it went."""
    return [f"{d.start:10.3f} {d.end:10.3f} {d.transport}/{d.destination} {d.message} "
            f"x{d.recipients} {d.outcome} window={d.window}"
            + (f" ({d.reason})" if d.reason else "") for d in res.deliveries]


def windows(res: Result) -> list[str]:
    """Each destination's window and busy count whenever they changed: a header, then
    one aligned line per change point.

    One line per point rather than one per destination: a destination changes its
    window thousands of times in a long run, and a line that long can be neither read
    nor grepped.
    """
    rows = [(dest, f"{t:.3f}", w, b)
            for dest, points in sorted(res.windows.items()) for t, w, b in points]
    dw = max([len("destination")] + [len(r[0]) for r in rows])
    tw = max([len("time")] + [len(r[1]) for r in rows])
    out = [f"{'destination':<{dw}}  {'time':>{tw}}  {'window':>6}  {'busy':>4}"]
    out += [f"{dest:<{dw}}  {t:>{tw}}  {w:>6}  {b:>4}" for dest, t, w, b in rows]
    return out


def _time(t: float) -> float:
    """A virtual time for JSON: always a float (a scan at 300 is 300.0), to the
    microsecond, without float noise such as 0.30000000000000004."""
    return float(round(t, 6))


def as_json(sc: Scenario, res: Result, trace: bool = False, *, scenario: str = "",
            seed: int | None = None) -> dict[str, Any]:
    """The summary as one JSON-ready dict; with ``trace``, the deliveries and window
    points too.

    Every key is always present (``null`` or empty when the scenario does not model
    that part, ``trace`` null without --trace), so that a script can index without
    checking first. Keys are snake_case and are part of the interface: add, never rename.
    """
    destinations = {}
    for r in destination_rows(res):
        row = dict(r)
        destinations[row.pop("destination")] = row
    policy_service = None
    if sc.delegation is not None:
        policy_service = {"questions": res.asked, "held_back": dict(sorted(res.held_back.items())),
                          "messages_on_hold": res.held,
                          "recipients_rejected": sum(res.rejected.values())}
    deferred_queue = None
    if sc.retry_deferred:
        by_scan, recovered, last = _came_back(res)
        deferred_queue = {"came_back_by_scan": by_scan, "brought_forward": recovered,
                          "still_deferred": res.still_deferred,
                          "last_delivered": None if last is None else _time(last),
                          "scans": [{"time": _time(t), "messages": n} for t, n in res.scans]}
    doc: dict[str, Any] = {
        "scenario": scenario, "title": sc.title,
        "seed": sc.seed if seed is None else seed, "policy": policies(sc),
        "simulated_seconds": _time(res.end_time), "deliveries": len(res.deliveries),
        "decisions": res.decisions, "destinations": destinations,
        "policy_service": policy_service, "deferred_queue": deferred_queue,
        "sources": res.sources, "trace": None}
    if trace:
        doc["trace"] = {
            "deliveries": [{"start": _time(d.start), "end": _time(d.end),
                            "transport": d.transport, "destination": d.destination,
                            "message": d.message, "recipients": d.recipients,
                            "outcome": d.outcome, "window": d.window, "reason": d.reason}
                           for d in res.deliveries],
            "windows": {dest: [{"time": _time(t), "window": w, "busy": b}
                               for t, w, b in points]
                        for dest, points in sorted(res.windows.items())}}
    return doc
