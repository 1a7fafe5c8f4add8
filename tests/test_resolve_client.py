"""The trivial-rewrite client against a real unix socket that misbehaves."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import time

import pytest

from pyqmgr.postfix.attr import encode
from pyqmgr.postfix.resolve import ResolveClient, ResolverFailure


class SilentServer:
    """Accepts connections and never says a word (a wedged trivial-rewrite)."""

    def __init__(self, announce: bool = False) -> None:
        self.dir = tempfile.mkdtemp(prefix="pyqmgr-rw-")
        self.path = os.path.join(self.dir, "rewrite")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(8)
        self.announce = announce
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        # Bound the test even if the client has no timeout: hang up after 5 s, so the
        # client sees end-of-file and the elapsed-time check fails instead of hanging.
        self.watchdog = threading.Timer(5.0, self._hang_up)
        self.watchdog.start()

    def _hang_up(self) -> None:
        # shutdown() first: close() alone does not wake the thread blocked in accept(),
        # and the socket would go on accepting connections nobody answers.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for conn in self.conns:
            conn.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.announce:
                conn.sendall(encode([("protocol", "trivial_rewrite_protocol")]))

    def close(self) -> None:
        self.watchdog.cancel()
        self._hang_up()
        os.unlink(self.path)
        os.rmdir(self.dir)


@pytest.mark.parametrize("announce", [False, True], ids=["no-announcement", "no-reply"])
def test_a_silent_trivial_rewrite_times_out_instead_of_hanging(announce):
    server = SilentServer(announce=announce)
    warnings: list[str] = []
    client = ResolveClient(server.path, ipc_timeout=0.3, give_up_after=1.0,
                           warn=warnings.append, sleep=lambda s: None)
    try:
        start = time.monotonic()
        with pytest.raises(ResolverFailure):
            client.resolve("s@example.com", "r@example.com")
        elapsed = time.monotonic() - start
        # Each attempt waits ipc_timeout, then the client gives up after give_up_after.
        assert 0.5 <= elapsed < 3.0, elapsed
        assert any("problem talking to service rewrite" in w for w in warnings), warnings
    finally:
        client.close()
        server.close()


def test_transports_and_next_hops_are_shared_and_the_table_bounded():
    """A batch of 5,000 routes to one domain holds one copy of its transport and next
    hop, not 5,000 (the 50,000-recipient memory load, issue #24)."""
    from pyqmgr.postfix import shared_strings

    a = shared_strings.shared("".join(["smtp:", "mx.example"]))
    b = shared_strings.shared("".join(["smtp:", "mx.example"]))
    assert a == b == "smtp:mx.example" and a is b
    for i in range(shared_strings.LIMIT + 10):
        shared_strings.shared(f"hop{i}.example")
    assert len(shared_strings._TABLE) <= shared_strings.LIMIT
