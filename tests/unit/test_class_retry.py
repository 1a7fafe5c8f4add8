"""The higher classes' deferred mail, offered to the feed when due (issue #34)."""

from __future__ import annotations

from pyqmgr.daemon.class_retry import MAX_KEPT, SLACK, ClassRetries


def _taker(result: dict[str, bool | float], offered: list[str]):
    def take(qid: str) -> bool | float:
        offered.append(qid)
        return result.get(qid, True)
    return take


def test_due_ones_are_offered_highest_class_first_then_earliest():
    r = ClassRetries()
    r.deferred("B", 20.0, 0)
    r.deferred("A", 10.0, 0)
    r.deferred("L", 5.0, 1)
    r.deferred("LATER", 30.0, 0)
    offered: list[str] = []
    assert r.feed_due(4.0, lambda rank: True, _taker({}, offered)) == (0, False)
    assert offered == [] and r.next_due(4.0) == 5.0
    assert r.feed_due(25.0, lambda rank: True, _taker({}, offered)) == (3, False)
    assert offered == ["A", "B", "L"]
    assert len(r) == 1 and r.next_due(25.0) == 30.0 and r.fed == 3


def test_a_class_without_room_keeps_its_mail_and_the_others_go_on():
    r = ClassRetries()
    r.deferred("T1", 1.0, 0)
    r.deferred("T2", 2.0, 0)
    r.deferred("M1", 1.0, 1)
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
        r.deferred(f"Q{i}", float(i), 0)
    room = [True, True, False]
    fed, blocked = r.feed_due(10.0, lambda rank: room.pop(0) if room else False,
                              _taker({}, []))
    assert (fed, blocked, len(r)) == (2, True, 3)


def test_gone_is_dropped_and_a_future_mtime_is_retimed():
    r = ClassRetries()
    r.deferred("GONE", 1.0, 0)
    r.deferred("MOVED", 1.0, 0)
    r.deferred("STALE", 1.0, 0)
    offered: list[str] = []
    take = _taker({"GONE": False, "MOVED": 50.0, "STALE": 3.0}, offered)
    assert r.feed_due(5.0, lambda rank: True, take) == (0, False)
    assert sorted(offered) == ["GONE", "MOVED", "STALE"], "each offered once"
    assert list(r.due_at) == ["MOVED"] and r.next_due(5.0) == 50.0 and r.retimed == 1
    offered.clear()
    assert r.feed_due(49.0, lambda rank: True, take) == (0, False) and offered == []
    assert r.feed_due(50.0, lambda rank: True, _taker({}, offered)) == (1, False)
    assert offered == ["MOVED"]


def test_forgotten_and_redeferred_ones_are_offered_once_at_their_latest_time():
    r = ClassRetries()
    r.deferred("SCANNED", 1.0, 0)
    r.deferred("AGAIN", 1.0, 0)
    r.forget("SCANNED")  # the deferred scan took it
    r.forget("AGAIN")
    r.deferred("AGAIN", 8.0, 0)  # ... and deferred it again
    offered: list[str] = []
    assert r.feed_due(5.0, lambda rank: True, _taker({}, offered)) == (0, False)
    assert offered == [] and r.next_due(5.0) == 8.0
    assert r.feed_due(9.0, lambda rank: True, _taker({}, offered)) == (1, False)
    assert offered == ["AGAIN"] and len(r) == 0


def test_bounded_ids_and_heap_entries():
    r = ClassRetries()
    for i in range(MAX_KEPT + 10):
        r.deferred(f"Q{i}", float(i), 0)
    assert len(r) == MAX_KEPT and r.over_cap == 10
    r.deferred("Q0", 1e9, 0)  # a remembered one deferred again: not over the cap
    assert r.over_cap == 10
    # The scan takes and re-defers the same messages over and over: forgotten
    # entries do not pile up past the slack.
    for rnd in range(5):
        for i in range(MAX_KEPT):
            r.forget(f"Q{i}")
            r.deferred(f"Q{i}", 1e6 + rnd, 0)
    assert len(r) == MAX_KEPT
    assert r.entries == sum(len(h) for h in r.heaps.values()) <= MAX_KEPT + SLACK + 1
    assert r.describe()["deferred_watched"] == MAX_KEPT
