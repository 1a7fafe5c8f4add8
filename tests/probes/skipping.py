"""Not collected by the suite (no test_ prefix): tests/test_ci_policy.py runs it alone to
show that a skip fails in CI."""

import pytest


def test_skips():
    pytest.skip("the probe's own reason")
