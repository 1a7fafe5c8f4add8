"""The suspensions' state file: round trip, clocks, and every kind of bad file.

A real directory and real files; the daemon reaches them through a directory
descriptor, as it does under chroot.
"""

from __future__ import annotations

import argparse
import json
import os

import pytest

from pyqmgr.cli import parse_duration
from pyqmgr.daemon.suspensions import (
    MAX_STATE_BYTES,
    STATE_FILE,
    StateFile,
    format_duration,
)
from pyqmgr.postfix.maillog_client import MailLog
from pyqmgr.scheduler.suspension import Suspension, Target


class Log(MailLog):
    def __init__(self) -> None:
        super().__init__("test/qmgr")
        self.lines: list[str] = []

    def log(self, severity: str, text: str) -> None:
        self.lines.append(f"{severity}: {text}")


@pytest.fixture
def state(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield StateFile(fd, str(tmp_path))
    os.close(fd)


def test_round_trip_keeps_the_end_on_the_wall_clock(state, tmp_path):
    log = Log()
    s = Suspension(Target("smtp", "a.example"), "remote asked", "root (uid=0 pid=1)",
                   100.0, 700.0, 1_000_600.0)
    assert state.save([s], log)
    assert oct(os.stat(tmp_path / STATE_FILE).st_mode & 0o777) == "0o600"
    # Loaded by a process whose monotonic clock reads 5000 at wall time 1,000,100.
    (back,) = state.load(log, 5000.0, 1_000_100.0)
    assert back.target == s.target and back.reason == s.reason and back.who == s.who
    assert back.until == 5500.0 and back.ttl == 600.0 and back.wall_until == 1_000_600.0
    assert not log.lines
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_an_ended_suspension_is_logged_and_dropped(state):
    log = Log()
    state.save([Suspension(Target(None, "a.example"), "", "root", 0.0, 10.0, 1010.0)], log)
    assert state.load(log, 0.0, 2000.0) == []
    assert log.lines == ["info: control: suspension of destination a.example ended while "
                         "no qmgr was running (its ttl ran out)"]


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe", b"[]", b'{"version": 2}',
                                  b'{"version": 1}', b'{"version": 1, "suspensions": 3}'])
def test_a_corrupt_file_is_moved_aside_with_a_warning(state, tmp_path, body):
    (tmp_path / STATE_FILE).write_bytes(body)
    log = Log()
    assert state.load(log, 0.0, 0.0) == []
    assert len(log.lines) == 1 and log.lines[0].startswith("warning: ")
    assert "moved aside to suspensions.json.corrupt" in log.lines[0]
    assert not (tmp_path / STATE_FILE).exists()
    assert (tmp_path / (STATE_FILE + ".corrupt")).read_bytes() == body


def test_an_oversized_file_is_refused_without_reading_it_all(state, tmp_path):
    (tmp_path / STATE_FILE).write_bytes(b" " * (MAX_STATE_BYTES + 10))
    log = Log()
    assert state.load(log, 0.0, 0.0) == []
    assert f"larger than {MAX_STATE_BYTES} bytes" in log.lines[0]


def test_bad_records_are_skipped_one_by_one(state, tmp_path):
    good = {"transport": None, "destination": "ok.example", "reason": "", "by": "root",
            "since": 0, "until": 100}
    bad = [
        "a string",
        {**good, "destination": None},
        {**good, "destination": "has space"},
        {**good, "destination": "x" * 301},
        {**good, "reason": "line\nbreak"},
        {**good, "by": ""},
        {**good, "until": "soon"},
        {**good, "until": True},
        {**good, "since": 50, "until": 40},
        {**good, "until": 10 ** 9},
    ]
    (tmp_path / STATE_FILE).write_text(json.dumps({"version": 1,
                                                   "suspensions": [*bad, good]}))
    log = Log()
    (kept,) = state.load(log, 0.0, 10.0)
    assert kept.target == Target(None, "ok.example")
    assert len(log.lines) == len(bad)
    assert all(line.startswith("warning: ") and "; skipped" in line for line in log.lines)
    assert "record 1: not an object" in log.lines[0]


def test_a_symlink_is_not_followed(state, tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("{}")
    os.symlink(target, tmp_path / STATE_FILE)
    log = Log()
    assert state.load(log, 0.0, 0.0) == []
    assert "starting without" in log.lines[0]


def test_a_failed_save_is_a_warning(tmp_path):
    sub = tmp_path / "gone"
    sub.mkdir()
    fd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.rmdir(sub)
        log = Log()
        assert not StateFile(fd, str(sub)).save([], log)
        assert "cannot save operator suspensions" in log.lines[0]
    finally:
        os.close(fd)


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("15m", 900),
                                               ("2h", 7200), ("1d", 86400), ("1w", 604800),
                                               ("1.5h", 5400), ("2H", 7200)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-5m", "soon", "5y", "nan", "1e12"])
def test_bad_durations(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration(text)


@pytest.mark.parametrize(("seconds", "text"), [(90, "90s"), (900, "15m"), (7200, "2h"),
                                               (86400, "1d"), (5400, "90m"), (61, "61s")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text
