"""The defer log reader (pyqmgr.postfix.bounce_log) on what Postfix writes and on what
it must survive: mixed old and new entries, malformed and unknown lines, bytes that
are not text, entries cut short, files far past its byte limit, names that are not
regular files. Its reasons are what ``pyqmgr explain`` shows of a deferred message."""

from __future__ import annotations

import os

import pytest

from pyqmgr.postfix import bounce_log
from pyqmgr.postfix.bounce_log import NO_ADDRESS, NO_REASON, parse, read_log

#: A defer log as bounce(8) of Postfix 3.7.11 wrote it (queue_files_lifecycle.md 4.5).
REAL = (b"\n<carol@defer.test>: test deferral\nrecipient=carol@defer.test\noffset=320\n"
        b"dsn_orig_rcpt=rfc822;carol@defer.test\nstatus=4.4.1\naction=delayed\n"
        b"reason=test deferral\n\n")


def test_an_entry_as_postfix_writes_it():
    log = parse(REAL, "defer/6/65CC420E1F4")
    (e,) = log.entries
    assert (e.recipient, e.offset, e.dsn_orig_rcpt) == ("carol@defer.test", 320,
                                                        "rfc822;carol@defer.test")
    assert (e.status, e.action, e.reason) == ("4.4.1", "delayed", "test deferral")
    assert log.warnings == [] and not log.cut
    assert log.last_by_offset() == {320: e}


def test_each_recipients_last_entry_wins():
    again = REAL.replace(b"test deferral", b"second try")
    other = REAL.replace(b"carol", b"dave").replace(b"320", b"400")
    log = parse(REAL + other + again, "d")
    assert [e.reason for e in log.entries] == ["test deferral", "test deferral",
                                               "second try"]
    assert log.last_by_offset()[320].reason == "second try"
    assert log.last_by_address()["dave@defer.test"].offset == 400


def test_old_style_entries_get_stocks_defaults():
    log = parse(b"<a@x>: 4.0.0 old text\n\n<>: to nobody\n\n", "defer/A")
    a, empty = log.entries
    assert (a.recipient, a.status, a.action, a.reason) == ("a@x", "4.0.0", "delayed",
                                                           "4.0.0 old text")
    assert empty.recipient == "(MAILER-DAEMON)"
    bounce = parse(b"<a@x>: gone\n\n", "bounce/A", "bounce").entries[0]
    assert (bounce.status, bounce.action) == ("5.0.0", "failed")


def test_malformed_and_unknown_lines_are_skipped_with_stocks_words():
    data = (b"\nno equals sign\n=value\n\x00\x01binary=1\nwhat=ever\n<a@x> no colon\n"
            b"recipient=b@x\noffset=-5\nnotify_flags=999\nstatus=4.4.1\n\n")
    log = parse(data, "defer/B")
    (e,) = log.entries
    assert (e.recipient, e.offset, e.notify_flags, e.status) == ("b@x", 0, 0, "4.4.1")
    assert e.reason == NO_REASON and e.action == "delayed"
    assert log.warnings == [
        "defer/B: malformed record: missing '=' after attribute name",
        "defer/B: malformed record: =value...",
        "defer/B: malformed record: ??binary=1...",
        "defer/B: unknown attribute name: what, ignored",
        "defer/B: malformed record: <a@x> no colon..."]


def test_an_entry_of_nothing_but_junk_still_counts_with_place_holders():
    (e,) = parse(b"junk line\n\n", "d").entries
    assert (e.recipient, e.reason) == (NO_ADDRESS, NO_REASON)


def test_bytes_that_are_not_text_become_question_marks():
    (e,) = parse(b"recipient=a\xff\xfe@x\nreason=caf\xc3\xa9 \x1b[31m red\n\n", "d").entries
    assert e.recipient == "a??@x"
    assert e.reason == "caf\u00e9 ?[31m red"


def test_an_entry_no_blank_line_ends_is_left_out_as_stock_leaves_it():
    log = parse(REAL + b"recipient=half@x\nreason=being written", "d")
    assert [e.recipient for e in log.entries] == ["carol@defer.test"]


def test_warnings_and_values_are_capped():
    log = parse(b"bad line\n" * 1000 + b"reason=" + b"r" * 100_000 + b"\n\n", "d")
    assert len(log.warnings) == bounce_log.MAX_WARNINGS + 1
    assert log.warnings[-1] == "d: 990 more warnings"
    assert len(log.entries[0].reason) == bounce_log.MAX_VALUE


def test_a_file_past_the_limit_is_read_in_part(tmp_path):
    path = tmp_path / "log"
    entry = REAL.replace(b"test deferral", b"x" * 300)
    count = 3 * 2**20 // len(entry)
    path.write_bytes(entry * count)
    log = read_log(str(path), limit=2**20)
    assert log is not None and log.cut
    assert (log.read, log.size) == (2**20, len(entry) * count)
    # Whole entries only: the one the limit cut is left out.
    assert len(log.entries) == 2**20 // len(entry)
    assert all(e.reason == "x" * 300 for e in log.entries)


def test_a_file_of_exactly_the_limit_is_whole(tmp_path):
    path = tmp_path / "log"
    path.write_bytes(REAL * 4)
    log = read_log(str(path), limit=len(REAL) * 4)
    assert log is not None and not log.cut and len(log.entries) == 4


def test_a_log_that_is_one_huge_line(tmp_path):
    path = tmp_path / "log"
    path.write_bytes(b"reason=" + b"z" * (4 * 2**20))
    log = read_log(str(path), limit=2**20)
    assert log is not None and log.entries == [] and log.read == 2**20 and log.cut


def test_no_log_a_link_and_a_fifo(tmp_path):
    assert read_log(str(tmp_path / "none")) is None
    real = tmp_path / "real"
    real.write_bytes(REAL)
    os.symlink(real, tmp_path / "link")
    with pytest.raises(OSError, match="symbolic link"):
        read_log(str(tmp_path / "link"))
    os.mkfifo(tmp_path / "fifo")  # opened without blocking, then refused
    with pytest.raises(OSError, match="not a regular file"):
        read_log(str(tmp_path / "fifo"))
    with pytest.raises(OSError, match="not a regular file"):
        read_log(str(tmp_path))
