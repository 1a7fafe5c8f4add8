"""Debian's postfwd, a real and unmodified Postfix policy server, run on loopback for tests.

Delivery policy delegation is only proven against a server that was written for
Postfix, not one written to fit pyqmgr. postfwd (``postfwd2`` 1.35 in Debian's
``postfwd`` package) is such a server, and its ``rate()`` action is the use case: "at
most N deliveries per T seconds to this domain".

How it is run, and why:

* **postfwd2**, not postfwd1: rate limits live in postfwd2's cache daemon, shared by
  all its policy processes, so a client with several connections sees one counter.
  ``--nodaemon`` is no way to keep it in the foreground: in postfwd2 that mode reads
  requests from stdin and disables ``rate()`` (the cache daemon is not started). So it
  daemonizes (Net::Server::Daemonize: fork, then ``setsid``), which makes its master a
  process group leader: the pid in its ``--pidfile`` is the group id, and stopping
  signals the whole group (master, cache daemon, policy daemon and its prefork
  children) with SIGTERM, then SIGKILL after a bounded wait.
* Everything lives in a temp dir: the rules file, ``--pidfile`` and the cache daemon's
  socket (``--cache_socket unix::DIR/cache.socket``; the defaults are shared paths in
  /var/tmp that a second instance would fight over). postfwd drops privileges before
  it creates the cache socket, so the directory belongs to the user it runs as
  (``nobody:nogroup`` when started by root).
* Logging: ``-L`` (log to stdout) is unusable, because in the prefork children stdout is
  the client's socket and log lines would be sent to the client as part of the reply
  (it says "Never use this with postfix!"). Without it postfwd logs to syslog through
  /dev/log and, when there is none, drops the lines silently. The default here is
  ``--perfmon``, "no logging at all" (the ``--nolog`` and ``--quiet`` its usage text
  lists are not options of 1.35), so tests neither need a syslog daemon nor fill the
  machine's mail log; ``syslog=True`` keeps postfwd's syslogging for a human debugging
  a rule.
* ``--cache 0`` turns off postfwd's request cache, so every request is judged by the
  rules (its rate counters are kept either way); ``--nodns`` keeps DNS out.
* Readiness is postfwd's own health check, the one its master runs: ``PING`` on a
  line to the policy port and to the cache socket answers ``PONG``. No policy request
  is sent, so no rate counter moves before the test starts. The listening socket must
  also belong to this instance's processes (a port picked free can be taken by someone
  else before postfwd binds it; then another port is tried).

``postfwd2 -C`` checks the rules first: a rule postfwd would ignore is an error here,
not a server that silently answers DUNNO to everything.

Rule syntax that works (``rate(item/max/seconds/action)``; the 4th request for the
domain within 10 s, and every one after it until the 10 s window that began with the
first request ends, gets the action; a line starting with whitespace continues the
rule before it)::

    id=LIMIT; protocol_state==DELIVERY; recipient_domain==limited.example
        action=rate(recipient_domain/3/10/450 4.7.1 too many)
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence

from pyqmgr.testbed.instance import TestbedError, free_port

HOST = "127.0.0.1"
#: Where Debian installs the prefork postfwd (``/usr/sbin/postfwd`` is an alternative
#: that may point to postfwd1, whose options differ).
POSTFWD2 = "/usr/sbin/postfwd2"


def find_postfwd2() -> str | None:
    """The postfwd2 program, or None when Debian's postfwd package is not installed."""
    if os.access(POSTFWD2, os.X_OK):
        return POSTFWD2
    return shutil.which("postfwd2")


def _proc_stat(pid: str) -> tuple[str, int] | None:
    """(state, process group) of a process from /proc/PID/stat, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name is in parentheses and may hold anything: parse after the last ')'.
    fields = data[data.rfind(")") + 2:].split()
    return fields[0], int(fields[2])


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group ``pgid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _proc_stat(entry)
        if stat is not None and stat[1] == pgid and stat[0] != "Z":
            found.append(int(entry))
    return sorted(found)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _tcp_sockets(port: int, state: str) -> list[int]:
    """Inodes of IPv4/IPv6 TCP sockets in ``state`` (hex, e.g. "0A" listen, "01"
    established) whose local port is ``port``, from /proc/net/tcp{,6}."""
    inodes = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            local_port = int(fields[1].rpartition(":")[2], 16)
            if local_port == port and fields[3] == state:
                inodes.append(int(fields[9]))
    return inodes


def _socket_inodes(pid: int) -> set[int]:
    inodes: set[int] = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _ping(family: int, address: str | tuple[str, int], timeout: float) -> bool:
    """postfwd's health check: ``PING`` answered by ``PONG``."""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(address)
            sock.sendall(b"PING\n")
            data = b""
            while not data.endswith(b"\n") and len(data) < 64:
                chunk = sock.recv(64)
                if not chunk:
                    break
                data += chunk
            return data.strip() == b"PONG"
    except OSError:
        return False


class Postfwd:
    """One postfwd2 on 127.0.0.1; a context manager that always stops it.

    ``rules`` is the rules file's text (or its lines). ``port`` is chosen free unless
    given. ``servers`` is (min, max) prefork policy processes. Each persistent client
    connection holds one process for as long as it stays open, and a connection beyond
    the processes waiting sits in the listen queue until postfwd forks another, which
    Net::Server's prefork parent does in its own time: seen taking more than 5 s. So
    the minimum is started at once and must exceed the connections a test keeps open
    (the policy client's pool holds up to 4).
    """

    def __init__(self, rules: str | Sequence[str], *, port: int | None = None,
                 servers: tuple[int, int] = (6, 12), syslog: bool = False,
                 start_timeout: float = 20.0, extra_args: Sequence[str] = ()) -> None:
        binary = find_postfwd2()
        if binary is None:
            raise TestbedError("postfwd2 not found (install Debian's postfwd package)")
        self.binary = binary
        self.rules = rules if isinstance(rules, str) else "\n".join(rules) + "\n"
        self._fixed_port = port
        self.port = port or 0
        self.servers = servers
        self.syslog = syslog
        self.start_timeout = start_timeout
        self.extra_args = list(extra_args)
        self.root = tempfile.mkdtemp(prefix="pyqmgr-postfwd-")
        self.rules_path = os.path.join(self.root, "rules.cf")
        self.pid_path = os.path.join(self.root, "master.pid")
        self.cache_path = os.path.join(self.root, "cache.socket")
        self.log_path = os.path.join(self.root, "startup.log")
        self.user, self.group = self._run_as()
        self._pgid: int | None = None
        try:
            with open(self.rules_path, "w") as f:
                f.write(self.rules)
            os.chmod(self.rules_path, 0o644)
            os.chmod(self.root, 0o700)
            if os.geteuid() == 0:
                os.chown(self.root, pwd.getpwnam(self.user).pw_uid,
                         grp.getgrnam(self.group).gr_gid)
            self.check_rules()
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise

    @staticmethod
    def _run_as() -> tuple[str, str]:
        # postfwd2 switches to --user/--group (default nobody/nobody, and Debian has no
        # group "nobody"). As root: the unprivileged nobody/nogroup; otherwise ourselves.
        if os.geteuid() == 0:
            return "nobody", "nogroup"
        return pwd.getpwuid(os.geteuid()).pw_name, grp.getgrgid(os.getegid()).gr_name

    # -- the rules ------------------------------------------------------------------

    def check_rules(self) -> None:
        """``postfwd2 -C``: refuse a rules file postfwd would partly ignore."""
        proc = subprocess.run([self.binary, "--file", self.rules_path, "--showconfig"],
                              capture_output=True, text=True, timeout=30, check=False)
        problems = [line for line in (proc.stdout + proc.stderr).splitlines()
                    if line.startswith("[LOG warning]") or "critical" in line]
        if problems or "Rule" not in proc.stdout:
            raise TestbedError("postfwd rejects the rules:\n" + "\n".join(
                problems or [proc.stdout.strip(), proc.stderr.strip()]))

    # -- life cycle -----------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The ``delivery_policy_service`` value for this server."""
        return f"inet:{HOST}:{self.port}"

    def _command(self) -> list[str]:
        low, high = self.servers
        args = [
            self.binary, "--daemon",
            "--file", self.rules_path,
            "--interface", HOST, "--port", str(self.port),
            "--user", self.user, "--group", self.group,
            "--pidfile", self.pid_path,
            "--cache_socket", f"unix::{self.cache_path}",
            "--nodns", "--cache", "0",
            "--min_servers", str(low), "--max_servers", str(high),
            "--min_spare_servers", "2", "--max_spare_servers", str(max(2, high // 2)),
        ]
        if not self.syslog:
            args.append("--perfmon")
        return args + self.extra_args

    def start(self) -> Postfwd:
        """Start postfwd2 and wait until it answers; TestbedError when it does not.

        The first start picks a free port (trying up to three); later starts, after
        :meth:`stop` or :meth:`kill`, use the same port again.
        """
        if self._pgid is not None and group_members(self._pgid):
            return self
        tries = 1 if self._fixed_port else 3
        for attempt in range(1, tries + 1):
            if not self._fixed_port:
                self.port = free_port()
            try:
                self._start_once()
                # From now on the port is this instance's: a restart (after stop or
                # kill, mid-run) must come back where its clients connect.
                self._fixed_port = self.port
                return self
            except TestbedError:
                self.stop()
                if attempt == tries:
                    raise
        return self

    def _start_once(self) -> None:
        for path in (self.pid_path, self.cache_path):
            if os.path.lexists(path):
                os.unlink(path)
        # Output to a file, not a pipe: the daemon inherits stdout and stderr until it
        # reopens them on /dev/null, and a pipe would keep run() waiting for it.
        with open(self.log_path, "w") as log:
            try:
                proc = subprocess.run(self._command(), stdin=subprocess.DEVNULL,
                                      stdout=log, stderr=subprocess.STDOUT,
                                      timeout=self.start_timeout, check=False)
            except subprocess.TimeoutExpired:
                raise TestbedError(f"postfwd2 did not daemonize within "
                                   f"{self.start_timeout:g}s: {self._startup_log()}") from None
        if proc.returncode != 0:
            raise TestbedError(f"postfwd2 exited {proc.returncode}: {self._startup_log()}")
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._pgid is None:
                self._pgid = self._read_pid()
            if self._pgid is not None and self._ready():
                return
            if self._pgid is not None and not group_members(self._pgid):
                raise TestbedError(f"postfwd2 (pid {self._pgid}) exited during start-up: "
                                   f"{self._startup_log()}")
            time.sleep(0.05)
        raise TestbedError(
            f"postfwd2 on {self.endpoint} did not answer PING within "
            f"{self.start_timeout:g}s (processes: {self.processes()}; listening socket "
            f"ours: {self._listener_is_ours()}): {self._startup_log()}")

    def _read_pid(self) -> int | None:
        try:
            with open(self.pid_path) as f:
                text = f.read().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def _startup_log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                text = f.read().strip()
        except OSError:
            text = ""
        return text or "(no output)"

    def _listener_is_ours(self) -> bool:
        listening = set(_tcp_sockets(self.port, "0A"))
        if not listening or self._pgid is None:
            return False
        return any(listening & _socket_inodes(pid) for pid in group_members(self._pgid))

    def _ready(self) -> bool:
        return (_ping(socket.AF_UNIX, self.cache_path, 1.0)
                and _ping(socket.AF_INET, (HOST, self.port), 1.0)
                and self._listener_is_ours())

    def running(self) -> bool:
        return self._pgid is not None and bool(group_members(self._pgid))

    def processes(self) -> dict[int, str]:
        """This instance's live processes with their command lines."""
        if self._pgid is None:
            return {}
        return {pid: _cmdline(pid) for pid in group_members(self._pgid)}

    def established(self) -> int:
        """TCP connections open at postfwd's port now (server side, counted by the kernel).

        An independent count of the connections a client keeps: each persistent
        connection is one established socket whose local port is postfwd's.
        """
        return len(_tcp_sockets(self.port, "01"))

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM to the whole process group, SIGKILL after ``grace`` seconds.

        postfwd's master answers SIGTERM by signalling its group itself; the group
        signal also reaches children whose master already died. Raises TestbedError
        when a process survives SIGKILL for 5 s. Only this instance's group is
        signalled, and only while its members are postfwd processes.
        """
        pgid, self._pgid = self._pgid, None
        if pgid is None:
            pgid = self._read_pid()
        if pgid is None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            members = group_members(pgid)
            if not members:
                break
            # A process that is exiting shows an empty command line: not a stranger.
            if not all("postfwd" in _cmdline(pid) for pid in members if _cmdline(pid)):
                raise TestbedError(f"process group {pgid} holds other programs than "
                                   f"postfwd: { {p: _cmdline(p) for p in members} }")
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while group_members(pgid) and time.monotonic() < deadline:
                time.sleep(0.05)
        survivors = group_members(pgid)
        if survivors:
            raise TestbedError(f"postfwd processes survive SIGKILL: {survivors}")
        for path in (self.pid_path, self.cache_path):
            if os.path.lexists(path):
                os.unlink(path)

    def kill(self) -> None:
        """Stop at once, as a crash would (SIGKILL to the group): for mid-run tests."""
        pgid = self._pgid
        if pgid is not None and group_members(pgid):
            os.killpg(pgid, signal.SIGKILL)
        self.stop(grace=0.0)

    def restart(self) -> Postfwd:
        """Stop, then start again on the same port (rate counters start from zero)."""
        self.stop()
        return self.start()

    def close(self) -> None:
        """Stop and remove the temp dir (kept with $PYQMGR_KEEP_TESTBED set)."""
        try:
            self.stop()
        finally:
            if os.environ.get("PYQMGR_KEEP_TESTBED"):
                print(f"postfwd testbed kept at {self.root}")
            else:
                shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Postfwd:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
