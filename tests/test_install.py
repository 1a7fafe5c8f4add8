"""`pyqmgr install` / `uninstall`: idempotent, reversible, refuse what is not Postfix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pyqmgr.install import InstallError, install, launcher_path, launcher_text, uninstall

CLI = os.path.join(os.path.dirname(sys.executable), "pyqmgr")


def qmgr_line(pf) -> str:
    return pf.postconf("-M", "qmgr/unix").strip()


def test_install_uninstall_idempotent_on_a_running_instance(postfix):
    pf = postfix(qmgr="stock")
    stock_pid = pf.qmgr_pid()
    before = qmgr_line(pf)
    assert before.split()[-1] == "qmgr"

    out = subprocess.run([CLI, "install", "--config-dir", pf.config_dir], capture_output=True,
                         text=True, check=True).stdout
    assert "reloaded" in out
    after = qmgr_line(pf)
    assert after.split()[:-1] == before.split()[:-1], "other columns untouched"
    assert after.split()[-1] == "pyqmgr/qmgr"
    assert os.path.exists(pf.config_dir + "/master.cf.pyqmgr-backup")
    # master now runs the launcher; its log tag still reads postfix/qmgr.
    (qid,) = pf.smtp_send([("s@test.example", ["r@test.example"])])
    new_pid = pf.qmgr_pid()
    assert new_pid != stock_pid
    with open(f"/proc/{new_pid}/cmdline", "rb") as f:
        assert b"pyqmgr/qmgr" in f.read()
    pf.maillog.wait_for(lambda ln: ln.queue_id == qid and ln.program == "postfix/qmgr"
                        and ln.pid == new_pid, timeout=20, what="pyqmgr logging as qmgr")

    master_cf = open(pf.config_dir + "/master.cf").read()
    lines = install(pf.config_dir)
    assert "qmgr service already runs pyqmgr" in lines
    assert open(pf.config_dir + "/master.cf").read() == master_cf, "second install: no change"

    uninstall(pf.config_dir)
    assert qmgr_line(pf) == before
    assert "already runs stock qmgr" in uninstall(pf.config_dir)[0]


def test_install_keeps_qmgr_options(postfix):
    pf = postfix(qmgr="stock", start=False,
                 qmgr_args=["-o", "smtp_destination_concurrency_limit=7"])
    install(pf.config_dir)
    line = qmgr_line(pf)
    assert line.endswith("pyqmgr/qmgr -o smtp_destination_concurrency_limit=7")
    uninstall(pf.config_dir)
    assert qmgr_line(pf).endswith(" qmgr -o smtp_destination_concurrency_limit=7")


def test_not_a_postfix_directory_is_refused_and_untouched(tmp_path):
    (tmp_path / "main.cf").write_text("x = 1\n")
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(InstallError, match="not a Postfix configuration directory"):
        install(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == before
    proc = subprocess.run([CLI, "install", "--config-dir", str(tmp_path / "nope")],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "not a Postfix configuration directory" in proc.stderr


def test_launcher_uses_this_interpreter_in_isolated_mode():
    text = launcher_text()
    assert text.startswith(f"#!{sys.executable} -I\n")
    assert "from pyqmgr.daemon import main" in text
    # Isolated mode still finds the package (the venv's site-packages, editable or not).
    subprocess.run([sys.executable, "-I", "-c", "from pyqmgr.daemon import main"],
                   check=True, cwd="/")


def snapshot(directory) -> dict[str, tuple[bytes, float]]:
    out = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[name] = (f.read(), os.stat(path).st_mtime)
    return out


def test_stopped_instance_launcher_backup_and_round_trip(postfix):
    pf = postfix(qmgr="stock", start=False,
                 qmgr_args=["-o", "{ smtp_x = a b }", "-o", "y=2"])
    original = open(pf.config_dir + "/master.cf").read()
    lines = install(pf.config_dir)
    assert any("not running" in ln for ln in lines)
    assert not any("reloaded" in ln for ln in lines)
    assert qmgr_line(pf).split(None, 7)[7] == "pyqmgr/qmgr -o {smtp_x=a b} -o y=2"
    daemon_dir = pf.postconf("-xh", "daemon_directory").strip()
    launcher = launcher_path(daemon_dir)
    assert os.access(launcher, os.X_OK) and open(launcher).read() == launcher_text()
    backup = pf.config_dir + "/master.cf.pyqmgr-backup"
    assert open(backup).read() == original

    before = snapshot(pf.config_dir)
    assert install(pf.config_dir) == [f"kept launcher {launcher}",
                                      "qmgr service already runs pyqmgr"]
    assert snapshot(pf.config_dir) == before

    uninstall(pf.config_dir)
    assert qmgr_line(pf).split(None, 7)[7] == "qmgr -o {smtp_x=a b} -o y=2"
    before = snapshot(pf.config_dir)
    uninstall(pf.config_dir)
    assert snapshot(pf.config_dir) == before
    # A second install keeps the first backup: it is the admin's original master.cf.
    install(pf.config_dir)
    assert open(backup).read() == original
    uninstall(pf.config_dir)


def test_uninstall_leaves_a_foreign_qmgr_alone(postfix):
    pf = postfix(qmgr="stock", start=False)
    pf.postconf("-F", "qmgr/unix/command=oqmgr")
    before = snapshot(pf.config_dir)
    assert "nothing to undo" in uninstall(pf.config_dir)[0]
    assert snapshot(pf.config_dir) == before
    lines = install(pf.config_dir)
    assert any("ran 'oqmgr'" in ln for ln in lines)
    assert qmgr_line(pf).split()[-1] == "pyqmgr/qmgr"


def test_no_qmgr_service_is_refused_and_untouched(postfix):
    pf = postfix(qmgr="stock", start=False)
    pf.postconf("-M#", "qmgr/unix")
    before = snapshot(pf.config_dir)
    for action in (install, uninstall):
        with pytest.raises(InstallError, match="no qmgr/unix service"):
            action(pf.config_dir)
    assert snapshot(pf.config_dir) == before
    assert not os.path.exists(pf.config_dir + "/master.cf.pyqmgr-backup")


def test_broken_main_cf_is_refused(tmp_path):
    (tmp_path / "main.cf").write_text("this line has no equals sign\n")
    (tmp_path / "master.cf").write_text("qmgr unix n - n 300 1 qmgr\n")
    before = snapshot(tmp_path)
    with pytest.raises(InstallError, match="postconf"):
        install(str(tmp_path))
    assert snapshot(tmp_path) == before


def test_snippet_matches_what_install_writes(postfix):
    """The pasteable line in master_cf_snippets/qmgr.cf is what install produces."""
    snippet = os.path.join(os.path.dirname(__file__), "..", "master_cf_snippets", "qmgr.cf")
    with open(snippet) as f:
        (line,) = [ln for ln in f if ln.strip() and not ln.startswith("#")]
    pf = postfix(qmgr="stock", start=False)
    install(pf.config_dir)
    got = qmgr_line(pf).split()
    assert got == line.split()
