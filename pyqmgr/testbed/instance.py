"""A throwaway Postfix instance in a temp dir, run by the real ``postfix`` command.

Everything an instance needs lives under one directory (config, queue, data, maillog,
mail spool); it listens on loopback only. Tear-down is thorough because a test that
fails must not leave daemons behind: after ``postfix stop``, any process whose
environment names this instance's config directory is killed.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import smtplib
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from email.message import EmailMessage

from pyqmgr.testbed.maillog import Maillog

LOCAL_USER = "pyqmgrtest"
LOCAL_DOMAIN = "local.test.example"
MYHOSTNAME = "pfx.test.example"


class TestbedError(Exception):
    """The instance could not be created, started or driven; the text says why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_local_user() -> str:
    """A real unprivileged user for local(8) deliveries in tests."""
    try:
        pwd.getpwnam(LOCAL_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", LOCAL_USER], check=True, capture_output=True)
    return LOCAL_USER


def wait_until(predicate: Callable[[], bool], timeout: float, what: str,
               interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _run(args: list[str], check: bool = True, **kw: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, capture_output=True, text=True, check=False, **kw)  # type: ignore
    if check and proc.returncode != 0:
        raise TestbedError(f"{' '.join(args)} failed ({proc.returncode}): "
                           f"{proc.stdout.strip()} {proc.stderr.strip()}")
    return proc


class PostfixInstance:
    def __init__(
        self,
        qmgr: str = "stock",
        main_cf: dict[str, str] | None = None,
        transports: dict[str, str] | None = None,
        master_cf_extra: Iterable[str] = (),
        qmgr_args: Iterable[str] = (),
        root: str | None = None,
    ) -> None:
        self.root = root or tempfile.mkdtemp(prefix="pyqmgr-tb-")
        os.chmod(self.root, 0o755)
        self.config_dir = os.path.join(self.root, "etc")
        self.queue_dir = os.path.join(self.root, "spool")
        self.data_dir = os.path.join(self.root, "data")
        self.maillog_path = os.path.join(self.root, "maillog")
        self.spool_mail = os.path.join(self.root, "mail")
        self.smtpd_port = free_port()
        self.qmgr = qmgr
        self.started = False
        for d in (self.config_dir, self.queue_dir, self.data_dir, self.spool_mail):
            os.makedirs(d, exist_ok=True)
        os.chmod(self.spool_mail, 0o1777)
        pf = pwd.getpwnam("postfix")
        os.chown(self.data_dir, pf.pw_uid, pf.pw_gid)
        ensure_local_user()
        self._write_config(main_cf or {}, transports or {}, list(master_cf_extra),
                           list(qmgr_args))
        self.maillog = Maillog(self.maillog_path)
        if qmgr == "pyqmgr":
            self._install()

    # -- configuration ----------------------------------------------------------------

    def _write_config(self, main_cf: dict[str, str], transports: dict[str, str],
                      extra: list[str], qmgr_args: list[str]) -> None:
        params = {
            "compatibility_level": "3.6",
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
            "mail_spool_directory": self.spool_mail,
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
            items = []
            for domain, route in transports.items():
                items.append(f"{{{domain}={route}}}" if " " in route else f"{domain}={route}")
            params["transport_maps"] = "inline:{" + ", ".join(items) + "}"
        params.update(main_cf)
        with open(os.path.join(self.config_dir, "main.cf"), "w") as f:
            for name, value in params.items():
                f.write(f"{name} = {value}\n")
        shutil.copy("/usr/share/postfix/master.cf.dist",
                    os.path.join(self.config_dir, "master.cf"))
        self._backdate()
        self.postconf("-M#", "smtp/inet")
        self.postconf("-Me", f"127.0.0.1:{self.smtpd_port}/inet="
                      f"127.0.0.1:{self.smtpd_port} inet n - n - - smtpd")
        services = self.postconf("-F", "*/*/chroot").splitlines()
        for line in services:
            svc = line.split(" = ")[0].rsplit("/", 1)[0]
            self.postconf("-F", f"{svc}/chroot=n")
        if qmgr_args:
            cmd = self.postconf("-F", "qmgr/unix/command").partition("=")[2].strip()
            self.postconf("-F", "qmgr/unix/command=" + " ".join([cmd, *qmgr_args]))
        with open(os.path.join(self.config_dir, "master.cf"), "a") as f:
            for line in extra:
                f.write(line + "\n")

    def _backdate(self) -> None:
        # Postfix programs re-read a main.cf younger than about a second (~2 s a command).
        t = time.time() - 3600
        os.utime(os.path.join(self.config_dir, "main.cf"), (t, t))

    def postconf(self, *args: str) -> str:
        out = _run(["postconf", "-c", self.config_dir, *args]).stdout
        self._backdate()
        return out

    def set_main(self, **params: str) -> None:
        self.postconf("-e", *[f"{k}={v}" for k, v in params.items()])

    def _install(self) -> None:
        from pyqmgr.install import install

        install(self.config_dir)

    def use_qmgr(self, which: str) -> None:
        from pyqmgr.install import install, uninstall

        (install if which == "pyqmgr" else uninstall)(self.config_dir)
        self.qmgr = which

    # -- life cycle -------------------------------------------------------------------

    def start(self, prefix: str = "") -> PostfixInstance:
        """Start with the real ``postfix start``; ``prefix`` wraps it (a namespace...)."""
        proc = _run(["script", "-qec", f"{prefix}postfix -c {self.config_dir} start",
                     "/dev/null"], check=False)
        if proc.returncode != 0:
            raise TestbedError(f"postfix start failed: {proc.stdout.strip()}")
        self.started = True
        wait_until(lambda: os.path.exists(os.path.join(self.queue_dir, "public", "qmgr")),
                   20, "public/qmgr to appear")
        return self

    def reload(self) -> None:
        _run(["postfix", "-c", self.config_dir, "reload"])

    def stop(self) -> None:
        if self.started:
            _run(["postfix", "-c", self.config_dir, "stop"], check=False)
            self.started = False
        deadline = time.monotonic() + 10
        while True:
            pids = self.pids()
            if not pids:
                return
            sig = signal.SIGTERM if time.monotonic() < deadline - 5 else signal.SIGKILL
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise TestbedError(f"processes of {self.root} survive SIGKILL: {pids}")
            time.sleep(0.1)

    def pids(self, program: str | None = None) -> list[int]:
        """Processes of this instance (by MAIL_CONFIG), optionally by argv[0] basename."""
        want = f"MAIL_CONFIG={self.config_dir}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read().split(b"\0")
                if want not in env:
                    continue
                if program is not None:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        argv = f.read().split(b"\0")
                    names = [os.path.basename(a.decode(errors="replace")) for a in argv[:3]]
                    if program not in names:
                        continue
            except OSError:
                continue
            found.append(int(entry))
        return found

    def qmgr_pid(self, timeout: float = 10) -> int:
        pids: list[int] = []

        def present() -> bool:
            pids[:] = self.pids("qmgr")
            return bool(pids)

        wait_until(present, timeout, "a qmgr process")
        return pids[0]

    def close(self) -> None:
        try:
            self.stop()
        finally:
            if os.environ.get("PYQMGR_KEEP_TESTBED"):
                print(f"testbed kept at {self.root}")
            else:
                shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PostfixInstance:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- queue ------------------------------------------------------------------------

    def queue_files(self, queue: str) -> list[str]:
        base = os.path.join(self.queue_dir, queue)
        found = []
        for _dirpath, _dirs, files in os.walk(base):
            found.extend(files)
        return found

    def queue_path(self, queue: str, qid: str) -> str | None:
        for dirpath, _dirs, files in os.walk(os.path.join(self.queue_dir, queue)):
            if qid in files:
                return os.path.join(dirpath, qid)
        return None

    def queue_empty(self) -> bool:
        return not any(self.queue_files(q) for q in ("incoming", "active", "deferred",
                                                      "maildrop"))

    def wait_queue_empty(self, timeout: float) -> None:
        wait_until(self.queue_empty, timeout, "an empty queue "
                   f"(incoming/active/deferred: {self.queue_files('incoming')[:3]} "
                   f"{self.queue_files('active')[:3]} {self.queue_files('deferred')[:3]})")

    def postqueue(self, *args: str) -> str:
        return _run(["postqueue", "-c", self.config_dir, *args]).stdout

    def postsuper(self, *args: str) -> str:
        return _run(["postsuper", "-c", self.config_dir, *args]).stdout

    # -- injection --------------------------------------------------------------------

    def sendmail(self, sender: str, recipients: list[str], subject: str = "test",
                 body: str = "hello\n", extra_args: Iterable[str] = ()) -> None:
        text = f"From: {sender}\nSubject: {subject}\n\n{body}"
        _run(["sendmail", "-C", self.config_dir, "-f", sender, *extra_args, *recipients],
             input=text)

    def smtp_send(self, messages: Iterable[tuple[str, list[str]]],
                  subject: str = "test") -> list[str]:
        """Send (sender, recipients) pairs in one SMTP session; returns queue ids."""
        qids = []
        with smtplib.SMTP("127.0.0.1", self.smtpd_port, timeout=60) as smtp:
            for i, (sender, rcpts) in enumerate(messages):
                msg = EmailMessage()
                msg["From"] = sender
                msg["To"] = ", ".join(rcpts[:3])
                msg["Subject"] = f"{subject} {i}"
                msg.set_content(f"message {i}\n")
                smtp.ehlo_or_helo_if_needed()
                smtp.mail(sender)
                for r in rcpts:
                    code, resp = smtp.rcpt(r)
                    if code >= 400:
                        raise TestbedError(f"smtpd refused {r}: {code} {resp!r}")
                code, resp = smtp.data(msg.as_bytes())
                if code != 250:
                    raise TestbedError(f"smtpd refused data: {code} {resp!r}")
                qids.append(resp.decode().rsplit(" ", 1)[-1])
        return qids

    def disable_qmgr(self) -> str:
        """Comment the qmgr service out (for preloading); returns its line."""
        line = self.postconf("-M", "qmgr/unix").strip()
        self.postconf("-M#", "qmgr/unix")
        if self.started:
            self.reload()
            wait_until(lambda: not self.pids("qmgr"), 10, "qmgr to exit")
        return line

    def enable_qmgr(self, line: str) -> None:
        self.postconf("-Me", f"qmgr/unix={line}")
        if self.started:
            self.reload()

    def preload(self, messages: list[tuple[str, list[str]]], batch: int = 500) -> list[str]:
        """Put messages in incoming/ while no qmgr runs; returns their queue ids."""
        line = self.disable_qmgr()
        self.set_main(in_flow_delay="0")
        if self.started:
            self.reload()
        qids: list[str] = []
        for i in range(0, len(messages), batch):
            qids += self.smtp_send(messages[i:i + batch])
        wait_until(lambda: len(self.queue_files("incoming")) >= len(messages), 60,
                   f"{len(messages)} files in incoming")
        self.set_main(in_flow_delay="1s")
        self._enable_line = line
        return qids

    def release_preload(self) -> None:
        """Bring qmgr back after :meth:`preload`."""
        self.enable_qmgr(self._enable_line)
