"""The records qmgr writes itself: what stock's ``sent()`` appends to the trace log for
a delivery qmgr makes (the double-bounce discard), the reason ``trace_append()`` records,
and a blocking append that fails cleanly (tests/test_delivery_events_real.py runs them
against real Postfix)."""

from __future__ import annotations

import os
import socket
import threading
from types import SimpleNamespace

import pytest

from pyqmgr.postfix import bounce
from pyqmgr.postfix.attr import AttrParser, encode
from pyqmgr.postfix.deliver_request import (
    DEL_REQ_FLAG_REC_DLY_SENT,
    DEL_REQ_FLAG_RECORD,
)
from pyqmgr.postfix.sent import DSN_NOTIFY_DELAY, DSN_NOTIFY_SUCCESS, trace_appends
from tests.unit.test_delivery_events import _events, _lines, _message, _wait, queue_dir, record

__all__ = ["queue_dir"]  # the fixture, imported for the tests below

FAILURE = 1 << 2  # DSN_NOTIFY_FAILURE


@pytest.mark.parametrize(("flags", "notify", "want"), [
    (0, 0, 0),
    (DEL_REQ_FLAG_RECORD, 0, 1),
    (DEL_REQ_FLAG_RECORD, FAILURE, 1),
    # REC_DLY_SENT: a recipient that asked for no DSN, or for DELAY.
    (DEL_REQ_FLAG_REC_DLY_SENT, 0, 1),
    (DEL_REQ_FLAG_REC_DLY_SENT, DSN_NOTIFY_DELAY, 1),
    (DEL_REQ_FLAG_REC_DLY_SENT, FAILURE, 0),
    # NOTIFY=SUCCESS: once more, whatever the flags.
    (0, DSN_NOTIFY_SUCCESS, 1),
    (DEL_REQ_FLAG_RECORD, DSN_NOTIFY_SUCCESS | FAILURE, 2),
    (DEL_REQ_FLAG_RECORD | DEL_REQ_FLAG_REC_DLY_SENT, DSN_NOTIFY_SUCCESS, 2),
])
def test_trace_appends_is_sents_rule(flags, notify, want):
    assert trace_appends(flags, notify) == want


def test_trace_reason_prefixes_a_relay_but_not_none():
    assert bounce.trace_reason("none", "discarded") == "discarded"
    assert bounce.trace_reason("mx[192.0.2.1]:25", "250 ok") == (
        "delivery via mx[192.0.2.1]:25: 250 ok")


def test_append_now_without_a_service_is_minus_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert bounce.append_now("trace", DEL_REQ_FLAG_RECORD, "ABC123", "", "a@b", 1, "", 0,
                             "2.0.0", "delivered", "x", timeout=1.0) == -1


def test_append_now_sends_the_record_and_returns_the_status(tmp_path, monkeypatch):
    """A stand-in trace service on private/trace: it announces the protocol, gets the
    append's attributes in order and answers status 0."""
    monkeypatch.chdir(tmp_path)
    os.mkdir("private")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind("private/trace")
    server.listen(1)
    got: list[list[tuple[str, str]]] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(encode([("protocol", bounce.PROTOCOL)]))
            parser = AttrParser()
            while (attrs := parser.pop()) is None:
                parser.feed(conn.recv(4096))
            got.append(attrs)
            conn.sendall(encode([("status", 0)]))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        status = bounce.append_now(
            "trace", DEL_REQ_FLAG_RECORD, "ABC123", "o@b", "a@b", 42, "", 0, "2.0.0",
            "delivered", bounce.trace_reason(bounce.NO_RELAY, "discarded"), timeout=5.0)
        thread.join(5)
    finally:
        server.close()
    assert status == 0
    fields = dict(got[0])
    assert [name for name, _ in got[0]][:3] == ["nrequest", "flags", "queue_id"]
    assert (fields["flags"], fields["recipient"], fields["offset"], fields["reason"]) == (
        str(DEL_REQ_FLAG_RECORD), "a@b", "42", "discarded")


# -- whose record: a read meets the records of the message's other requests ----------------


def _out(am: SimpleNamespace, transport: str, nexthop: str, *offsets: int) -> SimpleNamespace:
    """A request out with an agent: its queue and its recipients' offsets."""
    queue = SimpleNamespace(transport=SimpleNamespace(name=transport), nexthop=nexthop,
                            site=None)
    return SimpleNamespace(message=SimpleNamespace(owner=am), queue=queue, busy=True,
                           recipients=[SimpleNamespace(offset=o) for o in offsets])


def test_a_record_of_another_request_out_carries_that_requests_transport(queue_dir):
    """Two requests of one message out at once: the second agent's record is written
    before the first one's reply is read. Each event carries its own request's
    transport and next hop; a record of qmgr's own (no request) carries none, and a
    request put back in its queue (no longer busy) is forgotten."""
    events, writer = _events(queue_dir)
    writer.start()
    am = _message("ABC123")
    gmail = _out(am, "out1", "gmail.com", 100)
    yahoo = _out(am, "out2", "yahoo.com", 200, 300)
    back = _out(am, "out3", "aol.com", 400)
    for entry in (gmail, yahoo, back):
        events.flags(entry)
    back.busy = False  # its request never left: the entry went back to its queue
    log = queue_dir / "trace" / "ABC123"
    log.write_bytes(record("a@gmail.com", 100) + record("b@yahoo.com", 200))
    events.after_reply(am, gmail)
    with open(log, "ab") as f:
        f.write(record("c@yahoo.com", 300) + record("d@aol.com", 400, "4.3.0", "delayed"))
    events.after_reply(am, None)  # qmgr's own record of d@aol.com, with yahoo's still out
    events.after_reply(am, yahoo)  # nothing left to read
    events.message_left(am)
    _wait(lambda: len(_lines(queue_dir)) == 4, "four events")
    writer.stop()
    got = [(e["recipient"], e["transport"], e["nexthop"]) for e in _lines(queue_dir)]
    assert got == [("a@gmail.com", "out1", "gmail.com"), ("b@yahoo.com", "out2", "yahoo.com"),
                   ("c@yahoo.com", "out2", "yahoo.com"), ("d@aol.com", "", "")]
    assert events.logs.get("ABC123") is None or events.logs["ABC123"].out is None
