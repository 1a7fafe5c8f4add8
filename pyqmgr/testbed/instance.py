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

import json
import os
import pwd
import shlex
import shutil
import signal
import smtplib
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from email.message import EmailMessage

from pyqmgr.testbed.maillog import Maillog
from pyqmgr.testbed.release import ReleaseRoot, selected

LOCAL_USER = "pyqmgrtest"
LOCAL_DOMAIN = "local.test.example"
MYHOSTNAME = "pfx.test.example"
#: Set to keep instance directories after a run (their paths are printed).
KEEP_ENV = "PYQMGR_KEEP_TESTBED"
#: Where instance directories go when the constructor is not told; default /tmp.
BASE_ENV = "PYQMGR_TESTBED_DIR"
MASTER_CF_DIST = "/usr/share/postfix/master.cf.dist"
SENDMAIL = "/usr/sbin/sendmail"
SYSTEM_DAEMON_DIR = "/usr/lib/postfix/sbin"
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


def _run(args: Sequence[str], check: bool = True, timeout: float = 60,
         input: str | None = None) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(list(args), capture_output=True, text=True, check=False,
                              timeout=timeout, input=input)
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"{' '.join(args)} did not finish in {timeout:g}s") from exc
    if check and proc.returncode != 0:
        raise TestbedError(f"{' '.join(args)} failed ({proc.returncode}): "
                           f"{proc.stdout.strip()} {proc.stderr.strip()}")
    return proc


def _read_proc(pid: str, name: str) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return None


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


class PostfixInstance:
    """One Postfix instance; a context manager that stops it and removes its files.

    ``qmgr`` is ``"stock"`` or ``"pyqmgr"``; ``main_cf`` adds or overrides main.cf
    parameters; ``transports`` maps domains to ``transport:nexthop`` and becomes an
    inline ``transport_maps``; ``master_cf_extra`` lines are appended to master.cf;
    ``qmgr_args`` are appended to the qmgr service command (e.g. ``["-o", "x=1"]``).
    The instance is not started by the constructor: call :meth:`start`.
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
        return _run(self.command(args), check=check, timeout=timeout, input=input)

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

    def use_qmgr(self, which: str) -> None:
        """Make the qmgr service run ``"stock"``, ``"pyqmgr"`` or ``"oqmgr"``.

        ``"oqmgr"`` is Postfix's own old queue manager (``$daemon_directory/oqmgr``),
        the reference for pyqmgr's oqmgr policy. Reloads if running.
        """
        from pyqmgr.install import install, uninstall

        if which not in QMGRS:
            raise ValueError(f"qmgr must be one of {', '.join(QMGRS)}, not {which!r}")
        if self.release_root is not None:
            # The launcher must name the root's python3 and edit master.cf with the
            # release's postconf: install runs inside the root.
            verb = "install" if which == "pyqmgr" else "uninstall"
            self.run(["python3", "-I", "-c", f"import sys; from pyqmgr.install import {verb}; "
                      f"{verb}(sys.argv[1])", self.config_dir])
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
        proc = _run(["script", "-qec", command, "/dev/null"], check=False)
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

    def reload(self) -> None:
        """``postfix reload``: master re-reads its config and restarts qmgr."""
        self.run(["postfix", "-c", self.config_dir, "reload"])

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

    def _kill_leftovers(self, grace: float = 3.0) -> None:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.05)
        survivors = self.processes()
        if survivors:
            raise TestbedError(f"processes of {self.root} survive SIGKILL: {survivors}")

    def processes(self) -> dict[int, list[str]]:
        """Live processes of this instance (found by MAIL_CONFIG), with their argv."""
        want = f"MAIL_CONFIG={self.config_dir}".encode()
        me = os.getpid()
        found: dict[int, list[str]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            env = _read_proc(entry, "environ")
            if env is None or want not in env:
                continue
            argv = _read_proc(entry, "cmdline")
            if not argv:
                continue  # exited (or a zombie) between the two reads
            found[int(entry)] = [a.decode(errors="replace") for a in argv if a]
        return found

    def pids(self, program: str | None = None) -> list[int]:
        """Pids of this instance's processes, optionally only those running ``program``.

        ``program`` is compared with the basename of the first words of argv, so
        ``"qmgr"`` finds stock qmgr (``qmgr -l -t unix -u``) as well as the pyqmgr
        launcher (``python -I .../pyqmgr/qmgr -l ...``), and ``"master"`` the master.
        """
        found = []
        for pid, argv in self.processes().items():
            if program is None or program in (os.path.basename(a) for a in argv[:3]):
                found.append(pid)
        return sorted(found)

    def qmgr_pid(self, timeout: float = 10) -> int:
        """The pid of the running qmgr process, waiting for master to start one."""
        pids: list[int] = []

        def present() -> bool:
            pids[:] = self.pids("qmgr")
            return len(pids) == 1

        self.wait_until(present, timeout, "exactly one qmgr process")
        return pids[0]

    def wait_until(self, predicate: Callable[[], bool], timeout: float, what: str,
                   interval: float = 0.05) -> None:
        """:func:`wait_until` whose error ends with this instance's last maillog lines."""
        wait_until(predicate, timeout, what, interval,
                   detail=lambda: f"; last maillog lines:\n{self.maillog.tail(20)}")

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

    # -- queue ------------------------------------------------------------------------

    def queue_files(self, queue: str) -> list[str]:
        """Queue ids of the files in one queue directory, hashed subdirectories included.

        Names with anything but letters and digits (cleanup's ``usec.pid`` temporary
        files, for one) are not queue files yet and are left out.
        """
        found: list[str] = []
        for _dirpath, _dirs, files in os.walk(os.path.join(self.queue_dir, queue)):
            found.extend(f for f in files if f.isalnum())
        return found

    def queue_path(self, queue: str, qid: str) -> str | None:
        """Where a queue file is, or None."""
        for dirpath, _dirs, files in os.walk(os.path.join(self.queue_dir, queue)):
            if qid in files:
                return os.path.join(dirpath, qid)
        return None

    def queue_counts(self) -> dict[str, int]:
        return {q: len(self.queue_files(q)) for q in QUEUES}

    def queue_empty(self) -> bool:
        """No message in maildrop, incoming, active or deferred (hold is not counted)."""
        return not any(self.queue_files(q) for q in ("maildrop", "incoming", "active",
                                                      "deferred"))

    def wait_queue_empty(self, timeout: float) -> None:
        """Wait until :meth:`queue_empty`; the error lists what is still queued."""
        wait_until(self.queue_empty, timeout, "an empty queue", detail=lambda: (
            f" (still queued: {self.queue_counts()}); last maillog lines:\n"
            f"{self.maillog.tail(20)}"))

    def wait_removed(self, qids: Iterable[str], timeout: float = 10) -> None:
        """Wait for qmgr's ``removed`` line of every message in ``qids``.

        The queue file goes before its log line reaches the maillog (syslog or
        postlogd writes it a moment later), so an empty queue is not yet proof.
        """
        want = set(qids)

        def missing() -> set[str]:
            return want - {ln.queue_id for ln in self.maillog.lines()
                           if ln.text.endswith(": removed")}

        wait_until(lambda: not missing(), timeout, "a removed line for every message",
                   detail=lambda: f" (missing: {sorted(missing())})")

    def postqueue(self, *args: str) -> str:
        return self.run(["postqueue", "-c", self.config_dir, *args]).stdout

    def postsuper(self, *args: str) -> str:
        """``postsuper`` prints its reports on stderr; both streams are returned."""
        proc = self.run(["postsuper", "-c", self.config_dir, *args])
        return proc.stdout + proc.stderr

    def queue_json(self) -> list[dict[str, object]]:
        """``postqueue -j``: one dict per queued message (showq's view, no hold)."""
        out = self.postqueue("-j")
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def flush(self) -> None:
        """``postqueue -f``: deliver deferred mail now."""
        self.postqueue("-f")

    # -- injection --------------------------------------------------------------------

    def sendmail(self, sender: str, recipients: list[str], subject: str = "test",
                 body: str = "hello\n", extra_args: Iterable[str] = ()) -> None:
        """Submit through ``sendmail -C DIR`` (maildrop, then pickup); waits for it."""
        text = (f"From: {sender}\nTo: {', '.join(recipients)}\nSubject: {subject}\n\n"
                f"{body}")
        self.run([SENDMAIL, "-C", self.config_dir, "-i", "-f", sender, *extra_args, "--",
              *recipients], input=text)

    def smtp_send(self, messages: Iterable[Message], subject: str = "test",
                  body: str | None = None) -> list[str]:
        """Send (sender, recipients) pairs in one SMTP session; return the queue ids.

        smtpd has the message in the queue (incoming) when it answers 250 to DATA.
        """
        qids = []
        with smtplib.SMTP("127.0.0.1", self.smtpd_port, timeout=60) as smtp:
            smtp.ehlo()
            for i, (sender, rcpts) in enumerate(messages):
                msg = EmailMessage()
                msg["From"] = sender
                msg["To"] = ", ".join(rcpts[:3])
                msg["Subject"] = f"{subject} {i}"
                msg.set_content(body if body is not None else f"message {i}\n")
                code, resp = smtp.mail(sender)
                if code != 250:
                    raise TestbedError(f"smtpd refused sender {sender}: {code} {resp!r}")
                for r in rcpts:
                    code, resp = smtp.rcpt(r)
                    if code >= 400:
                        raise TestbedError(f"smtpd refused {r}: {code} {resp!r}")
                code, resp = smtp.data(msg.as_bytes())
                if code != 250:
                    raise TestbedError(f"smtpd refused data: {code} {resp!r}")
                qids.append(resp.decode().rsplit(" ", 1)[-1])
        return qids

    def smtp_send_many(self, messages: Sequence[Message], sessions: int = 4,
                       subject: str = "test") -> list[str]:
        """Like :meth:`smtp_send`, over several parallel sessions; ids in input order."""
        sessions = max(1, min(sessions, len(messages)))
        if sessions == 1:
            return self.smtp_send(messages, subject)
        size = -(-len(messages) // sessions)
        chunks = [messages[i:i + size] for i in range(0, len(messages), size)]
        results: list[list[str] | BaseException] = [[] for _ in chunks]

        def send(k: int) -> None:
            try:
                results[k] = self.smtp_send(chunks[k], subject)
            except BaseException as exc:
                results[k] = exc

        threads = [threading.Thread(target=send, args=(k,)) for k in range(len(chunks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        qids: list[str] = []
        for r in results:
            if isinstance(r, BaseException):
                raise r
            qids.extend(r)
        return qids

    def mailbox(self, user: str = LOCAL_USER) -> str:
        """Path of a local user's mailbox file (may not exist yet)."""
        return os.path.join(self.mail_dir, user)

    # -- preloading the incoming queue ------------------------------------------------

    def disable_qmgr(self) -> str:
        """Comment the qmgr service out and wait for qmgr to exit; return its line."""
        line = self.postconf("-M", "qmgr/unix").strip()
        if not line:
            raise TestbedError("master.cf has no active qmgr/unix service")
        self.postconf("-M#", "qmgr/unix")
        self._disabled_qmgr_line = line
        if self.started:
            self.reload()
            self.wait_until(lambda: not self.pids("qmgr"), 10, "qmgr to exit")
        return line

    def enable_qmgr(self, line: str | None = None) -> None:
        """Restore the qmgr service line saved by :meth:`disable_qmgr` and reload."""
        line = line or self._disabled_qmgr_line
        if line is None:
            raise TestbedError("enable_qmgr: no saved qmgr line (disable_qmgr not called)")
        self.postconf("-Me", f"qmgr/unix={line}")
        self._disabled_qmgr_line = None
        if self.started:
            self.reload()

    def preload(self, messages: int | Sequence[Message],
                recipients: Callable[[int], list[str]] | None = None,
                sender: str = "sender@test.example", sessions: int = 4,
                timeout: float = 300) -> list[str]:
        """Fill incoming/ while no qmgr runs; return the queue ids. Then :meth:`release_preload`.

        ``messages`` is a list of (sender, recipients) or a count, with ``recipients(i)``
        giving message i's recipients. The qmgr service is commented out and
        ``in_flow_delay`` is 0 while injecting: with no qmgr there are no flow-control
        tokens, and cleanup would otherwise wait 1 s per message. Returns when every
        message is a file in incoming/.
        """
        if not self.started:
            raise TestbedError("preload needs a started instance")
        if isinstance(messages, int):
            if recipients is None:
                raise TypeError("preload(n) needs recipients=lambda i: [...]")
            messages = [(sender, recipients(i)) for i in range(messages)]
        before = len(self.queue_files("incoming"))
        saved = self.postconf("-n", "in_flow_delay").partition(" = ")[2].strip()
        self._saved_in_flow_delay = saved or None
        self.set_main(in_flow_delay="0")
        self.disable_qmgr()  # its reload also gives cleanup the new in_flow_delay
        qids = self.smtp_send_many(messages, sessions=sessions)
        want = before + len(messages)
        self.wait_until(lambda: len(self.queue_files("incoming")) >= want, timeout,
                        f"{len(messages)} new files in incoming/")
        if self._saved_in_flow_delay is None:
            self.postconf("-X", "in_flow_delay")
        else:
            self.set_main(in_flow_delay=self._saved_in_flow_delay)
        return qids

    def release_preload(self) -> None:
        """Bring qmgr back after :meth:`preload`; it starts on the reload."""
        self.enable_qmgr()
