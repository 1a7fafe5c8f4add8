"""The suite cannot pass by not running: in CI a skip is a failure (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = os.path.join(os.path.dirname(__file__), "probes", "skipping.py")


def _run(ci: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           PROBE], capture_output=True, text=True, env=env, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(__file__)))


def test_a_skip_fails_in_ci_and_says_why():
    proc = _run("true")
    assert proc.returncode == 1, proc.stdout
    assert "1 failed" in proc.stdout
    assert "skipped in CI (Skipped: the probe's own reason)" in proc.stdout
    assert "ALLOWED_SKIPS" in proc.stdout


def test_outside_ci_a_skip_is_a_skip():
    proc = _run(None)
    assert proc.returncode == 0, proc.stdout
    assert "1 skipped" in proc.stdout
