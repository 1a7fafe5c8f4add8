"""What every part of a test-bed Postfix instance stands on: running its commands.

:class:`~pyqmgr.testbed.instance.PostfixInstance` is assembled from parts (queue
inspection, process tracking, mail injection), each a mixin in a module of its own so no
one class grows unreadable. They all drive Postfix the same way, through the instance's
release (:meth:`InstanceBase.run`) and its ``postconf`` (main.cf backdated after every
edit), and wait the same way (:func:`wait_until`); that common ground lives here, with
the names the parts share, so the parts need not import the instance module itself.
"""

from __future__ import annotations

import os
import pwd
import socket
import subprocess
import time
from collections.abc import Callable, Sequence

from pyqmgr.testbed.maillog import Maillog
from pyqmgr.testbed.release import ReleaseRoot

LOCAL_USER = "pyqmgrtest"
LOCAL_DOMAIN = "local.test.example"
SENDMAIL = "/usr/sbin/sendmail"
QUEUES = ("maildrop", "incoming", "active", "deferred", "hold")

Message = tuple[str, list[str]]


class TestbedError(Exception):
    """The instance could not be created, started or driven; the text says why."""

    __test__ = False  # not a pytest test class, despite the name


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def file_tail(path: str, n: int = 20) -> str:
    """A server's log file's last ``n`` lines, for an error message ("(no log)")."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def wait_until(predicate: Callable[[], bool], timeout: float, what: str,
               interval: float = 0.05, detail: Callable[[], str] | None = None) -> None:
    """Poll ``predicate`` until it holds; raise a TimeoutError naming ``what``.

    ``detail`` adds context to the error (an instance passes its maillog tail), so a
    failed wait says why without re-running the test.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            extra = ""
            if detail is not None:
                try:
                    extra = detail()
                except Exception as exc:  # the error must not hide the timeout
                    extra = f"(no detail: {exc})"
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}{extra}")
        time.sleep(interval)


def run_checked(args: Sequence[str], check: bool = True, timeout: float = 60,
                input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``args``; TestbedError on a timeout or (with ``check``) a non-zero exit,
    naming the command and what it printed, so a failed set-up explains itself."""
    try:
        proc = subprocess.run(list(args), capture_output=True, text=True, check=False,
                              timeout=timeout, input=input)
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"{' '.join(args)} did not finish in {timeout:g}s") from exc
    if check and proc.returncode != 0:
        raise TestbedError(f"{' '.join(args)} failed ({proc.returncode}): "
                           f"{proc.stdout.strip()} {proc.stderr.strip()}")
    return proc


class InstanceBase:
    """The state and the command runners every part of a test-bed instance uses.

    The attributes are set by :class:`~pyqmgr.testbed.instance.PostfixInstance`'s
    constructor; they are declared here so each part type-checks on its own.
    """

    root: str
    config_dir: str
    queue_dir: str
    mail_dir: str
    daemon_dir: str
    smtpd_port: int
    started: bool
    maillog: Maillog
    release_root: ReleaseRoot | None
    _binds: list[str]

    def mail_owner_ids(self) -> tuple[int, int]:
        """(uid, gid) of the postfix account as this instance's release knows it (a
        release's root has a passwd file of its own)."""
        if self.release_root is not None:
            return self.release_root.user("postfix")
        pf = pwd.getpwnam("postfix")
        return pf.pw_uid, pf.pw_gid

    def _file(self, path: str) -> str:
        """Where one of Postfix's own files is: in the release's root, or the machine's."""
        return path if self.release_root is None else self.release_root.host_path(path)

    def command(self, args: Sequence[str]) -> list[str]:
        """``args`` as they run against this instance's Postfix release: as they are
        for the machine's own, inside the release's root otherwise."""
        if self.release_root is None:
            return list(args)
        return self.release_root.command(args, self._binds)

    def run(self, args: Sequence[str], check: bool = True, timeout: float = 60,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run a Postfix command (postkick, postcat...) of this instance's release."""
        return run_checked(self.command(args), check=check, timeout=timeout, input=input)

    def _backdate(self) -> None:
        # Every Postfix program re-reads a main.cf younger than about a second, which
        # costs ~2 s per command; an hour-old mtime avoids that.
        t = time.time() - 3600
        os.utime(os.path.join(self.config_dir, "main.cf"), (t, t))

    def postconf(self, *args: str) -> str:
        """Run ``postconf -c DIR ARGS``; return its output. main.cf is backdated after."""
        try:
            return self.run(["postconf", "-c", self.config_dir, *args]).stdout
        finally:
            self._backdate()

    def set_main(self, **params: str) -> None:
        """Set main.cf parameters (``postconf -e``); running daemons see them on reload."""
        self.postconf("-e", *[f"{k}={v}" for k, v in params.items()])

    def reload(self) -> None:
        """``postfix reload``: master re-reads its config and restarts qmgr."""
        self.run(["postfix", "-c", self.config_dir, "reload"])

    def wait_until(self, predicate: Callable[[], bool], timeout: float, what: str,
                   interval: float = 0.05) -> None:
        """:func:`wait_until` whose error ends with this instance's last maillog lines."""
        wait_until(predicate, timeout, what, interval,
                   detail=lambda: f"; last maillog lines:\n{self.maillog.tail(20)}")
