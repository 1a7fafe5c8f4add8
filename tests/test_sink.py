"""The sink SMTP server by itself, through smtplib: each behaviour the qmgr tests rely on."""

from __future__ import annotations

import smtplib
import socket
import threading
import time

import pytest

from pyqmgr.testbed.sink import SinkServer, lookup

BODY = b"Subject: t\r\n\r\nhi\r\n"


def send(port, rcpts, sender="a@x.example"):
    with smtplib.SMTP("127.0.0.1", port, timeout=10) as s:
        return s.sendmail(sender, rcpts, BODY)


def test_accepts_and_records(sink):
    srv = sink()
    send(srv.port, ["u1@sink.example", "U2@Sink.example"], sender="me@x.example")
    assert srv.stats.delivered == {"u1@sink.example": 1, "u2@sink.example": 1}
    (msg,) = srv.messages()
    assert msg.sender == "me@x.example"
    assert msg.recipients == ("u1@sink.example", "U2@Sink.example")
    assert msg.data.endswith(b"hi\r\n") and msg.peer == "127.0.0.1"
    assert srv.received_senders == ["me@x.example"]
    assert srv.outcomes("u1@sink.example") == ["250 2.1.5 OK", "250 2.0.0 queued"]
    snap = srv.snapshot()
    assert snap.sessions == 1 and snap.messages == 1 and snap.max_concurrent == 1


def test_chosen_replies_at_rcpt(sink):
    srv = sink(replies={"slow@sink.example": "450 4.2.0 try later",
                        "gone@sink.example": "550 5.1.1 no such user",
                        "bounce.example": "550 5.7.1 domain says no",
                        "tmp*@sink.example": "451 4.3.0 pattern"})
    refused = send(srv.port, ["ok@sink.example", "Slow@sink.example", "gone@sink.example",
                              "x@bounce.example", "tmp7@sink.example"])
    assert refused["Slow@sink.example"] == (450, b"4.2.0 try later")
    assert refused["gone@sink.example"][0] == 550
    assert refused["x@bounce.example"][0] == 550
    assert refused["tmp7@sink.example"] == (451, b"4.3.0 pattern")
    assert srv.stats.delivered == {"ok@sink.example": 1}
    assert srv.stats.replies == {"450": 1, "550": 2, "451": 1}
    assert srv.outcomes("gone@sink.example") == ["550 5.1.1 no such user"]


def test_replies_change_at_run_time_and_can_be_callables(sink):
    srv = sink(replies={"r@sink.example": "450 4.2.0 later"})
    assert send(srv.port, ["r@sink.example", "o@sink.example"])  # r refused
    srv.set_replies(lambda rcpt: "550 5.1.1 nope" if rcpt.startswith("o@") else None)
    refused = send(srv.port, ["r@sink.example", "o@sink.example"])
    assert list(refused) == ["o@sink.example"]
    assert srv.outcomes("r@sink.example")[0] == "450 4.2.0 later"
    assert srv.stats.delivered == {"r@sink.example": 1, "o@sink.example": 1}


def test_reply_at_data(sink):
    srv = sink(data_replies={"late@sink.example": "554 5.6.0 content rejected"})
    with pytest.raises(smtplib.SMTPDataError) as err:
        send(srv.port, ["ok@sink.example", "late@sink.example"])
    assert err.value.smtp_code == 554
    assert srv.messages() == [] and not srv.stats.delivered
    assert srv.outcomes("ok@sink.example") == ["250 2.1.5 OK", "554 5.6.0 content rejected"]
    srv.set_data_replies({})
    send(srv.port, ["late@sink.example"])
    assert srv.stats.delivered == {"late@sink.example": 1}


def test_latency_per_recipient_at_rcpt(sink):
    srv = sink(latency={"slow@sink.example": 0.4})
    t = time.monotonic()
    send(srv.port, ["fast@sink.example"])
    assert time.monotonic() - t < 0.3
    t = time.monotonic()
    send(srv.port, ["slow@sink.example", "fast@sink.example"])
    assert time.monotonic() - t >= 0.4


def test_latency_at_data(sink):
    srv = sink(latency=lambda rcpt: 0.3, latency_at="data")
    with smtplib.SMTP("127.0.0.1", srv.port, timeout=10) as s:
        s.ehlo()
        s.mail("a@x.example")
        t = time.monotonic()
        s.rcpt("r@sink.example")
        assert time.monotonic() - t < 0.2, "RCPT is not delayed"
        t = time.monotonic()
        s.data(BODY)
        assert time.monotonic() - t >= 0.3, "DATA is"
    srv.set_latency(0)
    t = time.monotonic()
    send(srv.port, ["r@sink.example"])
    assert time.monotonic() - t < 0.2


def test_client_limit_answers_421_to_parallel_clients(sink):
    srv = sink(client_limit=2, latency=0.5)
    results: list[object] = []

    def client(i):
        try:
            send(srv.port, [f"p{i}@sink.example"])
            results.append("ok")
        except smtplib.SMTPConnectError as exc:
            results.append(exc.smtp_code)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results, key=str) == [421, 421, 421, "ok", "ok"]
    snap = srv.snapshot()
    assert snap.rejected_421 == 3 and snap.sessions == 5
    assert snap.max_concurrent == snap.max_concurrent_per_client == 2
    # Capacity comes back once sessions end, and the limit can be lifted.
    srv.wait(lambda: srv.open_sessions() == 0, 5, "sessions to close")
    srv.set_client_limit(0)
    hold = [smtplib.SMTP("127.0.0.1", srv.port, timeout=10) for _ in range(3)]
    for s in hold:
        s.quit()
    assert srv.snapshot().rejected_421 == 3


def test_refuse_and_reopen_on_the_same_port(sink):
    srv = sink()
    port = srv.port
    srv.refuse()
    assert not srv.listening
    with pytest.raises(ConnectionRefusedError):
        send(port, ["a@sink.example"])
    srv.reopen()
    assert srv.port == port
    send(port, ["a@sink.example"])
    assert srv.stats.delivered["a@sink.example"] == 1


def test_not_started_refuses_and_stop_ends_open_sessions():
    srv = SinkServer()
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        srv.start()
        s = smtplib.SMTP("127.0.0.1", srv.port, timeout=5)
        s.ehlo()
    finally:
        srv.stop()
    # The open session was closed by stop(): the next command finds the socket gone.
    with pytest.raises((smtplib.SMTPServerDisconnected, OSError)):
        s.noop()
    s.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", srv.port), timeout=5)


def test_parallel_sessions_are_counted(sink):
    srv = sink(latency=0.2)
    threads = [threading.Thread(target=send, args=(srv.port, [f"p{i}@sink.example"]))
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert srv.stats.max_concurrent == 4
    srv.wait_delivered(4, 5)
    srv.reset()
    assert srv.delivered_count() == 0 and srv.messages() == []


def test_wait_times_out_with_a_summary(sink):
    srv = sink()
    with pytest.raises(TimeoutError, match=r"1 recipients at the sink .*0 deliveries"):
        srv.wait_delivered(1, 0.1)


def test_lookup_order():
    rule = {"a@d.example": "exact", "d.example": "domain", "*@e.example": "glob"}
    assert lookup(rule, "a@d.example") == "exact"
    assert lookup(rule, "b@d.example") == "domain"
    assert lookup(rule, "b@e.example") == "glob"
    assert lookup(rule, "b@f.example") is None
