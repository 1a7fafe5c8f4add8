"""The fidelity gate's criterion (benchmarks/fidelity.py): the score, and its verdict
on forecasts whose faults are known."""

from __future__ import annotations

import random

import pytest

from benchmarks.fidelity import RESOLUTION, TOLERANCE, crps, score


def test_crps_is_zero_for_a_forecast_all_at_the_value_and_grows_with_distance():
    assert crps([5, 5, 5], 5) == 0
    assert crps([5], 7) == 2
    assert crps([4, 6], 5) == pytest.approx(1 - 1)  # near 1 on average, spread 2 / 2
    assert crps([5, 5], 8) > crps([5, 5], 6) > 0


def test_crps_charges_a_forecast_spread_too_wide():
    # The value is always 10: a forecast around it with a wide spread scores worse than
    # a narrow one, though both are centred.
    assert crps([0, 20, 0, 20], 10) > crps([9, 11, 9, 11], 10)


def _real(n: int, mean: float, sd: float, rng: random.Random) -> list[float | None]:
    return [rng.gauss(mean, sd) for _ in range(n)]


def test_a_replay_drawn_as_reality_is_judged_faithful():
    rng = random.Random(7)
    real = _real(10, 100, 10, rng)
    replays = [[rng.gauss(100, 10) for _ in range(10)] for _ in real]
    row = score("deferred", real, replays)
    assert row is not None and row["faithful"], row


def test_a_replay_off_by_its_spread_or_too_sure_or_too_wide_is_not():
    rng = random.Random(7)
    real = _real(10, 100, 10, rng)
    for mean, sd in ((120, 10), (100, 60)):
        replays = [[rng.gauss(mean, sd) for _ in range(10)] for _ in real]
        row = score("deferred", real, replays)
        assert row is not None and not row["faithful"], (mean, sd, row)


def test_reality_that_agrees_with_itself_leaves_the_resolution_only():
    # Ten runs with no bounces: a replay one bounce off on average is within a try,
    # two off is not.
    real: list[float | None] = [0.0] * 10
    ok = score("bounced", real, [[1.0] * 10] * 10)
    off = score("bounced", real, [[2.0] * 10] * 10)
    assert ok is not None and ok["faithful"] and ok["bar"] == RESOLUTION["bounced"]
    assert off is not None and not off["faithful"]


def test_no_run_is_scored_against_its_own_replay():
    # Run 0's replay predicts run 0 exactly and everything else badly: it must not
    # get credit for its own run.
    real: list[float | None] = [0.0, 10.0, 10.0, 10.0]
    replays = [[0.0] * 5, [10.0] * 5, [10.0] * 5, [10.0] * 5]
    row = score("p50", real, replays)
    assert row is not None
    # Pairs (0, j) score 10 each (3 of 12), the others score 0 or 10 (against run 0).
    assert row["score_replay"] == pytest.approx((3 * 10 + 3 * 10) / 12)


def test_missing_values_are_left_out_and_too_few_runs_give_no_row():
    assert score("p50", [1.0, None], [[1.0], [1.0]]) is None
    row = score("p50", [1.0, None, 1.0, 1.0], [[1.0]] * 4)
    assert row is not None and row["faithful"]


def test_the_bar_is_reality_times_the_tolerance_plus_the_resolution():
    real: list[float | None] = [10.0, 20.0, 30.0]
    row = score("p95", real, [[20.0] * 4] * 3)
    assert row is not None
    assert row["bar"] == pytest.approx(row["score_real"] * (1 + TOLERANCE)
                                       + RESOLUTION["p95"], abs=1e-3)
