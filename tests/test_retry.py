"""Deferral, retry time on the file's mtime, and flushing, with pyqmgr as qmgr."""

from __future__ import annotations

import os
import time

import pytest


@pytest.mark.parametrize("qmgr", ["stock", "pyqmgr"])
def test_4xx_defers_with_retry_time_then_flush_delivers(postfix, sink, qmgr):
    srv = sink(replies={"later@sink.example": "450 4.2.0 try again later"})
    pf = postfix(qmgr=qmgr, transports={"sink.example": f"smtp:[127.0.0.1]:{srv.port}"})
    (qid,) = pf.smtp_send([("sender@sink.example", ["now@sink.example",
                                                     "later@sink.example"])])
    pf.maillog.wait_for(lambda ln: ln.queue_id == qid and ln.status == "deferred",
                        timeout=30, what="the deferral")
    deferred_at = time.time()
    path = None
    deadline = time.monotonic() + 20
    while path is None and time.monotonic() < deadline:
        path = pf.queue_path("deferred", qid)
        time.sleep(0.05)
    assert path is not None, "message did not reach deferred/"
    assert os.path.basename(os.path.dirname(path)) == qid[0], "hashed by queue id"
    st = os.stat(path)
    # A young message waits minimal_backoff_time (300 s); atime equals mtime.
    assert abs(st.st_mtime - (deferred_at + 300)) < 3
    assert st.st_atime == st.st_mtime
    assert srv.stats.delivered == {"now@sink.example": 1}
    assert pf.queue_path("defer", qid) is not None, "the agent wrote a defer log"

    srv.set_replies({})
    pf.postqueue("-f")
    pf.maillog.wait_for(lambda ln: ln.queue_id == qid and ln.text.endswith(": removed"),
                        timeout=30, what="removal after flush")
    assert srv.stats.delivered == {"now@sink.example": 1, "later@sink.example": 1}
    assert pf.queue_empty()
    assert pf.queue_path("defer", qid) is None, "defer log removed on reactivation"


@pytest.mark.parametrize("qmgr", ["stock", "pyqmgr"])
def test_postqueue_i_revives_a_dead_destination_for_that_message(postfix, sink, qmgr):
    srv = sink()
    srv.refuse()
    pf = postfix(qmgr=qmgr, transports={"sink.example": f"smtp:[127.0.0.1]:{srv.port}"},
                 main_cf={"initial_destination_concurrency": "1"})
    (first,) = pf.smtp_send([("s@sink.example", ["one@sink.example"])])
    pf.maillog.wait_for(lambda ln: ln.queue_id == first and ln.program == "postfix/smtp"
                        and ln.status == "deferred", timeout=30, what="connection refused")
    (second,) = pf.smtp_send([("s@sink.example", ["two@sink.example"])])
    pf.maillog.wait_for(lambda ln: ln.queue_id == second and ln.status == "deferred"
                        and "delivery temporarily suspended" in ln.text, timeout=30,
                        what="the dead site deferring the next message through retry")
    deadline = time.monotonic() + 20
    while pf.queue_path("deferred", second) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    srv.start()
    pf.postqueue("-i", second)
    pf.maillog.wait_for(lambda ln: ln.queue_id == second and ln.program == "postfix/smtp"
                        and ln.status == "sent", timeout=30, what="delivery after postqueue -i")
    assert srv.stats.delivered == {"two@sink.example": 1}


def _delivery_gaps(srv, n: int, timeout: float = 20) -> list[float]:
    """Seconds between the sink's first ``n`` deliveries, polled every 10 ms."""
    t0 = time.monotonic()
    times: list[float] = []
    while len(times) < n:
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {n} deliveries"
        if sum(srv.stats.delivered.values()) > len(times):
            times.append(time.monotonic())
        time.sleep(0.01)
    return [b - a for a, b in zip(times, times[1:], strict=False)]


@pytest.mark.parametrize("qmgr", ["stock", "pyqmgr"])
def test_destination_rate_delay_spaces_deliveries(postfix, sink, qmgr):
    srv = sink()
    pf = postfix(qmgr=qmgr, transports={"sink.example": f"smtp:[127.0.0.1]:{srv.port}"},
                 main_cf={"smtp_destination_rate_delay": "1s"})
    pf.smtp_send([("s@sink.example", [f"r{i}@sink.example"]) for i in range(3)])
    gaps = _delivery_gaps(srv, 3)
    assert all(0.9 <= g <= 1.6 for g in gaps), gaps


@pytest.mark.parametrize("qmgr", ["stock", "pyqmgr"])
def test_transport_rate_delay_spaces_deliveries_across_destinations(postfix, sink, qmgr):
    srv = sink()
    nexthop = f"smtp:[127.0.0.1]:{srv.port}"
    pf = postfix(qmgr=qmgr, transports={f"d{i}.example": nexthop for i in range(3)},
                 main_cf={"smtp_transport_rate_delay": "1s"})
    pf.smtp_send([("s@sink.example", [f"r@d{i}.example"]) for i in range(3)])
    gaps = _delivery_gaps(srv, 3)
    # One delivery at a time for the whole transport, a second apart, even though
    # each message goes to a different destination.
    assert all(0.9 <= g <= 1.8 for g in gaps), gaps
