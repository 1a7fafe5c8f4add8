"""The suite cannot pass by not running: in CI a skip is a failure (tests/conftest.py),
and every test has a deadline (pytest-timeout, ``timeout`` in pyproject.toml)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

PROBES = os.path.join(os.path.dirname(__file__), "probes")
PROBE = os.path.join(PROBES, "skipping.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(ci: str | None, *args: str, probe: str = PROBE) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *args, probe], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)


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


def test_every_test_has_a_deadline():
    """The ini's deadline applies to every test; a hanging one fails with its stack."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        ini = tomllib.load(f)["tool"]["pytest"]["ini_options"]
    assert 200 < int(ini["timeout"]) <= 900, ini
    started = time.monotonic()
    proc = _run(None, "-o", "timeout=2", probe=os.path.join(PROBES, "hanging.py"))
    assert proc.returncode == 1, proc.stdout
    assert "Timeout (>2.0s)" in proc.stdout
    assert time.monotonic() - started < 30
