"""The 2.5 concurrency window, step by step, against traces derived by hand from stock's
qmgr_queue.c (which is what parity needs; the seed's pseudocode differs in two details:
stock compares the cohort count with >=, and adds half a feedback step of rounding slack).
The pseudocode's rules are the "pseudocode" rounding, traced at the end.
"""


import pytest

from pyqmgr.scheduler.feedback import parse
from pyqmgr.scheduler.queue import Dsn
from pyqmgr.scheduler.transport import Transport
from tests.unit.params import Params as Cfg

DSN = Dsn("4.4.1", "connect refused")


def queue(pos="1", neg="1", window=None, rounding="stock", **cfg):
    lines: list[str] = []
    t = Transport("smtp", Cfg(**cfg), parse(pos), parse(neg), lines.append,
                  feedback_debug=True, rounding=rounding)
    q = t.queue("example.com", "example.com")
    if window is not None:
        q.window = window
    return q, lines


def test_safety_rule_blocks_growth_without_busy_deliveries():
    q, _ = queue()
    q.busy_count = 0
    q.unthrottle()
    assert q.window == 5, "5 < 0 + 5 is false: no positive feedback"
    q.busy_count = 1
    q.unthrottle()
    assert q.window == 6


def test_constant_feedback_grows_one_per_success_and_clamps_at_limit():
    q, _ = queue(window=18)
    q.busy_count = 18
    q.unthrottle()
    q.unthrottle()
    q.unthrottle()
    assert q.window == 20


def test_one_over_concurrency_needs_a_window_of_successes():
    q, _ = queue(pos="1/concurrency")
    q.busy_count = 5
    for _ in range(4):
        q.unthrottle()
    assert q.window == 5 and q.success == pytest.approx(0.8)
    q.unthrottle()  # 0.8 + 0.2, and 1.0 + 0.1 >= 1
    assert q.window == 6 and q.success == pytest.approx(0.0, abs=1e-9)


def test_negative_feedback_takes_effect_at_the_start_of_its_cycle():
    # failure starts at 0: the first failure already drops the window; with
    # feedback 1 it drops by two (failure -1 -> 0 -> 1 while failure - 0.5 < 0).
    q, _ = queue(failed_cohort_limit=0)
    q.throttle(DSN, 0.0, 300)
    assert q.window == 3 and q.failure == 1.0
    q.throttle(DSN, 0.0, 300)
    assert q.window == 2


def test_one_over_concurrency_negative_feedback():
    q, _ = queue(neg="1/concurrency", window=10, failed_cohort_limit=0)
    q.throttle(DSN, 0.0, 300)
    assert q.window == 9 and q.failure == pytest.approx(0.9)
    # Now 1/9 per failure: the next decrement when 0.9 - k/9 - 1/18 < 0, i.e. k = 8.
    for _ in range(7):
        q.throttle(DSN, 0.0, 300)
    assert q.window == 9
    q.throttle(DSN, 0.0, 300)
    assert q.window == 8


def test_pseudo_cohorts_declare_the_site_dead():
    # Window 5, feedback 1, cohort limit 1: cohorts 0.2, then +1/3, then +1/2 >= 1.
    q, lines = queue()
    assert not q.throttle(DSN, 0.0, 300)
    assert not q.throttle(DSN, 0.0, 300)
    assert q.throttle(DSN, 10.0, 300)
    assert q.throttled and q.dsn == DSN and q.revive_at == 310.0
    assert lines[-1] == ("qmgr_queue_throttle: queue example.com: limit 20 window 0 "
                         "success 0 failure 1 fail_cohorts 1.03333")


def test_revived_site_restarts_at_busy_or_initial_concurrency():
    q, _ = queue(window=1)
    assert q.throttle(DSN, 0.0, 300)
    q.busy_count = 2
    q.unthrottle()
    assert q.window == 2 and q.dsn is None
    q2, _ = queue(window=1)
    q2.throttle(DSN, 0.0, 300)
    q2.unthrottle()
    assert q2.window == 5


def test_success_resets_failed_cohorts_and_positive_resets_failure():
    q, _ = queue(failed_cohort_limit=3)
    q.throttle(DSN, 0.0, 300)
    assert q.fail_cohorts == pytest.approx(0.2)
    q.busy_count = 10
    q.unthrottle()
    assert q.fail_cohorts == 0 and q.failure == 0 and q.window == 4


def test_pseudocode_rounding_drops_one_per_failure():
    # Pseudocode: failure -= 1 -> -1; while (failure < 0): window -= 1, failure += 1.
    q, _ = queue(failed_cohort_limit=0, rounding="pseudocode")
    q.throttle(DSN, 0.0, 300)
    assert q.window == 4 and q.failure == 0.0
    q.throttle(DSN, 0.0, 300)
    assert q.window == 3
    q.busy_count = 3
    q.unthrottle()
    assert q.window == 4 and q.success == 0.0


def test_pseudocode_rounding_one_over_concurrency_grows_at_exactly_one():
    # No slack: five steps of 1/5 make exactly 1.0 in binary floating point too.
    q, _ = queue(pos="1/concurrency", rounding="pseudocode")
    q.busy_count = 5
    for _ in range(4):
        q.unthrottle()
    assert q.window == 5
    q.unthrottle()
    assert q.window == 6


def test_pseudocode_rounding_kills_only_beyond_the_cohort_limit():
    # Window 2, negative feedback 0 so the window stays 2: cohorts 0.5, 1.0, 1.5.
    q, _ = queue(neg="0", window=2, rounding="pseudocode")
    assert not q.throttle(DSN, 0.0, 300)
    assert not q.throttle(DSN, 0.0, 300), "1.0 is not beyond the limit of 1"
    assert q.throttle(DSN, 0.0, 300)
    stock, _ = queue(neg="0", window=2)
    assert not stock.throttle(DSN, 0.0, 300)
    assert stock.throttle(DSN, 0.0, 300), "stock: 1.0 reaches the limit of 1"


def test_unknown_rounding_is_refused():
    with pytest.raises(ValueError, match="stock, pseudocode"):
        queue(rounding="2007")
