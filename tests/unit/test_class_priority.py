"""Message classes in nqmgr's job list (issue #34): one segment per class, highest
first, so that a transactional message's delivery comes before every bulk one's,
whatever their arrival order, while each class keeps stock's order (and preemption)
among its own jobs. Driven through the core as tests/unit/test_preemption.py is."""

from __future__ import annotations

import random

from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.nqmgr.structures import NqState
from tests.unit.params import Params
from tests.unit.test_preemption import ONE_AT_A_TIME, deliver


def scheduler(**kw: object) -> Scheduler:
    params = {**ONE_AT_A_TIME, **kw}
    return Scheduler(lambda name: Params(**params))  # type: ignore[arg-type]


def add(s: Scheduler, name: str, n: int, rank: int = 0, now: float = 0.0,
        dest: str = "d", tenant: str = "", weight: int = 1) -> Message:
    m = Message(name, now, rank=rank, tenant=tenant, weight=weight)
    s.read_limit(m)
    s.assign(m, [Route("smtp", dest, dest, Recipient(i, f"r{i}@{dest}")) for i in range(n)],
             now=now)
    return m


def _state(s: Scheduler) -> NqState:
    policy = s.transports["smtp"].policy
    assert isinstance(policy, NqState)
    return policy


def test_a_later_higher_class_message_goes_first():
    s = scheduler(delivery_slot_cost=1)
    add(s, "b", 3, rank=1)
    add(s, "c", 2, rank=1)
    add(s, "T", 1, rank=0)
    assert deliver(s) == "Tbbbcc"


def test_it_takes_the_next_delivery_from_a_bulk_job_already_under_way():
    s = scheduler(delivery_slot_cost=1)
    add(s, "b", 4, rank=1)
    assert deliver(s, 2) == "bb"
    add(s, "T", 2, rank=0)
    add(s, "U", 1, rank=0, now=1)
    assert deliver(s) == "TTUbb"


def test_one_class_is_stock_order_and_keeps_no_segments():
    s = scheduler(delivery_slot_cost=1)
    for name, n in (("1", 3), ("2", 1), ("3", 2)):
        add(s, name, n)
    assert deliver(s) == "111233"
    assert _state(s).segments is None


def test_preemption_stays_inside_a_class():
    # Stock's "12211113311111" for 10-2-2 at slot cost 2; a lower class's 2 never
    # preempts, a same-class one still does.
    s = scheduler(delivery_slot_cost=2)
    add(s, "1", 10, rank=0)
    add(s, "2", 2, rank=1)
    add(s, "3", 2, rank=0)
    assert deliver(s) == "13311111111122"


def test_a_blocked_higher_class_leaves_its_slots_to_the_lower_class():
    # Work-conserving: transactional mail at a destination whose window is full does
    # not stop bulk mail to another destination.
    s = scheduler(delivery_slot_cost=1)
    add(s, "T", 2, rank=0, dest="slow")
    add(s, "b", 2, rank=1, dest="fast")
    first = s.select("smtp", 0).deliver
    assert first is not None and first.message.queue_id == "T"
    order = ""
    while (entry := s.select("smtp", 0).deliver) is not None:
        order += entry.message.queue_id
        s.done(entry, 0, None, False, 0)
    assert order == "bb"  # slow's window (1) is T's busy delivery
    s.done(first, 0, None, False, 0)
    assert deliver(s) == "T"


def test_segments_hold_through_random_arrivals_and_retirements():
    """Many arrivals of three classes in random order, deliveries in between: every
    delivery is of the highest class with mail in core, each class in arrival order."""
    rng = random.Random(34)
    s = scheduler(delivery_slot_cost=1)
    waiting: list[list[str]] = [[], [], []]
    for i in range(300):
        rank = rng.randrange(3)
        name = f"{rank}.{i}"
        add(s, name, 1, rank=rank, now=float(i))
        waiting[rank].append(name)
        for _ in range(rng.randrange(3)):
            entry = s.select("smtp", float(i)).deliver
            if entry is None:
                break
            want = next(w for w in waiting if w)
            assert entry.message.queue_id == want[0]
            want.pop(0)
            s.done(entry, 0, None, False, float(i))
        _check_segments(_state(s))


def _check_segments(state: NqState) -> None:
    """The list is in key order, and the structure's tails and keys are the list's."""
    seg = state.segments
    if seg is None:
        return
    jobs = list(state.job_list)
    keys = [(j.message.rank, j.round) for j in jobs]
    assert keys == sorted(keys)
    assert seg.keys == sorted(set(keys))
    for key in seg.keys:
        assert seg.tails[key].item is [j for j in jobs if (j.message.rank, j.round) == key][-1]


# -- tenants: rounds inside a class ------------------------------------------------------


def test_three_tenants_one_sending_ten_times_take_turns():
    s = scheduler(delivery_slot_cost=1)
    for i in range(30):
        add(s, "A", 1, tenant="a", now=i / 100)
    for i in range(3):
        add(s, "B", 1, tenant="b", now=1 + i / 100)
        add(s, "C", 1, tenant="c", now=1 + i / 100)
    assert deliver(s) == "ABC" * 3 + "A" * 27


def test_a_weight_is_jobs_a_round():
    s = scheduler(delivery_slot_cost=1)
    for i in range(8):
        add(s, "A", 1, tenant="a", weight=3, now=i / 100)
        add(s, "B", 1, tenant="b", now=i / 100)
    assert deliver(s) == "ABAA" "BAAA" "BAA" "BBBBB", "3 of A a round, 1 of B"


def test_a_tenant_arriving_late_joins_the_current_round_not_the_backlogs_end():
    s = scheduler(delivery_slot_cost=1)
    for i in range(20):
        add(s, "A", 1, tenant="a", now=i / 100)
    assert deliver(s, 5) == "AAAAA"
    add(s, "B", 1, tenant="b", now=5)
    add(s, "B", 1, tenant="b", now=5.1)
    assert deliver(s, 5) == "BABAA", "B joins round 4, where A was served last"
    _check_segments(_state(s))


def test_classes_come_before_rounds():
    s = scheduler(delivery_slot_cost=1)
    for i in range(4):
        add(s, "a", 1, rank=1, tenant="a", now=i / 100)
        add(s, "b", 1, rank=1, tenant="b", now=i / 100)
    add(s, "T", 1, rank=0, tenant="a", now=9)
    assert deliver(s) == "T" + "ab" * 4


def test_rounds_hold_through_random_arrivals_of_tenants_and_classes():
    """Random arrivals of two classes and four tenants of weights 1-3 with deliveries
    between: the list stays in key order, and while every tenant of the highest class
    with mail has mail, none is more than a round ahead of another."""
    rng = random.Random(3434)
    s = scheduler(delivery_slot_cost=1)
    weights = {"a": 1, "b": 2, "c": 3, "d": 1}
    for i in range(600):
        tenant = rng.choice("aaaaaaabcd")
        add(s, f"{tenant}{i}", 1, rank=rng.randrange(2), tenant=tenant,
            weight=weights[tenant], now=i / 10)
        for _ in range(rng.randrange(3)):
            entry = s.select("smtp", i / 10).deliver
            if entry is None:
                break
            s.done(entry, 0, None, False, i / 10)
        _check_segments(_state(s))
        jobs = list(_state(s).job_list)
        first = {}
        for j in jobs:
            first.setdefault((j.message.rank, j.message.tenant), j.round)
        for rank in (0, 1):
            rounds = [r for (k, _), r in first.items() if k == rank]
            assert not rounds or max(rounds) - min(rounds) <= 1, first
