"""Durations in human units (issue #43): what status, explain, top and the controls'
replies print, where ``in 597.943s`` used to be."""

from __future__ import annotations

import math

import pytest

from pyqmgr.durations import ago, duration, until


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (0.0004, "0s"), (0.25, "250ms"), (0.9996, "1s"), (1, "1s"), (2.5, "2.5s"),
    (2.04, "2s"), (9.96, "10s"), (58.4, "58s"), (59.6, "1m"), (597.943, "9m58s"),
    (600, "10m"), (3599.6, "1h"), (3600, "1h"), (7499, "2h5m"), (86399, "1d"),
    (86400, "1d"), (90061, "1d1h"), (3 * 86400 + 4 * 3600 + 100, "3d4h"),
    (30 * 86400, "30d"), (-90, "-1m30s"),
])
def test_duration(seconds, text):
    assert duration(seconds) == text


def test_no_duration():
    assert duration(None) == duration(math.inf) == duration(math.nan) == "-"


def test_until_and_ago():
    assert until(597.943) == "in 9m58s"
    assert until(0.2) == until(-5) == "now"
    assert until(None) == "never"
    assert ago(65) == "1m5s ago" and ago(None) == "never"
