"""The attribute protocol codec, against byte strings captured from real Postfix."""

import pytest

from pyqmgr.postfix.attr import AttrError, AttrParser, check_announcement, encode, expect, to_int


def test_announcement_bytes_match_capture():
    # client_protocols.md §1.2: the trivial-rewrite announcement, 35 bytes.
    wire = b"protocol\0trivial_rewrite_protocol\0\0"
    assert encode([("protocol", "trivial_rewrite_protocol")]) == wire
    parser = AttrParser()
    parser.feed(wire)
    check_announcement(parser.pop(), "trivial_rewrite_protocol")


def test_resolve_request_bytes_match_capture():
    wire = b"request\0resolve\0sender\0sender@test.example\0address\0user@discard.example\0\0"
    got = encode([("request", "resolve"), ("sender", "sender@test.example"),
                  ("address", "user@discard.example")])
    assert got == wire


def test_negative_int_goes_out_unsigned_and_comes_back_signed():
    assert encode([("status", -1)]) == b"status\x004294967295\0\0"
    assert to_int("4294967295", "status") == -1
    assert to_int("0", "status") == 0


def test_duplicate_names_are_kept_by_position():
    parser = AttrParser()
    parser.feed(b"flags\x000\0transport\0discard\0nexthop\0d.example\0"
                b"recipient\0u@d.example\0flags\x004096\0\0")
    attrs = parser.pop()
    values = expect(attrs, ("flags", "transport", "nexthop", "recipient", "flags"), "resolve")
    assert values == ["0", "discard", "d.example", "u@d.example", "4096"]


def test_parser_handles_arbitrary_splits_and_merged_lists():
    wire = encode([("a", "1"), ("b", "")]) + encode([("c", "x")])
    for cut in range(len(wire) + 1):
        parser = AttrParser()
        parser.feed(wire[:cut])
        parser.feed(wire[cut:])
        assert parser.pop() == [("a", "1"), ("b", "")]
        assert parser.pop() == [("c", "x")]
        assert parser.pop() is None
        assert not parser.pending


def test_strict_expect_rejects_extra_missing_and_reordered():
    with pytest.raises(AttrError, match="unexpected attribute b"):
        expect([("b", "1")], ("a",), "x")
    with pytest.raises(AttrError, match="missing attribute b"):
        expect([("a", "1")], ("a", "b"), "x")
    with pytest.raises(AttrError, match="unexpected attribute c"):
        expect([("a", "1"), ("c", "2")], ("a",), "x")


def test_data_attribute_is_base64():
    assert encode([("time", b"\x00\x01")]) == b"time\0AAE=\0\0"


def test_bad_integers_are_refused():
    # "²" and "٣" pass str.isdigit, and 4,300 digits pass it too: each once raised a
    # ValueError out of the reply's reader (issue #31).
    for bad in ("", "-1", "12x", "99999999999", "²", "٣", "9" * 4300, "1 ", "+1"):
        with pytest.raises(AttrError):
            to_int(bad, "status")
    assert to_int("0" * 5000 + "17", "status") == 17, "as scanf reads leading zeros"


def test_unexpected_protocol_is_refused():
    with pytest.raises(AttrError, match="unexpected protocol"):
        check_announcement([("protocol", "other")], "delivery_request_protocol")


def test_utf8_and_invalid_bytes_survive_a_round_trip():
    parser = AttrParser()
    parser.feed(b"recipient\0j\xc3\xbcrgen@x\0raw\0\xff\xfe\0\0")
    attrs = parser.pop()
    assert attrs[0] == ("recipient", "jürgen@x")
    assert encode(attrs) == b"recipient\0j\xc3\xbcrgen@x\0raw\0\xff\xfe\0\0"


def test_multibyte_characters_split_across_reads():
    # The parser decodes everything up to the last NUL at once; a character whose
    # bytes arrive in two reads must still come out whole, invalid bytes escaped.
    wire = encode([("recipient", "jürgen@bücher.example"), ("raw", "x\udcc3")])
    for cut in range(len(wire) + 1):
        parser = AttrParser()
        for piece in (wire[:cut], wire[cut:]):
            parser.feed(piece)
        assert parser.pop() == [("recipient", "jürgen@bücher.example"), ("raw", "x\udcc3")]
        assert not parser.pending


def test_a_list_longer_than_the_limit_is_refused_not_buffered():
    """A peer that never ends its token, or its list, is refused at the limit
    instead of growing the daemon's buffer (issue #31)."""
    parser = AttrParser(limit=1000)
    with pytest.raises(AttrError, match="attribute list longer than 1000 bytes"):
        for _ in range(20):
            parser.feed(b"x" * 100)
    parser = AttrParser(limit=1000)
    with pytest.raises(AttrError, match="longer than 1000 bytes"):
        for i in range(200):
            parser.feed(f"name{i}\0value{i}\0".encode())
    # Lists under the limit, however many, are read.
    parser = AttrParser(limit=1000)
    for i in range(500):
        parser.feed(f"status\0{i}\0\0".encode())
    assert len(parser.lists) == 500
    with pytest.raises(AttrError):
        AttrParser().feed(b"r" * (2 << 20))
