"""The source pools' core (pyqmgr/scheduler/source.py): one test per transition."""

from __future__ import annotations

from collections import Counter

import pytest

from pyqmgr.scheduler.source import (
    DAY,
    HOUR,
    WARM,
    PlanError,
    Pool,
    SourceBook,
    WarmupPlan,
    parse_plan,
)
from pyqmgr.settings.sources import parse_start

START = parse_start("2026-11-20")  # src1's first day
PLAN = WarmupPlan(((0, 10), (2, 20), (5, WARM)))


def book(plan: WarmupPlan | None = PLAN, weights: tuple[int, ...] = (1, 1, 1)) -> SourceBook:
    return SourceBook({"bulk": Pool("bulk", ("src1", "src2", "src3"), weights)}, plan,
                      {"src1": START})


def day(n: int, hour: float = 12.0) -> float:
    """A time on src1's n-th day (0: its first)."""
    return START + n * DAY + hour * HOUR


def choose_many(b: SourceBook, n: int, now: float, site: str | None = "google") -> Counter:
    got: Counter = Counter()
    for i in range(n):
        got[b.choose("bulk", site, now, ("m", i, now))] += 1
    return got


def test_plan_parses_steps_window_and_overflow() -> None:
    plan = parse_plan("# comment\nwindow hour\noverflow = wait\n0 50\n3 200 # more\n"
                      "30 warm\n", "/etc/postfix/pyqmgr-warmup")
    assert plan == WarmupPlan(((0, 50), (3, 200), (30, WARM)), HOUR, "wait")
    assert [plan.allowance(a) for a in (-1, 0, 2, 3, 29, 30, 400)] == \
        [0, 50, 50, 200, 200, None, None]


@pytest.mark.parametrize("text, why", [
    ("0 ten\n", "line 1: '0 ten': the messages are a number or warm"),
    ("day1 10\n", "the age is a number of days"),
    ("0 10\n0 20\n", "line 2: '0 20': age 0 is given twice"),
    ("window week\n0 1\n", "window is day or hour"),
    ("overflow drop\n", "overflow is warm or wait"),
    ("0 1 2\n", "expected AGE MESSAGES"),
    ("# nothing\n", "no AGE MESSAGES line"),
])
def test_plan_refuses_bad_lines_naming_them(text: str, why: str) -> None:
    with pytest.raises(PlanError, match="^/p") as err:
        parse_plan(text, "/p")
    assert why in str(err.value)


def test_age_crossing_a_plan_step_raises_the_allowance() -> None:
    b = book()
    assert b.allowance("src1", day(0)) == 10
    assert b.allowance("src1", day(1, 23.99)) == 10
    assert b.allowance("src1", day(2, 0.0)) == 20
    assert b.allowance("src1", day(5)) is None  # warm
    assert b.allowance("src2", day(0)) is None  # no start date: warm
    assert b.allowance("src1", day(-1)) == 0  # its first day is to come
    assert choose_many(b, 90, day(2))["src1"] == 20


def test_cold_source_gets_its_allowance_and_the_rest_goes_warm() -> None:
    got = choose_many(book(), 90, day(0))
    assert got["src1"] == 10
    assert got["src2"] + got["src3"] == 80
    assert abs(got["src2"] - got["src3"]) <= 1  # weighted alike
    assert None not in got


def test_allowance_is_per_site() -> None:
    b = book()
    choose_many(b, 90, day(0), "google")
    assert choose_many(b, 90, day(0), "microsoft")["src1"] == 10


def test_weights_share_the_warm_mail() -> None:
    got = choose_many(book(None, (1, 1, 3)), 500, day(0))
    assert got == Counter({"src1": 100, "src2": 100, "src3": 300})


def test_unknown_site_goes_to_a_warm_member() -> None:
    b = book()
    got = choose_many(b, 30, day(0), site=None)
    assert got["src1"] == 0 and got["src2"] + got["src3"] == 30
    assert b.unknown_site == 30 and not b.counts


def test_window_rollover_starts_counts_afresh() -> None:
    b = book()
    assert choose_many(b, 60, day(0, 23.5))["src1"] == 10
    assert choose_many(b, 60, day(0, 23.9))["src1"] == 0
    assert choose_many(b, 60, day(1, 0.1))["src1"] == 10  # a new day
    assert len(b.reservations) == 10  # the old day's are forgotten


def test_hourly_window() -> None:
    b = book(WarmupPlan(((0, 5),), HOUR))
    assert choose_many(b, 60, day(0, 10.1))["src1"] == 5
    assert choose_many(b, 60, day(0, 10.9))["src1"] == 0
    assert choose_many(b, 60, day(0, 11.0))["src1"] == 5


def test_reservation_given_back_when_the_entry_ends_unsent() -> None:
    b = book()
    now = day(0)
    keys = [k for k in range(60) if b.choose("bulk", "google", now, k) == "src1"]
    assert len(keys) == 10
    assert choose_many(b, 30, now)["src1"] == 0
    b.started(keys[0])
    b.ended(keys[0], sent=True)   # delivered: stays counted
    b.started(keys[1])
    b.unselected(keys[1])         # never left: still reserved
    b.ended(keys[1], sent=False)  # deferred in core: given back
    b.ended(keys[2], sent=False)
    assert b.counts[("src1", "google")] == 8
    assert b.left[("src1", "google")] == 1
    assert choose_many(b, 30, now)["src1"] == 2


def test_giving_back_after_a_rollover_changes_nothing() -> None:
    b = book()
    keys = [k for k in range(60) if b.choose("bulk", "google", day(0), k) == "src1"]
    b.choose("bulk", "google", day(1), "new")
    for k in keys:
        b.ended(k, sent=False)
    assert all(n >= 0 for n in b.counts.values())


def test_overflow_wait_keeps_the_cold_share_waiting() -> None:
    b = book(WarmupPlan(((0, 10),), DAY, "wait"))
    got = choose_many(b, 90, day(0))
    assert got["src1"] == 10
    assert got[None] == 20  # src1's share beyond its plan waits
    assert got["src2"] == got["src3"] == 30


def test_no_warm_member_and_unknown_site_waits() -> None:
    b = SourceBook({"p": Pool("p", ("src1",), (1,))}, PLAN, {"src1": START})
    assert b.choose("p", None, day(0), 1) is None
    assert b.choose("p", "google", day(0), 2) == "src1"


def test_snapshot_keeps_what_left_and_restores_in_the_same_window_only() -> None:
    b = book()
    now = day(0)
    keys = [k for k in range(60) if b.choose("bulk", "google", now, k) == "src1"]
    for k in keys[:7]:
        b.started(k)
    snap = b.snapshot()
    assert snap["counts"] == [["src1", "google", 7]]
    fresh = book()
    assert fresh.restore([("src1", "google", 7)], int(snap["window"]),  # type: ignore[call-overload]
                         DAY, now + 60) == 1
    assert choose_many(fresh, 60, now + 60)["src1"] == 3
    later = book()
    assert later.restore([("src1", "google", 7)], int(snap["window"]),  # type: ignore[call-overload]
                         DAY, day(1)) == 0
    assert later.restore([("src1", "google", 7)], int(snap["window"]),  # type: ignore[call-overload]
                         HOUR, now) == 0


def test_start_date_parses_as_utc_midnight() -> None:
    assert parse_start("2026-11-20") % DAY == 0
    with pytest.raises(ValueError):
        parse_start("20.11.2026")


def test_totals_follow_every_count_per_source() -> None:
    """The metrics read a cold source's count over every site from ``totals``, kept as
    the pairs change: it must equal their sum after each transition."""
    b = book()
    now = day(0)

    def summed() -> dict[str, int]:
        out: dict[str, int] = {}
        for (source, _), n in b.counts.items():
            out[source] = out.get(source, 0) + n
        return out

    keys = [k for k in range(60) if b.choose("bulk", "google", now, k) == "src1"]
    keys += [k for k in range(60, 90) if b.choose("bulk", "yahoo", now, k) == "src1"]
    assert b.totals == summed() == {"src1": 20}
    b.ended(keys[0], sent=False)   # given back
    b.ended(keys[1], sent=True)    # kept
    assert b.totals == summed() == {"src1": 19}
    fresh = book()
    assert fresh.restore([("src1", "google", 7), ("src1", "yahoo", 2)], int(now // DAY),
                         DAY, now) == 2
    assert fresh.totals == {"src1": 9}
    got = choose_many(b, 6, day(1))  # the window rolls over: counted afresh
    assert b.totals == summed() == {"src1": got["src1"]} and got["src1"] > 0


def test_top_shows_a_cold_sources_count_against_its_allowance() -> None:
    """``pyqmgr top`` (issue #46: sources seen everywhere): a row per cold source and
    site, this window's count of the allowance and its change since the last refresh."""
    from pyqmgr.control.top import frame

    b = book()
    now = day(0)
    choose_many(b, 9, now)
    before = {"sources": b.status(now)}
    choose_many(b, 9, now)
    lines = [text for text, _ in frame({"sources": b.status(now)}, before, "name")]
    (row,) = [ln for ln in lines if ln.startswith("src1")]
    assert row.split()[:4] == ["src1", "google", "6/10", "+3"], row
    assert any(ln.startswith("SOURCE") and "THIS DAY/ALLOWANCE" in ln for ln in lines)
    assert not any(ln.startswith("SOURCE") for ln, _ in frame({}, None, "name"))
