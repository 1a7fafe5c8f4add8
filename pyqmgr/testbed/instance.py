"""A throwaway Postfix instance in a temp dir, run by the real ``postfix`` command.

pyqmgr is only worth anything if it behaves like stock qmgr under the real master(8),
cleanup, smtpd and delivery agents, so tests run the distribution's Postfix rather than
fakes. Everything one instance needs lives under one directory (``etc/`` config,
``spool/`` queue, ``data/``, ``maillog``, ``mail/`` mailboxes); it listens on loopback
only, runs no service chrooted (a chrooted agent would need copies of /etc files in the
queue directory) and logs through postlogd to its own file, so tests can read exactly
the lines an admin would see.

Tear-down is thorough because a failing test must not leave daemons behind that would
hold ports or keep delivering: after ``postfix stop``, every process whose environment
names this instance's config directory (master exports ``MAIL_CONFIG`` to every child)
is killed.

Local deliveries: ``mydestination`` is :data:`LOCAL_DOMAIN` and the system user
:data:`LOCAL_USER` (created with ``useradd --system`` if absent; no home, no shell)
receives mail in ``<root>/mail/<user>`` (``mail_spool_directory`` inside the instance,
mode 1777 so local(8) can create the mailbox with the user's privileges).
``local_recipient_maps`` is empty, so smtpd accepts any local part; unknown users
bounce in local(8) instead.
"""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterable

from pyqmgr.testbed.instance_base import (
    LOCAL_DOMAIN,
    LOCAL_USER,
    QUEUES,
    SENDMAIL,
    Message,
    TestbedError,
    free_port,
    run_checked,
    wait_until,
)
from pyqmgr.testbed.instance_inject import InstanceInjection
from pyqmgr.testbed.maillog import Maillog
from pyqmgr.testbed.release import ReleaseRoot, selected

#: The names other modules import from here (some are defined in the parts' modules).
__all__ = ["BASE_ENV", "KEEP_ENV", "LOCAL_DOMAIN", "LOCAL_USER", "MASTER_CF_DIST",
           "MYHOSTNAME", "OQMGR_DIR", "QMGRS", "QUEUES", "SENDMAIL", "SYSTEM_DAEMON_DIR",
           "Message", "PostfixInstance", "TestbedError", "ensure_local_user", "free_port",
           "wait_until"]

MYHOSTNAME = "pfx.test.example"
#: Set to keep instance directories after a run (their paths are printed).
KEEP_ENV = "PYQMGR_KEEP_TESTBED"
#: Where instance directories go when the constructor is not told; default /tmp.
BASE_ENV = "PYQMGR_TESTBED_DIR"
MASTER_CF_DIST = "/usr/share/postfix/master.cf.dist"
SYSTEM_DAEMON_DIR = "/usr/lib/postfix/sbin"


def ensure_local_user() -> str:
    """The unprivileged user that receives local(8) deliveries in tests.

    A dedicated user rather than ``postfix`` or ``root``: local(8) refuses to deliver
    as root to a file and delivering as the mail owner would hide permission bugs.
    """
    try:
        pwd.getpwnam(LOCAL_USER)
    except KeyError:
        proc = subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                               "/usr/sbin/nologin", LOCAL_USER], capture_output=True,
                              text=True, check=False)
        try:
            pwd.getpwnam(LOCAL_USER)  # a parallel test run may have won the race
        except KeyError:
            raise TestbedError(f"cannot create user {LOCAL_USER}: "
                               f"{proc.stderr.strip()}") from None
    return LOCAL_USER



def _inline_map(entries: dict[str, str]) -> str:
    # inline:{k=v, ...}; an entry whose value has spaces ("error:5.1.1 no such user")
    # must be braced as a whole, or the space would end the value.
    items = [f"{{{k}={v}}}" if (" " in v or "," in v) else f"{k}={v}"
             for k, v in entries.items()]
    return "inline:{" + ", ".join(items) + "}"


#: What the qmgr service can run: stock qmgr, pyqmgr, or Postfix's own oqmgr.
QMGRS = ("stock", "pyqmgr", "oqmgr")
#: Where the test bed puts Postfix's oqmgr under the name qmgr (in daemon_directory).
OQMGR_DIR = "postfix-oqmgr"
#: The environment variable naming another pyqmgr installation's interpreter.
QMGR_PYTHON_ENV = "PYQMGR_QMGR_PYTHON"


class PostfixInstance(InstanceInjection):
    """One Postfix instance; a context manager that stops it and removes its files.

    ``qmgr`` is ``"stock"`` or ``"pyqmgr"``; ``main_cf`` adds or overrides main.cf
    parameters; ``transports`` maps domains to ``transport:nexthop`` and becomes an
    inline ``transport_maps``; ``master_cf_extra`` lines are appended to master.cf;
    ``qmgr_args`` are appended to the qmgr service command (e.g. ``["-o", "x=1"]``);
    ``qmgr_python`` is another pyqmgr installation's interpreter to run as the qmgr.
    The instance is not started by the constructor: call :meth:`start`.

    Configuration and the life cycle are here; the queue, the processes and mail
    injection are parts it inherits (``instance_queue``, ``instance_processes``,
    ``instance_inject``), all standing on ``instance_base``.
    """

    __test__ = False

    def __init__(
        self,
        qmgr: str = "stock",
        main_cf: dict[str, str] | None = None,
        transports: dict[str, str] | None = None,
        master_cf_extra: Iterable[str] = (),
        qmgr_args: Iterable[str] = (),
        root: str | None = None,
        base_dir: str | None = None,
        pyqmgr_cf: dict[str, str] | None = None,
        release: str | None = None,
        qmgr_python: str | None = None,
    ) -> None:
        if qmgr not in QMGRS:
            raise ValueError(f"qmgr must be one of {', '.join(QMGRS)}, not {qmgr!r}")
        #: Another Postfix release's root (pyqmgr.testbed.release), or None for the
        #: machine's own Postfix. ``release`` defaults to $PYQMGR_POSTFIX_RELEASE.
        name = release if release is not None else selected()
        self.release_root = ReleaseRoot(name).ensure() if name else None
        base = base_dir or os.environ.get(BASE_ENV) or "/tmp"
        self.root = root or tempfile.mkdtemp(prefix="pyqmgr-tb-", dir=base)
        self.config_dir = os.path.join(self.root, "etc")
        self.queue_dir = os.path.join(self.root, "spool")
        self.data_dir = os.path.join(self.root, "data")
        self.maillog_path = os.path.join(self.root, "maillog")
        self.mail_dir = os.path.join(self.root, "mail")
        self.daemon_dir = os.path.join(self.root, "libexec")
        self.smtpd_port = free_port()
        self.qmgr = qmgr
        #: The interpreter of the pyqmgr installation the qmgr service runs, when not
        #: this one's: ``qmgr_python`` or $PYQMGR_QMGR_PYTHON (``./dev test-compiled``
        #: sets it to the compiled build's venv).
        self.qmgr_python = qmgr_python or os.environ.get(QMGR_PYTHON_ENV) or None
        self.started = False
        #: What ``postfix start`` printed (warnings from ``postfix check`` land here).
        self.start_output = ""
        self.maillog = Maillog(self.maillog_path)
        self._binds = [os.path.dirname(os.path.abspath(self.root))]
        self._start_attempted = False
        self._disabled_qmgr_line: str | None = None
        self._saved_in_flow_delay: str | None = None
        try:
            self._create(main_cf or {}, transports or {}, list(master_cf_extra),
                         list(qmgr_args))
            if pyqmgr_cf is not None:
                self.write_pyqmgr_cf(pyqmgr_cf)
            if qmgr != "stock":
                self.use_qmgr(qmgr)
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise

    # -- configuration ----------------------------------------------------------------

    @property
    def spool_mail(self) -> str:
        """Older name of :attr:`mail_dir`."""
        return self.mail_dir

    @property
    def local_address(self) -> str:
        """A recipient that local(8) delivers to :meth:`mailbox`."""
        return f"{LOCAL_USER}@{LOCAL_DOMAIN}"

    def _create(self, main_cf: dict[str, str], transports: dict[str, str],
                extra: list[str], qmgr_args: list[str]) -> None:
        os.chmod(self.root, 0o755)
        self._check_traversable()
        for d in (self.config_dir, self.queue_dir, self.data_dir, self.mail_dir):
            os.makedirs(d, exist_ok=True)
        os.chmod(self.mail_dir, 0o1777)
        os.chown(self.data_dir, *self.mail_owner_ids())
        if self.release_root is None:
            ensure_local_user()
        self._make_daemon_dir()
        params = {
            "compatibility_level": "3.6",
            "daemon_directory": self.daemon_dir,
            "queue_directory": self.queue_dir,
            "data_directory": self.data_dir,
            "maillog_file": self.maillog_path,
            "maillog_file_prefixes": self.root,
            "inet_interfaces": "127.0.0.1",
            "inet_protocols": "ipv4",
            "myhostname": MYHOSTNAME,
            "mydomain": "test.example",
            "myorigin": "test.example",
            "mydestination": LOCAL_DOMAIN,
            "mynetworks": "127.0.0.0/8",
            "alias_maps": "",
            "alias_database": "",
            "local_recipient_maps": "",
            "mail_spool_directory": self.mail_dir,
            "smtpd_recipient_restrictions": "permit_mynetworks, reject",
            "smtpd_relay_restrictions": "permit_mynetworks, reject",
            "smtpd_reject_unlisted_recipient": "no",
            "smtpd_error_sleep_time": "0",
            "smtp_host_lookup": "native",
            "smtp_tls_security_level": "none",
            "smtpd_tls_security_level": "none",
            "biff": "no",
            "notify_classes": "",
        }
        if transports:
            params["transport_maps"] = _inline_map(transports)
        params.update(main_cf)
        with open(os.path.join(self.config_dir, "main.cf"), "w") as f:
            for name, value in params.items():
                f.write(f"{name} = {value}\n")
        shutil.copy(self._file(MASTER_CF_DIST), os.path.join(self.config_dir, "master.cf"))
        self._backdate()
        # The public smtp port becomes a loopback listener on a port of our own.
        self.postconf("-M#", "smtp/inet")
        listen = f"127.0.0.1:{self.smtpd_port}"
        self.postconf("-Me", f"{listen}/inet={listen} inet n - n - - smtpd")
        services = [line.partition(" = ")[0].rpartition("/")[0]
                    for line in self.postconf("-F", "*/*/chroot").splitlines() if line]
        self.postconf("-F", *[f"{svc}/chroot=n" for svc in services])
        if qmgr_args:
            cmd = self.postconf("-F", "qmgr/unix/command").partition(" = ")[2].strip()
            self.postconf("-F", "qmgr/unix/command=" + " ".join([cmd, *qmgr_args]))
        if extra:
            with open(os.path.join(self.config_dir, "master.cf"), "a") as f:
                for line in extra:
                    f.write(line + "\n")

    def _make_daemon_dir(self) -> None:
        """A daemon_directory of the instance's own: Debian's daemons, linked.

        pyqmgr's launcher lives in daemon_directory and names one interpreter, so with
        the system directory every instance (and every checkout running tests) would
        share one launcher. Hard links keep the daemons' own owner and modes, which
        ``postfix check`` inspects; a copy is the fallback across file systems.
        """
        os.makedirs(self.daemon_dir)
        system = self._file(SYSTEM_DAEMON_DIR)
        for name in os.listdir(system):
            src = os.path.join(system, name)
            if not os.path.isfile(src):
                continue
            dst = os.path.join(self.daemon_dir, name)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)

    def _check_traversable(self) -> None:
        # Daemons run as postfix and must reach the queue and data directories.
        path = os.path.dirname(os.path.abspath(self.root))
        while True:
            if not os.stat(path).st_mode & 0o001:
                raise TestbedError(f"{path} is not traversable by user postfix; put the "
                                   f"test bed elsewhere (base_dir= or ${BASE_ENV})")
            parent = os.path.dirname(path)
            if parent == path:
                return
            path = parent

    def use_qmgr(self, which: str) -> None:
        """Make the qmgr service run ``"stock"``, ``"pyqmgr"`` or ``"oqmgr"``.

        ``"oqmgr"`` is Postfix's own old queue manager (``$daemon_directory/oqmgr``),
        the reference for pyqmgr's oqmgr policy. Reloads if running.
        """
        from pyqmgr.install import install, uninstall

        if which not in QMGRS:
            raise ValueError(f"qmgr must be one of {', '.join(QMGRS)}, not {which!r}")
        verb = "install" if which == "pyqmgr" else "uninstall"
        code = f"import sys; from pyqmgr.install import {verb}; {verb}(sys.argv[1])"
        if self.release_root is not None:
            # The launcher must name the root's python3 and edit master.cf with the
            # release's postconf: install runs inside the root.
            self.run(["python3", "-I", "-c", code, self.config_dir])
        elif self.qmgr_python:
            # Another installation (the compiled build's venv): its launcher, its build.
            self.run([self.qmgr_python, "-I", "-c", code, self.config_dir])
        else:
            (install if which == "pyqmgr" else uninstall)(self.config_dir)
        if which == "oqmgr":
            # Under a directory of its own as "qmgr": the log tag is argv[0]'s
            # basename, so its lines read postfix/qmgr[pid] like stock's and pyqmgr's.
            ref_dir = os.path.join(self.daemon_dir, OQMGR_DIR)
            os.makedirs(ref_dir, exist_ok=True)
            target = os.path.join(ref_dir, "qmgr")
            if not os.path.exists(target):
                os.link(os.path.join(self.daemon_dir, "oqmgr"), target)
            cmd = self.postconf("-F", "qmgr/unix/command").partition(" = ")[2].split()
            self.postconf("-F", "qmgr/unix/command="
                          + " ".join([f"{OQMGR_DIR}/qmgr", *cmd[1:]]))
            if self.started:
                self.reload()
        self.qmgr = which

    def write_pyqmgr_cf(self, params: dict[str, str]) -> str:
        """Write ``$config_directory/pyqmgr.cf`` (root's, 0644, as the trust check wants)."""
        path = os.path.join(self.config_dir, "pyqmgr.cf")
        with open(path, "w") as f:
            for name, value in params.items():
                f.write(f"{name} = {value}\n")
        os.chmod(path, 0o644)
        return path

    # -- life cycle -------------------------------------------------------------------

    def start(self, prefix: str = "") -> PostfixInstance:
        """``postfix start``; raise TestbedError with its output if it fails.

        It runs under a pseudo-terminal because postfix-script only prints fatal
        start-up errors to a terminal (otherwise they go to the log, if anywhere).
        ``prefix`` is prepended to the shell command (e.g. to start in a namespace).
        """
        self._start_attempted = True
        command = prefix + shlex.join(self.command(["postfix", "-c", self.config_dir, "start"]))
        proc = run_checked(["script", "-qec", command, "/dev/null"], check=False)
        self.start_output = proc.stdout.replace("\r\n", "\n").strip()
        if proc.returncode != 0:
            try:
                self._kill_leftovers()
            except TestbedError:
                pass
            raise TestbedError(f"postfix start failed ({proc.returncode}):\n"
                               f"{self.start_output}\nlast maillog lines:\n"
                               f"{self.maillog.tail(20)}")
        self.started = True
        return self

    def running(self) -> bool:
        """Is this instance's master alive (``postfix status``)?"""
        return self.run(["postfix", "-c", self.config_dir, "status"], check=False).returncode == 0

    def stop(self, grace: float = 3.0) -> None:
        """Stop the instance and make sure none of its processes survive.

        ``postfix stop`` first (it waits for master, at most a few seconds), then
        SIGTERM to anything still running with this config directory and, after
        ``grace`` seconds, SIGKILL. Raises TestbedError only if a process survives that.
        """
        # postfix stop on a stopped instance still costs a second; skip it then.
        if self.started or (self._start_attempted and self.pids("master")):
            self.run(["postfix", "-c", self.config_dir, "stop"], check=False, timeout=30)
        self.started = False
        self._kill_leftovers(grace)

    def close(self) -> None:
        """Stop, then remove the instance directory (kept if $PYQMGR_KEEP_TESTBED)."""
        try:
            self.stop()
        finally:
            if os.environ.get(KEEP_ENV):
                print(f"testbed kept at {self.root}")
            else:
                shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PostfixInstance:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

