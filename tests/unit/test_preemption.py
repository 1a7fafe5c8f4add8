"""nqmgr's preemption, driven through the core: the specification's worked examples.

The driver plays one delivery agent (or a few) against the core with a clock the test
sets, recording which message each delivery served. Message names are their enqueue
order, as in the specification's figures.
"""

from __future__ import annotations

from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.entry import Entry
from pyqmgr.scheduler.message import Message, Recipient
from tests.unit.params import Params

ONE_AT_A_TIME = dict(destination_recipient_limit=1, destination_concurrency_limit=1,
                     initial_destination_concurrency=1)


def scheduler(**kw: object) -> Scheduler:
    params = {**ONE_AT_A_TIME, **kw}
    return Scheduler(lambda name: Params(**params))  # type: ignore[arg-type]


def add(s: Scheduler, name: str, n: int, now: float = 0.0, dest: str = "d") -> Message:
    m = Message(name, now)
    s.read_limit(m)
    s.assign(m, [Route("smtp", dest, dest, Recipient(i, f"r{i}@{dest}")) for i in range(n)],
             now=now)
    return m


def deliver(s: Scheduler, count: int | None = None, now: float = 0.0) -> str:
    """Select and finish deliveries one at a time; the message names, in order."""
    seq = ""
    while count is None or len(seq) < count:
        entry = s.select("smtp", now).deliver
        if entry is None:
            break
        seq += entry.message.queue_id
        s.done(entry, 0, None, False, now)
    return seq


def test_fifo_without_preemption():
    s = scheduler(delivery_slot_cost=1)
    for name, n in (("1", 3), ("2", 1), ("3", 2)):
        add(s, name, n)
    assert deliver(s) == "111233"


def test_ten_recipients_then_two_twos_without_slot_loans():
    # "If the preemption happened when enough delivery slots accumulate (assuming
    # slot cost 2), the delivery sequence becomes 11112211113311."
    s = scheduler(delivery_slot_cost=2, delivery_slot_loan=0, delivery_slot_discount=0)
    for name, n in (("1", 10), ("2", 2), ("3", 2)):
        add(s, name, n)
    assert deliver(s) == "11112211113311"


def test_ten_recipients_then_two_twos_with_half_the_slots_on_loan():
    # "If we use such a slot loan [wait for only 50% of the necessary slots], the
    # delivery sequence becomes 11221111331111."
    s = scheduler(delivery_slot_cost=2, delivery_slot_loan=0, delivery_slot_discount=50)
    for name, n in (("1", 10), ("2", 2), ("3", 2)):
        add(s, name, n)
    assert deliver(s) == "11221111331111"


def test_default_loan_of_three_slots_lets_small_mail_in_at_once():
    s = scheduler(delivery_slot_cost=2)  # loan 3, discount 50: stock's defaults
    for name, n in (("1", 10), ("2", 2), ("3", 2)):
        add(s, name, n)
    assert deliver(s) == "12211113311111"


def test_minimum_delivery_slots_exempts_small_jobs_from_preemption():
    # 4 entries can never accumulate minimum_delivery_slots (3) * cost (2) slots.
    s = scheduler(delivery_slot_cost=2)
    for name, n in (("1", 4), ("2", 1), ("3", 1)):
        add(s, name, n)
    assert deliver(s) == "111123"
    s = scheduler(delivery_slot_cost=2, minimum_delivery_slots=2)
    for name, n in (("1", 4), ("2", 1), ("3", 1)):
        add(s, name, n)
    assert deliver(s) == "121131"


def test_slot_cost_below_two_turns_preemption_off():
    s = scheduler(delivery_slot_cost=1)
    for name, n in (("1", 10), ("2", 1)):
        add(s, name, n)
    assert deliver(s) == "1" * 10 + "2"


def test_older_mail_beats_fewer_recipients():
    # Candidates score (time in queue + 1) / entries: a 2-recipient message that has
    # waited 9 s beats a 1-recipient message that just arrived (10/2 > 1/1).
    s = scheduler(delivery_slot_cost=2, delivery_slot_loan=0, delivery_slot_discount=0)
    add(s, "1", 20, now=0)
    add(s, "2", 2, now=0)
    add(s, "3", 1, now=9)
    assert deliver(s, now=9) == "1111" + "22" + "11" + "3" + "1" * 14


def jobs_in_list_order(s: Scheduler) -> list[str]:
    return [j.message.queue_id for j in s.policy("smtp").job_list]


def test_preemption_stack_and_job_list_order():
    # The figure "1--2--3--5--6--8 on the job list, 4 preempting 1, 7 preempting 4":
    # job 4 preempts 1; 7, enqueued later, preempts 4; the scheduler's job list then
    # reads 7--4--1--2--3--5--6--8 and 7, then 4, then 1 finish in that order.
    s = scheduler(delivery_slot_cost=2, delivery_slot_loan=0, delivery_slot_discount=0)
    for name, n in (("1", 100), ("2", 50), ("3", 50), ("4", 10), ("5", 50), ("6", 50)):
        add(s, name, n, now=0)
    seq = deliver(s, 21, now=0)
    assert seq == "1" * 20 + "4", "4 preempts 1 once 1 saved 2 * 10 slots"
    add(s, "7", 2, now=0)
    add(s, "8", 50, now=0)
    seq = deliver(s, 4, now=0)
    assert seq == "4447", "7 preempts 4 once 4 saved 2 * 2 slots"
    t = s.policy("smtp")
    jobs = {j.message.queue_id: j for j in t.job_list}
    assert jobs_in_list_order(s) == ["7", "4", "1", "2", "3", "5", "6", "8"]
    assert jobs["7"].stack_parent is jobs["4"] and jobs["7"].stack_level == 2
    assert jobs["4"].stack_parent is jobs["1"] and jobs["4"].stack_level == 1
    assert jobs["1"].stack_level == 0 and list(jobs["1"].children) == [jobs["4"]]
    assert deliver(s, 1 + 6 + 1, now=0) == "7" + "444444" + "1"
    assert jobs_in_list_order(s)[:2] == ["1", "2"]


def test_blocker_job_is_skipped_and_revived_when_its_destination_frees_up():
    s = scheduler(delivery_slot_cost=1)
    add(s, "1", 2, dest="slow")
    add(s, "2", 2, dest="fast")
    first = s.select("smtp", 0).deliver
    assert first is not None and first.message.queue_id == "1"
    # slow is at its window of 1: job 1 blocks, job 2's destination is served.
    second = s.select("smtp", 0).deliver
    assert second is not None and second.message.queue_id == "2"
    t = s.policy("smtp")
    job1 = s.policy("smtp").job_list.first()
    assert job1 is not None and job1.blocker_tag == t.blocker_tag
    s.done(second, 0, None, False, 0)
    # slow frees up: all blockers are released at once and job 1 comes first again.
    s.done(first, 0, None, False, 0)
    assert job1.blocker_tag != t.blocker_tag
    third = s.select("smtp", 0).deliver
    assert third is not None and third.message.queue_id == "1"


def test_children_of_a_finished_job_are_adopted_by_its_parent():
    # The figure with "adoptive parent", "parent gone", children 7 and 8 as siblings:
    # 4 preempted 1; 7 preempted 4 and got blocked; 4 went on, was preempted by 8;
    # when 4 is done, 7 and 8 become children of 1 (stack levels unchanged).
    s = scheduler(delivery_slot_cost=2, delivery_slot_loan=0, delivery_slot_discount=0,
                  destination_concurrency_limit=1)
    add(s, "1", 100, now=0)
    add(s, "4", 12, now=0)
    assert deliver(s, 25, now=0) == "1" * 24 + "4"
    seven = add(s, "7", 2, now=0, dest="blocked")
    eight = add(s, "8", 2, now=0)
    # Hold "blocked" busy with one of 7's deliveries so that 7 becomes a blocker.
    t = s.policy("smtp")
    busy: list[Entry] = []
    seq = ""
    siblings_seen = False
    adopted: bool | None = None
    jobs = {"7": seven.jobs["smtp"], "8": eight.jobs["smtp"]}
    four = next(j for j in t.job_list if j.message.queue_id == "4")
    one = next(j for j in t.job_list if j.message.queue_id == "1")
    while (entry := s.select("smtp", 0).deliver) is not None:
        seq += entry.message.queue_id
        if list(four.children) == [jobs["7"], jobs["8"]]:
            siblings_seen = True
        if four.stack_level == -1 and one.stack_level == 0 and adopted is None:
            adopted = (jobs["7"].stack_parent is one and jobs["7"].stack_level == 2
                       and list(one.children) == [jobs["7"]])
        if entry.queue.name == "blocked":
            busy.append(entry)
        else:
            s.done(entry, 0, None, False, 0)
    assert seq == "444" + "7" + "4444" + "88" + "4444" + "1" * 76, seq
    assert siblings_seen, "7 (blocked) and 8 were both children of 4"
    assert adopted, "when 4 was done, 1 adopted 7 (still at stack level 2)"
    assert jobs["7"].stack_parent is None, "then 1 was done too: parent gone"
    for entry in busy:
        s.done(entry, 0, None, False, 0)
    assert deliver(s, None, now=0) == "7"
    assert not t.job_list, "all jobs finished"
