"""The kept fatal error (pyqmgr.control.last_fatal) in a queue directory of its own:
written before the privilege drop (making its directory), after it and inside a
chroot, readable by exactly the users authorized_mailq_users lets read, refused or
ignored when it is not what it should be, and removed by a good start."""

from __future__ import annotations

import json
import os
import pathlib
import pwd
import shutil
import stat
import tempfile
from collections.abc import Callable

import pytest

from pyqmgr.control import last_fatal

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, chroot)")


@pytest.fixture
def queue_dir(monkeypatch):
    """A queue directory (active, deferred, incoming: mail_owner's, here nobody's) as
    the working directory, as master(8) starts the daemon in it; in a directory other
    users can pass through (pytest's own is root's alone), as /var/spool/postfix is."""
    nobody = pwd.getpwnam("nobody")
    top = pathlib.Path(tempfile.mkdtemp(prefix="pyqmgr-last-fatal-"))
    os.chmod(top, 0o755)
    try:
        for name in ("active", "deferred", "incoming"):
            (top / name).mkdir()
            os.chown(top / name, nobody.pw_uid, nobody.pw_gid)
        monkeypatch.chdir(top)
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


def in_child(action: Callable[[], bool]) -> int:
    """``action`` in a forked child; its exit status (0: it returned True)."""
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if action() else 1)
        except BaseException:
            os._exit(2)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def as_user(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def test_before_the_drop_it_makes_the_directory_and_everyone_reads(queue_dir):
    nobody = pwd.getpwnam("nobody")
    assert last_fatal.keep("pyqmgr.cf, line 1: bad", ["untrusted: /x"], public=True,
                           now=1000.5)
    st = os.lstat(queue_dir / "pyqmgr")
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (nobody.pw_uid, 0o755)
    record = queue_dir / last_fatal.PATH
    assert stat.S_IMODE(os.stat(record).st_mode) == 0o644
    kept = last_fatal.read(str(queue_dir))
    assert kept == last_fatal.LastFatal("pyqmgr.cf, line 1: bad", 1000.5, os.getpid(),
                                        ("untrusted: /x",))
    assert [p.name for p in (queue_dir / "pyqmgr").iterdir()] == ["last-fatal"]
    last_fatal.clear()
    assert last_fatal.read(str(queue_dir)) is None


def test_private_record_is_for_the_named_readers_only(queue_dir):
    nobody = pwd.getpwnam("nobody")
    daemon = pwd.getpwnam("daemon")
    assert last_fatal.keep("secret", public=False, readers=[nobody.pw_uid])
    record = queue_dir / last_fatal.PATH
    assert stat.S_IMODE(os.stat(record).st_mode) & 0o007 == 0
    assert os.getxattr(record, "system.posix_acl_access") == last_fatal.readers_acl(
        [nobody.pw_uid])

    def reads(user: pwd.struct_passwd) -> Callable[[], bool]:
        def action() -> bool:
            as_user(user.pw_uid, user.pw_gid)
            try:
                return last_fatal.read(str(queue_dir)) is not None
            except PermissionError:
                return False
        return action

    assert in_child(reads(nobody)) == 0, "the reader authorized_mailq_users names"
    assert in_child(reads(daemon)) == 1, "a user it does not name"


def test_after_the_drop_in_a_chroot(queue_dir):
    """The daemon as mail_owner, chrooted into the queue directory: the same path."""
    nobody = pwd.getpwnam("nobody")
    os.mkdir(queue_dir / "pyqmgr", 0o755)
    os.chown(queue_dir / "pyqmgr", nobody.pw_uid, nobody.pw_gid)
    # An old record of root's is replaced, as the directory is mail_owner's.
    assert last_fatal.keep("older", public=True, now=1.0)

    def action() -> bool:
        os.chroot(str(queue_dir))
        os.chdir("/")
        as_user(nobody.pw_uid, nobody.pw_gid)
        return last_fatal.keep("timeout receiving delivery status", public=True, now=2.0)

    assert in_child(action) == 0
    kept = last_fatal.read(str(queue_dir))
    assert kept is not None and (kept.text, kept.time) == ("timeout receiving delivery "
                                                           "status", 2.0)
    assert os.stat(queue_dir / last_fatal.PATH).st_uid == nobody.pw_uid


def test_not_written_outside_a_queue_directory_or_without_its_own(queue_dir, tmp_path):
    nobody = pwd.getpwnam("nobody")
    os.rmdir(queue_dir / "incoming")
    assert not last_fatal.keep("x", public=True)
    assert not (queue_dir / "pyqmgr").exists()
    os.mkdir(queue_dir / "incoming")
    os.symlink(tmp_path, queue_dir / "pyqmgr")  # someone else's link: left alone
    assert not last_fatal.keep("x", public=True)
    assert os.path.islink(queue_dir / "pyqmgr")

    def action() -> bool:  # not root, and no directory to write in
        os.unlink(queue_dir / "pyqmgr")
        as_user(nobody.pw_uid, nobody.pw_gid)
        return last_fatal.keep("x", public=True)

    assert in_child(action) == 1


def test_the_text_is_bounded_and_a_bad_record_is_no_record(queue_dir):
    assert last_fatal.keep("y" * 100_000, ["w" * 10_000] * 100, public=True)
    kept = last_fatal.read(str(queue_dir))
    assert kept is not None and len(kept.text) == last_fatal.MAX_TEXT
    assert len(kept.warnings) == last_fatal.MAX_WARNINGS
    assert os.path.getsize(queue_dir / last_fatal.PATH) < last_fatal.MAX_BYTES
    record = queue_dir / last_fatal.PATH
    for junk in (b"\xff\xfe", b"[1, 2]", b'{"text": 5, "time": 1}', b"{" * 100_000,
                 json.dumps({"text": "t"}).encode()):
        record.write_bytes(junk)
        assert last_fatal.read(str(queue_dir)) is None, junk[:20]
    record.unlink()
    os.mkfifo(record)
    assert last_fatal.read(str(queue_dir)) is None
