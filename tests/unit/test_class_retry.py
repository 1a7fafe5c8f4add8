"""The higher classes' deferred mail, offered to the feed when due (issue #34)."""

from __future__ import annotations

from pyqmgr.daemon.class_retry import MAX_KEPT, ClassRetries


def test_due_ones_are_offered_earliest_first_and_no_room_keeps_them():
    r = ClassRetries()
    r.deferred("B", 20.0, 0)
    r.deferred("A", 10.0, 0)
    r.deferred("C", 30.0, 1)
    offered: list[tuple[str, int]] = []

    def feed(qid: str, rank: int) -> bool | None:
        offered.append((qid, rank))
        return None if qid == "B" else True

    assert r.feed_due(5.0, feed) == 0 and offered == []
    assert r.next_due() == 10.0
    assert r.feed_due(25.0, feed) == 1
    assert offered == [("A", 0), ("B", 0)]
    assert r.next_due() == 20.0, "B had no room: kept"
    offered.clear()
    assert r.feed_due(40.0, lambda q, k: offered.append((q, k)) or False) == 0
    assert offered == [("B", 0), ("C", 1)] and len(r) == 0, "not taken: the scan's"
    assert r.fed == 1


def test_bounded():
    r = ClassRetries()
    for i in range(MAX_KEPT + 10):
        r.deferred(f"Q{i}", float(i), 0)
    assert len(r) == MAX_KEPT
