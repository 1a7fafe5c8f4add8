"""Delay formatting of qmgr's own status lines (log_adhoc.c / format_tv.c)."""

import pytest

from pyqmgr.postfix.log_adhoc import format_tv, log_adhoc_line


@pytest.mark.parametrize("sec,usec,text", [
    (0, 0, "0"), (0, 30000, "0.03"), (0, 4000, "0"), (0, 5000, "0.01"), (0, 123456, "0.12"),
    (1, 230000, "1.2"), (9, 960000, "10"), (12, 600000, "13"), (200, 0, "200"),
    (0, 999999, "1"),
])
def test_format_tv(sec, usec, text):
    assert format_tv(sec, usec, 2, 2) == text


def test_line_shape_matches_stock():
    line = log_adhoc_line("8B0CC20E25D", "rcpt2@example.com", "", "none", (100, 0),
                          (100, 20000), (100, 30000), "4.4.1", "deferred", "whatever")
    assert line == ("8B0CC20E25D: to=<rcpt2@example.com>, relay=none, delay=0.03, "
                    "delays=0.02/0.01/0/0, dsn=4.4.1, status=deferred (whatever)")


def test_orig_to_only_when_different():
    line = log_adhoc_line("Q", "a@x", "A@X", "none", (1, 0), (1, 0), (1, 0), "2.0.0", "sent",
                          "r")
    assert "orig_to" not in line
    line = log_adhoc_line("Q", "a@x", "b@x", "none", (1, 0), (1, 0), (1, 0), "2.0.0", "sent",
                          "r")
    assert ", orig_to=<b@x>, relay=none" in line
