"""The jobs command through the control channel: the request, the daemon's answer from
a real scheduler, and its refusals (an unknown transport, a negative limit) as replies
with a code a script can branch on, never as an internal error."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pyqmgr.control.client import request
from pyqmgr.control.protocol import READ, ProtocolError, RequestParser, encode_request
from pyqmgr.daemon.control import ControlServer, Peer, jobs_reply
from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.message import Message, Recipient
from tests.unit.params import Params
from tests.unit.test_control_server import Log, anyone


def scheduler() -> Scheduler:
    s = Scheduler(lambda n: Params())
    s.assign(Message("Q1", 0.0), [Route("smtp", "d", "d", Recipient(0, "r@d"))], now=0.0)
    return s


def test_jobs_request_names_a_transport_and_maybe_a_limit():
    req = RequestParser().feed(b'{"command":"jobs","transport":"smtp","limit":5}\n')
    assert req is not None and req.kind == READ
    assert req.as_dict() == {"command": "jobs", "transport": "smtp", "limit": 5}
    with pytest.raises(ProtocolError, match="missing argument transport"):
        encode_request("jobs")
    with pytest.raises(ProtocolError, match="limit must be a number, not a string"):
        encode_request("jobs", transport="smtp", limit="5")


def test_the_daemons_answer_and_its_refusals():
    qmgr = SimpleNamespace(scheduler=scheduler(), classifier=None)
    reply = jobs_reply(qmgr, {"command": "jobs", "transport": "smtp"}, 3.0)  # type: ignore[arg-type]
    assert reply["transport"] == "smtp" and reply["kind"] == "jobs"
    assert reply["current_job"] == "Q1" and reply["jobs"][0]["age"] == 3.0  # type: ignore[index]
    with pytest.raises(ProtocolError) as info:
        jobs_reply(qmgr, {"command": "jobs", "transport": "smpt"}, 3.0)  # type: ignore[arg-type]
    assert info.value.code == "not_found"
    assert str(info.value) == (
        'jobs: no transport "smpt" in core (in core: smtp); a transport appears when '
        "mail for it first reaches the active queue")
    for bad in (-1, 1.5):
        with pytest.raises(ProtocolError) as info:
            jobs_reply(qmgr, {"command": "jobs", "transport": "smtp", "limit": bad}, 0.0)  # type: ignore[arg-type]
        assert info.value.code == "bad_request"
        assert str(info.value) == f"jobs: limit must be a whole number, 0 or more, not {bad}"


def test_a_refusal_reaches_the_client_as_a_reply(tmp_path):
    qmgr = SimpleNamespace(scheduler=scheduler(), classifier=None)

    def handler(req: dict[str, object], peer: Peer) -> dict[str, object]:
        return jobs_reply(qmgr, req, 0.0)  # type: ignore[arg-type]

    path = str(tmp_path / "control")
    log = Log()

    async def main() -> tuple[dict[str, object], dict[str, object]]:
        server = ControlServer(handler, anyone(), log)
        await server.start(path)
        try:
            return await asyncio.wait_for(asyncio.to_thread(lambda: (
                request(path, "jobs", {"transport": "nowhere"}),
                request(path, "jobs", {"transport": "smtp", "limit": 0}))), 30)
        finally:
            server.close()

    missing, empty = asyncio.run(main())
    assert missing["ok"] is False and missing["code"] == "not_found"
    assert "no transport \"nowhere\" in core" in str(missing["error"])
    assert empty["ok"] is True and empty["jobs"] == [] and empty["total"] == 1
    assert log.lines == [], "a request naming nothing is no misbehaviour to log"
