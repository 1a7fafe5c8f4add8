"""pyqmgr top in a real terminal: tmux runs it against a real Postfix instance.

tmux is driven on a private server (``-L`` with a name of this process's own, no
configuration file), so a user's tmux is never touched, and that server is killed
however the test ends. The pane runs top and then prints its exit status, so the
capture shows both the live screen and the shell after top has restored the terminal.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from pyqmgr.testbed.instance import PostfixInstance, wait_until
from pyqmgr.testbed.sink import SinkServer
from tests.test_control import cli, wait_for_channel

TMUX = "/usr/bin/tmux"


class Tmux:
    """One private tmux server with one session, ``top``."""

    def __init__(self) -> None:
        self.socket = f"pyqmgr-test-{os.getpid()}-{time.monotonic_ns()}"

    def run(self, *args: str) -> str:
        proc = subprocess.run([TMUX, "-f", "/dev/null", "-L", self.socket, *args],
                              capture_output=True, text=True, timeout=20, check=False)
        assert proc.returncode == 0, f"tmux {' '.join(args)}: {proc.stderr}"
        return proc.stdout

    def start(self, argv: list[str], width: int = 160, height: int = 40) -> None:
        # After top, the exit status, then a pause that keeps the pane for capturing.
        command = f"{shlex.join(argv)}; echo \"top exited $?\"; sleep 600"
        self.run("new-session", "-d", "-s", "top", "-x", str(width), "-y", str(height),
                 command)

    def capture(self) -> str:
        return self.run("capture-pane", "-p", "-t", "top")

    def keys(self, *keys: str) -> None:
        self.run("send-keys", "-t", "top", *keys)

    def wait_for(self, predicate: Callable[[str], bool], timeout: float, what: str) -> str:
        """Capture until ``predicate(screen)``; the error shows the last screen."""
        screen = [""]

        def shows() -> bool:
            screen[0] = self.capture()
            return predicate(screen[0])

        wait_until(shows, timeout, what, interval=0.1,
                   detail=lambda: f"; the pane ({self.size()}) shows:\n{screen[0]}")
        return screen[0]

    def size(self) -> str:
        return self.run("display", "-p", "-t", "top", "#{pane_width}x#{pane_height}").strip()

    def kill(self) -> None:
        """Stop the server and remove its socket file (tmux 3.3 leaves it behind)."""
        subprocess.run([TMUX, "-L", self.socket, "kill-server"], capture_output=True,
                       timeout=20, check=False)
        # Where tmux(1) puts a -L socket; the name is this test's own.
        path = os.path.join(os.environ.get("TMUX_TMPDIR") or "/tmp", f"tmux-{os.getuid()}",
                            self.socket)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@pytest.fixture
def tmux() -> Iterator[Tmux]:
    if not os.access(TMUX, os.X_OK):
        pytest.skip(f"needs {TMUX}")
    t = Tmux()
    try:
        yield t
    finally:
        t.kill()


def top_argv(pf: PostfixInstance, *args: str) -> list[str]:
    return [sys.executable, "-m", "pyqmgr.cli", "top", "--config-dir", pf.config_dir, *args]


def cells(screen: str, row_start: str, columns: list[str]) -> dict[str, str] | None:
    """The named columns of the destination row that starts with ``row_start``.

    Cells are read at their header's position (a ± column may be blank, so the
    row's words do not line up with the header's).
    """
    lines = screen.splitlines()
    header = next((ln for ln in lines if ln.startswith("DESTINATION ")), None)
    row = next((ln for ln in lines if ln.startswith(row_start + " ")), None)
    if header is None or row is None:
        return None
    starts = sorted(header.index(c) for c in columns)
    out = {}
    for name in columns:
        start = header.index(name)
        later = [s for s in starts if s > start]
        # Up to the next column asked for, or to the end of the column's own word run.
        end = later[0] if later else start + len(name) + 4
        out[name] = row[start:end].split()[0] if row[start:end].split() else ""
    return out


def test_top_shows_the_destination_counts_changing_while_mail_flows(
        postfix_instance, sink, tmux):
    srv: SinkServer = sink(latency=0.5)
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"flow.example": f"smtp:[127.0.0.1]:{srv.port}"},
        main_cf={"smtp_destination_concurrency_limit": "2",
                 "smtp_connection_cache_on_demand": "no"})
    wait_for_channel(pf)
    tmux.start(top_argv(pf, "--interval", "0.5"))
    tmux.wait_for(lambda s: "pyqmgr top - " in s and "TRANSPORT" in s, 20,
                  "top's first screen")

    n = 30
    pf.smtp_send([("s@test.example", [f"r{i}@flow.example"]) for i in range(n)])
    nexthop = f"[127.0.0.1]:{srv.port}"
    seen: list[tuple[str, str, str, int]] = []

    def flowing() -> bool:
        screen = tmux.capture()
        row = cells(screen, nexthop, ["IN FLIGHT", "RCPTS"])
        if row is not None:
            delivered = srv.delivered_count()
            sample = (row["IN FLIGHT"], row["RCPTS"], screen, delivered)
            if not seen or sample[:2] != seen[-1][:2]:
                seen.append(sample)
        queued = {s[1] for s in seen if 0 < s[3] < n}
        return len(queued) >= 4

    wait_until(flowing, 40, f"four different queued counts for {nexthop} while the sink "
               "was part-way through", interval=0.2,
               detail=lambda: f"; samples {[s[:2] + (s[3],) for s in seen]}; the pane "
                              f"shows:\n{tmux.capture()}")
    print(f"\n(in flight, queued recipients, delivered at the sink) as top showed them: "
          f"{[s[:2] + (s[3],) for s in seen]}")
    counts = [int(s[1]) for s in seen if s[1].isdigit()]
    assert counts == sorted(counts, reverse=True), f"queued only goes down: {counts}"
    assert all(s[0] in ("1", "2") for s in seen if 0 < s[3] < n), seen
    # The change since the previous refresh shows beside the count.
    changed = [s[2] for s in seen if cells(s[2], nexthop, ["RCPTS", "±"]) is not None]
    assert any(line.startswith(nexthop) and " -" in line
               for screen in changed for line in screen.splitlines()), seen[-1][2]

    tmux.keys("s")
    tmux.wait_for(lambda s: "sort window" in s, 10, "the sort order to change on s")
    tmux.keys("s")
    tmux.wait_for(lambda s: "sort busy" in s, 10, "the next sort order on s")
    tmux.keys("q")
    screen = tmux.wait_for(lambda s: "top exited 0" in s, 10, "top to quit on q")
    assert "pyqmgr top - " not in screen, "the terminal's own screen is back"
    pf.wait_until(lambda: srv.delivered_count() >= n, 60, f"all {n} deliveries")


def test_top_waits_for_the_daemon_survives_a_small_terminal_and_quits_on_ctrl_c(
        postfix_instance, tmux):
    pf: PostfixInstance = postfix_instance(qmgr="pyqmgr", start=False)
    # Not a terminal (a pipe): plain output, and a missing daemon is status's 69.
    piped = cli(pf, "top")
    assert piped.returncode == 69 and "not running" in piped.stderr, piped
    assert piped.stdout == ""

    tmux.start(top_argv(pf, "--interval", "0.5"))
    # The error is wrapped to the width: read the screen's words as one text.
    tmux.wait_for(lambda s: "the pyqmgr daemon is not running" in " ".join(s.split())
                  and "asking again every 0.5s" in s, 20, "top saying there is no daemon")
    pf.start()
    wait_for_channel(pf)
    tmux.wait_for(lambda s: "active queue: 0 messages" in s, 20,
                  "top finding the daemon once it runs")

    tmux.run("resize-window", "-t", "top", "-x", "40", "-y", "5")
    screen = tmux.wait_for(lambda s: "more lines" in s, 10, "a cut screen in 40x5")
    lines = screen.splitlines()
    assert len(lines) <= 5 and all(len(ln) <= 40 for ln in lines), screen
    tmux.run("resize-window", "-t", "top", "-x", "160", "-y", "40")
    tmux.wait_for(lambda s: "DESTINATION" in s or "no destinations in core" in s, 10,
                  "the whole screen again after growing")

    tmux.keys("p")
    tmux.wait_for(lambda s: "PAUSED" in s, 10, "pause on p")
    tmux.keys("C-c")
    screen = tmux.wait_for(lambda s: "top exited 0" in s, 10, "top to quit on Ctrl-C")
    assert "Traceback" not in screen and "pyqmgr top - " not in screen, screen

    # Piped again, now with a daemon: two plain snapshots an interval apart.
    two = cli(pf, "top", "-n", "2", "--interval", "0.2")
    assert two.returncode == 0, two.stderr
    assert two.stdout.count("pyqmgr top - ") == 2 and "TRANSPORT" in two.stdout
    assert "since the last refresh" in two.stdout.split("pyqmgr top - ")[2]


def read_snapshots(proc: subprocess.Popen[bytes], count: int, timeout: float) -> str:
    """What a piped top printed until ``count`` snapshots have come (each whole)."""
    import select

    assert proc.stdout is not None
    data = b""
    deadline = time.monotonic() + timeout
    while data.count(b"pyqmgr top - ") < count or not data.endswith(b"\n\n"):
        left = deadline - time.monotonic()
        assert left > 0, f"{count} snapshots within {timeout} s; got:\n{data.decode()}"
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 65536)
            assert chunk, f"top ended early ({proc.wait()}):\n{data.decode()}"
            data += chunk
    return data.decode()


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_top_without_a_terminal_is_top_b(postfix_instance):
    """Piped, top prints a snapshot every interval, each as soon as it is made, until
    its reader goes away (SIGPIPE: a quiet exit 0) or Ctrl-C; -n/--iterations counts."""
    pf: PostfixInstance = postfix_instance(qmgr="pyqmgr")
    wait_for_channel(pf)
    argv = top_argv(pf, "--interval", "0.2")
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for stop in ("close the pipe", "ctrl-c"):
            # As from a terminal: SIGINT at its default. CI's lanes run in the background
            # of a shell, which starts background jobs with SIGINT ignored, and Python
            # then never turns Ctrl-C into KeyboardInterrupt (top ran on, 30 s).
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env,
                                    preexec_fn=_sigint_default)
            procs.append(proc)
            text = read_snapshots(proc, 3, 30)
            first = text.split("\n", 1)[0]
            assert first.startswith("pyqmgr top - ") and "snapshot 1 - sort name" in first
            assert "snapshot 3 - " in text and "TRANSPORT" in text
            if stop == "close the pipe":
                assert proc.stdout is not None
                proc.stdout.close()
            else:
                proc.send_signal(signal.SIGINT)
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"top still runs 30 s after we did this: {stop}") from None
            assert code == 0, stop
            assert proc.stderr is not None
            err = proc.stderr.read().decode()
            assert "Traceback" not in err and "Error" not in err, (stop, err)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    counted = cli(pf, "top", "--iterations", "3", "-d", "0.1")
    assert counted.returncode == 0, counted.stderr
    assert counted.stdout.count("pyqmgr top - ") == 3 and "snapshot 3 of 3" in counted.stdout
    assert not counted.stdout.endswith("\n\n")
