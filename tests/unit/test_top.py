"""pyqmgr top's frames from canned status replies: the change since the previous
refresh beside the counts, changed rows marked, new and departed destinations, the
sort orders, and the plain output for pipes and scripts."""

from __future__ import annotations

import copy

import pytest

from pyqmgr.control.top import SORT_CYCLE, TopError, batch, frame, screen
from tests.unit.test_control_render import REPLY


def later() -> dict[str, object]:
    """REPLY a refresh later: a.example delivered 2 and took 1 more, c.example came."""
    r = copy.deepcopy(REPLY)
    a = r["destinations"][0]  # type: ignore[index]
    a["in_flight"], a["queued_recipients"], a["queued_entries"] = 3, 0, 0
    r["destinations"].append({  # type: ignore[attr-defined]
        "transport": "smtp", "name": "c.example", "window": 5, "limit": 20,
        "in_flight": 1, "queued_entries": 0, "queued_recipients": 0, "success": 0.0,
        "failure": 0.0, "fail_cohorts": 0.0, "dead": False})
    r["transports"][0]["agents_busy"] = 4  # type: ignore[index]
    r["transports"][0]["queued_recipients"] = 5  # type: ignore[index]
    r["recipients"] = 6
    return r


def row(lines: list[tuple[str, bool]], start: str) -> tuple[list[str], bool]:
    (found,) = [(text.split(), changed) for text, changed in lines if text.startswith(start)]
    return found


def test_the_first_frame_has_no_changes_to_show():
    lines = frame(REPLY, None, "name")
    assert lines[0] == ("active queue: 3 messages, 7 recipients in core", False)
    cells, changed = row(lines, "a.example")
    assert cells == ["a.example", "smtp", "5/20", "5", "1", "1", "0", "0", "0"]
    assert not changed and not any(c for _, c in lines)


def test_changes_since_the_previous_refresh():
    lines = frame(later(), REPLY, "name")
    assert lines[0][0] == ("active queue: 3 messages, 6 recipients in core (+0 messages, "
                           "-1 recipients since the last refresh)")
    smtp, changed = row(lines, "smtp")
    assert smtp == ["smtp", "nqmgr", "4/100", "-1", "1", "2", "4", "5", "-1"] and changed
    a, changed = row(lines, "a.example")
    # In flight 5 -> 3 (-2), queued recipients 1 -> 0 (-1).
    assert a == ["a.example", "smtp", "5/20", "3", "-2", "0", "0", "-1", "0", "0", "0"]
    assert changed
    b, changed = row(lines, "b.example")
    assert not changed and "dead:" in b
    c, changed = row(lines, "c.example")
    assert c[-1] == "new" and changed


def test_departed_destinations_are_counted():
    gone = copy.deepcopy(REPLY)
    gone["destinations"] = gone["destinations"][1:]  # type: ignore[index]
    lines = frame(gone, REPLY, "name")
    assert lines[-1] == ("1 destination(s) left core since the last refresh", False)
    empty = {**REPLY, "destinations": []}
    assert frame(empty, REPLY, "name")[-1] == (
        "no destinations in core (2 left core since the last refresh)", False)


@pytest.mark.parametrize("sort, order", [("name", "abc"), ("window", "acb"),
                                         ("busy", "acb"), ("queued", "bac")])
def test_every_sort_order(sort, order):
    assert sort in SORT_CYCLE
    names = [t.split()[0] for t, _ in frame(later(), REPLY, sort)
             if t.split() and t.split()[0].endswith(".example")]
    assert names == [f"{c}.example" for c in order]


def test_the_screen_says_why_there_is_no_status():
    from pyqmgr.control.top import Snapshot

    lines = screen(Snapshot(0.0, error="cannot connect: not running"), None, "name",
                   "/etc/postfix", 0.5, False)
    assert lines[0][0].startswith("pyqmgr top - /etc/postfix - ")
    assert "every 0.5s - sort name - q quit" in lines[0][0]
    assert lines[2:] == [("cannot connect: not running", True),
                         ("asking again every 0.5s", False)]
    narrow = screen(Snapshot(0.0, error="cannot connect: the daemon is not running"),
                    None, "name", "/etc/postfix", 0.5, False, width=20)
    assert [t for t, _ in narrow[2:]] == ["cannot connect: the", "daemon is not",
                                          "running", "asking again every 0.5s"]
    paused = screen(Snapshot(0.0, reply=REPLY), None, "busy", "/etc/postfix", 2, True)
    assert "PAUSED - sort busy" in paused[0][0]


def test_batch_prints_plain_snapshots_and_stops_at_a_failure():
    replies = [REPLY, later()]
    out: list[str] = []
    slept: list[float] = []
    assert batch(lambda: replies.pop(0), "/etc/postfix", 0.5, "name", 2, out.append,
                 slept.append) == 0
    assert slept == [0.5] and len(out) == 2
    assert "snapshot 1 of 2 - sort name\n" in out[0] and "q quit" not in out[0]
    assert "since the last refresh" in out[1] and "c.example" in out[1]

    def fails() -> dict[str, object]:
        raise TopError("not running", 69)

    with pytest.raises(TopError) as info:
        batch(fails, "/etc/postfix", 0.5, "name", 1, out.append)
    assert info.value.status == 69


def test_classes_each_with_its_room_and_the_change():
    """Issue #34: with message classes, a line per class under the transports."""
    first = copy.deepcopy(REPLY)
    first["classes"] = {"classes": [{"name": "transactional", "active": 2, "cap": 200},
                                    {"name": "bulk", "active": 180, "cap": 180}],
                        "incoming": "watched"}
    second = copy.deepcopy(first)
    second["classes"]["classes"][0]["active"] = 5  # type: ignore[index]
    lines = frame(second, first, "name")
    cells, changed = row(lines, "transactional")
    assert cells == ["transactional", "5", "200", "+3"] and changed
    cells, changed = row(lines, "bulk")
    assert cells == ["bulk", "180", "180"] and not changed
    assert not any(text.startswith("CLASS") for text, _ in frame(REPLY, None, "name"))


def test_batch_without_a_count_runs_until_stopped_and_survives_a_later_failure():
    """As top -b: a frame every interval until the reader goes away (here the write
    fails as a closed pipe does); a failure after the first frame is a frame saying
    so, and the next refresh asks again."""
    replies: list[object] = [REPLY, TopError("cannot connect: not running", 69), later(),
                             REPLY, REPLY]

    def fetch() -> dict[str, object]:
        item = replies.pop(0)
        if isinstance(item, TopError):
            raise item
        assert isinstance(item, dict)
        return item

    out: list[str] = []
    slept: list[float] = []

    def write(text: str) -> None:
        if len(out) == 4:
            raise BrokenPipeError
        out.append(text)

    with pytest.raises(BrokenPipeError):
        batch(fetch, "/etc/postfix", 0.5, "name", None, write, slept.append)
    assert len(out) == 4 and slept == [0.5] * 4
    assert "snapshot 1 - sort name" in out[0] and "of" not in out[0].split("\n")[0][-20:]
    assert "snapshot 2 - " in out[1] and "cannot connect: not running" in out[1]
    assert "asking again in 0.5s" in out[1]
    # The next frame's changes are against the last reply there was.
    assert "since the last refresh" in out[2] and "c.example" in out[2]
    assert all(text.endswith("\n\n") for text in out)
