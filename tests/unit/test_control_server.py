"""The daemon's control server with a stand-in handler: every bound it promises (size,
time, clients), the peer's credentials from the kernel, the access rules, and one
warning line per refusal; the scheduler itself is not needed for any of it."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import time
from collections.abc import Callable

import pytest

from pyqmgr.control.client import ClientError, request
from pyqmgr.control.protocol import MAX_REQUEST, ProtocolError, Request
from pyqmgr.daemon.control import Access, ControlServer, Peer
from pyqmgr.postfix.maillog_client import MailLog
from pyqmgr.postfix.user_acl import UserAcl


class Log(MailLog):
    def __init__(self) -> None:
        super().__init__("test/qmgr")
        self.lines: list[str] = []

    def log(self, severity: str, text: str) -> None:
        self.lines.append(f"{severity}: {text}")


def stand_in(request: dict[str, object], peer: Peer) -> dict[str, object]:
    if request["command"] == "explain" and request["target"] == "boom":
        raise RuntimeError("bug")
    if request["command"] == "retry":
        raise NotImplementedError("retry is not yet implemented")
    if request["command"] == "resume":
        raise ProtocolError("bad target 'x': no transport before ':'")
    return {"echo": request, "peer": [peer.pid, peer.uid, peer.gid]}


def anyone() -> Access:
    return Access(UserAcl.parse("authorized_mailq_users", "static:anyone"), 100)


def run(tmp_path, body: Callable[[str, ControlServer], object], *,
        access: Access | None = None, **kw: object) -> tuple[object, Log]:
    """Serve on tmp_path/control in an event loop; run ``body`` in a thread meanwhile."""
    log = Log()
    path = str(tmp_path / "control")

    async def main() -> object:
        server = ControlServer(stand_in, access or anyone(), log, **kw)  # type: ignore[arg-type]
        await server.start(path)
        try:
            return await asyncio.wait_for(asyncio.to_thread(body, path, server), 30)
        finally:
            server.close()

    return asyncio.run(main()), log


def raw(path: str, data: bytes, *, shut: bool = False, timeout: float = 10) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        if data:
            s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_status_through_the_socket_with_the_kernels_credentials(tmp_path):
    reply, log = run(tmp_path, lambda path, _s: request(path, "status"))
    assert reply == {"ok": True, "echo": {"command": "status"},
                     "peer": [os.getpid(), os.getuid(), os.getgid()]}
    assert log.lines == []


def test_socket_mode_and_stale_socket_removed(tmp_path):
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "control"))
    stale.close()

    def body(path: str, _s: ControlServer) -> int:
        return stat.S_IMODE(os.stat(path).st_mode)

    mode, _log = run(tmp_path, body)
    assert mode == 0o666
    assert not (tmp_path / "control").exists(), "close() removes the socket"


def test_malformed_request_is_refused_and_logged(tmp_path):
    out, log = run(tmp_path, lambda path, _s: raw(path, b"hello\n"))
    assert out.startswith(b'{"ok":false,"error":"request is not JSON')
    assert out.endswith(b'"code":"bad_request"}\n')
    assert len(log.lines) == 1
    assert log.lines[0].startswith(f"warning: control request from uid={os.getuid()} "
                                   f"pid={os.getpid()}: malformed request: request is not JSON")


def test_oversized_request_is_cut_off_at_the_limit(tmp_path):
    def body(path: str, _s: ControlServer) -> bytes:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(path)
            try:
                s.sendall(b"x" * (4 * MAX_REQUEST))
            except (BrokenPipeError, ConnectionResetError):
                pass  # the daemon closed after the limit: the reply is already there
            return s.recv(65536)

    out, log = run(tmp_path, body)
    assert out == (b'{"ok":false,"error":"request longer than 65536 bytes",'
                   b'"code":"too_long"}\n')
    assert "malformed request: request longer than 65536 bytes" in log.lines[0]


def test_half_sent_request_times_out(tmp_path):
    def body(path: str, _s: ControlServer) -> tuple[bytes, float]:
        t0 = time.monotonic()
        out = raw(path, b'{"command": "sta')
        return out, time.monotonic() - t0

    (out, took), log = run(tmp_path, body, timeout=0.5)
    assert out == (b'{"ok":false,"error":"request not finished within 0.5 s",'
                   b'"code":"timeout"}\n')
    assert 0.4 < took < 3
    assert log.lines == [f"warning: control request from uid={os.getuid()} "
                         f"pid={os.getpid()}: request not finished within 0.5 s"]


def test_silent_client_times_out(tmp_path):
    (out), log = run(tmp_path, lambda path, _s: raw(path, b""), timeout=0.3)
    assert b"no request within 0.3 s" in out and b'"code":"timeout"' in out


def test_client_that_closes_half_way(tmp_path):
    out, log = run(tmp_path, lambda path, _s: raw(path, b'{"command":"status"}', shut=True))
    assert b"request not ended by a newline" in out


def test_too_many_clients_are_refused_and_the_others_still_served(tmp_path):
    def body(path: str, server: ControlServer) -> tuple[bytes, dict[str, object]]:
        held = []
        try:
            for _ in range(2):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(path)
                held.append(s)
            deadline = time.monotonic() + 5
            while server.clients < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            busy = raw(path, b'{"command":"status"}\n')
        finally:
            for s in held:
                s.close()
        deadline = time.monotonic() + 5
        while server.clients and time.monotonic() < deadline:
            time.sleep(0.01)
        return busy, request(path, "status")

    (busy, after), log = run(tmp_path, body, max_clients=2, timeout=5)
    assert busy == (b'{"ok":false,"error":"too many clients (2); try again later",'
                    b'"code":"busy"}\n')
    assert after["ok"] is True, "closed clients free their places"
    assert any("too many clients (2)" in line for line in log.lines)


def test_handler_errors_become_replies_not_crashes(tmp_path):
    def body(path: str, _s: ControlServer) -> tuple[dict[str, object], ...]:
        return (request(path, "explain", {"target": "boom"}),
                request(path, "retry", {"target": "x"}),
                request(path, "resume", {"target": "x"}),
                request(path, "explain", {"target": "fine"}))

    (boom, retry, resume, fine), log = run(tmp_path, body)
    assert boom == {"ok": False, "error": "internal error: RuntimeError", "code": "internal"}
    assert retry == {"ok": False, "error": "retry is not yet implemented",
                     "code": "not_implemented"}
    assert resume == {"ok": False, "error": "bad target 'x': no transport before ':'",
                      "code": "bad_request"}
    assert any("resume: bad target 'x'" in line for line in log.lines), "logged too"
    assert fine["ok"] is True
    assert any("explain: internal error: RuntimeError: bug" in line for line in log.lines)


# -- the access rules, by peer ------------------------------------------------------


READ_REQ = Request("status", "read", {})
CONTROL_REQ = Request("suspend", "control", {"target": "x"})


def test_reading_follows_the_acl_root_and_mail_owner_always():
    access = Access(UserAcl.parse("authorized_mailq_users", "alice"), 100,
                    names={1000: "alice", 1001: "bob"})
    assert access.refusal(READ_REQ, Peer(1, 1000, 1000)) is None
    assert access.refusal(READ_REQ, Peer(1, 0, 0)) is None
    assert access.refusal(READ_REQ, Peer(1, 100, 100)) is None
    assert access.refusal(READ_REQ, Peer(1, 1001, 1001)) == (
        "permission denied: user bob(1001) is not allowed to read the scheduler's state "
        "(authorized_mailq_users)")


def test_controls_only_for_root_and_mail_owner_whatever_the_acl():
    access = anyone()
    assert access.refusal(CONTROL_REQ, Peer(1, 0, 0)) is None
    assert access.refusal(CONTROL_REQ, Peer(1, 100, 100)) is None
    assert access.refusal(CONTROL_REQ, Peer(1, 1000, 1000)) == (
        "permission denied: suspend is a control command, for root and mail_owner only")


def test_unsupported_acl_leaves_only_root_and_mail_owner():
    access = Access(None, 100, acl_error="authorized_mailq_users = hash:/x: not supported")
    assert access.refusal(READ_REQ, Peer(1, 0, 0)) is None
    text = access.refusal(READ_REQ, Peer(1, 1000, 1000))
    assert text is not None and "hash:/x: not supported" in text


def test_client_errors_name_the_cause(tmp_path):
    with pytest.raises(ClientError) as info:
        request(str(tmp_path / "nothing"), "status")
    assert info.value.kind == "unavailable" and "not running" in str(info.value)
    # A listener that never answers: the client's own bound.
    path = str(tmp_path / "mute")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mute:
        mute.bind(path)
        mute.listen(1)
        t0 = time.monotonic()
        with pytest.raises(ClientError) as info:
            request(path, "status", timeout=0.3)
        assert info.value.kind == "timeout" and time.monotonic() - t0 < 3


def test_close_leaves_a_successors_socket_alone(tmp_path):
    """After a reload the next qmgr may bind the path before this one has closed."""
    def body(path: str, _s: ControlServer) -> None:
        os.unlink(path)
        successor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        successor.bind(path)
        successor.close()

    run(tmp_path, body)
    assert (tmp_path / "control").exists()
