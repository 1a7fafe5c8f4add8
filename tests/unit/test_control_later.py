"""A control reply that must ask Redis first (``pyqmgr status --fleet``, issue #35): the
handler gives an awaitable, the server answers when it is done, and meanwhile serves
others; what it raises is an error reply as for any handler; one that takes longer
than the request's time is answered "timeout"; a client that leaves cancels it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from pyqmgr.control.client import request
from pyqmgr.control.protocol import ProtocolError
from pyqmgr.daemon.control import ControlServer, Peer, Result
from tests.unit.test_control_server import Log, anyone, raw

#: What the slow handler's coroutine saw: started, cancelled.
seen: list[str] = []


def later(request_: dict[str, object], peer: Peer) -> Result:
    if not request_.get("fleet"):
        return {"now": True}

    async def ask_redis() -> dict[str, object]:
        seen.append("started")
        try:
            await asyncio.sleep(float(str(request_.get("sleep", 0.3))))
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        return {"servers": ["relay1", "relay2"]}

    async def broken() -> dict[str, object]:
        await asyncio.sleep(0.01)
        raise ProtocolError("--fleet needs a fleet: set shared_state in pyqmgr.cf")

    return broken() if request_.get("broken") else ask_redis()


def serve(tmp_path, body: Callable[[str], object], timeout: float = 5.0,
          handler: Callable[..., Result] = later) -> tuple[object, Log]:
    log = Log()
    path = str(tmp_path / "control")

    async def main() -> object:
        server = ControlServer(handler, anyone(), log, timeout=timeout)
        await server.start(path)
        try:
            return await asyncio.wait_for(asyncio.to_thread(body, path), 30)
        finally:
            server.close()

    return asyncio.run(main()), log


def test_a_later_reply_comes_when_ready_and_others_are_served_meanwhile(tmp_path):
    def body(path: str) -> tuple[dict[str, object], float, float]:
        out: dict[str, object] = {}
        started = time.monotonic()
        slow = threading.Thread(target=lambda: out.update(request(path, "status", {
            "fleet": True})))
        slow.start()
        time.sleep(0.05)
        assert request(path, "status") == {"ok": True, "now": True}
        quick = time.monotonic() - started
        slow.join()
        return out, quick, time.monotonic() - started

    (reply, quick, took), log = serve(tmp_path, body)  # type: ignore[misc]
    assert reply == {"ok": True, "servers": ["relay1", "relay2"]}
    assert quick < 0.25 < took, (quick, took)
    assert log.lines == []


def test_what_a_later_reply_raises_is_an_error_reply(tmp_path):
    # The request's fields are checked by the protocol; "broken" rides in a raw line.
    reply, _ = serve(tmp_path, lambda path: raw(
        path, b'{"command":"status","fleet":true}\n'), handler=lambda r, p: later(
            {**r, "broken": True}, p))
    assert reply == (b'{"ok":false,"error":"--fleet needs a fleet: set shared_state in '
                     b'pyqmgr.cf","code":"bad_request"}\n')


def test_a_later_reply_past_the_requests_time_is_a_timeout(tmp_path):
    seen.clear()
    def body(path: str) -> tuple[dict[str, object], list[str]]:
        reply = request(path, "status", {"fleet": True})
        time.sleep(0.05)
        return reply, list(seen)

    (reply, got), _ = serve(tmp_path, body, timeout=0.2,  # type: ignore[misc]
                            handler=lambda r, p: later({**r, "sleep": 5}, p))
    assert reply == {"ok": False, "error": "no answer within 0.2 s", "code": "timeout"}
    assert got == ["started", "cancelled"]


def test_a_client_that_leaves_cancels_the_later_reply(tmp_path):
    seen.clear()

    def body(path: str) -> list[str]:
        import socket

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            s.sendall(b'{"command":"status","fleet":true}\n')
            time.sleep(0.1)
        time.sleep(0.2)
        return list(seen)  # before the loop's end cancels whatever is left

    got, _ = serve(tmp_path, body, handler=lambda r, p: later({**r, "sleep": 5}, p))
    assert got == ["started", "cancelled"]
