"""Not collected by the suite: tests/test_ci_policy.py runs it alone, with a short
deadline, to show that a test that hangs fails instead of holding the suite."""

import time


def test_hangs():
    time.sleep(60)
