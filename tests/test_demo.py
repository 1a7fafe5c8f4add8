"""The README's main job, `pyqmgr demo`, runs and reports real mail."""

import os
import subprocess
import sys

from pyqmgr.install import pyqmgr_command


def test_demo_runs_and_reports():
    exe = os.path.join(os.path.dirname(sys.executable), "pyqmgr")
    proc = subprocess.run([exe, "demo", "--messages", "8"], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"qmgr service: {pyqmgr_command()} (pid" in out
    assert "postfix/discard  sent" in out and "postfix/smtp     deferred" in out
    assert ", 0 warnings" in out
