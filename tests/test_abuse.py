"""The abuse suite (issue #31): what a local user, an outsider on the fleet's Redis, a
lost Redis and oversized input can do to a running pyqmgr, on real Postfix.

Each test plays the attack a security review found and holds the daemon to stock's
floor: mail keeps flowing, nothing is rerouted or lost, the maillog is not flooded.
The forged and replayed fleet notices are in tests/test_fleet_throttling.py
(``test_forged_replayed_and_misrouting_notices_reroute_nothing``).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time

from pyqmgr.control.client import request
from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.sink import SinkServer
from tests.test_control import control_path, control_warnings, wait_for_channel
from tests.trust_helpers import OTHERS_PYTHON, throwaway_user

#: A local user's flood: ``N`` connections to the control socket, held open, each one
#: the daemon closes opened again, a few of them sending garbage, for ``SECONDS``.
FLOOD = r"""
import json, select, socket, sys, time
path, n, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
socks, opened, refused, peak = [], 0, 0, 0
def connect(k):
    global opened, refused
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.connect(path)
    except (BlockingIOError, InterruptedError):
        pass
    except OSError:
        refused += 1
        s.close()
        return None
    opened += 1
    if k % 50 == 0:
        try:
            s.send(b"this is not json\n")
        except OSError:
            pass
    return s
end = time.monotonic() + seconds
while time.monotonic() < end:
    socks = [s for s in socks if s is not None]
    while len(socks) < n:
        socks.append(connect(len(socks)))
    live = [s for s in socks if s is not None]
    peak = max(peak, len(live))
    readable, _, _ = select.select(live, [], [], 0.2) if len(live) < 1000 else \
        (live, [], [])
    gone = set()
    for s in readable:
        try:
            if not s.recv(65536):
                gone.add(s)
        except BlockingIOError:
            pass
        except OSError:
            gone.add(s)
    for s in gone:
        s.close()
    socks = [s for s in socks if s not in gone]
    time.sleep(0.05)
print(json.dumps({"opened": opened, "refused": refused, "peak": peak}))
"""


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _limit_fds(pf: PostfixInstance, pid: int, n: int) -> None:
    """Set qmgr's open-file limit to ``n``: as mail_owner, its own uid (root here has
    no CAP_SYS_RESOURCE to change another user's process), with Debian's python3 (the
    suite's venv may be under a 0700 directory mail_owner cannot enter)."""
    uid, gid = pf.mail_owner_ids()

    def as_owner() -> None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)

    subprocess.run([OTHERS_PYTHON, "-c", "import resource, sys; resource.prlimit("
                    "int(sys.argv[1]), resource.RLIMIT_NOFILE, (int(sys.argv[2]),) * 2)",
                    str(pid), str(n)], preexec_fn=as_owner, check=True, timeout=30,
                   capture_output=True, cwd="/")


def _deliver(pf: PostfixInstance, srv: SinkServer, n: int, tag: str, timeout: float
             ) -> float:
    before = srv.delivered_count()
    t0 = time.monotonic()
    pf.smtp_send([("s@test.example", [f"{tag}{i}@fast.example"]) for i in range(n)])
    pf.wait_until(lambda: srv.delivered_count() >= before + n, timeout,
                  f"{n} deliveries ({tag}) at the sink")
    return time.monotonic() - t0


def test_a_local_users_thousand_idle_connections_do_not_stop_mail(postfix_instance, sink):
    """1,000 connections held (and reopened) by an unprivileged user, with qmgr's
    descriptors at the common limit of 1,024: the daemon holds a bounded few of them,
    delivers on time, answers root, and warns about the user at most once a minute."""
    srv: SinkServer = sink(latency=0.01)
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"fast.example": f"smtp:[127.0.0.1]:{srv.port}"})
    wait_for_channel(pf)
    path = control_path(pf)
    pid = pf.qmgr_pid()
    _limit_fds(pf, pid, 1024)
    _deliver(pf, srv, 20, "warm", 60)
    baseline = _deliver(pf, srv, 50, "base", 60)
    with throwaway_user() as stranger:
        def as_stranger() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
            os.setgroups([])
            os.setgid(stranger.pw_gid)
            os.setuid(stranger.pw_uid)

        flood = subprocess.Popen(
            [OTHERS_PYTHON, "-c", FLOOD, path, "1000", "20"], preexec_fn=as_stranger,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
        try:
            time.sleep(2)
            fds = [_fds(pid)]
            during = _deliver(pf, srv, 50, "flood", 60)
            fds.append(_fds(pid))
            t0 = time.monotonic()
            status = request(path, "status", timeout=10)
            answered = time.monotonic() - t0
            fds.append(_fds(pid))
            out, err = flood.communicate(timeout=60)
        finally:
            if flood.poll() is None:
                flood.kill()
                flood.wait()
        assert flood.returncode == 0, err
        counts = json.loads(out)
        after = _deliver(pf, srv, 50, "after", 60)
        stranger_lines = [t for t in control_warnings(pf) if f"uid={stranger.pw_uid} " in t]
    print(f"\n50 messages: {baseline:.2f} s alone, {during:.2f} s during the flood, "
          f"{after:.2f} s after; root's status answered in {answered * 1000:.0f} ms; "
          f"qmgr's descriptors {fds}; flood {counts}; {len(stranger_lines)} warnings")
    assert counts["peak"] >= 900, f"the flood never held its connections: {counts}"
    assert counts["opened"] >= 1000, counts
    assert status["ok"] is True, status
    assert pf.qmgr_pid() == pid, "qmgr restarted"
    assert max(fds) < 200, fds
    assert during < max(5 * baseline, baseline + 10), (baseline, during)
    assert after < max(3 * baseline, baseline + 5), (baseline, after)
    assert 1 <= len(stranger_lines) <= 2, stranger_lines
    assert "more from this uid" in stranger_lines[-1] or len(stranger_lines) == 1
    assert not pf.maillog.lines(contains="fatal")


def test_a_queue_file_that_cannot_be_opened_ends_the_daemon_and_master_restarts_it(
        postfix_instance, sink):
    """Stock's qmgr_message_open: an open error other than "no such file" is fatal,
    master starts a new qmgr and its recovery delivers the message. pyqmgr once ran
    on with its feeder dead and took no mail until restarted by hand."""
    srv: SinkServer = sink()
    # A deferred scan every 2 s: master's trigger needs a descriptor too (its accept
    # fails as stock's would), the queue manager's own timer does not.
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"fast.example": f"smtp:[127.0.0.1]:{srv.port}"},
        main_cf={"queue_run_delay": "2s"})
    wait_for_channel(pf)
    pid = pf.qmgr_pid()
    # No descriptor left for the queue manager: its next open fails with EMFILE.
    # Stopped meanwhile, so that the limit is what it has open at that instant.
    os.kill(pid, signal.SIGSTOP)
    try:
        _limit_fds(pf, pid, _fds(pid))
    finally:
        os.kill(pid, signal.SIGCONT)
    pf.smtp_send([("s@test.example", [f"m{i}@fast.example" for i in range(3)])])
    (fatal,) = pf.maillog.wait_for(lambda ln: ln.program_name == "qmgr" and
                                   "fatal:" in ln.text, 30, what="qmgr's fatal line")
    print(f"\n{fatal.text}")
    # Whichever open comes first: the deferred scan's directory, or the new message's
    # queue file (the incoming scan moved it to active/ first: a CI run under load).
    assert re.fullmatch(r"fatal: (scan_dir_push: open directory deferred|open active "
                        r"[0-9A-F]+): Too many open files", fatal.text), fatal.text
    # Master starts a queue manager when its socket has a trigger waiting. If the
    # dying one took cleanup's trigger (the "open active" case), the next one is the
    # next message's, as on a live server; otherwise master's 300 s wakeup, as stock.
    pf.smtp_send([("s@test.example", ["later@fast.example"])])
    pf.wait_until(lambda: pf.pids("qmgr") not in ([], [pid]), 30,
                  "master starting a new qmgr")
    pf.wait_until(lambda: srv.delivered_count() >= 4, 120, "the messages delivered "
                  "by the new qmgr")
    pf.wait_queue_empty(30)


# -- oversized input to replay (finding 6) ----------------------------------------------

#: ``pyqmgr ARGS``, printing its peak RSS (KiB) on stderr's last line.
_MEASURED = ("import resource, sys\nfrom pyqmgr.cli import main\ntry:\n    code = main()\n"
             "finally:\n    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
             "file=sys.stderr)\nsys.exit(code)\n")


def _replay(*paths: str) -> tuple[dict[str, object], int]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _MEASURED, "replay", *paths, "--year",
                           "2026", "--json"], capture_output=True, text=True, timeout=300,
                          check=False, env=dict(os.environ, PYTHONPATH=root))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout), int(proc.stderr.strip().splitlines()[-1])


def test_a_100_mb_line_and_a_gzip_bomb_cost_replay_no_memory(tmp_path):
    """A maillog with a 100 MB line among good ones, and a gzip file that expands a
    thousandfold: replay reads around the first and stops at the second, says so,
    and its peak memory stays that of a small log's replay (a 60 MB line once cost
    120 MB)."""
    from tests.test_replay import message, write

    good: list[str] = []
    for i in range(5):
        good += message(f"Nov 24 10:00:0{i}", f"G{i}AAAAAAAA",
                        [(f"Nov 24 10:00:1{i}", f"u{i}@good.example", "sent")])
    small = write(str(tmp_path / "small.log"), good)
    _, base_kib = _replay(small)
    big = str(tmp_path / "big.log")
    with open(big, "w") as f:
        f.write("".join(x + "\n" for x in good[:6]))
        f.write("Nov 24 10:00:05 mx postfix/smtpd[100]: ")
        chunk = "x" * (1 << 20)
        for _ in range(100):
            f.write(chunk)
        f.write("\n" + "".join(x + "\n" for x in good[6:]))
    bomb = str(tmp_path / "mail.log.1.gz")
    line = ("Nov 24 09:00:00 mx postfix/smtpd[100]: connect from x.example[192.0.2.1]\n"
            * 100).encode()
    with gzip.open(bomb, "wb", compresslevel=9) as g:
        for _ in range(20_000):  # 1.4 GB of text
            g.write(line * 10)
    # And one with no newline at all: 1 GB of one endless line.
    endless = str(tmp_path / "mail.log.2.gz")
    with gzip.open(endless, "wb", compresslevel=1) as g:
        chunk = b"y" * (1 << 20)
        for _ in range(1024):
            g.write(chunk)
    t0 = time.monotonic()
    rep, kib = _replay(big, bomb, endless)
    took = time.monotonic() - t0
    skipped = rep["input"]["skipped"]  # type: ignore[index]
    print(f"\nreplay's peak RSS: {base_kib / 1024:.0f} MiB for a small log, "
          f"{kib / 1024:.0f} MiB with a 100 MB line and a "
          f"{os.path.getsize(bomb) / 1e6:.1f} MB gzip bomb and a "
          f"{os.path.getsize(endless) / 1e6:.1f} MB one without a newline, in {took:.1f} s; "
          f"skipped {skipped}")
    assert skipped["line too long"] == 1, skipped
    assert skipped["gzip file expands more than 200 times over (read up to there)"] == 2
    assert took < 60, took
    assert rep["instances"][0]["messages"]["replayed"] == 5  # type: ignore[index]
    assert kib < base_kib + 30 * 1024, (base_kib, kib)


def test_unpriv_n_keeps_root_as_stock_does_and_says_so(postfix_instance):
    """master.cf's unpriv column n: stock's qmgr runs as root; so does pyqmgr, with a
    warning (pyqmgr(8) once said it always drops privileges, issue #31 finding 8)."""
    pf: PostfixInstance = postfix_instance(qmgr="pyqmgr")
    wait_for_channel(pf)
    pid = pf.qmgr_pid()
    assert _uid(pid) != 0, "unpriv - drops to mail_owner"
    assert not pf.maillog.lines(contains="with unpriv = n")
    pf.postconf("-F", "qmgr/unix/unprivileged=n")
    pf.reload()
    pf.wait_until(lambda: pf.pids("qmgr") not in ([], [pid]), 20, "a new qmgr")
    (line,) = pf.maillog.wait_for("with unpriv = n", 20)
    assert "pyqmgr keeps root privileges, as stock's qmgr would" in line.text, line.text
    assert _uid(pf.qmgr_pid()) == 0


def _uid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("Uid:"))
