"""Clients that scrape a metrics port in a loop, in a process of their own (issue #44).

``python -m benchmarks.scrapers PORT [CLIENTS]`` runs CLIENTS threads (16 by default),
each connecting, sending ``GET /metrics`` and reading the answer to its end, again and
again, as fast as the port lets it, until its standard input closes; then it prints
``answered=N failed=M bytes=B`` and exits at once. A process of its own so that the
benchmark's own threads (the drains' watchers) do not share a GIL with them.

:class:`Hammer` starts and stops one from a benchmark.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

CLIENTS = 16
REQUEST = b"GET /metrics HTTP/1.0\r\nHost: pyqmgr\r\n\r\n"


class Counts:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.answered = self.failed = self.bytes = 0


def client(port: int, stop: threading.Event, counts: Counts) -> None:
    while not stop.is_set():
        got = 0
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(REQUEST)
                while chunk := s.recv(65536):
                    got += len(chunk)
        except OSError:
            with counts.lock:
                counts.failed += 1
            stop.wait(0.05)  # the port is not open yet (the qmgr starting)
            continue
        with counts.lock:
            counts.answered += 1
            counts.bytes += got


def main(argv: list[str]) -> int:
    port = int(argv[0])
    clients = int(argv[1]) if len(argv) > 1 else CLIENTS
    stop = threading.Event()
    counts = Counts()
    threads = [threading.Thread(target=client, args=(port, stop, counts), daemon=True)
               for _ in range(clients)]
    for t in threads:
        t.start()
    sys.stdin.read()  # until the benchmark closes it
    stop.set()
    # No join: clients waiting in connect() on a paced port would hold the benchmark
    # up to 16 / ACCEPT_RATE seconds; the threads are daemons, gone with the process.
    with counts.lock:
        print(f"answered={counts.answered} failed={counts.failed} bytes={counts.bytes}",
              flush=True)
    return 0


class Hammer:
    """``clients`` scrapers of ``port`` in a loop, in a child process, until closed."""

    def __init__(self, port: int, clients: int = CLIENTS) -> None:
        self.port, self.clients = port, clients
        self.proc: subprocess.Popen[str] | None = None
        self.answered = self.failed = self.bytes = 0
        self.elapsed = 0.0
        self.started = 0.0

    def start(self) -> None:
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.scrapers", str(self.port), str(self.clients)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def close(self) -> None:
        proc = self.proc
        if proc is None:
            return
        self.proc = None
        try:
            out, _ = proc.communicate("", timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        self.elapsed = time.monotonic() - self.started
        fields = dict(item.split("=", 1) for item in out.split())
        self.answered = int(fields.get("answered", 0))
        self.failed = int(fields.get("failed", 0))
        self.bytes = int(fields.get("bytes", 0))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
