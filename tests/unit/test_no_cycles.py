"""A message that has left the scheduler leaves no reference cycle behind (issue #30).

The daemon keeps Python's cyclic garbage collector on a long leash (a full collection
walks every message in core), so whatever a finished message leaves in a cycle stays
in memory until one runs. A destination down for hours re-reads its deferred mail
every few minutes: with a cycle per entry, job or peer, memory grew by tens of KB a
message an hour. Here every policy's structures go through whole lives, delivered,
failed (the site dies and the rest goes to the retry transport), finished, with the
collector off; then a collection must find none of them unreachable.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.policy import Policy, PolicyTable
from pyqmgr.scheduler.queue import Dsn
from pyqmgr.settings.policies import load
from tests.unit.params import Params

#: Scheduler objects that must die by reference count: whatever a message makes.
SCHEDULER_MODULES = ("pyqmgr.scheduler",)


def _routes(qid: str, n: int, dests: int) -> list[Route]:
    return [Route("smtp", f"d{i % dests}.example", f"d{i % dests}.example",
                  Recipient(i, f"{qid}-u{i}@d{i % dests}.example")) for i in range(n)]


def _run_lives(s: Scheduler, messages: int, now: float) -> float:
    """Assign, deliver and fail messages until none is left in core."""
    live = []
    for m in range(messages):
        msg = Message(f"Q{m}", now)
        live.append(msg)
        s.assign(msg, _routes(msg.queue_id, 3 + m % 4, 3), now=now)
    for _step in range(10_000):
        now += 1.0
        s.tick(now)
        progressed = False
        for name in ("smtp", "retry"):
            entry = s.select(name, now).deliver
            if entry is None:
                continue
            progressed = True
            # d0 is down: its first failure kills the site, the rest goes to retry.
            down = entry.queue.name == "d0.example"
            s.done(entry, -1 if down else 0,
                   Dsn("4.4.1", "connect refused") if down else None, False, now)
        if not progressed and all(msg.refcount == 0 for msg in live):
            return now
    raise AssertionError("messages still in core after 10,000 steps")


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


@pytest.mark.parametrize("policy", ["nqmgr", "oqmgr", "finch", "zmailer"])
def test_finished_messages_leave_no_cycle(policy: str, collector_off: None) -> None:
    cls: type[Policy] = load(policy)
    s = Scheduler(lambda name: Params(destination_recipient_limit=2,
                                      initial_destination_concurrency=2),
                  transport_retry_time=60, policies=PolicyTable(cls))
    # Objects alive before (an earlier test's leftovers) are not this test's cycles.
    before = {id(obj) for obj in gc.get_objects()}
    now = _run_lives(s, 40, 0.0)
    assert not any(q.todo for q in s.transport("retry").queues.values())
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    left: dict[str, int] = {}
    for obj in gc.garbage:
        module = type(obj).__module__
        if module.startswith(SCHEDULER_MODULES) and id(obj) not in before:
            name = f"{module}.{type(obj).__qualname__}"
            left[name] = left.get(name, 0) + 1
    assert left == {}, f"{policy}: cycles left after {now:.0f} s of lives: {left}"
