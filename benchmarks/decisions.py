"""Scheduling decisions per second with 10, 1,000 and 100,000 jobs in the active queue.

Two figures per size:

* core: the scheduler core alone in steady state. The active queue is loaded first
  (not timed); then an agent loop keeps 50 deliveries in flight, each decision being
  one ``select`` (nqmgr's preemption check, job walk, peer round robin) plus the
  ``done`` that feeds the window back and frees the entry.
* simulator: ``pyqmgr simulate`` end to end on the same load (arrivals, virtual clock,
  destination models, reports), total time divided by the decisions it made.

Then the core alone under each other built-in policy (oqmgr, finch, zmailer), with
the ratio of its slowest to its fastest size: 1.0 is flat.

The cost per decision should not grow with the number of jobs: stock's structures are
amortized O(1) per decision (candidate cache, blocker tags, linked lists), and so are
these. Targets (``RATE`` and ``FLAT``, checked at the end; a miss exits 1): at least
100,000 decisions per second on a 2-core machine, for every policy at every size, and
no policy slower with 100,000 jobs than with 10. Each core figure is the best of
``ROUNDS`` runs: another process on the machine only ever slows a run down, so the
best is the one closest to the code's own speed.
"""

from __future__ import annotations

import argparse
import gc
import time

from benchmarks.target import Target, status
from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.policy import BUILTIN, PolicyTable
from pyqmgr.settings.policies import load
from pyqmgr.simulator import simulate
from pyqmgr.simulator.scenario import parse

SIZES = (10, 1_000, 100_000)
DESTINATIONS = 100
#: Runs of each core measurement; the best is the figure.
ROUNDS = 3
#: Decisions a second the core makes at least, every policy and size.
MIN_RATE = 100_000
RATE = Target(f"the core at least {MIN_RATE:,} decisions/s, every policy at every size",
              goal="decisions-rate")
#: Growth beyond this factor from 10 to 100,000 jobs is not amortized O(1) (even
#: log n would be 5x over those four decades); below it, the run's own noise.
MAX_GROWTH = 1.10
FLAT = Target(f"no policy's core more than {MAX_GROWTH - 1:.0%} slower with "
              f"{SIZES[-1]:,} jobs than with {SIZES[0]}")


class _Params:
    """Stock's defaults, no concurrency limit, one recipient per delivery."""

    destination_concurrency_limit = 0
    destination_recipient_limit = 1
    initial_destination_concurrency = 5
    failed_cohort_limit = 1
    destination_rate_delay = 0
    transport_rate_delay = 0
    delivery_slot_cost = 5
    delivery_slot_loan = 3
    delivery_slot_discount = 50
    minimum_delivery_slots = 3
    recipient_limit = 20000
    extra_recipient_limit = 1000
    recipient_refill_limit = 100
    recipient_refill_delay = 5
    positive_feedback = "1/concurrency"
    positive_feedback_name = "default_destination_concurrency_positive_feedback"
    negative_feedback = "1/concurrency"
    negative_feedback_name = "default_destination_concurrency_negative_feedback"


def core_rate(jobs: int, decisions: int, policy: str = "nqmgr") -> float:
    table = PolicyTable(load(policy)) if policy != "nqmgr" else None
    sched = Scheduler(lambda name: _Params(), active_limit=jobs, rcpt_limit=10**8,
                      policies=table)
    per_job = decisions // jobs + 2
    for k in range(jobs):
        m = Message(f"M{k}", 0.0)
        sched.read_limit(m)
        sched.assign(m, [Route("smtp", f"r{i}@d{(k + i) % DESTINATIONS}",
                               f"d{(k + i) % DESTINATIONS}", Recipient(i, f"r{i}@x"))
                         for i in range(per_job)], now=0.0)
    busy = []
    made = 0
    start = time.perf_counter()
    while made < decisions:
        entry = sched.select("smtp", 1.0).deliver
        if entry is not None:
            busy.append(entry)
            made += 1
        if len(busy) >= 50 or entry is None:
            sched.done(busy.pop(0), 0, None, False, 1.0)
    return made / (time.perf_counter() - start)


def best_core_rate(jobs: int, decisions: int, policy: str = "nqmgr") -> float:
    """The best of ROUNDS runs of ``core_rate``."""
    return max(core_rate(jobs, decisions, policy) for _ in range(ROUNDS))


def simulator_rate(jobs: int, decisions: int) -> float:
    per_job = max(1, decisions // jobs)
    sc = parse({
        "main_cf": {"default_destination_concurrency_limit": "0",
                    "smtp_destination_recipient_limit": "1",
                    "qmgr_message_active_limit": str(jobs)},
        "transports": {"smtp": {"process_limit": 50}},
        "destinations": {f"d{i}.example": {"latency": 0.5} for i in range(DESTINATIONS)},
        "messages": [{"count": jobs // DESTINATIONS or 1, "recipients": per_job,
                      "destination": f"d{i}.example"}
                     for i in range(min(jobs, DESTINATIONS))],
    })
    start = time.perf_counter()
    res = simulate(sc)
    return res.decisions / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--decisions", type=int, default=200_000)
    args = parser.parse_args(argv)
    # The daemon's setting: with 100,000 jobs in core, default GC thresholds make
    # full collections dominate (see pyqmgr/daemon/startup.py).
    gc.set_threshold(100_000, 50, 100)
    rates: dict[str, list[float]] = {"nqmgr": []}
    for jobs in SIZES:
        core = best_core_rate(jobs, args.decisions)
        rates["nqmgr"].append(core)
        sim = simulator_rate(jobs, args.decisions)
        print(f"{jobs:>7} jobs: core {core:>9,.0f} decisions/s "
              f"({1e6 / core:5.1f} us each), simulator {sim:>9,.0f} decisions/s")
    # The other policies, core alone: flat in the number of jobs is what matters.
    for policy in BUILTIN:
        if policy == "nqmgr":
            continue
        rates[policy] = [best_core_rate(jobs, args.decisions // 2, policy) for jobs in SIZES]
        cells = ", ".join(f"{jobs:,} jobs {rate:>9,.0f}/s"
                          for jobs, rate in zip(SIZES, rates[policy], strict=True))
        print(f"{policy:>8}: core {cells}; slowest/fastest "
              f"{min(rates[policy]) / max(rates[policy]):.2f}")
    return status(check(rates))


def check(rates: dict[str, list[float]]) -> list[bool]:
    """The targets against each policy's core rates (one per size of SIZES)."""
    slowest = min(rates, key=lambda p: min(rates[p]))
    growth = {p: r[0] / r[-1] for p, r in rates.items()}
    steepest = max(growth, key=lambda p: growth[p])
    return [RATE.check(min(rates[slowest]) >= MIN_RATE,
                       f"slowest {slowest} {min(rates[slowest]):,.0f}/s"),
            FLAT.check(growth[steepest] <= MAX_GROWTH,
                       f"largest cost a decision at {SIZES[-1]:,} jobs against {SIZES[0]}: "
                       f"{steepest} {growth[steepest]:.2f}x")]


if __name__ == "__main__":
    raise SystemExit(main())
