"""qmgr's queue-file reader (qmgr_message_read) on real and synthetic queue files.

Real files come from queue_samples/ (Postfix 3.7.11); synthetic ones are built with
:func:`build`, which lays records out the way cleanup does (C first, envelope, M,
content, X, extracted segment, E, then an optional heap).
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyqmgr.postfix import queue_file, record, shared_strings
from pyqmgr.postfix.queue_file import (
    READ_FLAG_MIXED_RCPT_OTHER,
    READ_FLAG_SEEN_ALL_NON_RCPT,
    Batch,
    Message,
    Opened,
    QueueFileError,
    kill_record,
    mark_done,
    read_batch,
    read_message,
    update_warn,
)
from pyqmgr.postfix.record import encode_record

SAMPLES = Path(__file__).parent / "data" / "queue_samples"
QID = "AAAAA1"

Rec = tuple[str, bytes | str]


@pytest.fixture(autouse=True)
def _fresh_goto_state():
    record.reset_goto_state()
    yield
    record.reset_goto_state()


def sample(name: str) -> bytes:
    return (SAMPLES / name).read_bytes()


def recs(records: list[Rec]) -> bytes:
    return b"".join(encode_record(t, p) for t, p in records)


def size_record(*fields: int) -> bytes:
    return encode_record("C", b"%15d %15d %15d %15d %15d %15d" % fields)


def build(envelope: list[Rec], *, content: list[Rec] | None = None,
          extracted: list[Rec] | None = None, nrcpt: int | None = None, flags: int = 0,
          cont_length: int | None = None, smtputf8: int = 0, end: bool = True) -> bytes:
    """A queue file as cleanup writes it, with a correct size record by default."""
    content = [("N", b"Subject: test"), ("N", b""), ("N", b"Hello.")] \
        if content is None else content
    extracted = extracted or []
    env = recs(envelope)
    body = recs(content)
    data_offset = 97 + len(env) + 2
    data_size = len(body)
    if nrcpt is None:
        nrcpt = sum(1 for t, _ in envelope + extracted if t in ("R", "D", "/"))
    head = size_record(data_size, data_offset, nrcpt, flags,
                       data_size if cont_length is None else cont_length, smtputf8)
    out = head + env + b"M\x00" + body + b"X\x00" + recs(extracted)
    return out + (b"E\x00" if end else b"")


def basic_envelope(*rcpts: str, sender: str = "alice@example.org") -> list[Rec]:
    env: list[Rec] = [("T", b"1795344681 411377"), ("A", b"create_time=1795344681"),
                      ("A", b"rewrite_context=local"), ("F", b"root"), ("S", sender)]
    for rcpt in rcpts:
        env.append(("R", rcpt))
    return env


def read(data: bytes | io.BytesIO, limit: int = 5000, qid: str = QID,
         **kw: object) -> tuple[Message, Batch]:
    msg = Message(queue_id=qid)
    return msg, read_batch(data, msg, limit, **kw)  # type: ignore[arg-type]


def rtuples(batch: Batch) -> list[tuple[int, str, str, str, int]]:
    return [(r.offset, r.address, r.orig_addr, r.dsn_orcpt, r.dsn_notify)
            for r in batch.recipients]


def offsets(batch: Batch) -> list[int]:
    return [r.offset for r in batch.recipients]


def addresses(batch: Batch) -> list[str]:
    return [r.address for r in batch.recipients]


def offset_of(data: bytes, rtype: str, payload: bytes) -> int:
    pos = data.index(encode_record(rtype, payload))
    assert data.count(encode_record(rtype, payload)) == 1
    return pos


# -- real files --------------------------------------------------------------------------

ALL_SAMPLES = sorted(p.name for p in SAMPLES.glob("*.bin"))


def _postcat_recipients(path: Path, tmp_path: Path) -> list[tuple[int, str]] | None:
    postcat = shutil.which("postcat") or "/usr/sbin/postcat"
    if not os.access(postcat, os.X_OK):
        return None
    (tmp_path / "main.cf").write_text("")
    os.utime(tmp_path / "main.cf", (time.time() - 60, time.time() - 60))  # see testbed notes
    out = subprocess.run([postcat, "-c", str(tmp_path), "-e", "-o", str(path)],
                         capture_output=True, text=True, timeout=20).stdout
    return [(int(m[1]), m[2]) for m in re.finditer(r"^\s*(\d+) recipient: (.*)$", out, re.M)]


@pytest.mark.parametrize("name", ALL_SAMPLES)
def test_samples_read_cleanly_and_agree_with_postcat(name, tmp_path):
    msg, batch = read(sample(name))
    assert batch.ok and batch.warnings == []
    assert msg.rcpt_offset == 0 and msg.rcpt_unread == 0
    assert msg.seen_all_non_rcpt
    assert msg.sender == "alice@example.org"
    assert batch.opened == Opened("alice@example.org", msg.cont_length, msg.rcpt_count)
    expected = _postcat_recipients(SAMPLES / name, tmp_path)
    if expected is None:
        pytest.skip("postcat not installed")
    # postcat prints records in logical order too (it follows pointers).
    assert [(r.offset, r.address) for r in batch.recipients] == expected


def test_hold_sample_known_values():
    msg, batch = read(sample("sample_hold_65CC420E1F4.bin"), qid="65CC420E1F4")
    assert offsets(batch) == [245, 320]
    bob, carol = batch.recipients
    assert (bob.address, bob.orig_addr, bob.dsn_orcpt, bob.dsn_notify) == \
        ("bob@discard.test", "bob@discard.test", "rfc822;bob@discard.test", 0)
    assert (carol.address, carol.dsn_orcpt) == ("carol@defer.test", "rfc822;carol@defer.test")
    assert (msg.data_size, msg.data_offset, msg.rcpt_count, msg.cont_length, msg.smtputf8) == \
        (305, 340, 2, 305, 0)
    assert msg.rflags == READ_FLAG_SEEN_ALL_NON_RCPT  # C field 4 was 0: not mixed
    assert msg.arrival_time == (1795344681, 411377)
    assert msg.create_time == 1795344681
    assert msg.rewrite_context == "local"
    assert (msg.warn_offset, msg.warn_time, msg.trace_flags, msg.verp_delims) == (0, 0, 0, "")
    assert (msg.filter, msg.redirect, msg.inspector) == (None, None, None)
    assert (msg.envelope_id, msg.encoding, msg.client_name, msg.log_ident) == ("", "", "", "")
    assert batch.opened == Opened("alice@example.org", 305, 2)


def test_done_recipient_is_counted_and_skipped():
    msg, batch = read(sample("sample_deferred_65CC420E1F4.bin"))
    assert offsets(batch) == [320]
    assert batch.warnings == []  # D counts toward the size record's 2: no mismatch
    assert batch.opened == Opened("alice@example.org", 305, 2)  # nrcpt stays 2


def test_warn_samples():
    msg, batch = read(sample("sample_warn_before.bin"))
    assert (msg.warn_offset, msg.warn_time) == (212, 1795344731)
    assert msg.rflags & 0x1F == 24  # -N delay,failure: (8|4) << 1
    assert msg.envelope_id == "myenvid123"
    assert batch.recipients[0].dsn_notify == 12
    msg, _ = read(sample("sample_warn_after.bin"))
    assert (msg.warn_offset, msg.warn_time) == (212, -1)


def test_milter_heap_recipient_is_reached_through_pointers():
    msg, batch = read(sample("sample_milter_addrcpt_hold.bin"))
    assert offsets(batch) == [247, 321, 704]
    added = batch.recipients[2]
    assert (added.address, added.orig_addr, added.dsn_orcpt) == \
        ("added@discard.test", "added@discard.test", "")
    assert (msg.data_offset, msg.data_size, msg.rcpt_count) == (357, 306, 3)
    msg, batch = read(sample("sample_milter_addrcpt_deferred.bin"))
    assert offsets(batch) == [321]
    assert batch.warnings == []


def test_reader_accepts_file_objects_and_buffers(tmp_path):
    data = sample("sample_hold_65CC420E1F4.bin")
    path = tmp_path / "q"
    path.write_bytes(data)
    with open(path, "rb") as f:
        f.seek(100)  # the reader always starts from offset 0
        _, from_file = read(f)  # type: ignore[arg-type]
    _, from_view = read(memoryview(data))  # type: ignore[arg-type]
    _, from_bytes = read(data)
    assert rtuples(from_file) == rtuples(from_view) == rtuples(from_bytes)


# -- in-place updates ------------------------------------------------------------------


def test_mark_done_turns_hold_sample_into_deferred_sample(tmp_path):
    path = tmp_path / "q"
    path.write_bytes(sample("sample_hold_65CC420E1F4.bin"))
    fd = os.open(path, os.O_RDWR)
    try:
        mark_done(fd, 245)
        mark_done(fd, -1)  # local(8)'s "nothing to mark"
    finally:
        os.close(fd)
    assert path.read_bytes() == sample("sample_deferred_65CC420E1F4.bin")


def test_mark_done_on_heap_recipient_matches_real_delivery():
    f = io.BytesIO(sample("sample_milter_addrcpt_hold.bin"))
    mark_done(f, 247)
    mark_done(f, 704)
    assert f.getvalue() == sample("sample_milter_addrcpt_deferred.bin")
    with pytest.raises(ValueError):
        mark_done(f, -2)


def test_update_warn_is_byte_exact(tmp_path):
    path = tmp_path / "q"
    path.write_bytes(sample("sample_warn_before.bin"))
    msg, _ = read(path.read_bytes())
    fd = os.open(path, os.O_RDWR)
    try:
        update_warn(fd, msg.warn_offset, -1)
    finally:
        os.close(fd)
    assert path.read_bytes() == sample("sample_warn_after.bin")
    f = io.BytesIO(sample("sample_warn_after.bin"))
    update_warn(f, 212, 1795344731)
    assert f.getvalue() == sample("sample_warn_before.bin")
    with pytest.raises(ValueError):
        update_warn(f, 212, 10**15)  # 16 digits would not fit in place
    with pytest.raises(ValueError):
        update_warn(f, 0, -1)


def test_trace_record_is_killed_in_place():
    # §6.4: `sendmail -v` files carry A trace_flags=1024; qmgr later turns A into K.
    env = basic_envelope("bob@discard.test", "carol@defer.test")
    env.insert(5, ("A", b"trace_flags=1024"))
    data = build(env)
    msg, batch = read(data)
    assert msg.trace_flags == queue_file.DEL_REQ_FLAG_RECORD
    assert msg.trace_offset == offset_of(data, "A", b"trace_flags=1024")
    f = io.BytesIO(data)
    kill_record(f, msg.trace_offset)
    killed = f.getvalue()
    assert killed[msg.trace_offset:msg.trace_offset + 18] == b"K\x10trace_flags=1024"
    assert sum(a != b for a, b in zip(data, killed, strict=True)) == 1
    msg, batch = read(killed)
    assert batch.ok and msg.trace_flags == 0 and msg.trace_offset == 0
    with pytest.raises(ValueError):
        kill_record(f, 0)


@pytest.mark.parametrize(("values", "flags", "offset_kept"), [
    ([b"1024"], 1024, True),
    ([b"1280"], 1280, False),  # RECORD|MTA_VRFY: not exactly RECORD, nothing to kill
    ([b"0", b"1024"], 1024, True),  # first *non-zero* value wins
    ([b"512", b"1024"], 512, False),
    ([b"1"], 0, False),  # bits outside the trace mask are dropped
    ([b"4294968320"], 1024, True),  # atoi() keeps the low 32 bits
])
def test_trace_flags(values, flags, offset_kept):
    env = basic_envelope("bob@discard.test")
    for k, v in enumerate(values):
        env.insert(1 + k, ("A", b"trace_flags=" + v))
    data = build(env)
    msg, _ = read(data)
    assert msg.trace_flags == flags
    expected = data.index(b"A" + bytes([12 + len(values[-1])]) + b"trace_flags=" + values[-1])
    assert msg.trace_offset == (expected if offset_kept else 0)


# -- batches -----------------------------------------------------------------------------

SEVEN = [f"r{i}@discard.test" for i in range(1, 8)]


def test_seven_recipients_in_batches_of_three():
    env = basic_envelope(*SEVEN)
    data = build(env, extracted=[("A", b"encoding=8bit")])
    r_offsets = [offset_of(data, "R", a.encode()) for a in SEVEN]
    msg = Message(queue_id=QID)
    first = read_batch(data, msg, 3)
    assert first.ok and first.warnings == []
    assert offsets(first) == r_offsets[:3]
    # Resume point: just after the third R record (stock's "offset 404" case).
    assert msg.rcpt_offset == r_offsets[2] + 2 + len(SEVEN[2])
    assert msg.rcpt_unread == 4
    # Pure recipients (flags 0): the rest of the envelope is skipped and the
    # extracted segment is still read before the first batch returns.
    assert msg.seen_all_non_rcpt and msg.encoding == "8bit"
    assert first.opened == Opened("alice@example.org", msg.cont_length, 7)

    second = read_batch(data, msg, 3)
    assert offsets(second) == r_offsets[3:6] and second.opened is None
    assert msg.rcpt_offset == r_offsets[5] + 2 + len(SEVEN[5]) and msg.rcpt_unread == 1
    third = read_batch(data, msg, 3)
    assert offsets(third) == r_offsets[6:]
    assert msg.rcpt_offset == 0 and msg.rcpt_unread == 0
    assert second.warnings == third.warnings == []


def test_batch_ends_exactly_at_last_recipient():
    data = build(basic_envelope(*SEVEN[:3]))
    msg = Message(queue_id=QID)
    batch = read_batch(data, msg, 3)
    assert len(batch.recipients) == 3 and msg.rcpt_offset != 0
    again = read_batch(data, msg, 3)
    assert again.recipients == [] and again.ok and again.warnings == []
    assert msg.rcpt_offset == 0


def test_mixed_file_keeps_reading_non_recipient_records_after_the_limit():
    env = basic_envelope(*SEVEN[:4])
    env.append(("A", b"log_ident=late"))  # a non-recipient record after recipients
    env.append(("O", b"orig5"))
    env.append(("R", b"r5@discard.test"))
    data = build(env, flags=READ_FLAG_MIXED_RCPT_OTHER)
    msg = Message(queue_id=QID)
    batch = read_batch(data, msg, 2)
    assert addresses(batch) == SEVEN[:2]
    assert msg.log_ident == "late"  # found although the batch was already full
    assert batch.warnings == []  # the O after the limit is neither kept nor reported
    rest = read_batch(data, msg, 10)
    assert addresses(rest) == SEVEN[2:4] + ["r5@discard.test"]
    assert rest.recipients[-1].orig_addr == "orig5"


def test_pure_recipients_in_extracted_segment_stop_reading_at_the_limit():
    # Stock's optimisation: a full batch found after data_offset means "all non-recipient
    # records seen", so an attribute after it in the same segment is never read.
    data = build(basic_envelope(), extracted=[("R", b"x1@d"), ("R", b"x2@d"),
                                              ("A", b"encoding=8bit"), ("R", b"x3@d")])
    msg = Message(queue_id=QID)
    batch = read_batch(data, msg, 1)
    assert addresses(batch) == ["x1@d"] and msg.seen_all_non_rcpt
    assert msg.encoding == ""
    batch = read_batch(data, msg, 5)
    assert addresses(batch) == ["x2@d", "x3@d"] and msg.encoding == ""


def test_later_batches_skip_non_recipient_records():
    env = basic_envelope(*SEVEN[:4])
    env.insert(1, ("A", b"sasl_method=PLAIN"))
    env.append(("A", b"sasl_method=LOGIN"))  # "ignoring multiple" once, on batch one
    env.append(("R", b"r5@discard.test"))
    data = build(env, flags=READ_FLAG_MIXED_RCPT_OTHER)
    msg = Message(queue_id=QID)
    first = read_batch(data, msg, 2)
    assert first.warnings == [f"{QID}: ignoring multiple sasl_method attribute: LOGIN"]
    rest = read_batch(data, msg, 2)
    assert rest.warnings == [] and addresses(rest) == SEVEN[2:4]
    last = read_batch(data, msg, 2)
    assert addresses(last) == ["r5@discard.test"] and msg.rcpt_offset == 0


def test_done_records_between_batches():
    env = basic_envelope("a@d", "b@d", "c@d", "d@d")
    data = bytearray(build(env))
    data[offset_of(bytes(data), "R", b"b@d")] = ord("D")
    data[offset_of(bytes(data), "R", b"c@d")] = ord("/")
    msg = Message(queue_id=QID)
    first = read_batch(bytes(data), msg, 1)
    assert addresses(first) == ["a@d"] and msg.rcpt_unread == 3
    rest = read_batch(bytes(data), msg, 5)
    assert addresses(rest) == ["d@d"] and msg.rcpt_unread == 0 and rest.warnings == []


def test_batch_limit_is_capped_at_5000_and_must_be_positive():
    rcpts = [f"u{i}@d" for i in range(5001)]
    data = build(basic_envelope(*rcpts))
    msg = Message(queue_id=QID)
    batch = read_batch(data, msg, 100000)
    assert len(batch.recipients) == 5000 and msg.rcpt_unread == 1
    assert addresses(read_batch(data, msg, 100000)) == ["u5000@d"]
    with pytest.raises(ValueError):
        read_batch(data, Message(queue_id=QID), 0)


def test_resume_with_wrong_count_reports_mismatch_only_at_the_end():
    data = build(basic_envelope(*SEVEN[:4]), nrcpt=6)
    msg = Message(queue_id=QID)
    assert read_batch(data, msg, 2).warnings == []
    last = read_batch(data, msg, 5)
    assert last.ok and last.warnings == [f"{QID}: rcpt count mismatch (2)"]
    assert msg.rcpt_unread == 0


def test_failed_later_batch_restores_resume_state():
    data = bytearray(build(basic_envelope(*SEVEN[:4])))
    msg = Message(queue_id=QID)
    read_batch(bytes(data), msg, 2)
    offset, unread = msg.rcpt_offset, msg.rcpt_unread
    data[offset_of(bytes(data), "R", b"r4@discard.test")] = ord("Z")
    batch = read_batch(bytes(data), msg, 5)
    assert not batch.ok and batch.recipients == []
    assert (msg.rcpt_offset, msg.rcpt_unread) == (offset, unread)


# -- malformed files (§3.4) ------------------------------------------------------------------


def test_truncated_file():
    batch = read(sample("sample_hold_65CC420E1F4.bin")[:100])[1]
    assert not batch.ok
    assert batch.warnings == [
        "active/AAAAA1: unexpected EOF in data, record type 84 length 17",
        "AAAAA1: message rejected: missing end record",
        "AAAAA1: rcpt count mismatch (2)",
    ]
    assert batch.recipients == [] and batch.opened is None


def test_garbage_text():
    batch = read(b"garbage text, not a queue file\n")[1]
    assert batch.warnings == [
        "active/AAAAA1: unexpected EOF in data, record type 103 length 97",
        "AAAAA1: message rejected: missing end record",
    ]


def test_bad_type_byte():
    data = bytearray(sample("sample_hold_65CC420E1F4.bin"))
    data[163] = ord("Z")  # the F record
    msg, batch = read(bytes(data), qid="AAAAA2")
    assert batch.warnings == ["Unexpected record type 'Z' at offset 163",
                              "AAAAA2: rcpt count mismatch (2)"]
    assert not batch.ok and batch.opened is None


def test_unexpected_high_byte_type_is_reported_as_that_byte():
    data = bytearray(sample("sample_hold_65CC420E1F4.bin"))
    data[163] = 0xFF
    warning = read(bytes(data))[1].warnings[0]
    assert warning.encode("utf-8", "surrogateescape") == \
        b"Unexpected record type '\xff' at offset 163"


def test_file_rejected_after_sender_still_reports_opened():
    data = bytearray(sample("sample_hold_65CC420E1F4.bin"))
    data[263] = ord("Z")  # after S and bob's R
    msg, batch = read(bytes(data), qid="AAAAA4")
    assert not batch.ok and batch.recipients == []
    assert batch.opened == Opened("alice@example.org", 305, 2)
    assert batch.warnings == ["Unexpected record type 'Z' at offset 263",
                              "AAAAA4: rcpt count mismatch (1)"]


def test_killed_time_record():
    data = bytearray(sample("sample_hold_65CC420E1F4.bin"))
    data[97] = ord("K")
    batch = read(bytes(data))[1]
    assert batch.warnings == ["AAAAA1: message rejected: missing arrival time record"]
    assert not batch.ok and batch.opened is not None


def test_killed_sender_record():
    data = bytearray(sample("sample_hold_65CC420E1F4.bin"))
    data[169] = ord("K")
    batch = read(bytes(data))[1]
    assert batch.warnings == ["AAAAA1: message rejected: missing sender record"]
    assert batch.opened is None


def test_missing_size_record():
    data = recs([("T", b"1795344681 0"), ("S", b"a@b"), ("R", b"c@d"), ("E", b"")])
    batch = read(data)[1]
    assert batch.warnings == ["AAAAA1: rcpt count mismatch (-1)",
                              "AAAAA1: message rejected: missing size record"]


def test_killed_size_record_meets_content_as_unexpected():
    data = bytearray(sample("sample_hold_65CC420E1F4.bin"))
    data[0] = ord("K")
    batch = read(bytes(data))[1]
    assert batch.warnings == ["Unexpected record type 'N' at offset 340",
                              "AAAAA1: rcpt count mismatch (-2)"]


def test_missing_end_record():
    data = build(basic_envelope("b@d"), end=False)
    batch = read(data)[1]
    assert batch.warnings == ["AAAAA1: message rejected: missing end record"]
    assert not batch.ok


def test_only_x_is_allowed_after_the_content():
    data = build(basic_envelope("b@d"), cont_length=10)
    bad = bytearray(data)
    msg, _ = read(data)
    x = msg.data_offset + msg.data_size
    assert bad[x] == ord("X")
    bad[x] = ord("N")
    batch = read(bytes(bad))[1]
    assert batch.warnings == [f"Unexpected record type 'N' at offset {x}"]


def test_wrong_data_size_lands_inside_content():
    data = bytearray(build(basic_envelope("b@d")))
    msg, _ = read(bytes(data))
    data[2:17] = b"%15d" % (msg.data_size - 8)  # short by the last N record
    batch = read(bytes(data))[1]
    assert batch.warnings == [f"Unexpected record type 'N' at offset "
                              f"{msg.data_offset + msg.data_size - 8}"]


def test_nul_type_byte_is_missing_end_record():
    data = bytearray(sample("sample_hold_65CC420E1F4.bin"))
    data[163] = 0
    batch = read(bytes(data))[1]
    assert batch.warnings == ["AAAAA1: message rejected: missing end record",
                              "AAAAA1: rcpt count mismatch (2)"]


BAD_FLAGS = b"%15d %15d %15d %15d %15d %15d" % (5, 9, 1, 64, 5, 0)


@pytest.mark.parametrize(("fields", "warnings"), [
    (b"1 2", ["message rejected: weird size record"]),
    (b"", ["message rejected: weird size record"]),
    (b"abc", ["message rejected: weird size record"]),
    (BAD_FLAGS, [f"invalid flags in size record: {BAD_FLAGS.decode()}",
                 "rcpt count mismatch (1)"]),
    (b"0 9 1", ["invalid size record: 0 9 1", "rcpt count mismatch (1)"]),
    (b"5 -9 0", ["invalid size record: 5 -9 0"]),
    (b"5 9 0 0 -1", ["invalid size record: 5 9 0 0 -1"]),
    (b"5 9 0 -1", ["invalid flags in size record: 5 9 0 -1"]),
])
def test_bad_size_records(fields, warnings):
    data = encode_record("C", fields) + recs(basic_envelope()) + b"E\x00"
    batch = read(data)[1]
    assert not batch.ok
    assert batch.warnings == [f"{QID}: {w}" for w in warnings]


def test_size_record_with_three_fields_keeps_mixed_default():
    env = recs(basic_envelope("b@d"))
    data_offset = 2 + 47 + len(env) + 2  # a 47-byte payload: three %15d fields
    data = encode_record("C", b"%15d %15d %15d" % (3, data_offset, 1)) + env + b"M\x00"
    data += b"N\x01x" + b"X\x00E\x00"
    msg, batch = read(data)
    assert batch.ok and batch.warnings == []
    assert msg.rflags == READ_FLAG_MIXED_RCPT_OTHER | READ_FLAG_SEEN_ALL_NON_RCPT
    assert msg.cont_length == 3  # 0 means "use data_size" (Postfix < 2.4)


def test_only_first_size_record_counts():
    env = basic_envelope("b@d")
    env.append(("C", b"1 1 1 31 1 1"))
    msg, batch = read(build(env))
    assert batch.ok and msg.rcpt_count == 1 and msg.rflags & 0x1F == 0


def test_old_style_size_record_is_rescanned():
    # Postfix < 1.0: the C record holds one number and M holds the extracted offset.
    env = recs([("T", b"1795344681 0"), ("S", b"a@b"), ("R", b"c@d"), ("D", b"e@f")])
    c_rec = encode_record("C", b"%15d" % 0)
    m_at = len(c_rec) + len(env)
    content = recs([("N", b"hello"), ("w", b"pad")])
    m_payload = b"%15d" % 0
    m_len = len(encode_record("M", m_payload))
    extra = m_at + m_len + len(content)
    data = c_rec + env + encode_record("M", b"%15d" % extra) + content
    data += recs([("X", b""), ("R", b"g@h"), ("E", b"")])
    msg, batch = read(data)
    assert batch.ok, batch.warnings
    assert addresses(batch) == ["c@d", "g@h"]
    assert (msg.data_offset, msg.data_size) == (m_at + m_len, len(content))
    assert msg.rcpt_unread == 0 and batch.warnings == []


def test_old_style_size_record_in_modern_file_is_refused():
    data = bytearray(sample("sample_hold_65CC420E1F4.bin"))
    data[0:97] = encode_record("C", b"%95d" % 305)
    batch = read(bytes(data))[1]
    assert not batch.ok
    assert batch.warnings == ["bad extra offset  file active/AAAAA1"]


@pytest.mark.parametrize(("payload", "error"), [
    (b"novalue", "missing '=' after attribute name"),
    (b"two words=x", "missing '=' after attribute name"),
    (b"=x", "missing attribute name"),
    (b"   ", "missing attribute name"),
    (b"", "missing attribute name"),
])
def test_bad_attribute_record(payload, error):
    env = basic_envelope("b@d")
    env.insert(2, ("A", payload))
    batch = read(build(env))[1]
    assert batch.warnings == [f"{QID}: bad attribute record: {error}: {payload.decode()}",
                              f"{QID}: rcpt count mismatch (1)"]


def test_bad_attribute_record_is_fatal_in_later_batches_too():
    # Attributes are split before the "non-recipient records already seen" test.
    env = basic_envelope("a@d")
    env += [("A", b"junk"), ("R", b"b@d")]
    data = build(env)  # pure recipients: batch one jumps to the content after a@d
    msg = Message(queue_id=QID)
    assert read_batch(data, msg, 1).ok
    batch = read_batch(data, msg, 1)
    assert not batch.ok
    assert batch.warnings == [f"{QID}: bad attribute record: missing '=' after attribute "
                              f"name: junk", f"{QID}: rcpt count mismatch (1)"]


def test_attribute_name_and_value_are_trimmed():
    env = basic_envelope("b@d")
    env.insert(1, ("A", b"  log_ident \t=  smtpd/x  "))
    env.insert(1, ("A", b"envelope_id= id1 "))
    msg, batch = read(build(env))
    assert msg.log_ident == "smtpd/x" and msg.envelope_id == "id1"


def test_malformed_pointer_record():
    env = basic_envelope("b@d")
    env.insert(1, ("p", b"      12x"))
    batch = read(build(env))[1]
    # No "missing end record": a pointer error ends the read on its own.
    assert batch.warnings == ["active/AAAAA1: malformed pointer record value: 12x",
                              "AAAAA1: rcpt count mismatch (1)"]
    assert not batch.ok


def test_pointer_loop():
    data = size_record(1, 9999, 0, 0, 1, 0) + encode_record("p", b"%15d" % 97)
    batch = read(data)[1]
    assert batch.warnings == ["active/AAAAA1: too many reverse jump records"]
    assert not batch.ok


def test_pointer_past_end_of_file():
    data = size_record(1, 9999, 0, 0, 1, 0) + encode_record("p", b"%15d" % 5000)
    batch = read(data)[1]
    assert batch.warnings == ["AAAAA1: message rejected: missing end record"]


def test_pointer_into_heap_and_back(tmp_path):
    # A hand-made milter file: the dummy pointer before M now leads to a heap recipient.
    env = basic_envelope("a@d")
    env.append(("p", b"%15d" % 0))
    data = bytearray(build(env, nrcpt=2))
    ptr = data.index(encode_record("p", b"%15d" % 0))
    heap_at = len(data)
    data += recs([("A", b"notify_flags=4"), ("R", b"heap@d")])
    data += encode_record("p", b"%15d" % (ptr + 17))
    data[ptr:ptr + 17] = encode_record("p", b"%15d" % heap_at)
    msg, batch = read(bytes(data))
    assert batch.ok and batch.warnings == []
    assert addresses(batch) == ["a@d", "heap@d"]
    assert batch.recipients[1].offset == heap_at + 16
    assert batch.recipients[1].dsn_notify == 4


# -- recipient side records ---------------------------------------------------------------


def test_out_of_order_recipient_records():
    env = basic_envelope()
    env += [("O", b"o1"), ("O", b"o2"), ("A", b"dsn_orig_rcpt=rfc822;x1"),
            ("o", b"rfc822;x2"), ("A", b"notify_flags=2"), ("n", b"8"), ("R", b"r@d"),
            ("O", b"dangling"), ("o", b"dangling-o"), ("n", b"4")]
    msg, batch = read(build(env))
    assert batch.ok
    assert batch.warnings == [
        f"{QID}: ignoring out-of-order original recipient <o1>",
        f"{QID}: ignoring out-of-order DSN original recipient address <rfc822;x1>",
        f"{QID}: ignoring out-of-order DSN notify flags <2>",
        f"{QID}: ignoring out-of-order DSN original recipient <dangling-o>",
        f"{QID}: ignoring out-of-order original recipient <dangling>",
    ]
    r = batch.recipients[0]
    assert (r.orig_addr, r.dsn_orcpt, r.dsn_notify) == ("o2", "rfc822;x2", 8)


def test_done_record_drops_pending_recipient_data():
    env = basic_envelope()
    env += [("O", b"o1"), ("n", b"2"), ("D", b"done@d"), ("R", b"r@d")]
    msg, batch = read(build(env))
    assert batch.warnings == []
    r = batch.recipients[0]
    assert (r.orig_addr, r.dsn_notify) == ("", 0)


@pytest.mark.parametrize("value", [b"0", b"16", b"3", b"abc", b"", b"-4", b" 4", b"9"])
def test_malformed_notify_flags(value):
    env = basic_envelope()
    env += [("n", value), ("R", b"r@d")]
    msg, batch = read(build(env))
    assert batch.ok and batch.recipients[0].dsn_notify == 0
    assert batch.warnings == [f"{QID}: ignoring malformed DSN notify flags <{value.decode()}>"]


@pytest.mark.parametrize(("value", "mask"), [(b"1", 1), (b"14", 14), (b"4294967298", 2)])
def test_valid_notify_flags(value, mask):
    env = basic_envelope()
    env += [("A", b"notify_flags=" + value), ("R", b"r@d")]
    msg, batch = read(build(env))
    assert batch.warnings == [] and batch.recipients[0].dsn_notify == mask


def test_payload_is_a_c_string():
    env = basic_envelope()
    env += [("O", b"orig\x00junk"), ("R", b"r@d\x00junk")]
    msg, batch = read(build(env))
    assert (batch.recipients[0].address, batch.recipients[0].orig_addr) == ("r@d", "orig")


def test_non_utf8_bytes_survive_the_round_trip():
    env = basic_envelope()
    env += [("R", b"caf\xe9@d")]
    msg, batch = read(build(env))
    assert batch.recipients[0].address.encode("utf-8", "surrogateescape") == b"caf\xe9@d"


# -- envelope records --------------------------------------------------------------------


def test_sender_first_wins_and_opened_uses_values_at_that_moment():
    env = basic_envelope("b@d")
    env.append(("S", b"second@x"))
    msg, batch = read(build(env, cont_length=0))
    assert msg.sender == "alice@example.org"
    assert batch.opened == Opened("alice@example.org", msg.data_size, 1)


def test_sender_before_size_record_logs_zeroes():
    data = build(basic_envelope("b@d"))
    data = recs([("S", b"early@x")]) + data
    # The C record is no longer first, but qmgr does not care where it is.
    msg, batch = read(data)
    assert batch.opened == Opened("early@x", 0, 0)


def test_null_sender():
    msg, batch = read(build(basic_envelope("b@d", sender="")))
    assert batch.ok and msg.sender == "" and batch.opened == Opened("", msg.cont_length, 1)


def test_time_and_create_time():
    env = basic_envelope("b@d")
    env[0] = ("T", b"1000 250")
    env[1] = ("c", b"900")
    env.insert(2, ("T", b"2000 1"))
    env.insert(2, ("A", b"create_time=800"))
    msg, _ = read(build(env))
    assert msg.arrival_time == (1000, 250) and msg.create_time == 900


def test_create_time_falls_back_to_arrival_seconds():
    env = basic_envelope("b@d")
    del env[1]
    msg, _ = read(build(env))
    assert msg.create_time == 1795344681


@pytest.mark.parametrize(("payload", "expected"), [
    (b"1795344681 411377", (1795344681, 411377)),
    (b"1795344681", (1795344681, 0)),
    (b" 123 456", (123, 123)),  # REC_TYPE_TIME_SCAN skips digits only, not blanks
    (b"12abc", (12, 0)),
    (b"99999999999999999999 1", (2**63 - 1, 1)),  # atol saturates
])
def test_time_record_parsing(payload, expected):
    env = basic_envelope("b@d")
    env[0] = ("T", payload)
    msg, _ = read(build(env))
    assert msg.arrival_time == expected


def test_zero_time_record_does_not_block_a_later_one():
    env = basic_envelope("b@d")
    env[0] = ("T", b"0 5")
    env.insert(1, ("T", b"77 6"))
    msg, batch = read(build(env))
    assert batch.ok and msg.arrival_time == (77, 6)


def test_warn_record_first_wins():
    env = basic_envelope("b@d")
    env.insert(5, ("W", b"%15d" % 1795344731))
    env.insert(6, ("W", b"%15d" % -1))
    data = build(env)
    msg, _ = read(data)
    assert msg.warn_time == 1795344731
    assert msg.warn_offset == offset_of(data, "W", b"%15d" % 1795344731)


def test_filter_redirect_inspector_last_wins():
    env = basic_envelope("b@d")
    env += [("L", b"smtp:[127.0.0.1]:10025"), ("I", b"old"), (">", b"first@x")]
    extracted: list[Rec] = [("L", b""), ("I", b"insp"), (">", b"second@x")]
    msg, batch = read(build(env, extracted=extracted, flags=READ_FLAG_MIXED_RCPT_OTHER))
    assert batch.ok
    assert (msg.filter, msg.inspector, msg.redirect) == ("", "insp", "second@x")


def test_envelope_id_and_ret_flags():
    env = basic_envelope("b@d")
    env += [("i", b"native"), ("A", b"envelope_id=attr"), ("A", b"ret_flags=2"),
            ("<", b"1"), ("<", b"3"), ("A", b"ret_flags=x")]
    msg, batch = read(build(env))
    assert msg.envelope_id == "attr" and msg.ret_flags == 1
    assert batch.warnings == [
        f"{QID}: ignoring malformed DSN RET flags in queue file record:3",
        f"{QID}: ignoring malformed DSN RET flags in queue file record:x",
    ]


def test_encoding_last_wins_across_segments():
    env = basic_envelope("b@d")
    env.insert(1, ("A", b"encoding=7bit"))
    msg, _ = read(build(env, extracted=[("A", b"encoding=8bit")]))
    assert msg.encoding == "8bit"


def test_log_attributes_override_legacy_names():
    env = basic_envelope("b@d")
    env[1:1] = [("A", b"client_name=legacy.example"), ("A", b"client_name=legacy2"),
                ("A", b"log_client_address=192.0.2.1"), ("A", b"client_address=10.0.0.1"),
                ("A", b"client_port=25"), ("A", b"log_helo_name=helo1"),
                ("A", b"log_helo_name=helo2"), ("A", b"protocol_name=SMTP")]
    msg, batch = read(build(env))
    assert batch.warnings == []
    # client_name was set before any log_* attribute; legacy names after it are ignored.
    assert (msg.client_name, msg.client_address, msg.client_port, msg.helo_name,
            msg.protocol_name) == ("legacy.example", "192.0.2.1", "", "helo2", "")


def test_legacy_attributes_alone():
    env = basic_envelope("b@d")
    env[1:1] = [("A", b"client_name=h.example"), ("A", b"client_address=192.0.2.9"),
                ("A", b"client_port=2525"), ("A", b"protocol_name=ESMTP"),
                ("A", b"helo_name=h")]
    msg, _ = read(build(env))
    assert (msg.client_name, msg.client_address, msg.client_port, msg.protocol_name,
            msg.helo_name) == ("h.example", "192.0.2.9", "2525", "ESMTP", "h")


@pytest.mark.parametrize("name", ["sasl_method", "sasl_username", "sasl_sender", "log_ident",
                                  "rewrite_context"])
def test_single_valued_attributes(name):
    env = basic_envelope("b@d")
    del env[2]  # the sample rewrite_context
    env[1:1] = [("A", f"{name}=one".encode()), ("A", f"{name}=two".encode())]
    msg, batch = read(build(env))
    assert getattr(msg, name) == "one"
    assert batch.warnings == [f"{QID}: ignoring multiple {name} attribute: two"]


def test_messages_share_their_client_and_sender_strings_not_their_own_ids():
    """A full active queue holds thousands of messages from the same few clients:
    each holds the one copy of a client name, address, helo and sender (memory,
    issue #24), while a message's own values (log_ident, client_port) stay its own
    and the shared table stays bounded."""
    def one(qid: str, port: str) -> Message:
        env = basic_envelope("b@d", sender="bulk@example.org")
        env[1:1] = [("A", b"log_client_name=mx.example"), ("A", b"log_helo_name=mx"),
                    ("A", f"log_client_port={port}".encode()),
                    ("A", f"log_ident={qid}".encode())]
        msg, _ = read(build(env), qid=qid)
        return msg

    a, b = one("A1", "40001"), one("B2", "40002")
    assert a.client_name == b.client_name == "mx.example" and a.client_name is b.client_name
    assert a.helo_name is b.helo_name and a.sender is b.sender
    assert (a.log_ident, b.log_ident, a.client_port, b.client_port) == (
        "A1", "B2", "40001", "40002")
    assert "A1" not in shared_strings._TABLE and "40001" not in shared_strings._TABLE
    for i in range(shared_strings.LIMIT + 10):
        shared_strings.shared(f"sender{i}@example.org")
    assert len(shared_strings._TABLE) <= shared_strings.LIMIT


def test_rewrite_context_defaults_to_local():
    env = basic_envelope("b@d")
    del env[2]
    msg, _ = read(build(env))
    assert msg.rewrite_context == "local"
    env.insert(2, ("A", b"rewrite_context=remote"))
    msg, _ = read(build(env))
    assert msg.rewrite_context == "remote"


def test_unknown_attributes_and_legacy_records_are_ignored():
    env = basic_envelope("b@d")
    env += [("A", b"whatever=1"), ("K", b"anything")]
    extracted: list[Rec] = [("P", b"1"), ("r", b"rr"), ("e", b"ee"), ("F", b"full")]
    msg, batch = read(build(env, extracted=extracted))
    assert batch.ok and batch.warnings == []


@pytest.mark.parametrize(("env_extra", "warning", "delims"), [
    ([("V", b"+=")], None, "+="),
    ([("V", b"-=")], None, "-="),
    ([("V", b"+x")], 'ignoring bad VERP request: "+x"', ""),
    ([("V", b"+=+")], 'ignoring bad VERP request: "+=+"', ""),
    ([("V", b"+\x00=")], 'ignoring bad VERP request: "+"', ""),
    ([("V", b"x+"), ("V", b"=+"), ("V", b"-=")], 'ignoring bad VERP request: "x+"', "=+"),
])
def test_verp(env_extra, warning, delims):
    env = basic_envelope("b@d") + env_extra
    msg, batch = read(build(env))
    assert batch.warnings == ([f"{QID}: {warning}"] if warning else [])
    assert msg.verp_delims == delims


def test_verp_null_sender_and_before_sender():
    msg, batch = read(build(basic_envelope("b@d", sender="") + [("V", b"+=")]))
    assert batch.warnings == [f"{QID}: ignoring VERP request for null sender"]
    assert msg.verp_delims == ""
    env = basic_envelope("b@d")
    env.insert(1, ("V", b"+="))
    msg, batch = read(build(env))
    assert batch.warnings == [f"{QID}: ignoring VERP request for null sender"]


def test_verp_filter_is_configurable():
    msg, batch = read(build(basic_envelope("b@d") + [("V", b"#%")]), verp_filter="#%")
    assert msg.verp_delims == "#%" and batch.warnings == []


def test_smtputf8_and_cont_length_fields():
    msg, _ = read(build(basic_envelope("b@d"), cont_length=12345, smtputf8=5))
    assert (msg.cont_length, msg.smtputf8) == (12345, 5)


def test_read_message_raises_queue_file_error():
    with pytest.raises(QueueFileError) as exc:
        read_message(b"garbage text\n", QID)
    assert exc.value.warnings[-1] == f"{QID}: message rejected: missing end record"
    assert exc.value.batch is not None and not exc.value.batch.ok
    msg, batch = read_message(sample("sample_hold_65CC420E1F4.bin"), QID)
    assert len(batch.recipients) == 2


def test_custom_path_prefixes_record_warnings():
    batch = read(b"T\x11", path="active/6/AAAAA1")[1]
    assert batch.warnings[0] == "active/6/AAAAA1: unexpected EOF in data, record type 84 length 17"


def test_fifty_thousand_recipients_is_fast():
    rcpts = [f"user{i}@example.com" for i in range(50000)]
    env = basic_envelope()
    for r in rcpts:
        env += [("A", b"dsn_orig_rcpt=rfc822;" + r.encode()), ("O", r), ("R", r)]
    data = build(env)
    msg = Message(queue_id=QID)
    started = time.perf_counter()
    total = 0
    while True:
        batch = read_batch(data, msg, 5000)
        assert batch.ok
        total += len(batch.recipients)
        if not msg.rcpt_offset:
            break
    assert total == 50000 and batch.warnings == []
    assert time.perf_counter() - started < 5


# -- robustness --------------------------------------------------------------------------


def _read_all_batches(data: bytes, limit: int) -> None:
    # A pointer that leads back before the resume point makes every batch re-read the
    # same recipients, in stock too (only rec_goto's per-path count ends that, after
    # 10000 batches), so the number of batches is capped here, not asserted.
    msg = Message(queue_id=QID)
    for _ in range(50):
        batch = read_batch(data, msg, limit)
        assert isinstance(batch.warnings, list)
        assert all(isinstance(w, str) for w in batch.warnings)
        assert len(batch.recipients) <= limit
        if not batch.ok:
            assert batch.recipients == []
            return
        if not msg.rcpt_offset:
            return


def _read_message_cleanly(data: bytes) -> None:
    try:
        read_message(data, QID)
    except QueueFileError as exc:
        assert exc.warnings


_FUZZ = settings(max_examples=300, deadline=2000,
                 suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(st.binary(max_size=600), st.integers(min_value=1, max_value=4))
def test_fuzz_random_bytes(data, limit):
    record.reset_goto_state()
    _read_all_batches(data, limit)
    _read_message_cleanly(data)


def damaged(data: bytearray, draw: st.DataObject) -> bytes:
    """A real file with one to six random edits: bytes set, bits flipped, cut short,
    bytes inserted or deleted (also tests/test_queue_file_window.py's)."""
    for _ in range(draw.draw(st.integers(min_value=1, max_value=6))):
        kind = draw.draw(st.sampled_from(["set", "flip", "cut", "insert", "delete"]))
        pos = draw.draw(st.integers(min_value=0, max_value=max(len(data) - 1, 0)))
        if kind == "set" and data:
            data[pos] = draw.draw(st.sampled_from(b"CTcFILSDRO/WVA>K<ionMNXEpw\x00\x80\xff"))
        elif kind == "flip" and data:
            data[pos] ^= 1 << draw.draw(st.integers(min_value=0, max_value=7))
        elif kind == "cut":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw.draw(st.binary(min_size=1, max_size=20))
        elif kind == "delete":
            del data[pos:pos + draw.draw(st.integers(min_value=1, max_value=20))]
    return bytes(data)


@_FUZZ
@given(st.sampled_from(ALL_SAMPLES), st.data())
def test_fuzz_mutated_samples(name, draw):
    data = damaged(bytearray(sample(name)), draw)
    record.reset_goto_state()
    _read_all_batches(data, draw.draw(st.integers(min_value=1, max_value=3)))
    _read_message_cleanly(data)


# -- fast paths against the C-faithful scanners -------------------------------------------


def _sscanf_size(s: bytes) -> list[int]:
    """sscanf("%ld %ld %d %d %ld %d") field by field, through the strtol emulation."""
    values: list[int] = []
    pos = 0
    for index in range(6):
        value, pos, ok = queue_file._strtol(s, pos)
        if not ok:
            break
        values.append(value if index in (0, 1, 4) else queue_file._int32(value))
    return values


def _regex_nameval(buf: bytes) -> tuple[str | None, bytes, bytes]:
    m = queue_file._NAMEVAL.match(buf)
    if m is None:
        stripped = buf.lstrip(queue_file._SPACES)
        if not stripped or stripped[0] == 0x3D:
            return "missing attribute name", b"", b""
        return "missing '=' after attribute name", b"", b""
    return None, m.group(1), buf[m.end():].strip(queue_file._SPACES)


_SIZE_PIECES = [b"1", b"0", b"9", b" ", b"\t", b"\n", b"\v", b"-", b"+", b"x", b"99999",
                b"2147483648", b"4294967296", b"99999999999999999999"]
_NAMEVAL_PIECES = [b"a", b"_", b"=", b" ", b"\t", b"\v", b"1", b"\xc3", b"-", b"Z", b".",
                   b"log_client_name"]


@given(st.lists(st.sampled_from(_SIZE_PIECES), max_size=14))
@settings(max_examples=3000, deadline=None)
def test_size_record_fast_path_scans_like_sscanf(pieces):
    s = b"".join(pieces)
    assert queue_file._scan_size(s) == _sscanf_size(s)


@given(st.lists(st.sampled_from(_NAMEVAL_PIECES), max_size=10))
@settings(max_examples=3000, deadline=None)
def test_attribute_fast_path_splits_like_split_nameval(pieces):
    buf = b"".join(pieces)
    assert queue_file._split_nameval(buf) == _regex_nameval(buf)
