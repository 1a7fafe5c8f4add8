"""encode_request's preformatted path against the general attribute encoder."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from pyqmgr.postfix.attr import encode
from pyqmgr.postfix.deliver_request import RequestMessage, encode_request, msg_stats


@dataclass
class Rcpt:
    orig_addr: str
    address: str
    offset: int
    dsn_orcpt: str
    dsn_notify: int


def reference(flags, msg, nexthop, sendopts, sender, recipients,
              attribute="smtputf8") -> bytes:
    """client_protocols.md section 3, attribute by attribute; the option bits' name is
    the release's (``smtputf8`` up to 3.9, ``sendopts`` from 3.10)."""
    out = encode([
        ("flags", flags), ("queue_name", "active"), ("queue_id", msg.queue_id),
        ("offset", msg.data_offset), ("size", msg.cont_length), ("nexthop", nexthop),
        ("encoding", msg.encoding), (attribute, sendopts), ("sender", sender),
        ("envelope_id", msg.envelope_id), ("ret_flags", msg.ret_flags),
        ("time", msg.stats), ("log_client_name", msg.client_name),
        ("log_client_address", msg.client_address),
        ("log_client_port", msg.client_port), ("log_protocol_name", msg.protocol_name),
        ("log_helo_name", msg.helo_name), ("sasl_method", msg.sasl_method),
        ("sasl_username", msg.sasl_username), ("sasl_sender", msg.sasl_sender),
        ("log_ident", msg.log_ident), ("rewrite_context", msg.rewrite_context),
        ("recipient_count", len(recipients)),
    ])
    for r in recipients:
        out += encode([("original_recipient", r.orig_addr), ("recipient", r.address),
                       ("offset", r.offset), ("dsn_orig_rcpt", r.dsn_orcpt),
                       ("notify_flags", r.dsn_notify)])
    return out


TEXTS = ["", "a@b.example", "ü@bücher.example", "x\udcff@raw.example", "%d %b", "{", "}"]


def test_same_bytes_as_the_general_encoder():
    rnd = random.Random(7)
    for _ in range(300):
        msg = RequestMessage(
            queue_id="4B5C61A2B3", data_offset=rnd.randrange(1 << 20),
            cont_length=rnd.randrange(1 << 20), encoding=rnd.choice(["", "8BIT", "7BIT"]),
            sendopts=rnd.randrange(64), sender=rnd.choice(TEXTS),
            envelope_id=rnd.choice(TEXTS), ret_flags=rnd.choice([0, 1, 2, -1]),
            stats=msg_stats((rnd.randrange(1 << 31), 5), (rnd.randrange(1 << 31), 9)),
            client_name=rnd.choice(TEXTS), helo_name=rnd.choice(TEXTS),
            log_ident=rnd.choice(TEXTS), rewrite_context=rnd.choice(["local", "remote"]),
        )
        rcpts = [Rcpt(rnd.choice(TEXTS), rnd.choice(TEXTS), rnd.randrange(1 << 40),
                      rnd.choice(TEXTS), rnd.randrange(32)) for _ in range(rnd.randrange(4))]
        args = (rnd.randrange(1 << 14), msg, rnd.choice(TEXTS), rnd.randrange(64),
                rnd.choice(TEXTS), rcpts, rnd.choice(["smtputf8", "sendopts"]))
        assert encode_request(*args) == reference(*args)


def test_odd_values_take_the_general_path():
    msg = RequestMessage("Q1", 100, 200, "", 0, "s@x", "", 0, b"\x01" * 88)
    neg_flags = RequestMessage("Q1", 100, 200, "", 0, "s@x", "", -1, b"\x01" * 88)
    assert encode_request(1, neg_flags, "x", 0, "s@x", []) == \
        reference(1, neg_flags, "x", 0, "s@x", [])
    neg = [Rcpt("a@x", "a@x", -1, "", 0)]
    assert encode_request(1, msg, "x", 0, "s@x", neg) == reference(1, msg, "x", 0, "s@x", neg)
    assert b"offset\x004294967295\x00" in encode_request(1, msg, "x", 0, "s@x", neg)
    with pytest.raises(ValueError, match="sender"):
        encode_request(1, msg, "x", 0, "s\0@x", [])
    with pytest.raises(ValueError, match="log_helo_name"):
        encode_request(1, RequestMessage("Q1", 1, 2, "", 0, "s@x", "", 0, b"", helo_name="a\0"),
                       "x", 0, "s@x", [])
    with pytest.raises(ValueError, match="recipient"):
        encode_request(1, msg, "x", 0, "s@x", [Rcpt("a@x", "a\0@x", 5, "", 0)])


def test_the_option_bits_go_under_the_release_s_name():
    """3.10 renamed the attribute; an agent of the other dialect rejects the request."""
    msg = RequestMessage("Q1", 100, 200, "", 0x30, "s@x", "", 0, b"\x01" * 88)
    old = encode_request(1, msg, "x", 0x31, "s@x", [])
    new = encode_request(1, msg, "x", 0x31, "s@x", [], "sendopts")
    assert b"\0smtputf8\x0049\0" in old and b"sendopts" not in old
    assert b"\0sendopts\x0049\0" in new and b"smtputf8" not in new
