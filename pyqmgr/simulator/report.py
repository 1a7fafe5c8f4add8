"""The printed result of a simulation: what an admin compares between two settings."""

from __future__ import annotations

from pyqmgr.simulator.engine import Result
from pyqmgr.simulator.scenario import Scenario


def summary(sc: Scenario, res: Result) -> list[str]:
    out = []
    if sc.title:
        out.append(sc.title)
    policies = {k: v for k, v in sorted(sc.pyqmgr_cf.items())
                if k == "scheduler_policy" or k.endswith("_scheduler_policy")}
    policy = ", ".join(f"{k} = {v}" for k, v in policies.items()) or "scheduler_policy = nqmgr"
    out.append(f"simulated {res.end_time:.1f} s, {len(res.deliveries)} deliveries, "
               f"{res.decisions} scheduling decisions ({policy})")
    bounced = f" {'bounced':>8}" if res.bounced else ""
    out.append(f"{'destination':<24} {'sent':>8} {'deferred':>8}{bounced} {'rate':>7} "
               f"{'mean conc':>9} {'max window':>10}")
    for dest in sorted(set(res.sent) | set(res.deferred) | set(res.bounced)):
        points = res.windows.get(dest, [])
        max_window = max((w for _, w, _ in points), default=0)
        bounced = f" {res.bounced.get(dest, 0):>8}" if res.bounced else ""
        out.append(f"{dest:<24} {res.sent.get(dest, 0):>8} {res.deferred.get(dest, 0):>8}"
                   f"{bounced} {res.deferral_rate(dest):>7.1%} "
                   f"{res.mean_concurrency(dest):>9.2f} {max_window:>10}")
    if sc.delegation is not None:
        held = ", ".join(f"{d} {n}" for d, n in sorted(res.held_back.items())) or "none"
        out.append(f"policy service: {res.asked} questions; held back: {held}; "
                   f"messages on hold: {res.held}; recipients rejected to error(8): "
                   f"{sum(res.rejected.values())}")
    if sc.retry_deferred:
        out += deferred(res)
    return out


def deferred(res: Result) -> list[str]:
    """The deferred-queue model: how the deferred mail came back, and the storm size."""
    by_scan = sum(1 for _, _, how in res.retries if how == "scan")
    recovered = len(res.retries) - by_scan
    busiest = max(res.scans, key=lambda s: s[1], default=None)
    out = [f"deferred queue: {by_scan} messages came back in {len(res.scans)} scans"
           + (f" (the busiest took {busiest[1]} at {busiest[0]:.0f} s)" if busiest else "")
           + f", {recovered} brought forward by recovery; {res.still_deferred} still "
           "deferred at the end"]
    came_back = {qid for _, qid, _ in res.retries}
    last = max((d.end for d in res.deliveries
                if d.outcome == "sent" and d.message in came_back), default=None)
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
    """Each destination's window and busy count whenever they changed."""
    out = []
    for dest, points in sorted(res.windows.items()):
        out.append(f"{dest}: " + " ".join(f"{t:.1f}:{w}/{b}" for t, w, b in points))
    return out
