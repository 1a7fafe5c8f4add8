"""The header section of a queue file's content (issue #34: a class or tenant named by
a header), on the files real cleanup(8) wrote (tests/data/header_samples, made by
tests/test_message_headers_real.py; tests/data/queue_samples) and on those files
damaged: what cleanup writes is read as the delivery agents read it, damage never
raises nor gives a value cut short, and the bytes read do not grow with the message.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from pyqmgr.daemon.classes import read_headers
from pyqmgr.postfix.message_headers import (
    HEADER_BYTES,
    MAX_POINTERS,
    READ_BUDGET,
    HeaderSection,
    header_section,
)
from pyqmgr.postfix.queue_file import Message, read_message
from pyqmgr.postfix.record import encode_record, rec_get_buf
from pyqmgr.pyqmgr_cf import from_text
from pyqmgr.settings.classes import classifier

DATA = Path(__file__).parent.parent / "data"
NAMES = frozenset({"x-tenant", "x-priority"})
FOLDED = {"x-tenant": "acme\tcorp", "x-priority": "urgent"}


def sample(name: str) -> bytes:
    folder = "queue_samples" if name.startswith("sample_") else "header_samples"
    return (DATA / folder / name).read_bytes()


def offset(data: bytes) -> int:
    return read_message(data, "Q")[0].data_offset


def look(tmp_path: Path, data: bytes, names: frozenset[str] = NAMES,
         at: int | None = None) -> HeaderSection:
    path = tmp_path / "qf"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        return header_section(fd, offset(data) if at is None else at, names, str(path))
    finally:
        os.close(fd)


def types(data: bytes, start: int) -> str:
    out, pos = [], start
    while pos < len(data):
        rtype, _payload, pos = rec_get_buf(data, pos, "qf")
        out.append(chr(rtype))
    return "".join(out)


def with_content(real: bytes, records: list[bytes]) -> bytes:
    """A real file's envelope, then other content (its size record no longer fits,
    which the header reader does not look at: pass the real file's offset)."""
    return real[:offset(real)] + b"".join(records) + encode_record("X", b"") \
        + encode_record("E", b"")


def lines(*text: str | bytes) -> list[bytes]:
    return [encode_record("N", t) for t in text]


@pytest.mark.parametrize(("name", "names", "want"), [
    ("headers_folded.bin", NAMES, FOLDED),
    ("headers_replaced.bin", NAMES, {"x-tenant": "replaced"}),
    ("headers_prepended.bin", NAMES, {"x-tenant": "prepended"}),
    ("headers_ignored.bin", NAMES, {"x-tenant": "kept"}),
    ("headers_long.bin", NAMES, {"x-tenant": "t" * 1000}),
    ("headers_headers_only.bin", NAMES, {"x-priority": "urgent"}),
    ("headers_absent.bin", NAMES, {}),
    ("sample_milter_addrcpt_hold.bin", frozenset({"x-milter-added", "subject"}),
     {"x-milter-added": "yes", "subject": "milter2 HOLDME"}),
    ("sample_warn_before.bin", frozenset({"subject", "x-tenant"}), {"subject": "warn test"}),
])
def test_real_files_read_as_cleanup_wrote_them(tmp_path, name, names, want):
    got = look(tmp_path, sample(name), names)
    assert (got.values, got.problem) == (want, "")


def test_the_real_files_have_what_the_cases_are_about():
    """Not a test of pyqmgr: that the samples hold what the cases above claim to
    read (a milter's padding, long-line pieces, a header behind a pointer)."""
    folded = sample("headers_folded.bin")
    assert "NwN" in types(folded, offset(folded)), "'Subject: s' padded before X-Tenant"
    long = sample("headers_long.bin")
    assert "LLN" in types(long, offset(long))
    milter = sample("sample_milter_addrcpt_hold.bin")
    assert milter.index(b"X-Milter-Added") > milter.index(b"E\x00")


def test_a_file_cut_short_anywhere_gives_no_exception_and_no_partial_value(tmp_path):
    real = sample("headers_folded.bin")
    start = offset(real)
    for cut in range(start, len(real)):
        got = look(tmp_path, real[:cut], at=start)
        for name, value in got.values.items():
            assert value == FOLDED[name], (cut, got)
        if not got.problem:
            assert got.values == FOLDED, cut


def test_binary_junk_anywhere_gives_no_exception_and_stays_in_budget(tmp_path):
    real = sample("headers_folded.bin")
    start = offset(real)
    rng = random.Random(34)
    for _ in range(300):
        at = rng.randrange(start, len(real))
        junk = rng.randbytes(rng.randrange(1, 64))
        got = look(tmp_path, real[:at] + junk + real[at + len(junk):], at=start)
        assert got.bytes_read <= READ_BUDGET
    got = look(tmp_path, with_content(real, [rng.randbytes(4096)]), at=offset(real))
    assert got.values == {} and got.problem


def test_a_record_claiming_megabytes_reads_no_further(tmp_path):
    real = sample("headers_absent.bin")
    claim = encode_record("N", b"X-Tenant: " + b"x" * 3_999_990)[:40]  # and no more
    got = look(tmp_path, with_content(real, [*lines("Subject: s"), claim]), at=offset(real))
    assert got.values == {} and "illegal length 4000000" in got.problem
    assert got.bytes_read < 2 * 8192


def test_damage_after_a_whole_header_keeps_it(tmp_path):
    real = sample("headers_absent.bin")
    records = [*lines("X-Tenant: acme", "Subject: s"), b"N\xff\xff\xff\xff\xff"]
    got = look(tmp_path, with_content(real, records), at=offset(real))
    assert got.values == {"x-tenant": "acme"} and "damaged record" in got.problem
    # Damage right after it: a folded line may have been lost, so it is not used.
    got = look(tmp_path, with_content(real, [*lines("X-Tenant: acme"), b"R\x01x"]), at=offset(real))
    assert got.values == {} and "a record of type 82" in got.problem


def test_a_header_in_many_pieces(tmp_path):
    real = sample("headers_absent.bin")
    few = [encode_record("L", "X-Tenant: " + "a" * 90), *[encode_record("L", "b" * 100)] * 20,
           *lines("c", "")]
    assert look(tmp_path, with_content(real, few), at=offset(real)).values == {
        "x-tenant": ("a" * 90 + "b" * 2000 + "c")[:1000]}
    many = [encode_record("L", "X-Tenant: " + "a" * 2038), *[encode_record("L", "b" * 2048)] * 40,
            *lines("c", "")]
    got = look(tmp_path, with_content(real, many), at=offset(real))
    assert got.values == {}
    assert got.problem == f"the header section is longer than {HEADER_BYTES} bytes"
    assert got.bytes_read <= READ_BUDGET


def test_pointers_bad_and_looping(tmp_path):
    real = sample("headers_absent.bin")
    start = offset(real)
    loop = with_content(real, [encode_record("p", f"{start:15d}")])
    assert look(tmp_path, loop, at=start).problem == f"more than {MAX_POINTERS} pointer records"
    away = with_content(real, [encode_record("p", f"{10**9:15d}")])
    assert look(tmp_path, away, at=start).problem == (f"the file ends at offset {10**9}, "
                                                      "in the content")
    bad = with_content(real, [encode_record("p", "12x")])
    assert look(tmp_path, bad, at=start).problem.startswith("a bad pointer record")


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("rchar:"))


def test_a_4mb_message_costs_what_a_small_one_does(tmp_path):
    """A real file's header section, with a body of 4 MB in cleanup's records; the
    bytes read by the kernel's count (/proc/self/io) and the reader's own."""
    real = sample("headers_folded.bin")
    # The envelope and headers, to the empty line (the body is one header-like line).
    head = real[:real.index(b"N\x00N\x10X-Priority: body")]
    small = head + b"".join(lines("", "hi")) + encode_record("X", b"") + encode_record("E", b"")
    big = head + b"".join(lines("", *["y" * 100] * 40_000)) + encode_record("X", b"") \
        + encode_record("E", b"")
    assert len(big) > 4_000_000
    cost = {}
    for name, data in (("small", small), ("big", big)):
        path = tmp_path / name
        path.write_bytes(data)
        fd = os.open(path, os.O_RDONLY)
        try:
            before = _rchar()
            got = header_section(fd, offset(real), NAMES, str(path))
            cost[name] = (_rchar() - before, got.bytes_read)
        finally:
            os.close(fd)
        assert got.values == FOLDED
    print(f"\nbytes read (kernel, reader): {cost}")
    assert cost["big"][1] <= 8192 and cost["big"][0] <= cost["small"][0] + 8192


def _classes(text: str, warned: list[str]):
    found = classifier(from_text(text, "pyqmgr.cf"), warned.append)
    assert found is not None
    return found


def test_read_headers_warns_once_a_file_and_only_when_a_header_was_not_reached(tmp_path):
    warned: list[str] = []
    c = _classes("tenant_key = header:X-Tenant\n", warned)
    real = sample("headers_absent.bin")
    qf = Message("ABC123", data_offset=offset(real))
    path = tmp_path / "qf"
    path.write_bytes(with_content(real, [*lines("Subject: s"), b"N\xff\xff\xff\xff\xff"]))
    assert read_headers(c, qf, str(path), warn=warned.append) == {}
    assert len(warned) == 1 and warned[0].startswith("ABC123: classes: header x-tenant not "
                                                     "read: a damaged record at offset")
    assert warned[0].endswith("counted as absent (the default class or tenant)")
    path.write_bytes(sample("headers_absent.bin"))
    assert read_headers(c, qf, str(path), warn=warned.append) == {}
    assert len(warned) == 1, "absent from a whole section: nothing to say"


def test_read_headers_on_a_fifo_does_not_wait(tmp_path):
    """Slow input: something other than a queue file in its place (a FIFO nobody
    writes) ends the look at once, with its line."""
    warned: list[str] = []
    c = _classes("tenant_key = header:X-Tenant\n", warned)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert read_headers(c, Message("F1", data_offset=100), str(fifo), warn=warned.append) == {}
    assert len(warned) == 1 and "read error at offset 100" in warned[0]


def test_no_header_key_reads_nothing(tmp_path):
    """The default path: no key names a header, so no file is opened (the path does
    not even exist) and nothing is read."""
    c = _classes("tenant_key = sender_domain\n", [])
    before = _rchar()
    assert read_headers(c, Message("Q", data_offset=100), str(tmp_path / "none")) == {}
    assert _rchar() - before < 200  # /proc/self/io itself
    assert look(tmp_path, sample("headers_folded.bin"), frozenset()) == HeaderSection()
