"""The control channel's request parser, one case each: the daemon relies on it to refuse
every malformed request with a clear text before anything reaches the scheduler."""

from __future__ import annotations

import json

import pytest

from pyqmgr.control.protocol import (
    CONTROL,
    MAX_REQUEST,
    READ,
    ProtocolError,
    Request,
    RequestParser,
    decode_reply,
    encode_request,
    error_reply,
    ok_reply,
)


def parse(data: bytes) -> Request:
    req = RequestParser().feed(data)
    assert req is not None
    return req


def refused(data: bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        RequestParser().feed(data)
    return info.value


def test_status_request():
    req = parse(b'{"command": "status"}\n')
    assert (req.command, req.kind, req.args) == ("status", READ, {})
    assert req.as_dict() == {"command": "status"}


def test_explain_request_with_its_target():
    req = parse(b'{"command":"explain","target":"example.com"}\n')
    assert req.as_dict() == {"command": "explain", "target": "example.com"}


def test_control_command_is_of_the_control_kind():
    assert parse(b'{"command":"suspend","target":"x","ttl":60}\n').kind == CONTROL


def test_request_in_pieces_waits_for_the_newline():
    p = RequestParser()
    assert p.feed(b'{"command":') is None
    assert p.pending == 11
    assert p.feed(b'"status"}') is None
    req = p.feed(b"\ntrailing bytes are ignored")
    assert req is not None and req.command == "status"
    assert p.feed(b"more") is None, "one request per connection"


def test_not_json():
    err = refused(b"hello\n")
    assert err.code == "bad_request" and "not JSON" in str(err)


def test_not_utf8():
    assert "not UTF-8" in str(refused(b'{"command":"\xff"}\n'))


@pytest.mark.parametrize("line, kind", [(b"[]", "an array"), (b'"status"', "a string"),
                                        (b"3", "a number"), (b"null", "null")])
def test_not_an_object(line, kind):
    assert str(refused(line + b"\n")) == f"request is not a JSON object but {kind}"


def test_no_command():
    assert str(refused(b'{"target":"x"}\n')) == 'request has no "command"'


def test_command_not_a_string():
    assert str(refused(b'{"command":1}\n')) == '"command" must be a string, not a number'


def test_unknown_command():
    text = str(refused(b'{"command":"rm -rf"}\n'))
    assert text == 'unknown command "rm -rf" (known: explain, jobs, resume, retry, status, suspend)'


def test_unknown_argument():
    text = str(refused(b'{"command":"status","verbose":true}\n'))
    assert text == 'command status: unknown argument "verbose"'


def test_missing_argument():
    assert str(refused(b'{"command":"explain"}\n')) == "command explain: missing argument target"


@pytest.mark.parametrize("value, kind", [("1", "a number"), ("true", "a boolean"),
                                         ("null", "null"), ('["a"]', "an array")])
def test_bad_argument_type(value, kind):
    text = str(refused(b'{"command":"explain","target":' + value.encode() + b"}\n"))
    assert text == f"command explain: argument target must be a string, not {kind}"


def test_boolean_is_not_a_number():
    err = refused(b'{"command":"suspend","target":"x","ttl":true}\n')
    assert "ttl must be a number, not a boolean" in str(err)


def test_too_long_without_newline_is_refused_at_the_limit():
    p = RequestParser()
    assert p.feed(b"x" * (MAX_REQUEST - 1)) is None
    with pytest.raises(ProtocolError) as info:
        p.feed(b"x")
    assert info.value.code == "too_long"
    assert str(info.value) == f"request longer than {MAX_REQUEST} bytes"
    assert p.feed(b"\n") is None, "nothing more after the refusal"


def test_too_long_with_newline_in_one_chunk():
    line = json.dumps({"command": "explain", "target": "x" * MAX_REQUEST}).encode() + b"\n"
    assert refused(line).code == "too_long"


def test_exactly_the_limit_is_accepted():
    head = b'{"command":"explain","target":"'
    tail = b'"}\n'
    line = head + b"a" * (MAX_REQUEST - len(head) - len(tail)) + tail
    assert len(line) == MAX_REQUEST
    assert parse(line).command == "explain"


def test_eof_half_way_and_eof_with_nothing():
    p = RequestParser()
    p.feed(b'{"command":"status"}')
    with pytest.raises(ProtocolError, match="not ended by a newline"):
        p.eof()
    with pytest.raises(ProtocolError, match="closed without a request"):
        RequestParser().eof()


def test_eof_after_the_request_is_fine():
    p = RequestParser()
    p.feed(b'{"command":"status"}\n')
    p.eof()


def test_replies_round_trip():
    assert decode_reply(ok_reply({"transports": []})) == {"ok": True, "transports": []}
    assert decode_reply(error_reply("permission denied", "denied")) == {
        "ok": False, "error": "permission denied", "code": "denied"}
    assert ok_reply({"x": "é"}).endswith(b"\n") and ok_reply({"x": "é"}).isascii()


@pytest.mark.parametrize("data", [b"garbage", b"[]", b'{"ok":1}', b'{"ok":false}'])
def test_bad_replies(data):
    with pytest.raises(ProtocolError):
        decode_reply(data)


def test_encode_request_checks_as_the_daemon_does():
    assert encode_request("explain", target="a.example") == (
        b'{"command":"explain","target":"a.example"}\n')
    with pytest.raises(ProtocolError):
        encode_request("explain")
    with pytest.raises(ProtocolError, match="longer than"):
        encode_request("explain", target="x" * MAX_REQUEST)


def test_fleet_is_a_boolean_and_only_a_boolean():
    req = parse(b'{"command": "suspend", "target": "a.example", "ttl": 60, "fleet": true}\n')
    assert req.args["fleet"] is True
    assert parse(b'{"command": "resume", "target": "a.example", "fleet": false}\n'
                 ).args["fleet"] is False
    for value in (b'1', b'"yes"', b'null'):
        exc = refused(b'{"command": "suspend", "target": "a.example", "ttl": 60, "fleet": '
                      + value + b'}\n')
        assert "argument fleet must be a boolean" in str(exc)
    # A number argument still refuses a boolean.
    exc = refused(b'{"command": "suspend", "target": "a.example", "ttl": true}\n')
    assert "argument ttl must be a number" in str(exc)
