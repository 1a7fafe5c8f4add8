"""Delivery events to a Redis stream (``delivery_events_stream``), against a real Redis.

The stream's thread alone first (a real redis-server, the fleet's own client factory):
every event once with its key, the stream kept near its bound, a Redis that stalls
(SIGSTOP) or refuses (an ACL without XADD) delays no caller and is caught up with,
and past the memory bound the oldest are dropped and counted. Then on real Postfix:
the events file and the stream hold the same keys, with Redis stopped while the mail
was delivered, and ``pyqmgr status`` counts what was streamed.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable

import pytest

from pyqmgr.events.stream import EventStream, event_key
from pyqmgr.fleet.client import make_redis
from pyqmgr.fleet.settings import parse_shared_state
from pyqmgr.testbed import redis as testbed_redis
from pyqmgr.testbed.instance_base import free_port
from pyqmgr.testbed.redis import RedisServer
from tests.test_control import cli
from tests.test_delivery_events_real import events_instance, read_events, status_lines
from tests.test_metrics_real import scrape

pytestmark = pytest.mark.skipif(not testbed_redis.available(), reason="no redis-server")

KEY = "pyqmgr:events"
TIMEOUT = 0.3


def lines(n: int, start: int = 0) -> list[bytes]:
    return [f'{{"v":1,"key":"4F1A2B.5f3e.{i}.1","status":"sent"}}\n'.encode()
            for i in range(start, start + n)]


def make_stream(redis: RedisServer, user: str | None = None, password: str | None = None,
                **kw: int) -> tuple[EventStream, list[str]]:
    endpoint = parse_shared_state(redis.url)
    if user is not None:
        endpoint = dataclasses.replace(endpoint, user=user, password=password)
    warnings: list[str] = []
    stream = EventStream(lambda: make_redis(endpoint, TIMEOUT, max_connections=1), KEY,
                         kw.pop("max_length", 1_000_000), TIMEOUT, warnings.append,
                         retry_delay=0.2, **kw)
    stream.start()
    return stream, warnings


def wait(cond: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def entries(redis: RedisServer) -> list[dict[bytes, bytes]]:
    """The stream's entries' fields, read raw (the test bed's client parses nothing)."""
    found = []
    for _, flat in redis.client().execute_command("XRANGE", KEY, "-", "+"):
        found.append(dict(zip(flat[::2], flat[1::2], strict=True)))
    return found


def stream_keys(redis: RedisServer) -> list[bytes]:
    return [fields[b"key"] for fields in entries(redis)]


def test_each_event_goes_to_the_stream_with_its_key(redis_server):
    redis = redis_server()
    stream, warnings = make_stream(redis)
    try:
        sent = lines(1200)
        for k in range(0, 1200, 400):
            stream.put(sent[k:k + 400])
        wait(lambda: stream.stats.sent == 1200, 20, "1,200 events streamed")
        found = entries(redis)
        assert [f[b"key"] for f in found] == [event_key(x) for x in sent]
        assert [f[b"event"] for f in found] == [x.rstrip(b"\n") for x in sent]
        assert json.loads(found[0][b"event"])["key"] == "4F1A2B.5f3e.0.1"
        assert stream.stats.pending == 0 and stream.stats.failures == 0 and not warnings
    finally:
        stream.stop()


def test_the_stream_is_kept_near_its_bound(redis_server):
    redis = redis_server()
    stream, _ = make_stream(redis, max_length=1000)
    try:
        stream.put(lines(5000))
        wait(lambda: stream.stats.sent == 5000, 20, "5,000 events streamed")
        length = redis.client().xlen(KEY)
        # MAXLEN ~ trims whole nodes of the stream's radix tree (100 entries each).
        assert 1000 <= length <= 1100, length
    finally:
        stream.stop()


def test_a_stalled_redis_delays_no_caller_and_is_caught_up_with(redis_server):
    redis = redis_server()
    stream, warnings = make_stream(redis)
    try:
        stream.put(lines(10))
        wait(lambda: stream.stats.sent == 10, 10, "the first events streamed")
        redis.freeze()
        try:
            slowest = 0.0
            for k in range(10, 310, 30):
                t = time.monotonic()
                stream.put(lines(30, k))
                slowest = max(slowest, time.monotonic() - t)
            wait(lambda: stream.stats.failures >= 2, 10, "the stalled calls given up")
            assert slowest < 0.05, f"put() waited {slowest:.3f} s on a stalled Redis"
            assert stream.stats.sent == 10
        finally:
            redis.thaw()
        wait(lambda: stream.stats.sent == 310 and stream.stats.pending == 0, 20,
             "the stream caught up")
        # Calls given up may still have been carried out by the thawed server: the same
        # keys again, which a consumer keeps once.
        keys = stream_keys(redis)
        assert set(keys) == {event_key(x) for x in lines(310)}
        assert len(warnings) == 1 and f"no answer within {TIMEOUT:g}s" in warnings[0], warnings
        assert "delivery_events_stream pyqmgr:events" in warnings[0]
        assert stream.stats.dropped == 0
    finally:
        stream.stop()


def test_past_the_memory_bound_the_oldest_are_dropped_and_counted(redis_server):
    redis = redis_server()
    stream, _ = make_stream(redis, max_pending=100)
    try:
        redis.freeze()
        try:
            for k in range(0, 250, 50):
                stream.put(lines(50, k))
            assert stream.stats.dropped == 150 and stream.stats.pending == 100
        finally:
            redis.thaw()
        wait(lambda: stream.stats.pending == 0, 20, "the pending events streamed")
        keys = set(stream_keys(redis))
        assert {event_key(x) for x in lines(100, 150)} <= keys, "the newest 100 are kept"
        status = stream.stats.as_json()
        assert status["dropped"] == 150 and status["pending"] == 0
    finally:
        stream.stop()


def test_an_acl_without_xadd_is_said_and_counted(redis_server):
    redis = redis_server()
    redis.command("ACL", "SETUSER", "ev", "on", ">secret-for-events", "~*", "+@all", "-xadd")
    stream, warnings = make_stream(redis, user="ev", password="secret-for-events")
    try:
        stream.put(lines(5))
        wait(lambda: stream.stats.failures >= 1, 10, "the refusal")
        assert "NOPERM" in stream.stats.last_error, stream.stats.last_error
        assert warnings and "NOPERM" in warnings[0] and "events file has them" in warnings[0]
        redis.command("ACL", "SETUSER", "ev", "+xadd")
        wait(lambda: stream.stats.sent == 5, 10, "the events streamed once allowed")
        assert stream_keys(redis) == [event_key(x) for x in lines(5)]
    finally:
        stream.stop()


def stream_status(pf) -> dict[str, object]:
    return json.loads(cli(pf, "status", "--json").stdout)["delivery_events"]["stream"]


def test_on_real_postfix_the_stream_holds_the_files_keys(postfix_instance, sink, redis_server):
    """Redis stopped while half the mail is delivered: the mail goes on at once, the
    file has every event, and the stream catches up once Redis answers again."""
    redis = redis_server()
    port = free_port()
    pf, path = events_instance(postfix_instance, sink, extra={
        "shared_state": redis.url, "delivery_events_stream": "events",
        "metrics_listen": f"127.0.0.1:{port}"})
    first = [("s@sink.example", [f"ok{i}@sink.example"]) for i in range(20)]
    pf.smtp_send(first)
    pf.wait_until(lambda: len(read_events(path)) >= 20, 60, "the first 20 events")
    pf.wait_until(lambda: redis.client().xlen("pyqmgr:events") >= 20, 30,
                  "the first 20 events streamed")
    redis.freeze()
    try:
        t = time.monotonic()
        rest = [("s@sink.example", [f"ok{i}@sink.example", f"hard{i}@sink.example"])
                for i in range(20, 60)]
        pf.smtp_send(rest)
        pf.wait_until(lambda: len(status_lines(pf)) >= 20 + 80 and pf.queue_empty(), 60,
                      "40 more messages delivered with Redis stopped")
        took = time.monotonic() - t
        pf.wait_until(lambda: len({e["key"] for e in read_events(path)})
                      >= len(status_lines(pf)), 30, "their events in the file")
        # The stall outlasts the stream's calls (shared_state_timeout, 500 ms): given
        # up and tried again, while the file and the mail went on.
        pf.wait_until(lambda: stream_status(pf)["failures"] >= 2, 30,
                      "the stream's calls given up on the stopped Redis")
        assert stream_status(pf)["sent"] <= 20 + 20, "nothing more streamed while stopped"
    finally:
        redis.thaw()
    file_keys = {e["key"].encode() for e in read_events(path)}
    pf.wait_until(lambda: set(stream_keys(redis)) >= file_keys, 30,
                  "the stream caught up with the file")
    status = json.loads(cli(pf, "status", "--json").stdout)["delivery_events"]
    assert status["writing"]["written"] >= len(file_keys), status
    assert status["stream"]["sent"] >= len(file_keys), status
    assert status["stream"]["pending"] == 0 and status["stream"]["failures"] >= 1, status
    metrics = {ln.split()[0]: float(ln.split()[1]) for ln in scrape(port).splitlines()
               if ln.startswith("pyqmgr_delivery_events_")}
    assert metrics["pyqmgr_delivery_events_streamed_total"] == status["stream"]["sent"]
    assert metrics["pyqmgr_delivery_events_written_total"] == status["writing"]["written"]
    assert metrics["pyqmgr_delivery_events_stream_failures_total"] >= 1, metrics
    assert metrics["pyqmgr_delivery_events_stream_waiting"] == 0, metrics
    text = cli(pf, "status").stdout
    assert "delivery events:" in text and "stream pyqmgr:events" in text, text
    print(f"{len(file_keys)} events, 40 messages delivered in {took:.1f} s with Redis "
          f"stopped; stream {status['stream']}")
