"""pyqmgr status/explain when there is no daemon: a clear line and sysexits' status."""

from __future__ import annotations

import os
import shutil

import pytest

from pyqmgr.cli import EX_UNAVAILABLE, main


@pytest.mark.skipif(shutil.which("postconf") is None, reason="needs postconf")
def test_no_daemon_running(tmp_path, capsys):
    (tmp_path / "main.cf").write_text(f"queue_directory = {tmp_path}/spool\n")
    os.mkdir(tmp_path / "spool")
    assert main(["status", "--config-dir", str(tmp_path)]) == EX_UNAVAILABLE
    err = capsys.readouterr().err
    assert err.startswith(f"pyqmgr status: cannot connect to {tmp_path}/spool/pyqmgr/control")
    assert "not running" in err
    assert main(["explain", "x.example", "--config-dir", str(tmp_path)]) == EX_UNAVAILABLE


@pytest.mark.skipif(shutil.which("postconf") is None, reason="needs postconf")
def test_not_a_config_directory(tmp_path, capsys):
    assert main(["status", "--config-dir", str(tmp_path / "none")]) == EX_UNAVAILABLE
    assert capsys.readouterr().err.startswith("pyqmgr status: ")
