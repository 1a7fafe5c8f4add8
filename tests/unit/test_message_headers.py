"""The header section of a queue file's content (issue #34: a class or tenant named by
a header): what cleanup writes, malformed content, and a read bounded whatever the
message's size."""

from __future__ import annotations

import os

import pytest

from pyqmgr.postfix.message_headers import HEADER_BYTES, header_values
from pyqmgr.postfix.record import encode_record

ENVELOPE = encode_record("C", "   1   2   0   1   0") + encode_record("M", b"")


def queue_file(tmp_path, records: list[bytes], name: str = "qf") -> tuple[str, int]:
    """A file of an envelope, then ``records``; its path and the content's offset."""
    path = tmp_path / name
    path.write_bytes(ENVELOPE + b"".join(records) + encode_record("X", b"")
                     + encode_record("E", b""))
    return str(path), len(ENVELOPE)


def values(path: str, offset: int, *names: str) -> dict[str, str]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return header_values(fd, offset, frozenset(names), path)
    finally:
        os.close(fd)


def lines(*text: str | bytes) -> list[bytes]:
    return [encode_record("N", t) for t in text]


def test_first_occurrence_case_insensitive_unfolded_and_trimmed(tmp_path):
    path, off = queue_file(tmp_path, lines(
        "Received: from x", "x-tenant:   acme", "\t corp  ", "X-Tenant: second",
        "Subject: hi", "", "X-Priority: urgent (in the body, not a header)"))
    got = values(path, off, "x-tenant", "x-priority")
    assert got == {"x-tenant": "acme\t corp"}


def test_a_long_line_in_pieces_is_joined(tmp_path):
    piece = "a" * 2000
    path, off = queue_file(tmp_path, [
        encode_record("L", "X-Tenant: " + piece), encode_record("L", piece),
        encode_record("N", "b"), *lines("", "body")])
    assert values(path, off, "x-tenant")["x-tenant"] == (piece * 2 + "b")[:1000]


def test_a_pointer_record_is_followed(tmp_path):
    """A milter's edit leaves the header elsewhere, behind a pointer."""
    head = lines("From: a@b.example")
    later = lines("X-Tenant: moved", "")
    # content: From, pointer to `later`, (later's records), X, E.
    body = ENVELOPE + b"".join(head)
    target = len(body) + len(encode_record("p", f"{0:15d}"))
    pointer = encode_record("p", f"{target:15d}")
    data = body + pointer + b"".join(later) + encode_record("X", b"") + encode_record("E", b"")
    path = tmp_path / "qf"
    path.write_bytes(data)
    assert values(str(path), len(ENVELOPE), "x-tenant") == {"x-tenant": "moved"}


def test_a_pointer_loop_ends(tmp_path):
    start = len(ENVELOPE)
    pointer = encode_record("p", f"{start:15d}")  # points at itself
    path = tmp_path / "qf"
    path.write_bytes(ENVELOPE + pointer + encode_record("E", b""))
    assert values(str(path), start, "x-tenant") == {}


@pytest.mark.parametrize("junk", [
    b"N\xff\xff\xff\xff\xff\xff",           # a length with too many bits
    b"N\x50abc",                             # a record cut short
    b"\x00\x00\x00",                         # records of no type
    os.urandom(4096),
])
def test_damaged_content_gives_what_was_found_and_no_exception(tmp_path, junk):
    path = tmp_path / "qf"
    path.write_bytes(ENVELOPE + b"".join(lines("X-Tenant: acme")) + junk)
    got = values(str(path), len(ENVELOPE), "x-tenant", "x-other")
    assert got.get("x-tenant") == "acme"


def test_no_offset_or_no_names_reads_nothing(tmp_path):
    path, off = queue_file(tmp_path, lines("X-Tenant: acme", ""))
    assert values(path, 0, "x-tenant") == {}
    assert values(path, off) == {}


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("rchar:"))


def test_the_read_is_bounded_whatever_the_size(tmp_path):
    """A 4 MB body costs no more than a small one; 200 KB of headers are looked at up
    to HEADER_BYTES, the header past them counting as absent. Measured with the
    kernel's count of bytes this process read (/proc/self/io)."""
    body = lines(*(["x" * 100] * 40_000))  # about 4 MB
    small, off = queue_file(tmp_path, [*lines("X-Tenant: acme", ""), *lines("x")], "small")
    big, _ = queue_file(tmp_path, [*lines("X-Tenant: acme", ""), *body], "big")
    crowd, _ = queue_file(tmp_path, [*lines(*(["Received: " + "r" * 90] * 2000)),
                                     *lines("X-Tenant: late", ""), *body], "crowd")
    assert os.path.getsize(big) > 4_000_000
    costs = {}
    for name, path in (("small", small), ("big", big), ("crowd", crowd)):
        before = _rchar()
        got = values(path, off, "x-tenant")
        costs[name] = _rchar() - before
        assert got == ({} if name == "crowd" else {"x-tenant": "acme"}), name
    print(f"\nbytes read: {costs}")
    assert costs["big"] <= costs["small"] + 8192
    assert costs["crowd"] <= 2 * HEADER_BYTES
