"""`pyqmgr install` / `uninstall`: idempotent, reversible, refuse what is not Postfix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pyqmgr.cli import DEFAULT_MAN_DIR
from pyqmgr.install import (
    InstallError,
    install,
    is_pyqmgr_command,
    launcher_path,
    launcher_text,
    pyqmgr_command,
    uninstall,
)

CLI = os.path.join(os.path.dirname(sys.executable), "pyqmgr")

#: This installation's launcher, as master.cf names it.
OURS = pyqmgr_command()


def qmgr_line(pf) -> str:
    return pf.postconf("-M", "qmgr/unix").strip()


def test_install_uninstall_idempotent_on_a_running_instance(postfix):
    pf = postfix(qmgr="stock")
    stock_pid = pf.qmgr_pid()
    before = qmgr_line(pf)
    assert before.split()[-1] == "qmgr"

    out = subprocess.run([CLI, "install", "--config-dir", pf.config_dir, "--no-man"],
                         capture_output=True, text=True, check=True).stdout
    assert "reloaded" in out
    after = qmgr_line(pf)
    assert after.split()[:-1] == before.split()[:-1], "other columns untouched"
    assert after.split()[-1] == OURS
    assert os.path.exists(pf.config_dir + "/master.cf.pyqmgr-backup")
    # master now runs the launcher; its log tag still reads postfix/qmgr.
    (qid,) = pf.smtp_send([("s@test.example", ["r@test.example"])])
    new_pid = pf.qmgr_pid()
    assert new_pid != stock_pid
    with open(f"/proc/{new_pid}/cmdline", "rb") as f:
        assert OURS.encode() in f.read()
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
    assert line.endswith(f"{OURS} -o smtp_destination_concurrency_limit=7")
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
    assert qmgr_line(pf).split(None, 7)[7] == f"{OURS} -o {{smtp_x=a b}} -o y=2"
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
    assert qmgr_line(pf).split()[-1] == OURS


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
    # The same columns; the command is a launcher of its own (install names it after
    # its venv, the snippet after an example directory).
    assert got[:-1] == line.split()[:-1]
    assert got[-1] == OURS and is_pyqmgr_command(line.split()[-1])


# -- one launcher per installation (#21) ------------------------------------------------


@pytest.fixture
def other_venv():
    """A second installation of this checkout: its own venv, in a root-only directory
    (the trust check refuses /tmp), importing pyqmgr through a .pth file."""
    import shutil
    import tempfile

    from pyqmgr import trust

    home = tempfile.mkdtemp(prefix="pyqmgr-venv2-", dir="/opt")
    os.chmod(home, 0o755)
    try:
        venv = os.path.join(home, "venv2")
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", venv], check=True,
                       timeout=120)
        site = subprocess.run([os.path.join(venv, "bin", "python"), "-c",
                               "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        with open(os.path.join(site, "pyqmgr-checkout.pth"), "w") as f:
            f.write(os.path.dirname(trust.package_dir()) + "\n")
        yield os.path.join(venv, "bin", "python")
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _install_with(python: str, verb: str, config_dir: str) -> list[str]:
    proc = subprocess.run([python, "-I", "-c", "import sys; from pyqmgr import install; "
                           f"print('\\n'.join(install.{verb}(sys.argv[1])))", config_dir],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_each_installation_has_a_launcher_of_its_own(postfix, other_venv):
    """A second venv installing on the same Postfix writes another launcher: it never
    rewrites the one an instance runs, and uninstall removes only its own."""
    pf = postfix(qmgr="stock", start=False)
    theirs = pyqmgr_command(other_venv)
    assert theirs != OURS and theirs.startswith("pyqmgr/venv2-")
    _install_with(other_venv, "install", pf.config_dir)
    assert qmgr_line(pf).split()[-1] == theirs
    their_launcher = os.path.join(pf.daemon_dir, theirs)
    assert open(their_launcher).readline() == f"#!{other_venv} -I\n"
    before = (open(their_launcher, "rb").read(), os.stat(their_launcher).st_mtime_ns)

    lines = install(pf.config_dir)
    assert any("ran another pyqmgr installation" in ln for ln in lines), lines
    assert qmgr_line(pf).split()[-1] == OURS
    assert (open(their_launcher, "rb").read(), os.stat(their_launcher).st_mtime_ns) == before

    ours = launcher_path(pf.daemon_dir)
    lines = uninstall(pf.config_dir)
    assert f"removed launcher {ours}" in lines, lines
    assert not os.path.exists(ours) and os.path.exists(their_launcher)


def test_uninstall_keeps_a_launcher_another_instance_runs(postfix):
    """Two instances of one Postfix (multi_instance_directories, one daemon_directory):
    the launcher stays until the last one is uninstalled."""
    first = postfix(qmgr="stock", start=False)
    second = postfix(qmgr="stock", start=False)
    second.set_main(daemon_directory=first.daemon_dir)
    first.set_main(multi_instance_directories=second.config_dir)
    install(first.config_dir)
    install(second.config_dir)
    launcher = launcher_path(first.daemon_dir)
    lines = uninstall(first.config_dir)
    assert f"kept launcher {launcher}: {second.config_dir}/master.cf runs it" in lines, lines
    assert os.path.exists(launcher)
    lines = uninstall(second.config_dir)
    assert not os.path.exists(launcher)


def test_the_shared_launcher_of_older_installs_is_undone(postfix):
    pf = postfix(qmgr="stock", start=False)
    legacy = os.path.join(pf.daemon_dir, "pyqmgr", "qmgr")
    os.makedirs(os.path.dirname(legacy))
    with open(legacy, "w") as f:
        f.write(launcher_text())
    os.chmod(legacy, 0o755)
    pf.postconf("-F", "qmgr/unix/command=pyqmgr/qmgr")
    lines = uninstall(pf.config_dir)
    assert qmgr_line(pf).split()[-1] == "qmgr"
    assert f"removed launcher {legacy}" in lines and not os.path.exists(legacy)


def _tree(directory: str) -> dict[str, tuple[bytes, int]]:
    found = {}
    for base, _dirs, files in os.walk(directory):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                found[path] = (f.read(), os.stat(path).st_mtime_ns)
    return found


TINY_WORKLOAD = """title = "tiny"
seed = 1
[compare]
time_scale = 0.2
timeout = 60
contenders = ["pyqmgr"]
[destinations."a.example"]
latency = 0.05
[[messages]]
count = 5
every = 0.1
destination = "a.example"
"""


def test_demo_and_compare_leave_an_installed_instance_as_it_was(postfix, tmp_path):
    """`pyqmgr demo` reports real mail; its sandbox and compare's make daemon
    directories of their own: an installed, running
    instance's launcher and master.cf stay byte for byte, and nothing is written into
    the machine's daemon_directory."""
    pf = postfix(qmgr="pyqmgr")
    system_launchers = "/usr/lib/postfix/sbin/pyqmgr"
    watched = [os.path.join(pf.config_dir, "master.cf"), *_tree(pf.daemon_dir)]
    before = {p: (open(p, "rb").read(), os.stat(p).st_mtime_ns) for p in watched}
    system_before = _tree(system_launchers) if os.path.isdir(system_launchers) else None
    qmgr_before = pf.qmgr_pid()

    # The README's main job runs and reports real mail (this was tests/test_demo.py).
    demo = subprocess.run([CLI, "demo", "--messages", "8"], capture_output=True, text=True,
                          timeout=180)
    assert demo.returncode == 0, demo.stderr
    assert f"qmgr service: {pyqmgr_command()} (pid" in demo.stdout
    assert "postfix/discard  sent" in demo.stdout
    assert "postfix/smtp     deferred" in demo.stdout
    assert ", 0 warnings" in demo.stdout
    workload = tmp_path / "tiny.toml"
    workload.write_text(TINY_WORKLOAD)
    cmp = subprocess.run([CLI, "compare", str(workload), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300)
    assert cmp.returncode == 0, cmp.stderr[-2000:]

    after = {p: (open(p, "rb").read(), os.stat(p).st_mtime_ns) for p in watched}
    assert after == before
    assert _tree(pf.daemon_dir).keys() == set(watched[1:]), "no new file in its daemon dir"
    assert (_tree(system_launchers) if os.path.isdir(system_launchers)
            else None) == system_before
    assert pf.qmgr_pid() == qmgr_before, "its qmgr was not restarted"


def test_demo_from_a_checkout_under_tmp_says_what_to_do(tmp_path):
    """The trust check refuses a checkout others can write to; the refusal says how to
    get a demo anyway."""
    import shutil

    from pyqmgr import trust

    copy = tmp_path / "checkout"
    shutil.copytree(trust.package_dir(), copy / "pyqmgr",
                    ignore=shutil.ignore_patterns("__pycache__"))
    os.makedirs(copy / ".git")
    proc = subprocess.run([sys.executable, "-m", "pyqmgr.cli", "demo", "--messages", "1"],
                          cwd=copy, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "refusing to install" in proc.stderr and "/tmp: writable by others" in proc.stderr
    assert "What to do:" in proc.stderr
    assert f"git clone {copy} /opt/pyqmgr && cd /opt/pyqmgr && ./dev demo" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_man_pages_are_installed_and_read_with_man(postfix, tmp_path):
    """`pyqmgr install` puts pyqmgr(8) and pyqmgr(1) where man finds them; man renders
    them; uninstall takes them away with the last launcher."""
    pf = postfix(qmgr="stock", start=False)
    man_dir = tmp_path / "man"
    proc = subprocess.run([CLI, "install", "--config-dir", pf.config_dir,
                           "--man-dir", str(man_dir)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert f"installed manual page {man_dir}/man8/pyqmgr.8" in proc.stdout
    env = dict(os.environ, MANPATH=str(man_dir), MANWIDTH="100", MAN_KEEP_FORMATTING="")
    for section, title, words in (
            ("8", "PYQMGR(8)", ["Postfix queue manager, in Python", "scheduler_policy",
                                "sendopts", "pyqmgr.cf"]),
            ("1", "PYQMGR(1)", ["pyqmgr install", "pyqmgr explain", "--man-dir"])):
        page = subprocess.run(["man", "-P", "cat", section, "pyqmgr"], capture_output=True,
                              text=True, env=env, timeout=60)
        assert page.returncode == 0, page.stderr
        text = page.stdout.replace("\u2010", "-").replace("\u2212", "-")
        assert text.startswith(title), text[:200]
        for word in words:
            assert word in text, f"{word!r} not in pyqmgr({section})"
        assert "warning" not in page.stderr.lower(), page.stderr
    # `man pyqmgr` (no section): the default man dir is on man's own path.
    assert DEFAULT_MAN_DIR in subprocess.run(["manpath"], capture_output=True, text=True,
                                             env={"PATH": os.environ["PATH"]}).stdout
    again = subprocess.run([CLI, "install", "--config-dir", pf.config_dir, "--man-dir",
                            str(man_dir)], capture_output=True, text=True).stdout
    assert f"kept manual page {man_dir}/man1/pyqmgr.1" in again
    out = subprocess.run([CLI, "uninstall", "--config-dir", pf.config_dir, "--man-dir",
                          str(man_dir)], capture_output=True, text=True, check=True).stdout
    assert f"removed manual page {man_dir}/man8/pyqmgr.8" in out
    assert not (man_dir / "man1" / "pyqmgr.1").exists()
