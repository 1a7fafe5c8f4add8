"""Benchmark targets: a miss makes the benchmark's exit status 1 (``.ci/run`` fails)."""

from __future__ import annotations

import pytest

from benchmarks import decisions
from benchmarks.target import Target, status


def test_check_prints_the_verdict_with_its_figure(capsys: pytest.CaptureFixture[str]) -> None:
    assert Target("at most 3x").check(True, "2.4x") is True
    assert Target("at most 3x").check(False, "3.2x") is False
    assert capsys.readouterr().out.splitlines() == [
        "target: at most 3x (2.4x): met", "target: at most 3x (3.2x): MISSED"]


def test_status_is_1_on_any_miss_and_every_check_is_printed(
        capsys: pytest.CaptureFixture[str]) -> None:
    t = Target("t")
    assert status([t.check(True), t.check(False), t.check(True)]) == 1
    assert status([t.check(True)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 4


def test_decisions_targets() -> None:
    flat = {"nqmgr": [209e3, 219e3, 230e3], "finch": [232e3, 288e3, 305e3]}
    assert decisions.check(flat) == [True, True]
    slow = {"nqmgr": [209e3, 219e3, 99e3]}
    assert decisions.check(slow) == [False, False]
    grows = {"nqmgr": [250e3, 219e3, 230e3]}
    assert decisions.check(grows) == [True, False]
