"""A slow proxymap and a 120-label sender domain do not stall the event loop (#45, 4).

The proxymap is ours (tests/test_proxymap.py's FakeProxymap): a real UNIX socket
speaking Postfix's attribute protocol, answering each lookup after 2 ms, "no such
key". The classifier is the daemon's, built from pyqmgr.cf's settings with a
``proxy:hash:`` class table and tenant table on that socket. While messages from
``x@<120 labels>.example`` are classified, a periodic timer on the same loop (every
millisecond) measures the loop's lag: its largest lateness, less the time the
machine kept the loop's thread from a CPU (tests/loop_lag.py). The daemon's way
(daemon/class_lookups.py, a worker thread with a per-message budget) keeps it under
10 ms; the control, classifying on the loop as the daemon did before, lags by the
whole walk (122 asks, about 250 ms per message).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from pyqmgr.daemon.class_lookups import ClassLookups
from pyqmgr.postfix.attr import encode
from pyqmgr.postfix.proxymap import MAX_PARENT_LABELS, MESSAGE_ASKS
from pyqmgr.pyqmgr_cf import PyqmgrCf
from pyqmgr.settings.classes import Classifier, Envelope, classifier
from tests.loop_lag import LoopLag
from tests.test_proxymap import FakeProxymap

#: Seconds proxymap takes for each lookup (a list: one test slows it further).
DELAY = [0.002]
#: 120 labels; each message's first label its own, so that no answer is cached.
DOMAIN = ".".join(f"l{i}" for i in range(118)) + ".example"
MESSAGES = 5


def _slow(attrs: list[tuple[str, str]]) -> bytes:
    if attrs[0][1] == "open":
        return encode([("status", 0), ("flags", 16)])  # DICT_FLAG_FIXED
    time.sleep(DELAY[0])
    return encode([("status", 1), ("value", "")])  # no such key


@pytest.fixture
def slow(tmp_path):
    server = FakeProxymap(str(tmp_path / "proxymap"), _slow)
    yield server
    server.close()
    DELAY[0] = 0.002


def _classifier(path: str, warned: list[str]) -> Classifier:
    settings = PyqmgrCf("/nonexistent/pyqmgr.cf", True, {
        "message_classes": "transactional bulk",
        "message_class_maps": "proxy:hash:/etc/postfix/classes",
        # The keys count whoever the client is: this test is about their cost.
        "sender_keys_trusted_clients": "0.0.0.0/0"})
    found = classifier(settings, warned.append, proxymap=path)
    assert found is not None
    return found


def _envelope(n: int = 0) -> Envelope:
    return Envelope(f"x+ext@m{n}.{DOMAIN}", "", "192.0.2.1", "client.example", {})


async def _lag_while(work: Callable[[asyncio.Future[None]], None]) -> tuple[float, float]:
    """(the loop's largest lateness less the machine's wait for a CPU, seconds taken)
    while ``work`` runs until it sets the future it is given (tests/loop_lag.py)."""
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()
    began = time.monotonic()
    lag = LoopLag()
    lag.start()
    await asyncio.sleep(0.01)
    work(finished)
    await asyncio.wait_for(finished, 30)
    await lag.stop()
    if lag.raw > lag.own + 0.005:
        print(f"(the loop's timer was late by {lag.raw * 1000:.1f} ms as seen, "
              f"{lag.own * 1000:.1f} ms less the machine's wait for a CPU)")
    return lag.own, time.monotonic() - began


def test_a_long_sender_domain_through_a_slow_proxymap_keeps_the_loop_free(slow) -> None:
    warned: list[str] = []
    classes = _classifier(slow.path, warned)
    results: list[tuple[int, str, int]] = []

    async def run() -> tuple[float, float]:
        lookups = ClassLookups(classes, warned.append, asyncio.get_running_loop())

        def work(finished: asyncio.Future[None]) -> None:
            def done(rank: int, tenant: str, weight: int) -> None:
                results.append((rank, tenant, weight))
                if len(results) == MESSAGES:
                    finished.set_result(None)
            for n in range(MESSAGES):
                lookups.submit(_envelope(n), done)
        try:
            return await _lag_while(work)
        finally:
            lookups.close()

    before = slow.requests
    lag, took = asyncio.run(run())
    asks = slow.requests - before
    print(f"\nworker: {MESSAGES} messages in {took * 1000:.0f} ms, {asks} asks, "
          f"loop lag {lag * 1000:.1f} ms; {warned}")
    assert lag < 0.010, f"the loop lagged {lag * 1000:.1f} ms"
    # Each message: the default class, every key asked that its budget allows (the
    # parent walk past ten labels is never asked).
    assert results == [(1, "", 1)] * MESSAGES
    assert asks <= MESSAGES * MESSAGE_ASKS
    cut = [text for text in warned if "asked proxymap more than" in text]
    assert len(cut) <= 1, warned


def test_a_message_past_its_budget_takes_the_defaults_with_one_warning(slow) -> None:
    """At 30 ms an ask the 0.1 s budget stops each message after four asks; the
    warning is said once for the first and counts the rest in its next line."""
    DELAY[0] = 0.03
    warned: list[str] = []
    classes = _classifier(slow.path, warned)
    results: list[tuple[int, str, int]] = []

    async def run() -> ClassLookups:
        lookups = ClassLookups(classes, warned.append, asyncio.get_running_loop())

        def work(finished: asyncio.Future[None]) -> None:
            def done(*found: object) -> None:
                results.append(found)  # type: ignore[arg-type]
                if len(results) == 3:
                    finished.set_result(None)
            for n in range(3):
                lookups.submit(_envelope(n), done)
        try:
            lag, _ = await _lag_while(work)
            assert lag < 0.010
            await asyncio.sleep(0.01)  # the warnings come through the loop
        finally:
            lookups.close()
        return lookups

    lookups = asyncio.run(run())
    print(f"\n{slow.requests} asks; {warned}")
    assert results == [(1, "", 1)] * 3 and lookups.cut == 3
    assert [t for t in warned if "more than" in t] == [
        "classes: 1 message(s) asked proxymap more than 16 keys or 0.1 s (a sender "
        "domain of many labels, or a slow table): the keys not asked took the defaults"]


def test_the_control_classifying_on_the_loop_lags_by_the_walk(slow) -> None:
    """The measurement can fail: the same message classified on the loop, as the
    daemon did before, with no budget. Even with the parent walk cut at ten labels
    (15 asks) that is some 30 ms; before the cut it was 122 asks."""
    classes = _classifier(slow.path, [])

    async def run() -> tuple[float, float]:
        def work(finished: asyncio.Future[None]) -> None:
            for table in classes.class_tables:
                assert table.proxy is not None
                table.proxy.budget = None
            classes.classify(_envelope())
            finished.set_result(None)
        return await _lag_while(work)

    lag, _ = asyncio.run(run())
    print(f"\non the loop: lag {lag * 1000:.0f} ms")
    assert lag > 0.02, "15 asks at 2 ms each on the loop stall it"


def test_parent_keys_past_the_cut_are_not_asked(slow) -> None:
    asked: list[str] = []

    def record(attrs: list[tuple[str, str]]) -> bytes:
        asked.extend(value for name, value in attrs if name == "key")
        return _slow(attrs)

    slow.reply = record
    classes = _classifier(slow.path, [])
    classes.classify(_envelope())
    parents = [key for key in asked if key.startswith(".")]
    assert parents and max(key.count(".") for key in parents) == MAX_PARENT_LABELS
