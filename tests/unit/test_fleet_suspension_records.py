"""Records of the fleet's suspensions table as read from Redis (issue #31): the table
is anyone's who can reach Redis, so no record may raise, or the daemon (whose failed
tasks end it) would restart on every server of the fleet, again and again."""

from __future__ import annotations

import json

import pytest

from pyqmgr.daemon.fleet.suspensions import MAX_RECORD, _record

GOOD = {"target": "x.example", "reason": "r", "by": "root", "node": "n1",
        "until": 1_800_000_000.5}


def test_a_good_record_and_a_tombstone_read_back():
    assert _record(json.dumps(GOOD).encode()) == GOOD
    tomb = {**GOOD, "ended": True}
    assert _record(json.dumps(tomb).encode()) == tomb


@pytest.mark.parametrize("raw", [
    b'{"target": "x", "reason": "r", "by": "b", "node": "n", "until": 1' + b"0" * 400 + b"}",
    b"[" * 100_000 + b"]" * 100_000,
    b'{"target": "x", "reason": "r", "by": "b", "node": "n", "until": NaN}',
    b'{"target": "x", "reason": "r", "by": "b", "node": "n", "until": Infinity}',
    b'{"target": "x", "reason": "r", "by": "b", "node": "n", "until": true}',
    b'{"target": 1, "reason": "r", "by": "b", "node": "n", "until": 1}',
    b"\xff\xfe not json",
    json.dumps({**GOOD, "reason": "r" * MAX_RECORD}).encode(),
])
def test_a_bad_record_is_none_never_an_exception(raw):
    assert _record(raw) is None
