"""The daemon's window on a queue file reads what the whole file gives, and no content.

:class:`~pyqmgr.postfix.queue_file.FileWindow` reads a queue file on demand with
``pread`` (issue #30: the whole file was read for every recipient batch, so a 4 MB
message cost 10x the CPU of a small one). It must change nothing that stock's reading
decides: every real sample and every mutated or random file gives the same batches,
warnings and message state through a window of any size as from the whole bytes, and
a file's content is never read.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyqmgr.postfix import record
from pyqmgr.postfix.queue_file import READ_CHUNK, FileWindow, Message, read_batch
from tests.test_queue_file import ALL_SAMPLES, QID, basic_envelope, build, damaged, sample

#: Windows from a few bytes (every record straddles one) to the daemon's own.
CHUNKS = (1, 3, 7, 64, READ_CHUNK)


def _all_batches(source_for: object, limit: int) -> list[tuple[object, ...]]:
    """Every batch of a file, as stock's repeated reads would take them."""
    record.reset_goto_state()
    msg = Message(queue_id=QID)
    out: list[tuple[object, ...]] = []
    for _ in range(30):
        batch = read_batch(source_for(), msg, limit)  # type: ignore[operator]
        out.append((batch.ok, batch.warnings, batch.opened, batch.opened_after,
                    [(r.offset, r.address, r.orig_addr, r.dsn_orcpt, r.dsn_notify)
                     for r in batch.recipients],
                    {f: getattr(msg, f) for f in Message.__dataclass_fields__}))
        if not batch.ok or not msg.rcpt_offset:
            break
    return out


class _OpenFile:
    """A file on disk and its descriptor, for windows over it."""

    def __init__(self, data: bytes) -> None:
        fd, self.path = tempfile.mkstemp(prefix="pyqmgr-window-")
        os.write(fd, data)
        os.close(fd)
        self.fd = os.open(self.path, os.O_RDONLY)
        self.windows: list[FileWindow] = []

    def window(self, chunk: int, size_hint: int = 0) -> FileWindow:
        w = FileWindow(self.fd, size_hint, chunk=chunk)
        self.windows.append(w)
        return w

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)


@pytest.fixture
def open_file() -> Iterator[type[_OpenFile]]:
    made: list[_OpenFile] = []

    class Made(_OpenFile):
        def __init__(self, data: bytes) -> None:
            super().__init__(data)
            made.append(self)

    yield Made
    for f in made:
        f.close()


def _same_through_windows(data: bytes, limit: int, open_file: type[_OpenFile]) -> None:
    whole = _all_batches(lambda: data, limit)
    f = open_file(data)
    for chunk in CHUNKS:
        assert _all_batches(lambda c=chunk: f.window(c), limit) == whole, f"chunk {chunk}"
    # The daemon's first read is sized by the file's size.
    assert _all_batches(lambda: f.window(READ_CHUNK, len(data)), limit) == whole


@pytest.mark.parametrize("name", ALL_SAMPLES)
@pytest.mark.parametrize("limit", [1, 2, 5000])
def test_real_samples_read_the_same_through_any_window(name: str, limit: int,
                                                       open_file: type[_OpenFile]) -> None:
    _same_through_windows(sample(name), limit, open_file)


_FUZZ = settings(max_examples=150, deadline=5000,
                 suppress_health_check=[HealthCheck.too_slow,
                                        HealthCheck.function_scoped_fixture])


@_FUZZ
@given(st.sampled_from(ALL_SAMPLES), st.data())
def test_damaged_samples_read_the_same_through_any_window(
        open_file: type[_OpenFile], name: str, draw: st.DataObject) -> None:
    data = damaged(bytearray(sample(name)), draw)
    _same_through_windows(data, draw.draw(st.integers(min_value=1, max_value=3)), open_file)


@_FUZZ
@given(st.binary(max_size=400))
def test_random_bytes_read_the_same_through_any_window(
        open_file: type[_OpenFile], data: bytes) -> None:
    _same_through_windows(data, 2, open_file)


def _big_message(body_bytes: int, recipients: int = 20) -> bytes:
    line = b"x" * 998
    lines = [("N", line)] * (body_bytes // 1000)
    return build(basic_envelope(*(f"u{i}@example.com" for i in range(recipients))),
                 content=[("N", b"Subject: big"), ("N", b"")] + lines)


def test_the_content_is_never_read(open_file: type[_OpenFile]) -> None:
    data = _big_message(4 << 20)
    assert len(data) > 4 << 20
    f = open_file(data)
    w = f.window(READ_CHUNK, len(data))
    msg = Message(queue_id=QID)
    batch = read_batch(w, msg, 5000)
    assert batch.ok and len(batch.recipients) == 20
    # The first read (64 KiB at most) and the extracted segment's: two windows.
    assert w.bytes_read <= 2 * READ_CHUNK, w.bytes_read


def test_a_later_batch_reads_from_where_the_last_one_stopped(
        open_file: type[_OpenFile]) -> None:
    data = _big_message(1 << 20, recipients=3000)
    f = open_file(data)
    msg = Message(queue_id=QID)
    first = f.window(READ_CHUNK, len(data))
    assert len(read_batch(first, msg, 1000).recipients) == 1000
    resume = msg.rcpt_offset
    later = f.window(READ_CHUNK)
    batch = read_batch(later, msg, 1000)
    assert batch.ok and batch.recipients[0].address == "u1000@example.com"
    assert batch.recipients[0].offset == resume
    # Its reads began at the resume point: one window's worth, nothing before it.
    assert later.bytes_read <= READ_CHUNK and later.start >= resume
