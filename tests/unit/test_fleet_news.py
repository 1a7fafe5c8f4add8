"""Notices of throttling on the fleet's channel: what one server writes, what another
accepts, and a clear refusal for everything else (malformed, oversized, out of range).

The channel is anyone's who can reach Redis, so a notice changes the scheduler only
once every field is the right type, size and range; the daemon logs the refusal.
"""

from __future__ import annotations

import json

import pytest

from pyqmgr.fleet.shared import MAX_NEWS, news_payload, parse_news
from pyqmgr.scheduler.decisions import DEAD, RULE, Throttling

DEAD_NEWS = Throttling("smtp", "mx.example", "mx.example", DEAD, "4.4.1",
                       "connect to mx.example[192.0.2.1]:25: Connection refused", 300.0)
RULE_NEWS = Throttling("smtp", "gmail.com", "gmail.com", RULE, "4.7.28",
                       "host said: 421 4.7.28 unusual rate", rule="/etc/rules, line 3")


@pytest.mark.parametrize("news", [DEAD_NEWS, RULE_NEWS])
def test_a_notice_reads_back_as_written(news):
    assert parse_news(news_payload(news, "relay1", "0a1b2c3d").encode()) == (
        news, "relay1", "0a1b2c3d")


def good() -> dict[str, object]:
    return json.loads(news_payload(DEAD_NEWS, "relay1", "0a1b2c3d"))


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
])
def test_a_bad_field_is_refused_by_name(change, error):
    record = {**good(), **change}
    with pytest.raises(ValueError, match="^" + error.replace("(", r"\(").replace(
            "[", r"\[").replace(".", r"\.").replace("?", r"\?")):
        parse_news(json.dumps(record).encode())


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


def test_the_largest_notice_a_server_writes_fits():
    news = Throttling("t" * 64, "q" * 1024, "n" * 1024, RULE, "4.7.0", "r" * 2000,
                      rule="f" * 1100)
    payload = news_payload(news, "n" * 255, "i" * 64).encode()
    assert len(payload) <= MAX_NEWS
    assert parse_news(payload)[0] == news
