"""The scheduler alone at a provider's size: a site's members and a transport's tenants.

Issue #44: a site at its limit was closed and opened at every delivery by walking
every member domain (6.9 ms a delivery with 10,000 members, 49.6 ms with 50,000), so
one provider MX serving many of the list's domains capped a whole qmgr at a few dozen
deliveries a second. A scope's gate now gates its members without visiting them;
this benchmark holds that, with no Postfix (the core alone, fed as the daemon feeds
it, CPU time a delivery):

* sites: one site (``site_concurrency_limit = 10``) with 30, 10,000 and 100,000 member
  domains, every member with mail waiting, 100,000 deliveries kept 10 in flight (the
  site full at every step: each delivery's end opens it, the next one closes it).
* tenants: 3 and 10,000 tenants sharing one transport's 30 destinations, one
  recipient a message, 100,000 deliveries 50 in flight: without tenant limits, and
  with ``tenant_concurrency_limit = 1`` and ``tenant_site_concurrency_limit = 2`` at a
  site of the 30 destinations (each tenant's mail beyond them staged and released as
  its deliveries end).

Targets (a miss exits 1): a delivery at 100,000 members costs at most ``RATIO`` times
one at 30; with 10,000 tenants at most ``RATIO`` times one with 3, with limits and
without. Each figure is the best of ``ROUNDS`` runs, the sizes taking turns (another
process only ever slows a run down).
"""

from __future__ import annotations

import argparse
import functools
import gc
import time
from collections import deque
from collections.abc import Callable

from benchmarks.decisions import _Params
from benchmarks.target import Target, status
from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.structures import SiteLimits, SiteTable
from pyqmgr.scheduler.tenant_cap import TenantLimits, TenantLimitTable

MEMBERS = (30, 10_000, 100_000)
TENANTS = (3, 10_000)
DESTINATIONS = 30
SITE_LIMIT = 10
ROUNDS = 3
#: The most a delivery may cost at the largest size against the smallest.
RATIO = 1.2
SITES = Target(f"a delivery with {MEMBERS[-1]:,} member domains at a site costs at most "
               f"{RATIO}x one with {MEMBERS[0]}")
TENANTS_FLAT = Target(f"a delivery with {TENANTS[-1]:,} tenants costs at most {RATIO}x one "
                      f"with {TENANTS[0]}, without tenant limits")
TENANTS_CAPPED = Target(f"a delivery with {TENANTS[-1]:,} tenants costs at most {RATIO}x "
                        f"one with {TENANTS[0]}, with tenant limits at destinations and at "
                        "their site")


def site_run(members: int, deliveries: int) -> float:
    """CPU seconds a delivery, one site at its limit with ``members`` domains."""
    domains = [f"d{i}.example" for i in range(members)]
    table = SiteTable(lambda t: SiteLimits(SITE_LIMIT, "site_concurrency_limit"),
                      pinned=dict.fromkeys(domains, "provider"))
    sched = Scheduler(lambda name: _Params(), active_limit=10**6, rcpt_limit=10**8,
                      sites=table)
    per = deliveries // members + 2
    message = Message("M0", 0.0)
    sched.read_limit(message)
    routes = [Route("smtp", d, d, Recipient(k, f"r{k}@{d}"))
              for k, d in enumerate(d for d in domains for _ in range(per))]
    sched.assign(message, routes, now=0.0)
    return _drive(sched, deliveries, SITE_LIMIT, step=0.01)


def tenant_run(tenants: int, deliveries: int, capped: bool) -> float:
    """CPU seconds a delivery, ``tenants`` sharing the transport's destinations."""
    limits = None
    table = None
    if capped:
        limits = TenantLimitTable(TenantLimits(limit=1, site_limit=2))
        table = SiteTable(lambda t: SiteLimits(0, "site_concurrency_limit"),
                          pinned={f"d{i}.example": "provider" for i in range(DESTINATIONS)})
    sched = Scheduler(lambda name: _Params(), active_limit=10**6, rcpt_limit=10**8,
                      sites=table, tenant_limits=limits)
    for k in range(deliveries + 200):
        m = Message(f"M{k}", 0.0)
        m.tenant = f"t{k % tenants}.example"
        sched.read_limit(m)
        d = f"d{k % DESTINATIONS}.example"
        sched.assign(m, [Route("smtp", d, d, Recipient(0, f"r{k}@{d}"))], now=0.0)
    return _drive(sched, deliveries, 50, step=0.001)


def _drive(sched: Scheduler, deliveries: int, width: int, step: float) -> float:
    """An agent loop: ``width`` deliveries in flight, the oldest ending first."""
    busy: deque = deque()
    made = 0
    now = 1.0
    start = time.process_time()
    while made < deliveries:
        entry = sched.select("smtp", now).deliver
        if entry is not None:
            busy.append(entry)
            made += 1
        if len(busy) >= width or entry is None:
            if not busy:
                raise RuntimeError(f"the core gave nothing to deliver after {made} "
                                   "deliveries with mail waiting")
            sched.done(busy.popleft(), 0, None, False, now)
            now += step
            sched.tick(now)
    return (time.process_time() - start) / deliveries


def best(runs: dict[int, Callable[[], float]]) -> dict[int, float]:
    """Each size's least cost over ROUNDS runs, the sizes taking turns within a round:
    a stretch when the machine is slow then costs every size a run, not one size all
    of its runs (the figures are compared with each other)."""
    out: dict[int, float] = {}
    for _ in range(ROUNDS):
        for size, run in runs.items():
            cost = run()
            out[size] = min(out.get(size, cost), cost)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deliveries", type=int, default=100_000,
                        help="deliveries each run times (default 100,000)")
    args = parser.parse_args(argv)
    gc.set_threshold(100_000, 50, 100)  # the daemon's setting (daemon/startup.py)
    n = args.deliveries
    sites = best({m: functools.partial(site_run, m, n) for m in MEMBERS})
    for members in MEMBERS:
        print(f"site at its limit of {SITE_LIMIT}, {members:>7,} member domains: "
              f"{sites[members] * 1e6:6.1f} us a delivery", flush=True)
    tenants: dict[bool, dict[int, float]] = {}
    for capped in (False, True):
        tenants[capped] = best({t: functools.partial(tenant_run, t, n, capped)
                                for t in TENANTS})
        for t in TENANTS:
            print(f"{t:>6,} tenants, {DESTINATIONS} destinations, "
                  f"{'limits 1 a destination, 2 a site' if capped else 'no tenant limits'}: "
                  f"{tenants[capped][t] * 1e6:6.1f} us a delivery", flush=True)
    return status(check(sites, tenants))


def check(sites: dict[int, float], tenants: dict[bool, dict[int, float]]) -> list[bool]:
    """The targets against the figures (seconds a delivery by size)."""
    grow = sites[MEMBERS[-1]] / sites[MEMBERS[0]]
    flat = tenants[False][TENANTS[-1]] / tenants[False][TENANTS[0]]
    capped = tenants[True][TENANTS[-1]] / tenants[True][TENANTS[0]]
    return [SITES.check(grow <= RATIO, f"{grow:.2f}x"),
            TENANTS_FLAT.check(flat <= RATIO, f"{flat:.2f}x"),
            TENANTS_CAPPED.check(capped <= RATIO, f"{capped:.2f}x")]


if __name__ == "__main__":
    raise SystemExit(main())
