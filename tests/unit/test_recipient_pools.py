"""Recipient slot pools: how many recipients of a message the core lets in at a time.

The driver plays the queue file: ``refill`` hands out the next recipients, as stock's
qmgr_message_realloc reads the next batch, and the test checks the in-core counts
against the specification's bounds.
"""

from __future__ import annotations

from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.nqmgr.job import Job
from tests.unit.params import Params


class File:
    """Unread recipients of each message, read in batches like a queue file."""

    def __init__(self) -> None:
        self.unread: dict[str, list[Route]] = {}
        self.reads: list[tuple[str, int]] = []

    def add(self, s: Scheduler, name: str, n: int, dest: str = "d", now: float = 0) -> Message:
        self.unread[name] = [Route("smtp", f"{dest}{i}", f"{dest}{i}", Recipient(i, f"r{i}@x"))
                             for i in range(n)]
        m = Message(name, now, rcpt_unread=n)
        routes = self.read(m, s.read_limit(m))
        s.assign(m, routes, now=now)
        return m

    def read(self, m: Message, limit: int) -> list[Route]:
        self.reads.append((m.queue_id, limit))
        rest = self.unread[m.queue_id]
        batch, self.unread[m.queue_id] = rest[:limit], rest[limit:]
        m.rcpt_unread -= len(batch)
        m.more = bool(self.unread[m.queue_id])
        return sorted(batch, key=lambda r: (r.transport, r.queue_name))


def make(file: File, global_limit: int = 20000, **kw: object) -> Scheduler:
    base: dict[str, object] = dict(destination_recipient_limit=1,
                                   destination_concurrency_limit=1, delivery_slot_cost=5)
    base.update(kw)
    return Scheduler(lambda n: Params(**base),  # type: ignore[arg-type]
                     rcpt_limit=global_limit, msg_rcpt_limit=10, refill=file.read,
                     active_limit=1)


def test_slot_arithmetic_of_a_three_job_message():
    # The specification's example: jobs with (in core, slots) = (1, 4), (5, 5), (2, 0)
    # hold 8 recipients and 9 slots. A later batch may take the message's own reserve
    # (qmgr_message_recipient_minimum) plus the jobs' slots minus what is in core:
    # 10 + 9 - 8 = 11. (The specification says "2 + minimum"; its sums give 1 + minimum,
    # which is what stock's rcpt_limit - rcpt_count computes.)
    s = Scheduler(lambda n: Params(), msg_rcpt_limit=10)
    m = Message("M", 0)
    m.more = True
    m.rcpt_limit = 10
    for name, in_core, slots in (("a", 1, 4), ("b", 5, 5), ("c", 2, 0)):
        job = Job(m, s.transport(name))
        job.rcpt_count, job.rcpt_limit = in_core, slots
        m.jobs[name] = job
        m.rcpt_count += in_core
        m.rcpt_limit += slots
    assert s.read_limit(m) == 10 + 1


def test_first_batch_fills_the_global_pool_but_gets_at_least_the_minimum():
    file = File()
    s = make(file, global_limit=25)
    file.add(s, "1", 100)
    assert file.reads == [("1", 25)]
    file.add(s, "2", 100)
    assert file.reads[-1] == ("2", 10), "global pool used up: the message minimum"


def test_transport_pool_goes_to_the_first_job_still_reading():
    file = File()
    s = make(file, recipient_limit=30, extra_recipient_limit=0, global_limit=20)
    one = file.add(s, "1", 100)
    two = file.add(s, "2", 100)
    t = s.policy("smtp")
    assert t.job_next_unread is one.jobs["smtp"]
    assert one.jobs["smtp"].rcpt_limit == 30 and two.jobs["smtp"].rcpt_limit == 0
    assert t.rcpt_unused == 0


def test_big_message_read_in_batches_delivers_every_recipient_once():
    file = File()
    s = make(file, recipient_limit=40, extra_recipient_limit=20, global_limit=20,
             recipient_refill_limit=10, destination_concurrency_limit=0)
    msgs = [file.add(s, "big", 500)] + [file.add(s, f"s{i}", 3) for i in range(5)]
    seen: list[tuple[str, int]] = []
    peak = 0
    busy = []
    finished = []
    while True:
        entry = s.select("smtp", 0).deliver
        if entry is None:
            if not busy:
                break
            finished += s.done(busy.pop(0), 0, None, False, 0).finished
            continue
        seen += [(entry.message.queue_id, r.offset) for r in entry.recipients]
        busy.append(entry)
        if len(busy) >= 4:
            finished += s.done(busy.pop(0), 0, None, False, 0).finished
        peak = max(peak, s.rcpt_count)
        for m in finished:
            if m.more:
                s.assign(m, file.read(m, s.read_limit(m)), now=0)
        finished.clear()
    assert sorted(seen) == sorted([("big", i) for i in range(500)]
                                  + [(f"s{i}", j) for i in range(5) for j in range(3)])
    assert len(seen) == len(set(seen)), "no recipient delivered twice"
    # The specification's bound for one transport:
    # max(minimum * active messages + recipient_limit + extra_recipient_limit, global).
    assert peak <= max(10 * len(msgs) + 40 + 20, 20), peak
    assert len([r for r in file.reads if r[0] == "big"]) > 5, "read in many batches"
    assert s.rcpt_count == 0 and s.policy("smtp").rcpt_unused == 40, "slots all returned"
    assert all(not m.jobs for m in msgs)


def test_unread_job_preempting_gets_half_of_the_extra_pool():
    # No normal pool; the first batch fills the global pool of 40, so message 2 gets
    # only its minimum of 10 in core and still has 2 on file when it preempts 1.
    file = File()
    s = make(file, recipient_limit=0, extra_recipient_limit=100, global_limit=40,
             delivery_slot_loan=0, delivery_slot_discount=0, delivery_slot_cost=2)
    file.add(s, "1", 40)
    small = file.add(s, "2", 12)
    assert small.more and small.rcpt_unread == 2
    job = small.jobs["smtp"]
    t = s.policy("smtp")
    assert job.rcpt_limit == 0 and t.rcpt_unused == 0
    seq = ""
    while not seq.endswith("2"):
        entry = s.select("smtp", 0).deliver
        assert entry is not None
        seq += entry.message.queue_id
        s.done(entry, 0, None, False, 0)
    assert seq == "1" * 24 + "2", "12 expected entries * cost 2 slots"
    # (per-stack extra 100 + unused 0 + 1) / 2 = 50 slots, borrowed from the pool.
    assert job.rcpt_limit == 50 and t.rcpt_unused == -50
