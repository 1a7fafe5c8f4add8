"""`pyqmgr install` / `uninstall`: idempotent, reversible, refuse what is not Postfix."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import time

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
from pyqmgr.rollback import daemon_pids
from tests.trust_helpers import CHECKOUT, PyqmgrForOthers, make_readable, run_as

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


def test_debians_no_configuration_is_named_with_what_to_do(tmp_path):
    """Debian's postfix installed with "No configuration" leaves master.cf and no
    main.cf (this machine's own /etc/postfix is such a one): check says what to run."""
    shutil.copy("/usr/share/postfix/master.cf.dist", tmp_path / "master.cf")
    proc = subprocess.run([CLI, "check", "--config-dir", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.splitlines()
    assert "(no main.cf); Postfix was installed without a configuration" in line
    assert "dpkg-reconfigure postfix" in line
    assert f"cp /usr/share/postfix/main.cf.debian {tmp_path}/main.cf" in line
    assert os.listdir(tmp_path) == ["master.cf"]


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
    """A second installation of this checkout: its own venv and a copy of the package,
    in a root-only directory (the trust check refuses /tmp), importing pyqmgr through a
    .pth file."""
    with venv_of_this_checkout(0o755) as python:
        yield python


@contextlib.contextmanager
def venv_of_this_checkout(mode: int):
    """A venv under a new directory of /opt with ``mode``, with a copy of the working
    tree's package beside it (so that the mode of the directories above the suite's own
    checkout does not matter); yields its python."""
    import shutil
    import tempfile

    home = tempfile.mkdtemp(prefix="pyqmgr-venv2-", dir="/opt")
    os.chmod(home, mode)
    try:
        source = os.path.join(home, "src")
        shutil.copytree(os.path.join(CHECKOUT, "pyqmgr"), os.path.join(source, "pyqmgr"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        make_readable(source)
        venv = os.path.join(home, "venv2")
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", venv], check=True,
                       timeout=120)
        site = subprocess.run([os.path.join(venv, "bin", "python"), "-c",
                               "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        with open(os.path.join(site, "pyqmgr-checkout.pth"), "w") as f:
            f.write(source + "\n")
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


# -- master.cf given back, state removed, the backup named (#43) ------------------------


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def cli(*args: str, user: str | None = None, others: PyqmgrForOthers | None = None,
        ) -> subprocess.CompletedProcess[str]:
    """The command as root or, with ``user``, as that user (its uid and gid, no other
    groups, a plain environment), who runs the copy ``others`` (the pyqmgr_for_others
    fixture): the suite's own venv may be under a 0700 directory it cannot enter."""
    extra = {"install": ["--no-man"], "uninstall": ["--man-dir", "/nonexistent"]}
    argv = [*args, *extra.get(args[0], [])]
    if user is None:
        return subprocess.run([CLI, *argv], capture_output=True, text=True, timeout=180,
                              cwd="/")
    if others is None:
        raise TypeError(f"cli(user={user!r}) needs others=pyqmgr_for_others")
    return others.run(others.pyqmgr(*argv), pwd.getpwnam(user), timeout=180)


#: The qmgr entry as an admin's master.cf may have it: its own alignment, a
#: continuation line with a comment inside the entry, and a commented alternative
#: right after it (postconf -F moves the entry past that comment).
ADMIN_QMGR_ENTRY = (b"qmgr\tunix  n   -   n   300   1     qmgr\n"
                    b"# the active queue limit is ours\n"
                    b"    -o qmgr_message_active_limit=20000\n"
                    b"#qmgr     unix  n       -       n       300     1       oqmgr\n")


def admin_layout(pf) -> bytes:
    """Give the instance's qmgr entry ADMIN_QMGR_ENTRY's layout; return the file."""
    path = os.path.join(pf.config_dir, "master.cf")
    lines = read_bytes(path).splitlines(keepends=True)
    (at,) = [i for i, ln in enumerate(lines) if ln.split()[:2] == [b"qmgr", b"unix"]]
    lines[at] = ADMIN_QMGR_ENTRY
    write_bytes(path, b"".join(lines))
    return read_bytes(path)


def wait_for_daemon(pf) -> None:
    pf.wait_until(lambda: cli("status", "--config-dir", pf.config_dir).returncode == 0, 30,
                  "pyqmgr's control socket to answer")


def test_install_then_uninstall_gives_master_cf_back_byte_for_byte(postfix):
    """The issue's round trip on a running instance: master.cf is the same file again,
    the backup was named and is gone, and so are the daemon's own directories (with
    the suspension it kept); only the command word changed in between."""
    pf = postfix(qmgr="stock", start=False)
    master_cf = os.path.join(pf.config_dir, "master.cf")
    backup = master_cf + ".pyqmgr-backup"
    original = admin_layout(pf)
    pf.start()
    installed = cli("install", "--config-dir", pf.config_dir)
    assert installed.returncode == 0, installed.stderr
    assert f"saved {backup}" in installed.stdout
    during = read_bytes(master_cf)
    assert during.replace(OURS.encode(), b"qmgr") == original, "one word changed, in place"
    assert during.count(OURS.encode()) == 1
    assert read_bytes(backup) == original

    wait_for_daemon(pf)
    suspended = cli("suspend", "example.com", "--ttl", "1h", "--config-dir", pf.config_dir)
    assert suspended.returncode == 0, suspended.stderr
    control = os.path.join(pf.queue_dir, "pyqmgr")
    state = os.path.join(pf.data_dir, "pyqmgr")
    assert os.path.exists(os.path.join(state, "suspensions.json"))
    assert os.path.exists(os.path.join(control, "control"))
    # Uninstall waits for this daemon to exit before it removes its directories.
    daemon = pf.qmgr_pid()
    assert daemon_pids(pf.queue_dir, launcher_path(pf.daemon_dir)) == [daemon]

    removed = cli("uninstall", "--config-dir", pf.config_dir)
    assert removed.returncode == 0, removed.stderr
    out = removed.stdout
    assert read_bytes(master_cf) == original
    assert f"restored {master_cf} from {backup} (saved " in out, out
    assert f"removed {backup}: master.cf is the same file again" in out, out
    assert not os.path.exists(backup)
    assert f"removed {control} (the control socket's directory)" in out, out
    assert f"removed {state} (pyqmgr's state: 1 suspension, which stock qmgr does not " \
           "know)" in out, out
    assert not os.path.exists(control) and not os.path.exists(state)
    assert not os.path.exists(f"/proc/{daemon}")
    with open(f"/proc/{pf.qmgr_pid()}/cmdline", "rb") as f:
        assert b"pyqmgr" not in f.read(), "stock qmgr runs again"
    # Once more: nothing to do, nothing changed.
    again = cli("uninstall", "--config-dir", pf.config_dir)
    assert again.stdout.splitlines() == ["qmgr service already runs stock qmgr"]
    assert read_bytes(master_cf) == original


def admin_edits(text: bytes) -> bytes:
    """What an admin does to master.cf in a week: a comment, another service's column
    changed, a service added."""
    lines = text.splitlines(keepends=True)
    (at,) = [i for i, ln in enumerate(lines) if ln.split()[:2] == [b"pickup", b"unix"]]
    assert b" 60 " in lines[at], lines[at]
    lines[at] = lines[at].replace(b" 60 ", b" 30 ", 1)
    lines.insert(0, b"# edited by hand after pyqmgr install\n")
    lines.append(b"relay2    unix  -       -       n       -       -       smtp\n"
                 b"  -o syslog_name=postfix/relay2\n")
    return b"".join(lines)


def test_an_admins_edits_after_install_survive_uninstall(postfix):
    pf = postfix(qmgr="stock", start=False)
    master_cf = os.path.join(pf.config_dir, "master.cf")
    backup = master_cf + ".pyqmgr-backup"
    original = admin_layout(pf)
    install(pf.config_dir)
    write_bytes(master_cf, admin_edits(read_bytes(master_cf)))

    lines = uninstall(pf.config_dir)
    assert read_bytes(master_cf) == admin_edits(original), "edits kept, qmgr back to stock"
    assert qmgr_line(pf).split()[-3:] == ["qmgr", "-o", "qmgr_message_active_limit=20000"]
    assert pf.postconf("-Fh", "pickup/unix/wakeup").strip() == "30"
    assert pf.postconf("-Fh", "relay2/unix/command").strip().startswith("smtp")
    assert any(ln.startswith(f"edited only the qmgr line of {master_cf}: it has changed "
                             "since install (4 line(s) differ from the backup)")
               for ln in lines), lines
    assert any(ln.startswith(f"kept {backup} (saved ") and f"diff -u {backup}" in ln
               for ln in lines), lines
    assert read_bytes(backup) == original

    # Reinstalling: the old backup is named and replaced by today's master.cf, the
    # last one without pyqmgr; uninstall then gives that one back.
    today = read_bytes(master_cf)
    lines = install(pf.config_dir)
    assert any(ln.startswith(f"replaced {backup} of ") and "master.cf has changed since"
               in ln for ln in lines), lines
    assert read_bytes(backup) == today
    lines = uninstall(pf.config_dir)
    assert read_bytes(master_cf) == today and not os.path.exists(backup)


def test_an_existing_backup_is_named(postfix):
    pf = postfix(qmgr="stock", start=False)
    master_cf = os.path.join(pf.config_dir, "master.cf")
    backup = master_cf + ".pyqmgr-backup"
    write_bytes(backup, read_bytes(master_cf))
    os.utime(backup, (1700000000, 1700000000))
    lines = install(pf.config_dir)
    saved = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(1700000000))
    assert f"kept {backup} (saved {saved}, the same as master.cf)" in lines, lines


def test_uninstall_after_an_older_pyqmgrs_postconf_install_restores_the_backup(postfix):
    """Installs before #43 edited master.cf with postconf -F, which rewrote the entry
    in its own layout after the comment that followed it: uninstall sees that only
    the layout differs and writes the backup's bytes."""
    pf = postfix(qmgr="stock", start=False)
    master_cf = os.path.join(pf.config_dir, "master.cf")
    original = admin_layout(pf)
    write_bytes(master_cf + ".pyqmgr-backup", original)
    current = pf.postconf("-Fh", "qmgr/unix/command").strip()
    pf.postconf("-F", f"qmgr/unix/command={OURS}{current[len('qmgr'):]}")
    assert read_bytes(master_cf).replace(OURS.encode(), b"qmgr") != original
    lines = uninstall(pf.config_dir)
    assert read_bytes(master_cf) == original
    assert any(ln.startswith(f"restored {master_cf} from ") for ln in lines), lines


def test_uninstall_gives_back_the_qmgr_that_ran_before(postfix):
    """An admin's oqmgr before install is the oqmgr after uninstall (the backup's)."""
    pf = postfix(qmgr="stock", start=False)
    pf.postconf("-F", "qmgr/unix/command=oqmgr")
    master_cf = os.path.join(pf.config_dir, "master.cf")
    original = read_bytes(master_cf)
    lines = install(pf.config_dir)
    assert "note: the qmgr service ran 'oqmgr', not stock qmgr; uninstall will restore " \
           "'oqmgr'" in lines, lines
    uninstall(pf.config_dir)
    assert read_bytes(master_cf) == original


# -- the wrong user (#43) ---------------------------------------------------------------


def test_the_wrong_user_is_told_what_is_needed_in_one_line(postfix, pyqmgr_for_others):
    """Run as nobody: install, uninstall and demo say they need root; the daemon's
    controls and reads say who may; compare says what it needs. One line on stderr,
    a non-zero status, nothing changed, no traceback."""
    others = pyqmgr_for_others
    probe = cli("--help", user="nobody", others=others)
    assert probe.returncode == 0, (
        f"nobody cannot run the copy in {others.path} at all: {probe.stderr.strip()}")
    # The workload, and the response rules it names by relative path, where nobody
    # can read them.
    workload = others.share(os.path.join("compat", "workloads", "limiter-421.toml"))
    others.share(os.path.join("contrib", "response_rules.example"))
    pf = postfix(qmgr="stock", main_cf={"authorized_mailq_users": "root"})
    master_cf = os.path.join(pf.config_dir, "master.cf")
    before = read_bytes(master_cf)
    for args, needs in (
            (["install", "--config-dir", pf.config_dir],
             "pyqmgr install: must be run as root: it changes master.cf and writes the "
             "launcher that master(8) runs as root"),
            (["uninstall", "--config-dir", pf.config_dir],
             "pyqmgr uninstall: must be run as root: it changes master.cf and reloads "
             "Postfix"),
            (["demo", "--messages", "1"],
             "pyqmgr demo: must be run as root: it starts a throwaway Postfix instance, "
             "whose master(8) runs as root (the machine's own Postfix is not touched)")):
        proc = cli(*args, user="nobody", others=others)
        assert (proc.returncode, proc.stderr.splitlines(), proc.stdout) == (1, [needs], ""), \
            proc
    assert read_bytes(master_cf) == before
    assert not os.path.exists(master_cf + ".pyqmgr-backup")

    install(pf.config_dir)
    wait_for_daemon(pf)
    installed = read_bytes(master_cf)
    proc = cli("uninstall", "--config-dir", pf.config_dir, user="nobody", others=others)
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1
    assert read_bytes(master_cf) == installed
    for args, code, words in (
            (["suspend", "example.com", "--config-dir", pf.config_dir], 77,
             "pyqmgr suspend: permission denied"),
            (["status", "--config-dir", pf.config_dir], 77, "pyqmgr status: permission "
                                                            "denied"),
            (["compare", workload], 4,
             "pyqmgr compare: runs real Postfix instances: needs root")):
        proc = cli(*args, user="nobody", others=others)
        assert proc.returncode == code, proc
        assert len(proc.stderr.splitlines()) == 1 and words in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    uninstall(pf.config_dir)


def test_install_says_when_only_root_can_run_this_pyqmgr(postfix):
    """From a venv under a 0700 directory (as /root is), users authorized_mailq_users
    allows cannot even start the interpreter to run status: install says so, and
    where to put the checkout instead. From a directory others can enter, no note.
    Both installations are made here: where the suite's own checkout lies does not
    matter. Each time nobody tries it, so the note is held to what it says."""
    pf = postfix(qmgr="stock", start=False)
    with venv_of_this_checkout(0o700) as python:
        home = os.path.dirname(os.path.dirname(os.path.dirname(python)))
        lines = _install_with(python, "install", pf.config_dir)
        script = os.path.join(os.path.dirname(python), "pyqmgr")
        assert (f"note: {home} is mode 0700, so only root can run {script}: the users "
                "authorized_mailq_users allows (static:anyone) cannot run 'pyqmgr status' "
                "or 'pyqmgr explain' from it. For them, put the checkout and its venv under "
                "/opt (README.md, section 6)") in lines, lines
        with pytest.raises(PermissionError, match=f"Permission denied: '{python}'"):
            _as_nobody(python, "--help")  # the exec itself is refused
        _install_with(python, "uninstall", pf.config_dir)
    with venv_of_this_checkout(0o755) as python:
        lines = _install_with(python, "install", pf.config_dir)
        assert not any("only root can run" in ln for ln in lines), lines
        ran = _as_nobody(python, "--help")
        assert ran.returncode == 0 and "usage: pyqmgr" in ran.stdout, ran.stderr
        _install_with(python, "uninstall", pf.config_dir)


def _as_nobody(python: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``pyqmgr ARGS`` from the venv of ``python``, as nobody."""
    return run_as([python, "-m", "pyqmgr.cli", *args], pwd.getpwnam("nobody"),
                  {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, timeout=60)


def test_state_stays_while_the_daemon_has_not_exited(tmp_path):
    """A daemon still on its way out keeps its directories, and uninstall says how to
    finish; once it is gone they go."""
    from pyqmgr.rollback import remove_state

    queue_dir, data_dir = tmp_path / "spool", tmp_path / "data"
    for directory in (queue_dir / "pyqmgr", data_dir / "pyqmgr"):
        directory.mkdir(parents=True)
    (data_dir / "pyqmgr" / "suspensions.json").write_text(
        '{"version": 1, "suspensions": [{}, {}]}')
    slow = subprocess.Popen(["sleep", "60"])
    try:
        lines = remove_state(str(queue_dir), str(data_dir), [slow.pid], timeout=0.3)
        assert lines == [f"left {queue_dir}/pyqmgr and {data_dir}/pyqmgr: the pyqmgr daemon "
                         f"(pid {slow.pid}) had not exited 0.3 s after the reload; 'pyqmgr "
                         "uninstall' again removes them once it has"]
        assert (data_dir / "pyqmgr" / "suspensions.json").exists()
    finally:
        slow.kill()
        slow.wait()
    lines = remove_state(str(queue_dir), str(data_dir), [slow.pid], timeout=0.3)
    assert lines == [f"removed {queue_dir}/pyqmgr (the control socket's directory)",
                     f"removed {data_dir}/pyqmgr (pyqmgr's state: 2 suspensions, which "
                     "stock qmgr does not know)"]
    assert not (queue_dir / "pyqmgr").exists() and not (data_dir / "pyqmgr").exists()
