"""Notices of throttling on the fleet's channel: what one server writes, what another
accepts, and a clear refusal for everything else (unsigned, signed with another key,
tampered with, stale, replayed, malformed, oversized, out of range).

The channel is anyone's who can reach Redis, so a notice changes the scheduler only
when the fleet's key signed it, it is fresh and new, and every field is the right
type, size and range; the daemon logs the refusal.
"""

from __future__ import annotations

import json

import pytest

from pyqmgr.fleet import shared
from pyqmgr.fleet.shared import (
    MAX_NEWS,
    NOTICE_AGE,
    Notice,
    NoticeSeal,
    news_payload,
    parse_news,
)
from pyqmgr.scheduler.decisions import DEAD, RULE, Throttling

KEY = b"0123456789abcdef0123456789abcdef"
NOW = 1_800_000_000.0
DEAD_NEWS = Throttling("smtp", "mx.example", "mx.example", DEAD, "4.4.1",
                       "connect to mx.example[192.0.2.1]:25: Connection refused", 300.0)
RULE_NEWS = Throttling("smtp", "gmail.com", "gmail.com", RULE, "4.7.28",
                       "host said: 421 4.7.28 unusual rate", rule="/etc/rules, line 3")


@pytest.mark.parametrize("news", [DEAD_NEWS, RULE_NEWS])
def test_a_notice_reads_back_as_written(news):
    body = news_payload(news, "relay1", "0a1b2c3d", NOW, "00ff" * 6)
    assert parse_news(body.encode()) == Notice(news, "relay1", "0a1b2c3d", NOW, "00ff" * 6)


@pytest.mark.parametrize("news", [DEAD_NEWS, RULE_NEWS])
def test_a_sealed_notice_opens_with_the_same_key(news):
    notice = NoticeSeal(KEY, "pyqmgr:").seal(news, "relay1", "0a1b2c3d", NOW)
    got = NoticeSeal(KEY, "pyqmgr:").open(notice.encode(), NOW + 1)
    assert (got.news, got.node, got.instance, got.sent) == (news, "relay1", "0a1b2c3d", NOW)


def good() -> dict[str, object]:
    return json.loads(news_payload(DEAD_NEWS, "relay1", "0a1b2c3d", NOW, "ab" * 12))


def signed(record: dict[str, object] | bytes, key: bytes = KEY, prefix: str = "pyqmgr:"
           ) -> bytes:
    """A notice signed as a member would sign it, whatever it says."""
    body = record if isinstance(record, bytes) else json.dumps(record).encode()
    return NoticeSeal(key, prefix)._mac(body) + b" " + body


@pytest.mark.parametrize(("change", "error"), [
    ({"kind": "maybe"}, "kind: 'maybe' is neither 'dead' nor 'rule'"),
    ({"status": "421"}, "status: '421' is not an enhanced status code"),
    ({"status": 4}, "status: a text of up to 11 characters expected"),
    ({"lasts": 0}, "lasts: 0 is not a number of seconds from more than 0 to 86400"),
    ({"lasts": -1}, "lasts: -1 is not a number"),
    ({"lasts": 1e9}, "lasts: 1000000000.0 is not a number"),
    ({"lasts": True}, "lasts: True is not a number"),
    ({"lasts": "300"}, "lasts: '300' is not a number"),
    ({"node": "two words"}, "node: 'two words' has spaces or unprintable characters"),
    ({"node": ""}, "node: a text of up to 255 characters expected"),
    ({"transport": "x" * 65}, "transport: a text of up to 64 characters expected"),
    ({"queue": "a\nb"}, "queue: unprintable characters"),
    ({"reason": "r" * 2001}, "reason: a text of up to 2000 characters expected"),
    ({"kind": "rule", "rule": "", "lasts": 0}, "rule: a text of up to 1100 characters"),
    ({"instance": None}, "instance: a text of up to 64 characters expected"),
    ({"sent": "now"}, "sent: 'now' is not a number"),
    ({"sent": float("nan")}, "sent: nan is not a number"),
    ({"nonce": "xyz" * 8}, "nonce: 'xyzxyz"),
    ({"nonce": "ab"}, "nonce: 'ab' is not 16 to 64 hex digits"),
])
def test_a_bad_field_is_refused_by_name_even_when_signed(change, error):
    record = {**good(), **change}
    pattern = "^" + error.replace("(", r"\(").replace("[", r"\[").replace(
        ".", r"\.").replace("?", r"\?")
    with pytest.raises(ValueError, match=pattern):
        parse_news(json.dumps(record).encode())
    with pytest.raises(ValueError, match=pattern):
        NoticeSeal(KEY, "pyqmgr:").open(signed(record), NOW)


@pytest.mark.parametrize(("payload", "error"), [
    (b"", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"{\"kind\": ", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b"null", "not a JSON object"),
    (b" " * (MAX_NEWS + 1), f"{MAX_NEWS + 1} bytes, more than {MAX_NEWS}"),
])
def test_what_is_not_a_notice_is_refused(payload, error):
    with pytest.raises(ValueError, match="^" + error):
        parse_news(payload)
    # Signed, an oversized one is refused by its whole size, signature included.
    with pytest.raises(ValueError, match=r"^\d+ bytes, more than" if "bytes" in error
                       else "^" + error):
        NoticeSeal(KEY, "pyqmgr:").open(signed(payload), NOW)


@pytest.mark.parametrize(("payload", "error"), [
    # What an outsider on the channel can write: the notice of issue #31's finding,
    # a queue named with another nexthop, unsigned, signed with a guess, or with a
    # real signature on a changed text.
    (json.dumps(good()).encode(), "not signed"),
    (b"0" * 64 + b" " + json.dumps(good()).encode(), "not signed with this fleet's key"),
    (signed(good(), key=b"another fleet's key, 32 chars ok"), "not signed with this "
                                                                "fleet's key"),
    (signed(good(), prefix="other:"), "not signed with this fleet's key"),
    (signed(good()).replace(b'"mx.example"', b'"[192.0.2.66]:25"', 1),
     "not signed with this fleet's key"),
    (signed(good()).upper(), "not signed with this fleet's key"),
    (b"x" * 200_000, "200000 bytes, more than"),
    (b"\x00" * 64 + b" {}", "not signed with this fleet's key"),
])
def test_a_notice_the_fleet_did_not_sign_is_refused(payload, error):
    with pytest.raises(ValueError, match="^" + error.replace("(", r"\(")):
        NoticeSeal(KEY, "pyqmgr:").open(payload, NOW)


def test_a_stale_or_future_notice_is_refused():
    seal = NoticeSeal(KEY, "pyqmgr:")
    old = seal.seal(DEAD_NEWS, "relay1", "0a1b2c3d", NOW - NOTICE_AGE - 1).encode()
    with pytest.raises(ValueError, match="^sent 31 s ago: stale"):
        seal.open(old, NOW)
    ahead = seal.seal(DEAD_NEWS, "relay1", "0a1b2c3d", NOW + NOTICE_AGE + 5).encode()
    with pytest.raises(ValueError, match="^sent 35 s from now: check the nodes' clocks"):
        seal.open(ahead, NOW)


def test_a_notice_heard_twice_is_a_replay():
    seal = NoticeSeal(KEY, "pyqmgr:")
    notice = seal.seal(DEAD_NEWS, "relay1", "0a1b2c3d", NOW).encode()
    seal.open(notice, NOW)
    for later in (NOW + 1, NOW + NOTICE_AGE):
        with pytest.raises(ValueError, match="^heard before .*: a replay"):
            seal.open(notice, later)
    with pytest.raises(ValueError, match="stale"):
        seal.open(notice, NOW + NOTICE_AGE + 1)
    # Two notices of the same news are two notices.
    seal.open(seal.seal(DEAD_NEWS, "relay1", "0a1b2c3d", NOW + 2).encode(), NOW + 2)


def test_the_nonces_remembered_are_bounded(monkeypatch):
    monkeypatch.setattr(shared, "MAX_NONCES", 50)
    seal = NoticeSeal(KEY, "pyqmgr:")
    for i in range(500):
        seal.open(seal.seal(DEAD_NEWS, "relay1", "0a1b2c3d", NOW).encode(), NOW + i / 1000)
    assert len(seal._seen) <= 51
    # And forgotten once stale, a few at each notice.
    for _ in range(20):
        seal.open(seal.seal(DEAD_NEWS, "relay1", "0a1b2c3d", NOW + 100).encode(), NOW + 100)
    assert len(seal._seen) == 20


def test_no_key_no_seal():
    with pytest.raises(ValueError, match="need its key"):
        NoticeSeal(b"", "pyqmgr:")


def test_the_largest_notice_a_server_writes_fits():
    news = Throttling("t" * 64, "q" * 1024, "n" * 1024, RULE, "4.7.0", "r" * 2000,
                      rule="f" * 1100)
    seal = NoticeSeal(KEY, "pyqmgr:")
    payload = seal.seal(news, "n" * 255, "i" * 64, NOW).encode()
    assert len(payload) <= 65 + MAX_NEWS
    assert seal.open(payload, NOW).news == news
