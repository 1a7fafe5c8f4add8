"""The records qmgr writes itself: what stock's ``sent()`` appends to the trace log for
a delivery qmgr makes (the double-bounce discard), the reason ``trace_append()`` records,
and a blocking append that fails cleanly (tests/test_delivery_events_real.py runs them
against real Postfix)."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from pyqmgr.postfix import bounce
from pyqmgr.postfix.attr import AttrParser, encode
from pyqmgr.postfix.deliver_request import (
    DEL_REQ_FLAG_REC_DLY_SENT,
    DEL_REQ_FLAG_RECORD,
)
from pyqmgr.postfix.sent import DSN_NOTIFY_DELAY, DSN_NOTIFY_SUCCESS, trace_appends

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
