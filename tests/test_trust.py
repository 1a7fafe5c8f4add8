"""The trust check: who can change what the daemon runs as root.

Needs root (files are chowned to other uids); no Postfix. Problems are built on a
directory whose chain is root's alone (tests/trust_helpers.py), so that each test sees
only the problem it made.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

from pyqmgr import trust
from tests.trust_helpers import trusted_dir

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown files")

#: A uid and gid no account uses (no name appears in the message).
NOBODY_UID = 54321


@pytest.fixture
def base() -> Iterator[str]:
    with trusted_dir() as path:
        yield path


def make(path: str, text: str = "x = 1\n", mode: int = 0o644) -> str:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)
    return path


def test_a_clean_tree_has_no_problems(base):
    os.makedirs(f"{base}/a/b")
    make(f"{base}/a/b/f.py")
    os.symlink("b/f.py", f"{base}/a/link")
    assert trust.untrusted_paths([f"{base}/a/b/f.py", f"{base}/a/link", base]) == []


def test_a_file_owned_by_someone_else(base):
    path = make(f"{base}/f.py")
    os.chown(path, NOBODY_UID, 0)
    assert trust.untrusted_paths([path]) == [f"{path}: owned by uid {NOBODY_UID}, not root"]


def test_the_owner_is_named_when_the_uid_has_an_account(base):
    path = make(f"{base}/f.py")
    os.chown(path, 65534, 0)
    (problem,) = trust.untrusted_paths([path])
    assert problem == f"{path}: owned by uid 65534, not root (user nobody)"


def test_a_group_writable_directory_is_named_with_the_file_it_leads_to(base):
    os.mkdir(f"{base}/d")
    path = make(f"{base}/d/f.py")
    os.chmod(f"{base}/d", 0o775)
    assert trust.untrusted_paths([path]) == [
        f"{base}/d: writable by group (gid 0, root) (on the way to {path})"]


def test_an_other_writable_file(base):
    path = make(f"{base}/f.py", mode=0o646)
    assert trust.untrusted_paths([path]) == [f"{path}: writable by others"]


def test_a_sticky_world_writable_directory_is_untrusted_and_the_message_says_why(base):
    os.mkdir(f"{base}/tmp")
    os.chmod(f"{base}/tmp", 0o1777)
    path = make(f"{base}/tmp/f.py")
    problems = trust.untrusted_paths([path])
    assert f"{base}/tmp: writable by others (a sticky world-writable directory such as " \
           f"/tmp is not trusted either) (on the way to {path})" in problems
    # The real /tmp too.
    with tempfile.NamedTemporaryFile(dir="/tmp") as f:
        assert any(p.startswith("/tmp: writable by others (a sticky")
                   for p in trust.untrusted_paths([f.name]))


def test_each_offender_is_reported_once(base):
    os.mkdir(f"{base}/d")
    os.chmod(f"{base}/d", 0o757)
    paths = [make(f"{base}/d/{n}.py") for n in "abc"]
    assert trust.untrusted_paths(paths) == [
        f"{base}/d: writable by others (on the way to {paths[0]})"]


def test_a_trusted_link_to_an_untrusted_target(base):
    os.mkdir(f"{base}/bad")
    os.chown(f"{base}/bad", NOBODY_UID, NOBODY_UID)
    target = make(f"{base}/bad/policy.py")
    os.mkdir(f"{base}/good")
    os.symlink(target, f"{base}/good/policy.py")
    assert trust.untrusted_paths([f"{base}/good/policy.py"]) == [
        f"{base}/bad: owned by uid {NOBODY_UID}, not root "
        f"(on the way to {base}/good/policy.py)"]


def test_an_untrusted_link_to_a_trusted_target(base):
    """Whoever can replace the link can point it anywhere: its directory counts."""
    target = make(f"{base}/policy.py")
    os.mkdir(f"{base}/bad")
    os.chmod(f"{base}/bad", 0o770)
    os.symlink("../policy.py", f"{base}/bad/link.py")
    assert trust.untrusted_paths([f"{base}/bad/link.py"]) == [
        f"{base}/bad: writable by group (gid 0, root) (on the way to {base}/bad/link.py)"]
    assert trust.untrusted_paths([target]) == []


def test_a_link_owned_by_someone_else_is_reported_but_its_mode_is_not(base):
    make(f"{base}/f.py")
    os.symlink("f.py", f"{base}/l.py")
    os.lchown(f"{base}/l.py", NOBODY_UID, 0)
    assert trust.untrusted_paths([f"{base}/l.py"]) == [
        f"{base}/l.py: owned by uid {NOBODY_UID}, not root"]


def test_dotdot_after_a_link_is_resolved_as_the_kernel_does(base):
    """``link/..`` is the parent of the link's target, not the link's own directory."""
    os.makedirs(f"{base}/real/sub")
    os.makedirs(f"{base}/elsewhere")
    make(f"{base}/real/f.py")
    make(f"{base}/elsewhere/f.py", mode=0o646)
    os.symlink(f"{base}/real/sub", f"{base}/elsewhere/link")
    assert trust.untrusted_paths([f"{base}/elsewhere/link/../f.py"]) == []
    problems = trust.untrusted_paths([os.path.normpath(f"{base}/elsewhere/link/../f.py")])
    assert problems == [f"{base}/elsewhere/f.py: writable by others"]


def test_missing_paths_and_link_loops_are_problems(base):
    assert trust.untrusted_paths([f"{base}/nope/x.py"]) == [
        f"{base}/nope: cannot be checked: No such file or directory "
        f"(on the way to {base}/nope/x.py)"]
    os.symlink("b", f"{base}/a")
    os.symlink("a", f"{base}/b")
    assert trust.untrusted_paths([f"{base}/a"]) == [
        f"{base}/a: too many levels of symbolic links"]


def test_assume_trusted_skips_only_the_named_directories(base):
    os.makedirs(f"{base}/daemon/pyqmgr")
    os.chmod(f"{base}/daemon", 0o777)
    launcher = make(f"{base}/daemon/pyqmgr/qmgr", mode=0o755)
    assert trust.untrusted_paths([launcher], assume_trusted=[f"{base}/daemon"]) == []
    os.chmod(launcher, 0o775)
    assert trust.untrusted_paths([launcher], assume_trusted=[f"{base}/daemon"]) == [
        f"{launcher}: writable by group (gid 0, root)"]


def test_installation_check_leaves_the_dirs_above_postfixs_own_to_postfix(base):
    """Above config_directory and daemon_directory: walked, not judged; below: judged."""
    os.chmod(base, 0o777)  # stands for /tmp above a test bed
    for d in ("etc", "libexec/pyqmgr", "policies"):
        os.makedirs(f"{base}/{d}")
    cf = make(f"{base}/etc/pyqmgr.cf")
    inner = make(f"{base}/etc/inner.py")
    launcher = make(f"{base}/libexec/pyqmgr/qmgr", mode=0o755)
    outer = make(f"{base}/policies/p.py")

    def check(settings, launchers=()):
        return trust.untrusted_installation(
            sys.executable, trust.package_dir(), config_dir=f"{base}/etc",
            daemon_dir=f"{base}/libexec", settings=settings, launcher=launchers)

    assert check([cf, inner], [f"{base}/libexec/pyqmgr", launcher]) == []
    assert check([outer]) == [f"{base}: writable by others (on the way to {outer})"]
    os.chmod(f"{base}/etc", 0o775)
    os.chmod(f"{base}/libexec", 0o757)
    assert check([cf], [launcher]) == [
        f"{base}/etc: writable by group (gid 0, root) (on the way to {cf})",
        f"{base}/libexec: writable by others (on the way to {launcher})"]


def test_untrusted_error_names_the_first_path_and_keeps_the_rest_as_warnings():
    err = trust.UntrustedError(["/a: writable by others", "/b: owned by uid 7, not root"])
    assert str(err) == ("/a: writable by others (and 1 more, logged above); pyqmgr starts "
                        "as root and uses no file that anyone but root can change")
    assert err.warnings == ["untrusted: /b: owned by uid 7, not root"]


def test_daemon_paths_cover_interpreter_venv_package_and_extra(base):
    extra = make(f"{base}/pyqmgr.cf")
    paths = trust.daemon_paths(sys.executable, trust.package_dir(), [extra])
    pkg = trust.package_dir()
    assert paths[0] == sys.executable
    assert os.path.join(pkg, "trust.py") in paths and os.path.join(pkg, "daemon") in paths
    assert os.path.join(pkg, "daemon", "startup.py") in paths
    assert paths[-1] == extra
    venv = trust.venv_root(sys.executable)
    if venv is not None:
        assert os.path.join(venv, "pyvenv.cfg") in paths
        assert any(p.endswith(".pth") for p in paths), "site-packages .pth files run code"
    assert len(paths) == len(set(paths))


def test_the_real_installation_is_trusted_and_cheap_to_check():
    """What the daemon checks at every start, on this very checkout and venv."""
    import pyqmgr.daemon.startup  # noqa: F401 - load what the daemon loads

    started = time.perf_counter()
    paths = trust.daemon_paths(sys.executable, trust.package_dir(),
                               trust.loaded_module_files(list(sys.modules.values())))
    problems = trust.untrusted_paths(paths)
    elapsed = time.perf_counter() - started
    print(f"trust check: {len(paths)} paths in {elapsed * 1000:.1f} ms")
    # Under pytest, modules may come from anywhere (the test files under /tmp, say);
    # the interpreter, venv and package are what must be clean.
    ours = [p for p in problems if "/tmp" not in p.split(" (on the way")[0]]
    assert ours == [], ours
    assert elapsed < 0.5, f"{elapsed:.3f}s for {len(paths)} paths"


def test_judge_reads_only_owner_and_mode():
    st = os.stat_result((stat.S_IFREG | 0o620, 0, 0, 1, 0, NOBODY_UID, 0, 0, 0, 0))
    assert trust.judge("/f", st) == [f"/f: writable by group (gid {NOBODY_UID})"]


def test_every_directory_on_sys_path_is_judged(base, monkeypatch):
    """A venv made with --system-site-packages (or a .pth file) puts directories on
    sys.path that sysconfig does not name: they were never walked (issue #31)."""
    extra = os.path.join(base, "dist-packages")
    os.mkdir(extra, 0o755)
    make(os.path.join(extra, "evil.pth"), "import os\n")
    monkeypatch.setattr(sys, "path", [*sys.path, extra])
    paths = trust.daemon_paths(sys.executable, trust.package_dir())
    assert extra in paths and os.path.join(extra, "evil.pth") in paths
    os.chown(os.path.join(extra, "evil.pth"), NOBODY_UID, NOBODY_UID)
    problems = trust.untrusted_paths(paths)
    assert any(p.startswith(os.path.join(extra, "evil.pth")) for p in problems), problems
