"""Queue directories: id validation, hashing, readiness, scanning, moves."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from pyqmgr.postfix import mail_queue
from pyqmgr.postfix.mail_queue import (
    dir_forest,
    hash_name,
    long_id_usec,
    mail_open_ok,
    mail_queue_id_ok,
    mail_queue_path,
    mail_queue_rename,
    queue_id_usec,
    queue_path,
    rename_path,
    save_removed,
    scan_all,
    set_file_times,
)

HASHED = ["deferred", "defer"]


@pytest.fixture
def queue_dir(tmp_path, monkeypatch):
    """A queue directory as qmgr's working directory."""
    monkeypatch.chdir(tmp_path)
    for q in ("incoming", "active", "deferred", "defer", "corrupt", "saved"):
        (tmp_path / q).mkdir(mode=0o700)
    return tmp_path


# -- ids and hashing ---------------------------------------------------------------------


@pytest.mark.parametrize(("qid", "ok"), [
    ("65CC420E1F4", True), ("4jXQsY32GMzJDK5", True), ("example_com", True), ("A", True),
    ("x" * 255, True), ("x" * 256, False), ("", False), ("123456.789", False),
    ("65CC420E1F4#FIX", False), ("a-b", False), ("é", False), ("a/b", False),
])
def test_mail_queue_id_ok(qid, ok):
    assert mail_queue_id_ok(qid) is ok
    assert mail_queue.queue_id_ok(qid) is ok


def test_short_id_hashing():
    # §1.2: the verified move of 65CC420E1F4 to deferred/6/.
    assert mail_queue_path("deferred", "65CC420E1F4", HASHED, 1) == "deferred/6/65CC420E1F4"
    assert mail_queue_path("defer", "65CC420E1F4", HASHED, 1) == "defer/6/65CC420E1F4"
    assert mail_queue_path("deferred", "65CC420E1F4", HASHED, 3) == \
        "deferred/6/5/C/65CC420E1F4"
    assert mail_queue_path("incoming", "65CC420E1F4", HASHED, 1) == "incoming/65CC420E1F4"
    assert mail_queue_path("active", "65CC420E1F4", HASHED, 2) == "active/65CC420E1F4"


def test_hash_queue_names_match_case_insensitively():
    assert queue_path("deferred", "ABC", ["DEFERRED"], 1) == "deferred/A/ABC"
    assert queue_path("Deferred", "ABC", "hold, deferred", 1) == "Deferred/A/ABC"
    assert queue_path("hold", "ABC", "hold,deferred", 1) == "hold/A/ABC"
    assert queue_path("hold", "ABC", "", 1) == "hold/ABC"


def test_short_name_pads_with_underscore():
    assert mail_queue_path("deferred", "AB", HASHED, 4) == "deferred/A/B/_/_/AB"
    assert dir_forest("x", 2) == "x/_/"


def test_long_id_hashing():
    # §1.3: 4jXQsY32GMzJDK5 has usec 32GM = 427979 = 687CB and went to deferred/6/.
    qid = "4jXQsY32GMzJDK5"
    assert long_id_usec(qid) == 427979
    assert hash_name(qid) == "687CB"
    assert mail_queue_path("deferred", qid, HASHED, 1) == f"deferred/6/{qid}"
    assert mail_queue_path("deferred", qid, HASHED, 3) == f"deferred/6/8/7/{qid}"
    # Same instant in short form (687CB20E004, postsuper's conversion) hashes alike.
    assert mail_queue_path("deferred", "687CB20E004", HASHED, 3) == \
        "deferred/6/8/7/687CB20E004"


def test_long_id_detection_uses_last_z_with_ten_chars_before_it():
    assert long_id_usec("4jXQsY32GMzJDK5") == 427979
    assert long_id_usec("65CC420E1F4") is None  # no z: short
    assert long_id_usec("123456789z1") is None  # only 9 characters before the z
    # The *last* z separates: an earlier z belongs to the microseconds ("001z" = 103).
    assert long_id_usec("4jXQsY0001zz") == 1 * 52 + 51


def test_long_id_microseconds_decode_like_stock():
    # Fields with characters outside the base-52 alphabet decode as 0: 00000.
    assert long_id_usec("4jXQsYAAAAzJDK5") == 0  # vowels are not in the alphabet
    assert mail_queue_path("deferred", "4jXQsY3_GMzJDK5", HASHED, 1) == \
        "deferred/0/4jXQsY3_GMzJDK5"
    # The largest field, zzzz, gives six hex digits; only the leading ones are used.
    assert hash_name("4jXQsYzzzzzJDK5") == "6F90FF"
    assert mail_queue_path("defer", "4jXQsYzzzzzJDK5", HASHED, 2) == \
        "defer/6/F/4jXQsYzzzzzJDK5"


def test_every_queue_id_holds_its_files_microseconds():
    """Short ids start with them in 5 hex digits, long ids hold them in base 52; what
    is neither (or holds more than a second's worth) gives None."""
    assert queue_id_usec("3DBAF20E599") == 0x3DBAF == 252847
    assert queue_id_usec("00000ABC") == 0
    assert queue_id_usec("4jXQsY32GMzJDK5") == 427979
    for bad in ("F424020E599", "3dbaf20e599", "3DBAF", "NOQUEUE", "", "B1F2G3H4I5J"):
        assert queue_id_usec(bad) is None, bad


def test_long_id_round_trips_through_the_alphabet():
    for usec in (0, 1, 51, 52, 427979, 999999):
        field = ""
        value = usec
        for _ in range(4):
            field = mail_queue.SAFE_CHARS[value % 52] + field
            value //= 52
        qid = f"4jXQsY{field}zJDK5"
        assert long_id_usec(qid) == usec
        assert hash_name(qid) == f"{usec:05X}"


def test_bad_names_are_refused():
    with pytest.raises(ValueError):
        mail_queue_path("deferred", "bad.name", HASHED, 1)
    with pytest.raises(ValueError):
        mail_queue_path("de/ferred", "ABC", HASHED, 1)
    with pytest.raises(ValueError):
        mail_queue_path("deferred", "ABC", HASHED, 0)


# -- readiness ---------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "ready"), [
    (0o700, True), (0o740, True), (0o710, True), (0o777, True), (0o744, True),
    (0o600, False), (0o400, False), (0o500, False), (0o300, False), (0o000, False),
])
def test_mail_open_ok_needs_user_bits_exactly_rwx(queue_dir, mode, ready):
    path = queue_dir / "incoming" / "ABCDE1"
    path.write_bytes(b"x")
    os.chmod(path, mode)
    st = mail_open_ok("incoming/ABCDE1")
    assert (st is not None) is ready
    if ready:
        assert stat.S_IMODE(st.st_mode) == mode and st.st_size == 1


def test_mail_open_ok_odd_files(queue_dir):
    warnings: list[str] = []
    assert mail_open_ok("incoming/MISSING", warn=warnings.append) is None
    assert warnings == []  # ENOENT is silent
    (queue_dir / "incoming" / "ADIR").mkdir(mode=0o700)
    assert mail_open_ok("incoming/ADIR", warn=warnings.append) is None
    os.symlink("/etc/passwd", queue_dir / "incoming" / "ALINK")
    assert mail_open_ok("incoming/ALINK", warn=warnings.append) is None
    uid = os.getuid()
    assert warnings == [f"incoming/ADIR: uid {uid}: not a regular file",
                        f"incoming/ALINK: uid {uid}: not a regular file"]


def test_mail_open_ok_warns_about_persistent_second_link(queue_dir, monkeypatch):
    path = queue_dir / "incoming" / "ABCDE2"
    path.write_bytes(b"x")
    os.chmod(path, 0o700)
    os.link(path, queue_dir / "active" / "ABCDE2")
    warnings: list[str] = []
    assert mail_open_ok("incoming/ABCDE2", warn=warnings.append) is not None
    assert warnings == []  # a fresh second link is a rename in progress
    monkeypatch.setattr(mail_queue.time, "time", lambda: time.time_ns() / 1e9 + 120)
    assert mail_open_ok("incoming/ABCDE2", warn=warnings.append) is not None
    assert warnings == [f"incoming/ABCDE2: uid {os.getuid()}: file has 2 links"]


# -- scanning ----------------------------------------------------------------------------


def _expected_scan(directory: str) -> list[str]:
    """Stock's walk, using the same readdir order: descend where a 1-char name is met."""
    out: list[str] = []
    for name in os.listdir(directory):
        if len(name) == 1:
            if os.path.isdir(f"{directory}/{name}"):
                out += _expected_scan(f"{directory}/{name}")
        else:
            out.append(name)
    return out


def test_scan_descends_one_char_directories_in_readdir_order(queue_dir):
    deferred = queue_dir / "deferred"
    for qid in ("AAAAA2", "AAAAA3", "AAAAA1", "AAAAA4", "65CC420E1F4", "F0000ABC"):
        target = deferred / mail_queue.hash_name(qid)[0]
        target.mkdir(exist_ok=True, mode=0o700)
        (target / qid).write_bytes(b"")
    (deferred / "B" / "C").mkdir(parents=True)  # depth 2 as well
    (deferred / "B" / "C" / "BC00001").write_bytes(b"")
    (deferred / "TOPLEVEL1").write_bytes(b"")  # a file in the wrong place is still seen
    got = list(scan_all("deferred"))
    assert got == _expected_scan("deferred")
    assert sorted(got) == sorted(["AAAAA2", "AAAAA3", "AAAAA1", "AAAAA4", "65CC420E1F4",
                                  "F0000ABC", "BC00001", "TOPLEVEL1"])


def test_scan_yields_invalid_names_for_the_caller_to_judge(queue_dir):
    for name in ("123456.789", "ABCDE#FIX", "GOOD1"):
        (queue_dir / "incoming" / name).write_bytes(b"")
    assert sorted(scan_all("incoming")) == ["123456.789", "ABCDE#FIX", "GOOD1"]


def test_scan_skips_one_char_files(queue_dir):
    (queue_dir / "incoming" / "x").write_bytes(b"")
    (queue_dir / "incoming" / "GOOD1").write_bytes(b"")
    warnings: list[str] = []
    assert list(scan_all("incoming", warn=warnings.append)) == ["GOOD1"]
    assert warnings == ["scan_dir_push: open directory incoming/x: Not a directory"]


def test_scan_of_missing_queue(queue_dir):
    warnings: list[str] = []
    assert list(scan_all("nosuchqueue", warn=warnings.append)) == []
    assert warnings == ["scan_dir_push: open directory nosuchqueue: No such file or directory"]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_scan_is_incremental_and_releases_directories(queue_dir):
    for i in range(5):
        sub = queue_dir / "deferred" / str(i)
        sub.mkdir()
        (sub / f"{i}AAAA").write_bytes(b"")
    before = _open_fds()
    scan = scan_all("deferred")
    first = next(scan)
    assert first.endswith("AAAA")
    assert _open_fds() == before + 2  # the queue and the current subdirectory
    scan.close()  # the daemon drops a scan when it restarts it
    assert _open_fds() == before
    # A file created during a scan in a directory not yet visited is found.
    scan = scan_all("deferred")
    names = [next(scan)]
    for i in range(5):
        path = queue_dir / "deferred" / str(i) / f"{i}BBBB"
        path.write_bytes(b"")
    names += list(scan)
    assert _open_fds() == before
    assert {f"{i}AAAA" for i in range(5)} <= set(names)
    assert len([n for n in names if n.endswith("BBBB")]) >= 4


# -- moves and time stamps ----------------------------------------------------------------


def test_rename_creates_missing_hash_directory(queue_dir):
    (queue_dir / "active" / "65CC420E1F4").write_bytes(b"q")
    rename_path("active/65CC420E1F4", "deferred/6/65CC420E1F4")
    assert (queue_dir / "deferred" / "6" / "65CC420E1F4").read_bytes() == b"q"
    assert stat.S_IMODE(os.stat(queue_dir / "deferred" / "6").st_mode) == 0o700
    assert not (queue_dir / "active" / "65CC420E1F4").exists()


def test_rename_creates_several_levels(queue_dir):
    (queue_dir / "active" / "65CC420E1F4").write_bytes(b"q")
    dst = mail_queue_rename("65CC420E1F4", "active", "deferred", HASHED, 3)
    assert dst == "deferred/6/5/C/65CC420E1F4"
    assert os.path.isfile(dst)
    for d in ("deferred/6", "deferred/6/5", "deferred/6/5/C"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_rename_of_vanished_file_raises_enoent(queue_dir):
    with pytest.raises(FileNotFoundError):
        rename_path("active/GONE1", "deferred/G/GONE1")
    with pytest.raises(FileNotFoundError):
        rename_path("active/GONE1", "incoming/GONE1")


def test_rename_reports_first_error_when_directories_cannot_be_made(queue_dir):
    (queue_dir / "active" / "ABC12").write_bytes(b"")
    (queue_dir / "deferred" / "A").write_bytes(b"")  # a file where a directory should be
    with pytest.raises(OSError) as exc:
        rename_path("active/ABC12", "deferred/A/ABC12")
    assert isinstance(exc.value, NotADirectoryError)
    assert os.path.exists("active/ABC12")


def test_nfs_workaround_treats_done_rename_as_success(queue_dir):
    (queue_dir / "incoming" / "DONE1").write_bytes(b"")
    notes: list[str] = []
    rename_path("active/DONE1", "incoming/DONE1", info=notes.append)
    assert notes == ["sane_rename(active/DONE1,incoming/DONE1): worked around spurious NFS "
                     "error"]


def test_set_file_times_uses_whole_seconds(queue_dir):
    path = queue_dir / "deferred" / "T1"
    path.write_bytes(b"")
    when = int(time.time()) + 300
    set_file_times("deferred/T1", when)
    st = os.stat(path)
    assert st.st_mtime_ns == st.st_atime_ns == when * 1_000_000_000


def test_save_removed_appends_plus_until_free(queue_dir):
    for _ in range(3):
        (queue_dir / "active" / "SAVE1").write_bytes(b"")
        save_removed("active/SAVE1", "SAVE1")
    assert sorted(os.listdir(queue_dir / "saved")) == ["SAVE1", "SAVE1+", "SAVE1++"]


def test_save_removed_creates_saved_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "active").mkdir()
    (tmp_path / "active" / "SAVE2").write_bytes(b"")
    assert save_removed("active/SAVE2", "SAVE2") == "saved/SAVE2"
    assert Path("saved/SAVE2").exists()
