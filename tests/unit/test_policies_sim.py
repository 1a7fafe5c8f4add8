"""The seed's schedulers in the simulator: what each one promises, measured.

finch (Tony Finch's first come, first served with allowed_new_worker) shares the
transport's agents between big envelopes by a formula; zmailer keeps one agent per
destination thread and runs threads in age order; oqmgr's round robin by destination
gives a busy destination 1/k of the deliveries. Every number comes from the scheduler
core the daemon runs; the simulator only plays the servers. The scenario files are the
shipped seed examples in scenarios/ (``pyqmgr simulate scenarios/NAME.toml``).
"""

from __future__ import annotations

import math
import os
import tomllib
from collections import defaultdict
from typing import Any

import pytest

from pyqmgr.simulator import load, simulate
from pyqmgr.simulator.engine import Delivery, Result
from pyqmgr.simulator.scenario import parse

SCENARIOS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "scenarios")
EXPONENTIAL = {"dist": "exponential", "mean": 1}
#: finch's defaults: finch_max_message_concurrency, finch_scale_max_concurrency.
MAX_CONC, SCALE = 10, 10


def scenario_file(name: str) -> dict[str, Any]:
    with open(os.path.join(SCENARIOS, name + ".toml"), "rb") as f:
        return tomllib.load(f)


def finch_alone(workers: int) -> int:
    """Deliveries one message reaches on an idle transport: fill while allowed.

    allowed_new_worker: concurrency < max_message_concurrency, or concurrency <
    scale * free workers (free = workers - deliveries in flight, all of them its own).
    """
    c = 0
    while c < workers and (c < MAX_CONC or c < SCALE * (workers - c)):
        c += 1
    return c


def finch_equilibrium(workers: int, messages: int) -> float:
    """Each of ``messages`` level messages: c = scale * (workers - messages * c)."""
    return SCALE * workers / (1 + messages * SCALE)


def concurrency(deliveries: list[Delivery], t0: float, t1: float) -> float:
    """Time-weighted mean of these deliveries in flight over [t0, t1]."""
    busy = sum(max(0.0, min(d.end, t1) - max(d.start, t0)) for d in deliveries)
    return busy / (t1 - t0)


def peak(intervals: list[tuple[float, float]]) -> int:
    """Most intervals open at once (one that ends as another starts does not overlap)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def of(res: Result, message: str) -> list[Delivery]:
    return [d for d in res.deliveries if d.message == message]


# -- finch -----------------------------------------------------------------------------

def test_finch_theory_at_the_process_limits_used():
    # 42 workers is where the integers work out: 10 * 42 / 21 = 20 exactly for two
    # messages, and one message alone stops at 39 (39/42 = 92.9%, the continuous
    # 10/11 being 90.9%). With 22 workers one alone holds exactly 20 (90.9%), but two
    # alternate between 10 and 11 (10 * 22 / 21 = 10.48).
    assert finch_alone(42) == 39 and finch_alone(22) == 20
    assert finch_equilibrium(42, 2) == 20
    assert math.isclose(finch_equilibrium(22, 1), 20)


def test_finch_one_big_envelope_holds_ten_elevenths_of_the_agents():
    for workers in (22, 42):
        data = scenario_file("finch-big-envelopes")
        data["transports"]["smtp"]["process_limit"] = workers
        data["messages"] = data["messages"][:1]
        res = simulate(parse(data))
        share = concurrency(of(res, "A0"), 5, 60) / workers
        print(f"finch alone, {workers} workers: {share:.1%} (theory "
              f"{finch_alone(workers)}/{workers} = {finch_alone(workers) / workers:.1%})")
        assert share == pytest.approx(finch_alone(workers) / workers, abs=0.03)
        assert share == pytest.approx(10 / 11, abs=0.03)
        assert peak([(d.start, d.end) for d in res.deliveries]) == finch_alone(workers)
        assert sum(res.sent.values()) == 3000


def test_finch_two_big_envelopes_hold_ten_twentyfirsts_each_and_b_takes_over():
    res = simulate(load(os.path.join(SCENARIOS, "finch-big-envelopes.toml")))
    workers, arrival = 42, 30.0
    a, b = of(res, "A0"), of(res, "B0")
    assert sum(res.sent.values()) == 6000 and not res.deferred
    # Before B: A alone at 39 of 42.
    assert concurrency(a, 5, arrival) / workers == pytest.approx(39 / 42, abs=0.03)
    # The equilibrium: 20 of 42 each (47.6%).
    share_a = concurrency(a, arrival + 10, arrival + 60) / workers
    share_b = concurrency(b, arrival + 10, arrival + 60) / workers
    print(f"finch two: A {share_a:.1%}, B {share_b:.1%} (theory 20/42 = {20 / 42:.1%})")
    for share in (share_a, share_b):
        assert share == pytest.approx(finch_equilibrium(workers, 2) / workers, abs=0.03)
    # Never more than that: an agent connection already asked for is no free worker
    # (counted free, a second agent on its way let A past its cap: 21, 48.8%).
    for ds in (a, b):
        window = [(max(d.start, arrival + 10), min(d.end, arrival + 60)) for d in ds
                  if d.end > arrival + 10 and d.start < arrival + 60]
        assert peak(window) == 20
    # B takes over: at once only the 3 free workers, then each agent A gives back,
    # rising toward 20 while A falls from 39; A starts nothing new meanwhile.
    first = min(d.start for d in b)
    assert first == arrival
    assert sum(1 for d in b if d.start == arrival) == workers - 39
    steps = [concurrency(b, arrival + i * 0.1, arrival + (i + 1) * 0.1) for i in range(10)]
    print("B's concurrency, 0.1 s steps after it arrives: "
          + " ".join(f"{c:.1f}" for c in steps))
    assert steps[0] < 10 and steps[-1] > 17
    assert all(later >= earlier - 1 for earlier, later in zip(steps, steps[1:], strict=False))
    level = min(d.start for d in b
                if sum(1 for e in b if e.start <= d.start < e.end) >= 20)
    assert not [d for d in a if arrival <= d.start < level], "A started while B caught up"
    assert sum(1 for d in a if arrival <= d.end <= level) >= 20 - (workers - 39)


# -- zmailer ---------------------------------------------------------------------------

def test_zmailer_one_agent_per_thread_up_to_the_process_limit_in_age_order():
    res = simulate(load(os.path.join(SCENARIOS, "zmailer-threads.toml")))
    assert sum(res.sent.values()) == 48 and not res.deferred
    by_dest: dict[str, list[Delivery]] = defaultdict(list)
    for d in res.deliveries:
        by_dest[d.destination].append(d)
    assert len(by_dest) == 6
    for dest, ds in by_dest.items():
        assert peak([(d.start, d.end) for d in ds]) == 1, dest
        ds.sort(key=lambda d: d.start)
        # Message names are "dJ-K", K counting arrivals at that destination.
        order = [int(d.message.rpartition("-")[2]) for d in ds]
        assert order == sorted(order) == list(range(8)), (dest, order)
    # One delivery per destination, so deliveries at once are destinations at once:
    # as many as the three processes, never more.
    assert peak([(d.start, d.end) for d in res.deliveries]) == 3


def test_zmailer_shuffled_runs_break_age_order():
    """zmailer_ageorder = no: the same check sees the difference (it is not vacuous)."""
    data = scenario_file("zmailer-threads")
    for m in data["messages"]:
        m["every"] = 0  # all of a thread's vertices wait when it starts
    data["pyqmgr_cf"] = {"zmailer_ageorder": "no"}
    res = simulate(parse(data))
    orders = defaultdict(list)
    for d in sorted(res.deliveries, key=lambda d: d.start):
        orders[d.destination].append(int(d.message.rpartition("-")[2]))
    assert any(o != sorted(o) for o in orders.values()), orders
    data["pyqmgr_cf"] = {"zmailer_ageorder": "yes"}
    res = simulate(parse(data))
    orders = defaultdict(list)
    for d in sorted(res.deliveries, key=lambda d: d.start):
        orders[d.destination].append(int(d.message.rpartition("-")[2]))
    assert all(o == sorted(o) for o in orders.values()), orders


# -- oqmgr -----------------------------------------------------------------------------

def test_oqmgr_round_robin_gives_the_busy_destination_one_in_k():
    res = simulate(load(os.path.join(SCENARIOS, "oqmgr-starvation.toml")))
    assert sum(res.sent.values()) == 500 and not res.deferred
    small = {f"s{i}.example" for i in range(1, 6)}
    # While every destination has mail: until the first small one's last delivery.
    cut = min(max(d.start for d in res.deliveries if d.destination == s) for s in small)
    during = [d for d in res.deliveries if d.start < cut]
    share = sum(1 for d in during if d.destination == "busy.example") / len(during)
    print(f"oqmgr: busy destination got {share:.1%} of {len(during)} deliveries "
          f"while 6 destinations had mail (holds 60% of it)")
    assert share == pytest.approx(1 / 6, abs=0.02)


# -- every policy, many destinations ---------------------------------------------------

@pytest.mark.parametrize("policy", ["nqmgr", "oqmgr", "finch", "zmailer"])
def test_every_policy_completes_a_hundred_destinations(policy):
    data: dict[str, Any] = {
        "seed": 3, "duration": 3600,
        "scheduler": {"policy": policy},
        "transports": {"smtp": {"process_limit": 10}},
        "destinations": {f"d{i}.example": {"latency": EXPONENTIAL} for i in range(100)},
        "messages": [{"at": (i % 7) * 0.5, "count": 3, "every": 1.5, "recipients": 1 + i % 4,
                      "destination": f"d{i}.example"} for i in range(100)],
    }
    res = simulate(parse(data))
    for i in range(100):
        assert res.sent.get(f"d{i}.example") == 3 * (1 + i % 4), (policy, i)
    assert not res.deferred
    assert peak([(d.start, d.end) for d in res.deliveries]) <= 10
