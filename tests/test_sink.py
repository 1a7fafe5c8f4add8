"""The sink SMTP server by itself, through smtplib."""

import smtplib
import threading
import time

import pytest


def send(port, rcpts):
    with smtplib.SMTP("127.0.0.1", port, timeout=10) as s:
        return s.sendmail("a@x.example", rcpts, b"Subject: t\r\n\r\nhi\r\n")


def test_accepts_and_records(sink):
    srv = sink()
    send(srv.port, ["u1@sink.example", "u2@sink.example"])
    assert srv.stats.delivered == {"u1@sink.example": 1, "u2@sink.example": 1}


def test_chosen_replies(sink):
    srv = sink(replies={"slow@sink.example": "450 4.2.0 try later",
                        "gone@sink.example": "550 5.1.1 no such user"})
    refused = send(srv.port, ["ok@sink.example", "slow@sink.example", "gone@sink.example"])
    assert refused["slow@sink.example"][0] == 450
    assert refused["gone@sink.example"][0] == 550
    assert srv.stats.delivered == {"ok@sink.example": 1}


def test_latency(sink):
    srv = sink(latency=0.3)
    t = time.monotonic()
    send(srv.port, ["a@sink.example"])
    assert time.monotonic() - t >= 0.3


def test_client_limit_answers_421(sink):
    srv = sink(client_limit=2)
    hold = [smtplib.SMTP("127.0.0.1", srv.port, timeout=10) for _ in range(2)]
    try:
        with pytest.raises(smtplib.SMTPConnectError) as err:
            smtplib.SMTP("127.0.0.1", srv.port, timeout=10)
        assert err.value.smtp_code == 421
        assert srv.stats.rejected_421 == 1
    finally:
        for s in hold:
            s.quit()
    # Capacity comes back once sessions end.
    deadline = time.monotonic() + 5
    while sum(srv.active.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    send(srv.port, ["a@sink.example"])
    assert srv.stats.max_concurrent == 2


def test_refuse_and_reopen(sink):
    srv = sink()
    srv.refuse()
    with pytest.raises(ConnectionRefusedError):
        send(srv.port, ["a@sink.example"])
    srv.start()
    send(srv.port, ["a@sink.example"])
    assert srv.stats.delivered["a@sink.example"] == 1


def test_parallel_sessions_are_counted(sink):
    srv = sink(latency=0.2)
    threads = [threading.Thread(target=send, args=(srv.port, [f"p{i}@sink.example"]))
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert srv.stats.max_concurrent == 4
