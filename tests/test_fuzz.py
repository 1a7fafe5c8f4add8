"""Property-based fuzzing of the two readers that take bytes from outside.

Any bytes make the queue-file reader report a clean result (``ok`` False with a
warning, or ok) and make the attribute-protocol reader raise only AttrError; never
another exception, which in the daemon would be a crash instead of a corrupt file or
a "malformed response". Structured fuzzing mutates real queue files that Postfix's
own cleanup wrote (tests/data/queue_samples).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyqmgr.postfix import queue_file
from pyqmgr.postfix.attr import AttrError, AttrParser, check_announcement
from pyqmgr.postfix.deliver_request import decode_reply

SAMPLES = os.path.join(os.path.dirname(__file__), "data", "queue_samples")
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _samples() -> list[bytes]:
    out = []
    for name in sorted(os.listdir(SAMPLES)):
        path = os.path.join(SAMPLES, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out.append(f.read())
    return out


SAMPLE_FILES = _samples()


def _read_all(data: bytes) -> None:
    """Read a file as qmgr does: a first batch, then further batches while it says more."""
    msg = queue_file.Message(queue_id="ABCDEF12345")
    batch = queue_file.read_batch(data, msg, 10)
    assert isinstance(batch.ok, bool)
    assert all(isinstance(w, str) for w in batch.warnings)
    rounds = 0
    while batch.ok and msg.rcpt_offset > 0 and rounds < 50:
        batch = queue_file.read_batch(data, msg, 10)
        rounds += 1
    if not batch.ok:
        assert batch.warnings, "a rejected file always says why"


@SETTINGS
@given(st.binary(max_size=4096))
def test_any_bytes_give_a_clean_queue_file_result(data):
    _read_all(data)


@SETTINGS
@given(st.sampled_from(range(len(SAMPLE_FILES))), st.data())
def test_mutated_real_queue_files_give_a_clean_result(index, data):
    raw = bytearray(SAMPLE_FILES[index])
    for _ in range(data.draw(st.integers(1, 8))):
        kind = data.draw(st.sampled_from(["flip", "cut", "insert", "dup"]))
        pos = data.draw(st.integers(0, max(len(raw) - 1, 0)))
        if kind == "flip" and raw:
            raw[pos] = data.draw(st.integers(0, 255))
        elif kind == "cut":
            del raw[pos:pos + data.draw(st.integers(1, 64))]
        elif kind == "insert":
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=32))
        elif kind == "dup" and raw:
            raw[pos:pos] = raw[pos:pos + data.draw(st.integers(1, 64))]
    _read_all(bytes(raw))


def _parse_all(chunks: list[bytes]) -> None:
    parser = AttrParser()
    try:
        for chunk in chunks:
            parser.feed(chunk)
            while (attrs := parser.pop()) is not None:
                for check in (lambda a: check_announcement(a, "delivery_protocol"),
                              decode_reply):
                    try:
                        check(attrs)
                    except AttrError:
                        pass
    except AttrError:
        pass


@SETTINGS
@given(st.lists(st.binary(max_size=512), max_size=8))
def test_any_bytes_give_attr_error_or_attributes(chunks):
    _parse_all(chunks)


_NAMES = st.sampled_from([b"status", b"dsn_status", b"dsn_action", b"reason", b"dsn_dtype",
                          b"dsn_dtext", b"dsn_mtype", b"dsn_mname", b"protocol", b"x"])


@SETTINGS
@given(st.lists(st.tuples(_NAMES, st.binary(max_size=20)), max_size=12),
       st.integers(1, 7))
def test_near_valid_replies_give_attr_error_or_a_reply(pairs, split):
    wire = b"".join(name + b"\0" + value.replace(b"\0", b"") + b"\0" for name, value in pairs)
    wire += b"\0"
    _parse_all([wire[i:i + split] for i in range(0, len(wire), split)])
