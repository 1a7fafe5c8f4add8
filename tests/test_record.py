"""Record framing against stock's record.c rules and real queue files."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pyqmgr.postfix import record
from pyqmgr.postfix.record import (
    REC_TYPE_EOF,
    Record,
    RecordError,
    c_string,
    encode_length,
    encode_record,
    off_cvt_string,
    put_record,
    rec_get_buf,
    rec_get_raw,
    rec_goto,
)

SAMPLES = Path(__file__).parent / "data" / "queue_samples"
PATH = "active/AAAAA1"


@pytest.fixture(autouse=True)
def _fresh_goto_state():
    record.reset_goto_state()
    yield
    record.reset_goto_state()


# -- length encoding ------------------------------------------------------------------------


@pytest.mark.parametrize(("length", "wire"), [
    (0, b"\x00"), (17, b"\x11"), (127, b"\x7f"), (128, b"\x80\x01"),
    (207, b"\xcf\x01"), (300, b"\xac\x02"), (16384, b"\x80\x80\x01"),
])
def test_length_encoding_examples(length, wire):
    # queue_files_lifecycle.md §2.1: 17 is 11, 207 is CF 01, 300 is AC 02.
    assert encode_length(length) == wire


@given(st.integers(min_value=0, max_value=2**31 - 1), st.binary(max_size=3))
def test_length_round_trip(length, tail):
    wire = b"N" + encode_length(length) + tail
    if length <= len(tail):
        rtype, payload, nxt = rec_get_buf(wire, 0, PATH)
        assert (rtype, payload) == (ord("N"), tail[:length])
    else:
        with pytest.raises(RecordError, match=f"length {length}$"):
            rec_get_buf(wire, 0, PATH)


def test_multi_byte_length_from_real_header():
    # §6.6: a 207-byte Subject header is stored as 4e cf 01 53 75 62 ...
    subject = b"Subject: " + b"x" * 198
    wire = encode_record("N", subject)
    assert wire[:4] == b"\x4e\xcf\x01S"
    assert rec_get_buf(wire + b"E\x00", 0, PATH) == (ord("N"), subject, 210)


def test_encode_record_accepts_str_and_int_type():
    assert encode_record(ord("R"), "bob@x") == b"R\x05bob@x"
    assert encode_record("M", b"") == b"M\x00"
    with pytest.raises(ValueError):
        encode_record(256, b"")


def test_put_record_writes_at_position():
    f = io.BytesIO()
    put_record(f, "S", b"a@b")
    put_record(f, "E", b"")
    assert f.getvalue() == b"S\x03a@bE\x00"


# -- reading and stock's errors ------------------------------------------------------------


def test_eof_at_type_byte_is_not_an_error():
    assert rec_get_buf(b"E\x00", 2, PATH) == (REC_TYPE_EOF, b"", 2)
    assert rec_get_raw(io.BytesIO(b""), PATH) == Record(REC_TYPE_EOF, b"", 0)


@pytest.mark.parametrize(("wire", "text"), [
    (b"T", "active/AAAAA1: unexpected EOF reading length, record type 84"),
    (b"T\x80", "active/AAAAA1: unexpected EOF reading length, record type 84"),
    (b"T\x111795", "active/AAAAA1: unexpected EOF in data, record type 84 length 17"),
    (b"garbage text\n", "active/AAAAA1: unexpected EOF in data, record type 103 length 97"),
    (b"N\x80\x80\x80\x80\x80\x01", "active/AAAAA1: too many length bits, record type 78"),
    # The fifth byte lands at bit 28 of a C int: 0x08 there is the sign bit.
    (b"N\x81\x80\x80\x80\x08", "active/AAAAA1: illegal length -2147483647, record type 78"),
    (b"N\x80\x80\x80\x80\x0f", "active/AAAAA1: illegal length -268435456, record type 78"),
])
def test_stock_error_texts(wire, text):
    with pytest.raises(RecordError) as exc:
        rec_get_buf(wire, 0, PATH)
    assert str(exc.value) == text
    with pytest.raises(RecordError) as exc:
        rec_get_raw(io.BytesIO(wire), PATH)
    assert str(exc.value) == text


def test_fifth_length_byte_without_sign_bit_is_a_plain_length():
    # 0x07 << 28 still fits a positive C int: a 1.8 GB record, reported as truncated.
    with pytest.raises(RecordError, match="unexpected EOF in data, record type 78 "
                                          "length 1879048192$"):
        rec_get_buf(b"N\x80\x80\x80\x80\x07", 0, PATH)


def test_maxsize_limit():
    with pytest.raises(RecordError, match="illegal length 5, record type 82$"):
        rec_get_buf(b"R\x05abcde", 0, PATH, maxsize=4)
    assert rec_get_buf(b"R\x05abcde", 0, PATH, maxsize=5)[1] == b"abcde"


def test_payload_may_hold_nuls():
    rtype, payload, _ = rec_get_buf(b"R\x03a\x00b", 0, PATH)
    assert payload == b"a\x00b"
    assert c_string(payload) == b"a"


def _physical_walk(data: bytes) -> list[tuple[int, str]]:
    out = []
    f = io.BytesIO(data)
    while True:
        rec = rec_get_raw(f, PATH)
        if rec.type == REC_TYPE_EOF:
            return out
        out.append((rec.offset, chr(rec.type)))


def test_physical_walk_of_real_file_matches_fact_sheet():
    data = (SAMPLES / "sample_hold_65CC420E1F4.bin").read_bytes()
    walk = _physical_walk(data)
    # §6.1: the envelope records and their offsets.
    assert walk[:13] == [(0, "C"), (97, "T"), (116, "A"), (140, "A"), (163, "F"),
                         (169, "S"), (188, "A"), (227, "O"), (245, "R"), (263, "A"),
                         (302, "O"), (320, "R"), (338, "M")]
    assert walk[-2:] == [(645, "X"), (647, "E")]
    # The in-memory reader agrees with the file reader everywhere.
    pos = 0
    for offset, rtype in walk:
        assert pos == offset
        got, _, pos = rec_get_buf(data, pos, PATH)
        assert chr(got) == rtype
    assert pos == len(data)


def test_heap_after_end_record_is_physically_present():
    data = (SAMPLES / "sample_milter_addrcpt_hold.bin").read_bytes()
    walk = _physical_walk(data)
    assert (682, "E") in walk
    assert walk[walk.index((682, "E")) + 1:] == [(684, "O"), (704, "R"), (724, "p"),
                                                 (741, "N"), (762, "p")]


# -- pointer records -----------------------------------------------------------------------


def test_pointer_values():
    assert rec_goto(b"              0", PATH) == 0
    assert rec_goto(b"            684", PATH) == 684
    assert rec_goto(b"\t 12", PATH) == 12
    assert rec_goto(b"", PATH) == 0  # off_cvt_string("") is 0: a dummy


@pytest.mark.parametrize(("payload", "shown"), [
    (b"  12x", "12x"), (b"-5", "-5"), (b"99999999999999999999", "99999999999999999999"),
    (b" 1 2", "1 2"),
])
def test_malformed_pointer(payload, shown):
    with pytest.raises(RecordError) as exc:
        rec_goto(payload, PATH)
    assert str(exc.value) == f"active/AAAAA1: malformed pointer record value: {shown}"


def test_pointer_text_stops_at_nul():
    assert rec_goto(b"  42\x00junk", PATH) == 42


def test_reverse_jump_guard_counts_jumps_to_or_before_the_last_target():
    assert rec_goto(b"500", PATH) == 500  # forward from 0: not counted
    assert rec_goto(b"600", PATH) == 600  # forward again
    for _ in range(record.REVERSE_JUMP_LIMIT):
        assert rec_goto(b"600", PATH) == 600  # same target counts as reverse
    with pytest.raises(RecordError) as exc:
        rec_goto(b"100", PATH)
    assert str(exc.value) == "active/AAAAA1: too many reverse jump records"


def test_reverse_jump_count_resets_when_another_path_is_read():
    for _ in range(record.REVERSE_JUMP_LIMIT):
        rec_goto(b"1", PATH)
    rec_goto(b"1", "active/OTHER")
    for _ in range(record.REVERSE_JUMP_LIMIT):
        rec_goto(b"1", PATH)  # a fresh count for PATH again


def test_off_cvt_string():
    assert off_cvt_string(b"0") == 0
    assert off_cvt_string(b"9223372036854775807") == 2**63 - 1
    assert off_cvt_string(b"9223372036854775808") == -1
    assert off_cvt_string(b"+1") == -1
    assert off_cvt_string("١".encode()) == -1  # non-ASCII digits are not digits
