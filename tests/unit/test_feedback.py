"""Feedback syntax, case by case from configuration.md §2 (verified on 3.7.11)."""

import pytest

from pyqmgr.scheduler.feedback import IDX_NONE, IDX_WIN, parse, parse_or_warn


@pytest.mark.parametrize("value,index,base", [
    ("1", IDX_NONE, 1.0), ("0.5abc", IDX_NONE, 0.5), ("1 junk", IDX_NONE, 1.0),
    ("1/8", IDX_NONE, 0.125), ("1 / 8", IDX_NONE, 0.125), (".25", IDX_NONE, 0.25),
    ("1e-1", IDX_NONE, 0.1), ("1/concurrency", IDX_WIN, 1.0),
    ("1/Concurrency", IDX_WIN, 1.0), ("0.5 / concurrency", IDX_WIN, 0.5),
])
def test_accepted(value, index, base):
    fb = parse(value)
    assert fb is not None and fb.index == index and fb.base == pytest.approx(base)


@pytest.mark.parametrize("value", [
    "1/sqrt_concurrency", "2", "-1", "2/concurrency", "1/0.5", "1/0", "nan", "1/", "/2",
    "1/8x", "1/8 x", "1/" + "9" * 31,
])
def test_rejected(value):
    assert parse(value) is None


def test_rejection_warns_and_falls_back_to_one():
    fb, warning = parse_or_warn("1/sqrt_concurrency", "slowsmtp_destination_concurrency_"
                                "positive_feedback")
    assert fb.index == IDX_NONE and fb.base == 1.0
    assert warning == ("slowsmtp_destination_concurrency_positive_feedback: ignoring "
                       "malformed or unreasonable feedback: 1/sqrt_concurrency")


def test_window_dependent_value():
    fb = parse("1/concurrency")
    assert fb.value(5) == pytest.approx(0.2)
