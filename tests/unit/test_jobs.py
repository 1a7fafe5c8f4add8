"""pyqmgr jobs from the core: each policy's list in the order it really picks from.

The reports are checked against the scheduler's own next choice (what the report says
goes next is what select() then takes), nqmgr's slot and loan figures against whether
preemption then happens, and every report against a run without reports (asking must
not change a single decision).
"""

from __future__ import annotations

import json

import pytest

from pyqmgr.control.render import jobs_lines
from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.entry import Entry, entry_select
from pyqmgr.scheduler.explain import jobs
from pyqmgr.scheduler.finch import Finch
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.nqmgr import Nqmgr
from pyqmgr.scheduler.oqmgr import Oqmgr
from pyqmgr.scheduler.policy import Policy, PolicyTable
from pyqmgr.scheduler.zmailer import Zmailer
from tests.unit.params import Params

ONE_AT_A_TIME = dict(destination_recipient_limit=1, destination_concurrency_limit=1,
                     initial_destination_concurrency=1)


def routes(n: int, dest: str = "d.example", prefix: str = "r") -> list[Route]:
    return [Route("smtp", dest, dest, Recipient(i, f"{prefix}{i}@{dest}")) for i in range(n)]


def report(s: Scheduler, now: float = 0.0, limit: int | None = None) -> dict:
    answer = jobs(s, "smtp", now, limit)
    assert answer is not None
    assert json.loads(json.dumps(answer)) == answer, "goes over the wire as JSON"
    return answer


def add(s: Scheduler, name: str, n: int, now: float = 0.0, dest: str = "d.example") -> Message:
    m = Message(name, now)
    s.read_limit(m)
    s.assign(m, routes(n, dest, prefix=name), now=now)
    return m


def deliver(s: Scheduler, count: int, now: float = 0.0) -> str:
    seq = ""
    for _ in range(count):
        e = s.select("smtp", now).deliver
        assert e is not None
        seq += e.message.queue_id
        s.done(e, 0, None, False, now)
    return seq


def big_then(n_small: int, **kw: object) -> tuple[Scheduler, dict]:
    """BIG (40 entries) delivers 4, then SMALL (n_small entries) arrives.

    Returns the scheduler and the report taken just before SMALL arrives.
    """
    params = {**ONE_AT_A_TIME, "delivery_slot_cost": 2, **kw}
    s = Scheduler(lambda n: Params(**params))  # type: ignore[arg-type]
    add(s, "BIG", 40)
    assert deliver(s, 4) == "BIGBIGBIGBIG"
    before = report(s, 1.0)
    add(s, "SMALL", n_small, now=1.0)
    return s, before


# -- nqmgr ----------------------------------------------------------------------------


def test_nqmgr_preemption_stack_slots_and_the_current_job():
    s, before = big_then(2, delivery_slot_loan=0, delivery_slot_discount=0)
    (big,) = before["jobs"]
    assert (big["slots_used"], big["slots_available"], big["loan"]) == (4, 4, 0)
    # 36 entries left + 4 slots fit 20 two-slot entries; 4 saved slots pay for 2.
    assert big["preempt_for"] == 2
    e = s.select("smtp", 2.0).deliver
    assert e is not None and e.message.queue_id == "SMALL", "preemption happened"
    r = report(s, 2.0)
    assert r["policy"] == "nqmgr" and r["kind"] == "jobs" and r["total"] == 2
    assert r["current_job"] == "SMALL" and r["stacks"] == [["BIG", "SMALL"]]
    assert r["settings"] == {"smtp_delivery_slot_cost": 2, "smtp_delivery_slot_loan": 0,
                             "smtp_delivery_slot_discount": 0,
                             "smtp_minimum_delivery_slots": 3}
    small, big = r["jobs"]
    assert (small["queue_id"], small["position"], small["current"]) == ("SMALL", 1, True)
    assert small["stack_level"] == 1 and small["preempts"] == "BIG"
    # Charged two expected entries up front, one of them delivered since.
    assert (small["slots_used"], small["slots_available"]) == (-1, 1)
    assert (small["entries_selected"], small["entries_read"], small["entries_max"]) == (1, 2, 2)
    assert small["destinations"] == [{"destination": "d.example", "todo": 1, "in_flight": 1}]
    assert big["stack_level"] == 0 and big["preempted_by"] == ["SMALL"]
    # Its 4 slots paid 2 x 2 for SMALL: nothing left, nothing owed.
    assert (big["slots_available"], big["loan"], big["preempt_for"]) == (0, 0, 0)
    assert not big["current"] and not big["blocker"]
    text = "\n".join(jobs_lines({"ok": True, **r}))
    assert "preemption stack, preempted first: BIG <- SMALL" in text
    assert "current job SMALL" in text


def test_nqmgr_preempt_for_is_the_largest_job_that_then_preempts():
    # Cost 2, loan 3, discount 50: 4 saved slots are 2 entries, plus 3 on loan, and
    # half of a job's entries must be covered: up to 10 entries.
    _, before = big_then(1)
    assert before["jobs"][0]["preempt_for"] == 10
    for n, preempts in ((10, True), (11, False)):
        s, _ = big_then(n)
        e = s.select("smtp", 2.0).deliver
        assert e is not None and (e.message.queue_id == "SMALL") is preempts, n
        if preempts:
            (small, big) = report(s, 2.0)["jobs"]
            # BIG was charged 10 x 2 with 4 saved: it lent 16 slots it has yet to earn.
            assert (big["slots_available"], big["loan"]) == (-16, 16)
            assert big["preempt_for"] == 0


def test_nqmgr_a_blocker_job_and_loans_off_without_slot_cost():
    s = Scheduler(lambda n: Params(**ONE_AT_A_TIME))  # type: ignore[arg-type]
    add(s, "Q1", 3, dest="slow.example")
    add(s, "Q2", 1, now=1.0, dest="fast.example")
    assert s.select("smtp", 1.0).deliver is not None  # Q1 to slow: its window is full
    assert s.select("smtp", 1.0).deliver is not None  # Q1 becomes a blocker, Q2 goes
    r = report(s, 5.0)
    (q1,) = [j for j in r["jobs"] if j["queue_id"] == "Q1"]
    assert q1["blocker"] and q1["age"] == 5.0
    assert q1["destinations"] == [{"destination": "slow.example", "todo": 2, "in_flight": 1}]
    assert "blocker" in "\n".join(jobs_lines(r))
    off = Scheduler(lambda n: Params(delivery_slot_cost=1))
    add(off, "Q1", 3)
    r = report(off)
    assert r["preemption"] is False and r["jobs"][0]["preempt_for"] == 0


def test_nqmgr_limit_keeps_the_head_and_counts_all():
    s = Scheduler(lambda n: Params())
    for i in range(5):
        add(s, f"Q{i}", 1, now=float(i))
    r = report(s, 10.0, limit=2)
    assert r["total"] == 5 and [j["queue_id"] for j in r["jobs"]] == ["Q0", "Q1"]
    assert jobs_lines(r)[0] == "transport smtp (nqmgr): 5 jobs, the first 2 shown"


# -- the other policies: the report's next item is select()'s next choice ------------


def make(policy: type[Policy], **kw: object) -> Scheduler:
    return Scheduler(lambda n: Params(**kw), policies=PolicyTable(policy),  # type: ignore[arg-type]
                     process_limit_for=lambda name: 4)


def test_oqmgr_round_robin_list_names_the_next_destination():
    s = make(Oqmgr, destination_recipient_limit=1, initial_destination_concurrency=10)
    m = Message("Q1", 0.0)
    s.assign(m, routes(3, "a") + routes(2, "b") + routes(1, "c"), now=0.0)
    r = report(s, 3.0)
    assert r["kind"] == "queues" and [q["destination"] for q in r["queues"]] == ["a", "b", "c"]
    for _ in range(6):
        r = report(s)
        (nxt,) = [q["destination"] for q in r["queues"] if q["next"]]
        e = s.select("smtp", 0.0).deliver
        assert e is not None and e.queue.name == nxt
    assert not any(q["next"] for q in report(s)["queues"])
    assert report(s)["queues"][0]["in_flight"] >= 1


def test_finch_messages_with_their_workers():
    s = make(Finch, destination_recipient_limit=1, destination_concurrency_limit=0,
             initial_destination_concurrency=100)
    add(s, "A", 30)
    add(s, "B", 2, now=1.0)
    busy = [s.select("smtp", 1.0).deliver for _ in range(4)]  # the four workers
    assert all(e is not None and e.message.queue_id == "A" for e in busy)
    r = report(s, 2.0)
    assert r["kind"] == "messages" and r["workers"] == 4 and r["busy"] == 4
    a, b = r["messages"]
    # Four workers, A first come: it holds them all (4 < finch_max_message_concurrency).
    assert (a["queue_id"], a["workers"], a["todo"], a["allowed_new_worker"]) == (
        "A", 4, 26, True)
    assert (b["queue_id"], b["workers"], b["todo"]) == ("B", 0, 2)
    assert r["free_workers"] == 0 and r["settings"]["smtp_finch_max_message_concurrency"] == 10


def test_zmailer_threads_in_the_order_agents_go_to_them():
    s = make(Zmailer, destination_recipient_limit=1)
    add(s, "A", 2, dest="a.example")
    add(s, "B", 2, now=1.0, dest="b.example")
    add(s, "C", 1, now=2.0, dest="c.example")
    r = report(s, 3.0)
    assert [(t["destination"], t["state"], t["turn"]) for t in r["threads"]] == [
        ("a.example", "waiting", 1), ("b.example", "waiting", 2), ("c.example", "waiting", 3)]
    assert r["threads"][0]["oldest_age"] == 3.0
    e = s.select("smtp", 3.0).deliver
    assert e is not None and e.queue.name == "a.example"
    s.done(e, 0, None, False, 3.0)  # its agent is back: the run of a goes on first
    r = report(s, 3.0)
    assert [(t["destination"], t["state"], t["run_left"]) for t in r["threads"]][:2] == [
        ("a.example", "continuing", 1), ("b.example", "waiting", 0)]
    e = s.select("smtp", 3.0).deliver
    assert e is not None and e.queue.name == "a.example"
    states = {t["destination"]: t["state"] for t in report(s)["threads"]}
    assert states == {"b.example": "waiting", "c.example": "waiting", "a.example": "running"}


class Lifo(Policy):
    """A policy without a report of its own: the newest entry of any queue first."""

    name = "lifo"

    def select(self) -> Entry | None:
        for queue in reversed(list(self.transport.queues.values())):
            last = queue.todo.last()
            if last is not None and queue.window > queue.busy_count:
                return entry_select(last, self.ctx.clock)
        return None


class Breaks(Lifo):
    name = "breaks"

    def select(self) -> Entry | None:
        raise RuntimeError("policy bug")


def test_a_policy_without_a_report_shows_its_destinations():
    s = make(Lifo)
    add(s, "A", 2, dest="a.example")
    add(s, "B", 1, dest="b.example")
    r = report(s)
    assert r["policy"] == "lifo" and r["kind"] == "queues" and not r["broken"]
    assert [(q["destination"], q["todo"], q["oldest"]) for q in r["queues"]] == [
        ("a.example", 1, "A"), ("b.example", 1, "B")]
    assert "no order of its own" in r["order"]
    lines = jobs_lines(r)
    assert lines[0] == "transport smtp (lifo): 2 queues"
    assert lines[-3].split() == ["DESTINATION", "NEXTHOP", "WINDOW", "IN", "FLIGHT", "TODO",
                                 "RECIPIENTS", "OLDEST"]
    assert lines[-2].split() == ["a.example", "a.example", "5", "0", "1", "2", "A"]


def test_a_broken_policy_is_not_asked_and_unknown_transports_are_none():
    s = make(Breaks)
    add(s, "A", 2, dest="a.example")
    assert s.select("smtp", 0.0).deliver is None
    r = report(s)
    assert r["broken"] and r["policy"] == "breaks" and r["kind"] == "queues"
    assert "the policy failed" in "\n".join(jobs_lines(r))
    assert jobs(s, "nowhere", 0.0) is None


@pytest.mark.parametrize("policy", [Nqmgr, Oqmgr, Finch, Zmailer])
def test_asking_changes_no_decision(policy):
    """The same workload with and without a report before every decision."""

    def run(ask: bool) -> list[str]:
        s = make(policy, destination_recipient_limit=1, initial_destination_concurrency=2,
                 delivery_slot_cost=2)
        out: list[str] = []
        busy: list[Entry] = []
        for k in range(6):
            m = Message(f"M{k}", float(k))
            s.read_limit(m)
            s.assign(m, routes(1 + 3 * (k % 3), f"d{k % 3}", f"m{k}"), now=float(k))
            for _ in range(2):
                if ask:
                    report(s, float(k))
                e = s.select("smtp", float(k)).deliver
                if e is not None:
                    out.append(f"{e.message.queue_id}/{e.queue.name}")
                    busy.append(e)
            if busy and k % 2:
                s.done(busy.pop(0), 0, None, False, float(k))
        while busy or (e := s.select("smtp", 9.0).deliver) is not None:
            if ask:
                report(s, 9.0)
            if busy:
                s.done(busy.pop(0), 0, None, False, 9.0)
            else:
                out.append(f"{e.message.queue_id}/{e.queue.name}")
                busy.append(e)
        return out

    plain = run(False)
    assert len(plain) > 15 and run(True) == plain
