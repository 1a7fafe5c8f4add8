"""Redis's wire protocol, no I/O: every reply type, split input, malformed and oversized
replies (pyqmgr/fleet/resp.py). The same codec against the real server is in
tests/test_fleet_redis.py."""

from __future__ import annotations

import pytest

from pyqmgr.fleet import resp
from pyqmgr.fleet.resp import Parser, ProtocolError, RedisError, encode


def parse(data: bytes) -> list[resp.Reply]:
    p = Parser()
    p.feed(data)
    return p.replies()


def test_a_command_is_an_array_of_bulk_strings():
    assert encode("SET", "k", 5) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n5\r\n"
    assert encode("GET", b"\x00\r\n") == b"*2\r\n$3\r\nGET\r\n$3\r\n\x00\r\n\r\n"
    assert encode("INCRBYFLOAT", "k", 0.5) == (
        b"*3\r\n$11\r\nINCRBYFLOAT\r\n$1\r\nk\r\n$3\r\n0.5\r\n")
    with pytest.raises(ValueError):
        encode()
    with pytest.raises(TypeError):
        encode("SET", "k", True)


def test_every_reply_type():
    data = (b"+OK\r\n-NOSCRIPT No matching script\r\n:42\r\n:-3\r\n$5\r\nhello\r\n"
            b"$-1\r\n$0\r\n\r\n*2\r\n:1\r\n*1\r\n$1\r\nx\r\n*-1\r\n*0\r\n")
    assert parse(data) == ["OK", RedisError("NOSCRIPT No matching script"), 42, -3,
                           b"hello", None, b"", [1, [b"x"]], None, []]
    assert RedisError("NOSCRIPT No matching script").kind == "NOSCRIPT"


def test_a_bulk_string_may_hold_crlf_and_nul():
    assert parse(b"$4\r\n\r\n\x00x\r\n") == [b"\r\n\x00x"]


@pytest.mark.parametrize("cut", range(1, 40))
def test_a_reply_split_anywhere_comes_out_once_whole(cut):
    data = b"*3\r\n:1\r\n$6\r\nfoobar\r\n+OK\r\n:7\r\n"
    p = Parser()
    p.feed(data[:cut])
    first = p.replies()
    p.feed(data[cut:])
    got = first + p.replies()
    assert got == [[1, b"foobar", "OK"], 7]
    assert p.buffered == 0


def test_one_byte_at_a_time():
    data = b"*2\r\n$3\r\nabc\r\n-ERR x\r\n"
    p = Parser()
    out = []
    for i in range(len(data)):
        p.feed(data[i:i + 1])
        out += p.replies()
    assert out == [[b"abc", RedisError("ERR x")]]


@pytest.mark.parametrize("data, says", [
    (b"!3\r\nabc\r\n", "unknown reply type"),
    (b":12a\r\n", "bad integer"),
    (b":\r\n", "bad integer"),
    (b"$abc\r\n", "bad bulk string length"),
    (b"$-2\r\n", "bad bulk string length"),
    (b"$3\r\nabcd\r\n", "not ended by CRLF"),
    (b"*x\r\n", "bad array length"),
    (b"*-5\r\n", "bad array length"),
])
def test_malformed_replies_are_protocol_errors(data, says):
    with pytest.raises(ProtocolError, match=says):
        parse(data)


def test_oversized_replies_are_refused_before_they_are_buffered():
    with pytest.raises(ProtocolError, match="over the limit"):
        parse(b"$%d\r\n" % (resp.MAX_BULK + 1))
    with pytest.raises(ProtocolError, match="over the limit"):
        parse(b"*%d\r\n" % (resp.MAX_ARRAY + 1))
    # A line that never ends: refused once it is longer than any line may be.
    p = Parser()
    p.feed(b"+" + b"x" * resp.MAX_LINE)
    assert p.replies() == []
    p.feed(b"xx")
    with pytest.raises(ProtocolError, match="longer than"):
        p.replies()
    deep = b"*1\r\n" * (resp.MAX_DEPTH + 1) + b":1\r\n"
    with pytest.raises(ProtocolError, match="nested deeper"):
        parse(deep)
    assert parse(b"*1\r\n" * resp.MAX_DEPTH + b":1\r\n") != []
