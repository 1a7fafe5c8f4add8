"""The higher classes' deferred mail, offered to the feed when due (issue #34)."""

from __future__ import annotations

from pyqmgr.daemon.class_retry import GRACE, MAX_KEPT, SLACK, ClassRetries


def _defer(r: ClassRetries, qid: str, due: float, rank: int) -> None:
    """Deferred so that it is offered at ``due`` (its retry time plus the grace)."""
    r.deferred(qid, due - GRACE, rank)


def _taker(result: dict[str, bool | float], offered: list[str]):
    def take(qid: str) -> bool | float:
        offered.append(qid)
        return result.get(qid, True)
    return take


def test_due_ones_are_offered_highest_class_first_then_earliest():
    r = ClassRetries()
    _defer(r, "B", 20.0, 0)
    _defer(r, "A", 10.0, 0)
    _defer(r, "L", 5.0, 1)
    _defer(r, "LATER", 30.0, 0)
    offered: list[str] = []
    assert r.feed_due(4.0, lambda rank: True, _taker({}, offered)) == (0, False)
    assert offered == [] and r.next_due(4.0) == 5.0
    assert r.feed_due(25.0, lambda rank: True, _taker({}, offered)) == (3, False)
    assert offered == ["A", "B", "L"]
    assert len(r) == 1 and r.next_due(25.0) == 30.0 and r.fed == 3


def test_a_class_without_room_keeps_its_mail_and_the_others_go_on():
    r = ClassRetries()
    _defer(r, "T1", 1.0, 0)
    _defer(r, "T2", 2.0, 0)
    _defer(r, "M1", 1.0, 1)
    offered: list[str] = []
    fed, blocked = r.feed_due(5.0, lambda rank: rank == 1, _taker({}, offered))
    assert (fed, blocked, offered) == (1, True, ["M1"])
    assert len(r) == 2, "no room: kept, in order"
    assert r.next_due(5.0) is None, "nothing due later; the feeder polls for room"
    fed, blocked = r.feed_due(5.0, lambda rank: True, _taker({}, offered))
    assert (fed, blocked, offered[1:]) == (2, False, ["T1", "T2"])


def test_room_is_asked_before_each_message():
    r = ClassRetries()
    for i in range(5):
        _defer(r, f"Q{i}", float(i), 0)
    room = [True, True, False]
    fed, blocked = r.feed_due(10.0, lambda rank: room.pop(0) if room else False,
                              _taker({}, []))
    assert (fed, blocked, len(r)) == (2, True, 3)


def test_offered_a_grace_after_the_retry_time():
    r = ClassRetries()
    r.deferred("Q", 10.0, 0)
    assert r.next_due(0.0) == 10.0 + GRACE
    assert r.feed_due(10.0 + GRACE - 0.01, lambda rank: True, _taker({}, [])) == (0, False)
    assert r.feed_due(10.0 + GRACE, lambda rank: True, _taker({}, [])) == (1, False)


def test_gone_is_dropped_and_a_future_mtime_is_retimed():
    r = ClassRetries()
    _defer(r, "GONE", 1.0, 0)
    _defer(r, "MOVED", 1.0, 0)
    _defer(r, "STALE", 1.0, 0)
    offered: list[str] = []
    take = _taker({"GONE": False, "MOVED": 50.0 - GRACE, "STALE": 3.0}, offered)
    assert r.feed_due(5.0, lambda rank: True, take) == (0, False)
    assert sorted(offered) == ["GONE", "MOVED", "STALE"], "each offered once"
    assert list(r.due_at) == ["MOVED"] and r.next_due(5.0) == 50.0 and r.retimed == 1
    offered.clear()
    assert r.feed_due(49.0, lambda rank: True, take) == (0, False) and offered == []
    assert r.feed_due(50.0, lambda rank: True, _taker({}, offered)) == (1, False)
    assert offered == ["MOVED"]


def test_forgotten_and_redeferred_ones_are_offered_once_at_their_latest_time():
    r = ClassRetries()
    _defer(r, "SCANNED", 1.0, 0)
    _defer(r, "AGAIN", 1.0, 0)
    r.forget("SCANNED")  # the deferred scan took it
    r.forget("AGAIN")
    _defer(r, "AGAIN", 8.0, 0)  # ... and deferred it again
    offered: list[str] = []
    assert r.feed_due(5.0, lambda rank: True, _taker({}, offered)) == (0, False)
    assert offered == [] and r.next_due(5.0) == 8.0
    assert r.feed_due(9.0, lambda rank: True, _taker({}, offered)) == (1, False)
    assert offered == ["AGAIN"] and len(r) == 0


def test_bounded_ids_and_heap_entries():
    r = ClassRetries()
    for i in range(MAX_KEPT + 10):
        _defer(r, f"Q{i}", float(i), 0)
    assert len(r) == MAX_KEPT and r.over_cap == 10
    _defer(r, "Q0", 1e9, 0)  # a remembered one deferred again: not over the cap
    assert r.over_cap == 10
    # The scan takes and re-defers the same messages over and over: forgotten
    # entries do not pile up past the slack.
    for rnd in range(5):
        for i in range(MAX_KEPT):
            r.forget(f"Q{i}")
            _defer(r, f"Q{i}", 1e6 + rnd, 0)
    assert len(r) == MAX_KEPT
    assert r.entries == sum(len(h) for h in r.heaps.values()) <= MAX_KEPT + SLACK + 1
    assert r.describe()["deferred_watched"] == MAX_KEPT
