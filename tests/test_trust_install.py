"""pyqmgr.cf and the trust check on real Postfix instances, with a real stranger.

A system user is created for each test that needs one (and deleted afterwards); a
pyqmgr.cf, a policy module or a directory is handed to that user, and ``pyqmgr check``,
``pyqmgr install`` and the daemon under a real master(8) must all name the path.
Instances that should pass the check live in a directory whose chain is root's alone
(tests/trust_helpers.py): the usual /tmp test beds are untrusted by design.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from pyqmgr.install import launcher_path, pyqmgr_command
from tests.trust_helpers import throwaway_user, trusted_dir

CLI = os.path.join(os.path.dirname(sys.executable), "pyqmgr")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None,
    reason="needs root and useradd (a real unprivileged user owns the bad files)")

#: This installation's launcher, as master.cf names it.
OURS = pyqmgr_command()


@pytest.fixture
def trusted_base() -> Iterator[str]:
    with trusted_dir("pyqmgr-tb-trusted-") as path:
        yield path


@pytest.fixture
def stranger():
    with throwaway_user() as pw:
        yield pw


def run(*args: str) -> subprocess.CompletedProcess[str]:
    # The manual pages are test_install.py's business: none go to the machine's man dir.
    extra = {"install": ["--no-man"], "uninstall": ["--man-dir", "/nonexistent"]}
    return subprocess.run([CLI, *args, *extra.get(args[0], [])], capture_output=True,
                          text=True, timeout=120)


def write_cf(pf, text: str) -> str:
    path = os.path.join(pf.config_dir, "pyqmgr.cf")
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o644)
    return path


def state(pf) -> dict[str, object]:
    """What install could change: config files and the launcher."""
    found: dict[str, object] = {}
    for name in sorted(os.listdir(pf.config_dir)):
        path = os.path.join(pf.config_dir, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                found[name] = (f.read(), os.stat(path).st_mtime_ns)
    found["launcher"] = os.path.lexists(launcher_path(pf.daemon_dir))
    return found


# pyqmgr_test_note is the admin's own parameter (another value uses it as $name, so
# check does not call it unknown); smtp_delivery_policy_context is one of pyqmgr's.
CLEAN_CF = ("# pyqmgr's own settings\n"
            "pyqmgr_test_note = queue in $queue_directory\n"
            "smtp_delivery_policy_context = ${pyqmgr_test_note},\n"
            "    continued\n")


def test_check_passes_a_clean_instance_and_reports_json(trusted_base, postfix):
    pf = postfix(qmgr="stock", start=False, base_dir=trusted_base)
    write_cf(pf, CLEAN_CF)
    proc = run("check", "--config-dir", pf.config_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok: no problems found" in proc.stdout
    assert "parses, 2 parameter(s)" in proc.stdout
    assert "absent" in proc.stdout, "no launcher before install"
    # This checkout's editable install is the pure build (the compiled one, in
    # .venv-compiled, is held to the parity suite by ./dev test-compiled).
    assert "(pure Python build)" in proc.stdout, proc.stdout

    proc = run("check", "--config-dir", pf.config_dir, "--json")
    assert proc.returncode == 0
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["problems"] == []
    assert report["pyqmgr_cf"] == {
        "path": f"{pf.config_dir}/pyqmgr.cf", "exists": True, "parses": True, "error": None,
        "parameters": ["pyqmgr_test_note", "smtp_delivery_policy_context"]}
    assert report["launcher"]["installed"] is False
    assert report["paths_checked"] > 50
    assert report["build"] == "pure Python"


def test_under_tmp_only_what_lies_outside_postfixs_directories_is_refused(postfix):
    """A test bed in /tmp: its pyqmgr.cf is fine, a policy module beside it is not.

    The directories above config_directory are Postfix's (whoever can change them can
    replace master.cf); a policy file elsewhere in /tmp has only /tmp above it.
    """
    pf = postfix(qmgr="stock", start=False)
    assert pf.root.startswith("/tmp/")
    write_cf(pf, CLEAN_CF)
    proc = run("check", "--config-dir", pf.config_dir)
    assert proc.returncode == 0, proc.stdout

    policy = os.path.join(pf.root, "policy.py")
    with open(policy, "w") as f:
        f.write("# a policy\n")
    write_cf(pf, f"scheduler_policy = module:{policy}\n")
    proc = run("check", "--config-dir", pf.config_dir)
    assert proc.returncode == 1
    assert (f"/tmp: writable by others (a sticky world-writable directory such as /tmp is "
            f"not trusted either) (on the way to {policy})") in proc.stdout


def test_check_and_install_refuse_a_pyqmgr_cf_owned_by_a_stranger(trusted_base, stranger,
                                                                  postfix):
    pf = postfix(qmgr="stock", start=False, base_dir=trusted_base)
    cf = write_cf(pf, CLEAN_CF)
    os.chown(cf, stranger.pw_uid, stranger.pw_gid)
    expected = f"{cf}: owned by uid {stranger.pw_uid}, not root (user {stranger.pw_name})"

    proc = run("check", "--config-dir", pf.config_dir)
    assert proc.returncode == 1
    assert f"  {expected}" in proc.stdout.splitlines()
    report = json.loads(run("check", "--config-dir", pf.config_dir, "--json").stdout)
    assert report["ok"] is False and report["problems"] == [expected]

    before = state(pf)
    proc = run("install", "--config-dir", pf.config_dir)
    assert proc.returncode == 1
    assert proc.stderr.startswith("pyqmgr install: refusing to install")
    assert expected in proc.stderr
    assert state(pf) == before, "a refused install changes nothing"
    assert not os.path.exists(pf.config_dir + "/master.cf.pyqmgr-backup")


def test_policy_modules_a_stranger_can_change_are_reported(trusted_base, stranger, postfix):
    pf = postfix(qmgr="stock", start=False, base_dir=trusted_base)
    shared = os.path.join(trusted_base, "policies")
    os.mkdir(shared)
    os.chown(shared, 0, stranger.pw_gid)
    os.chmod(shared, 0o775)  # the stranger's group may add and replace files
    with open(os.path.join(shared, "fair.py"), "w") as f:
        f.write("# a policy\n")
    own = os.path.join(trusted_base, "own.py")
    shutil.copy(os.path.join(shared, "fair.py"), own)
    os.chown(own, stranger.pw_uid, stranger.pw_gid)
    write_cf(pf, f"scheduler_policy = module:{shared}/fair.py\n"
                 f"smtp_scheduler_policy = module:{own}\n")

    report = json.loads(run("check", "--config-dir", pf.config_dir, "--json").stdout)
    assert report["policy_modules"] == {"scheduler_policy": f"{shared}/fair.py",
                                        "smtp_scheduler_policy": own}
    assert report["problems"] == [
        f"{shared}: writable by group (gid {stranger.pw_gid}, {stranger.pw_name}) "
        f"(on the way to {shared}/fair.py)",
        f"{own}: owned by uid {stranger.pw_uid}, not root (user {stranger.pw_name})",
    ]
    proc = run("install", "--config-dir", pf.config_dir)
    assert proc.returncode == 1 and f"{own}: owned by uid" in proc.stderr


def test_check_refuses_a_pyqmgr_cf_that_does_not_parse(trusted_base, postfix):
    pf = postfix(qmgr="stock", start=False, base_dir=trusted_base)
    cf = write_cf(pf, "scheduler_policy = fifo\nthis line has no equals sign\n")
    proc = run("check", "--config-dir", pf.config_dir)
    assert proc.returncode == 1
    assert (f"{cf}, line 2: missing '=' after attribute name: "
            f"\"this line has no equals sign\"") in proc.stdout
    report = json.loads(run("check", "--config-dir", pf.config_dir, "--json").stdout)
    assert report["pyqmgr_cf"]["parses"] is False


def test_check_of_a_non_postfix_directory_exits_2(tmp_path):
    proc = run("check", "--config-dir", str(tmp_path))
    assert proc.returncode == 2 and "not a Postfix configuration directory" in proc.stderr
    proc = run("check", "--config-dir", str(tmp_path), "--json")
    assert proc.returncode == 2 and json.loads(proc.stdout)["ok"] is False


def test_install_and_uninstall_leave_pyqmgr_cf_alone(trusted_base, postfix):
    pf = postfix(qmgr="stock", start=False, base_dir=trusted_base)
    cf = write_cf(pf, CLEAN_CF)
    before = (open(cf, "rb").read(), os.stat(cf).st_mtime_ns)
    proc = run("install", "--config-dir", pf.config_dir)
    assert proc.returncode == 0, proc.stderr
    assert f"left {cf} as it is" in proc.stdout
    assert pf.postconf("-F", "qmgr/unix/command").split()[-1] == OURS
    proc = run("uninstall", "--config-dir", pf.config_dir)
    assert proc.returncode == 0, proc.stderr
    assert f"kept {cf}" in proc.stdout
    assert (open(cf, "rb").read(), os.stat(cf).st_mtime_ns) == before


def qmgr_fatal(pf, what: str, since: int = 0):
    (line,) = pf.maillog.wait_for(
        lambda ln: ln.program == "postfix/qmgr" and ln.severity == "fatal", timeout=20,
        what=what, since=since)[:1]
    return line


def test_daemon_refuses_a_strangers_pyqmgr_cf_and_mail_stays_queued(trusted_base, stranger,
                                                                     postfix):
    # master(8) retries a throttled service after service_throttle_time (60s by default).
    pf = postfix(qmgr="pyqmgr", start=False, base_dir=trusted_base,
                 main_cf={"service_throttle_time": "2s"})
    cf = write_cf(pf, CLEAN_CF)
    os.chown(cf, stranger.pw_uid, stranger.pw_gid)
    pf.start()
    (qid,) = pf.smtp_send([("s@test.example", [pf.local_address])])

    fatal = qmgr_fatal(pf, "pyqmgr's fatal start-up error")
    assert fatal.text.startswith(
        f"fatal: {cf}: owned by uid {stranger.pw_uid}, not root (user {stranger.pw_name})")
    pf.maillog.wait_for(lambda ln: ln.program == "postfix/master"
                        and OURS in ln.text and "exit status 1" in ln.text,
                        timeout=10, what="master logging the exit")
    # master keeps retrying, each qmgr refuses again; the message stays in incoming/.
    qmgr_fatal(pf, "the retried qmgr refusing again", since=pf.maillog.mark())
    assert pf.queue_path("incoming", qid) is not None, pf.queue_counts()
    assert pf.maillog.lines(queue_id=qid, program="postfix/qmgr") == []
    assert not os.path.exists(pf.mailbox())

    # Fixed by the admin: master's next retry delivers the same message.
    mark = pf.maillog.mark()
    os.chown(cf, 0, 0)
    pf.maillog.wait_for(lambda ln: ln.queue_id == qid and ln.text.endswith("removed"),
                        timeout=30, what="the queued message delivered", since=mark)
    with open(pf.mailbox()) as f:
        assert "Subject: test 0" in f.read()


def test_daemon_refuses_a_pyqmgr_cf_that_does_not_parse(trusted_base, postfix):
    pf = postfix(qmgr="pyqmgr", start=False, base_dir=trusted_base)
    cf = write_cf(pf, "ok = 1\nbroken = ${unclosed\n")
    pf.start()
    (qid,) = pf.smtp_send([("s@test.example", [pf.local_address])])
    fatal = qmgr_fatal(pf, "pyqmgr's fatal pyqmgr.cf error")
    assert fatal.text.startswith(f"fatal: {cf}: parameter broken: bad $name expansion: ")
    assert pf.queue_path("incoming", qid) is not None


def test_daemon_runs_and_delivers_with_a_clean_pyqmgr_cf(trusted_base, postfix):
    pf = postfix(qmgr="pyqmgr", start=False, base_dir=trusted_base)
    write_cf(pf, CLEAN_CF)
    pf.start()
    (qid,) = pf.smtp_send([("s@test.example", [pf.local_address])])
    pf.maillog.wait_for(lambda ln: ln.queue_id == qid and ln.text.endswith("removed"),
                        timeout=30, what="delivery under a clean pyqmgr.cf")
    assert not [ln for ln in pf.maillog.lines(program="postfix/qmgr")
                if ln.severity in ("warning", "fatal")]


def test_pyqmgr_cf_names_are_invisible_to_postconf(postfix):
    """pyqmgr.cf is not main.cf: real postconf -n does not read it, so never warns."""
    pf = postfix(qmgr="stock", start=False)
    write_cf(pf, CLEAN_CF + "scheduler_policy = nqmgr\n")
    names = ("pyqmgr_test_note", "smtp_delivery_policy_context", "scheduler_policy")
    proc = subprocess.run(["postconf", "-c", pf.config_dir, "-n"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not [ln for ln in proc.stderr.splitlines() if any(n in ln for n in names)]
    assert not [ln for ln in proc.stdout.splitlines() if ln.split(" =")[0] in names]

    # The control: the same names in main.cf are what postconf warns about.
    pf.set_main(scheduler_policy="nqmgr")
    proc = subprocess.run(["postconf", "-c", pf.config_dir, "-n"], capture_output=True,
                          text=True, timeout=60)
    assert "unused parameter: scheduler_policy=nqmgr" in proc.stderr


def test_check_notes_a_launcher_that_runs_another_interpreter(trusted_base, postfix):
    from pyqmgr.install import inspect_installation, launcher_text

    pf = postfix(qmgr="pyqmgr", start=False, base_dir=trusted_base)
    launcher = launcher_path(pf.daemon_dir)
    venv_bin = os.path.dirname(sys.executable)
    for python, noted in ((os.path.join(venv_bin, "python3"), False),
                          (os.path.realpath(sys.executable), True)):
        with open(launcher, "w") as f:
            f.write(launcher_text(python))
        report = inspect_installation(pf.config_dir, pf.daemon_dir)
        assert report.launcher_interpreter == python
        assert any("the launcher runs" in n for n in report.notes) is noted, report.notes
        assert report.ok, report.problems


@pytest.mark.parametrize("what", ["venv", "package"])
def test_a_venv_or_package_a_stranger_can_change_stops_install_and_daemon(
        trusted_base, stranger, postfix, what):
    """The real venv and package, briefly handed to a stranger, and put back after.

    venv: its pyvenv.cfg (read by the interpreter at every start) becomes the
    stranger's; package: the scheduler directory becomes writable by everyone. Both
    are what a root-started daemon must refuse to run from.
    """
    from pyqmgr import trust

    pf = postfix(qmgr="pyqmgr", start=False, base_dir=trusted_base,
                 main_cf={"service_throttle_time": "2s"})
    if what == "venv":
        root = trust.venv_root(sys.executable)
        assert root is not None, "the tests run from the project's venv"
        path = os.path.join(root, "pyvenv.cfg")
        expected = f"{path}: owned by uid {stranger.pw_uid}, not root"
    else:
        path = os.path.join(trust.package_dir(), "scheduler")
        expected = f"{path}: writable by others"
    st = os.lstat(path)
    try:
        if what == "venv":
            os.chown(path, stranger.pw_uid, stranger.pw_gid)
        else:
            os.chmod(path, 0o777)
        proc = run("check", "--config-dir", pf.config_dir)
        assert proc.returncode == 1 and expected in proc.stdout, proc.stdout
        proc = run("install", "--config-dir", pf.config_dir)
        assert proc.returncode == 1 and expected in proc.stderr, proc.stderr

        pf.start()
        (qid,) = pf.smtp_send([("s@test.example", [pf.local_address])])
        fatal = qmgr_fatal(pf, f"pyqmgr refusing to run from a changeable {what}")
        assert fatal.text.startswith(f"fatal: {expected}"), fatal.text
        assert pf.queue_path("incoming", qid) is not None, pf.queue_counts()
        assert not os.path.exists(pf.mailbox())
    finally:
        os.chown(path, st.st_uid, st.st_gid)
        os.chmod(path, st.st_mode & 0o7777)
    # Put back, the next retry of master(8) delivers the waiting message.
    pf.maillog.wait_for(lambda ln: ln.queue_id == qid and ln.text.endswith("removed"),
                        timeout=30, what="the queued message delivered once trusted")


def test_check_judges_the_values_as_the_daemon_would(trusted_base, postfix, tmp_path):
    """A value the daemon would refuse at start-up: check says so before a reload."""
    pf = postfix(qmgr="stock", start=False, base_dir=trusted_base)
    rules = os.path.join(pf.config_dir, "rules")
    with open(rules, "w") as f:
        f.write("/ok/ throttle window=0.9\n/bad/ throttle window=7\n")
    cases = [
        ("scheduler_policy = fifo\n", 'unknown scheduler policy "fifo"'),
        ("smtp_destination_rate = fast\n", "parameter smtp_destination_rate: bad rate"),
        (f"smtp_response_rules = {rules}\n",
         f"{rules}, line 2: window: a factor between 0 and 1"),
        ("metrics_listen = 0.0.0.0:9155\n", "is not a loopback address"),
        ("deferred_retry_jitter = soon\n", "deferred_retry_jitter"),
        ("delivery_policy_service = inet:127.0.0.1:10040\n"
         "smtp_delivery_policy_timeout = soon\n", "smtp_delivery_policy_timeout"),
        ("site_grouping = mx\nsite_concurrency_limit = many\n",
         "parameter site_concurrency_limit: bad numerical value"),
    ]
    for text, error in cases:
        cf = write_cf(pf, text)
        proc = run("check", "--config-dir", pf.config_dir)
        assert proc.returncode == 1, (text, proc.stdout, proc.stderr)
        assert "the daemon would refuse to start: " in proc.stdout, (text, proc.stdout)
        assert error in proc.stdout, (text, proc.stdout)
        assert cf in proc.stdout or rules in proc.stdout
    # install refuses what check reports, and leaves master.cf alone.
    before = open(os.path.join(pf.config_dir, "master.cf")).read()
    write_cf(pf, "smtp_destination_rate = fast\n")
    proc = run("install", "--config-dir", pf.config_dir)
    assert proc.returncode != 0 and "the daemon would refuse to start: " in proc.stderr
    assert open(os.path.join(pf.config_dir, "master.cf")).read() == before
    write_cf(pf, f"smtp_destination_rate = 10/1s\nsmtp_response_rules = {rules}\n")
    with open(rules, "w") as f:
        f.write("/ok/ throttle window=0.9\n")
    assert run("check", "--config-dir", pf.config_dir).returncode == 0
