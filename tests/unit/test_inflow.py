"""Inflow (daemon/class_feed.py, issue #45): when in_flow_delay's top-up with classes is
switched off. The clock is the caller's: each case says when cleanup's new files and
the feeder's intake happen. tests/test_inflow_real.py runs it on real Postfix."""

from __future__ import annotations

from pyqmgr.daemon.class_feed import FLOOD_GROWTH, FLOOD_HOLD, FLOOD_WINDOW, Inflow


def steps(inflow: Inflow, start: float, seconds: float, arrive: float, take: float,
          step: float = 0.05) -> list[bool]:
    """``arrive`` new files and ``take`` messages taken in a second, the feeder asking
    every ``step``; what it was told each time."""
    seen = []
    owed_a = owed_t = 0.0
    t = start
    while t < start + seconds - 1e-9:
        owed_a += arrive * step
        owed_t += take * step
        inflow.arrived += int(owed_a)
        inflow.taken += int(owed_t)
        owed_a -= int(owed_a)
        owed_t -= int(owed_t)
        seen.append(inflow.flooding(t))
        t += step
    return seen


def test_a_trickle_of_resets_taken_in_at_once_is_no_flood():
    inflow = Inflow()
    assert not any(steps(inflow, 0, 30, arrive=50, take=50))
    assert inflow.floods == 0


def test_new_mail_slower_than_intake_is_no_flood_even_when_it_is_a_lot():
    assert not any(steps(Inflow(), 0, 10, arrive=1000, take=1200))


def test_a_few_bulk_messages_a_second_with_nothing_taken_in_are_no_flood():
    assert not any(steps(Inflow(), 0, 10, arrive=FLOOD_GROWTH - 2, take=0))


def test_a_flood_is_seen_within_its_first_messages_and_held_after_it():
    inflow = Inflow()
    seen = steps(inflow, 0, 0.3, arrive=300, take=20)
    assert seen[-1] and inflow.began and inflow.floods == 1
    # The flood stops: the top-up stays off while its window shows it and for
    # FLOOD_HOLD after, then comes back.
    quiet = steps(inflow, 0.3, FLOOD_HOLD + FLOOD_WINDOW + 0.5, arrive=0, take=0)
    assert all(quiet[:int(FLOOD_HOLD / 0.05)]) and not quiet[-1]
    assert inflow.ends_in(0.3 + FLOOD_HOLD + FLOOD_WINDOW + 0.5) is None


def test_a_flood_that_pauses_briefly_keeps_the_top_up_off():
    inflow = Inflow()
    t = 0.0
    for _ in range(6):
        on = steps(inflow, t, 2, arrive=200, take=10)
        off = steps(inflow, t + 2, FLOOD_HOLD - 0.5, arrive=0, take=0)
        t += 2 + FLOOD_HOLD - 0.5
        assert all(on[4:]) and all(off), (on, off)
    assert inflow.floods == 1


def test_after_a_long_pause_the_flood_is_seen_again_within_a_window():
    inflow = Inflow()
    steps(inflow, 0, 2, arrive=200, take=10)
    assert not steps(inflow, 2, FLOOD_HOLD + 3, arrive=0, take=0)[-1]
    again = steps(inflow, FLOOD_HOLD + 5, FLOOD_WINDOW, arrive=200, take=10)
    assert again.index(True) <= 3 and inflow.floods == 2


def test_a_long_gap_between_asks_averages_the_growth():
    """The feeder asked last 30 s ago: 3 messages a second since is no flood."""
    inflow = Inflow()
    assert not inflow.flooding(0.0)
    inflow.arrived += 90
    assert not inflow.flooding(30.0)


def test_lost_kernel_events_are_a_flood():
    inflow = Inflow()
    inflow.overflowed = True
    assert inflow.flooding(1.0) and inflow.ends_in(1.0) == FLOOD_HOLD


def test_floods_are_logged_at_most_once_a_minute_with_the_count_between():
    inflow = Inflow()
    inflow.rate = 212.4
    first = inflow.log_line(10.0)
    assert first is not None and "grew by 212 or more messages a second" in first
    assert "more since" not in first
    assert inflow.log_line(20.0) is None and inflow.log_line(69.0) is None
    again = inflow.log_line(70.0)
    assert again is not None and again.endswith("; 2 more since the last such line")
