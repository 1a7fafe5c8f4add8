"""trust.RootFiles: the one opener for every file pyqmgr.cf names (issue #45, item 4).

Real files, FIFOs, devices and a real other owner (``nobody``), as the daemon meets
them at start-up; each case is refused with the path and the reason in the text,
and a good file is read whole. The table kinds' loaders are run through it too.
"""

from __future__ import annotations

import os
import pwd
import time
from pathlib import Path

import pytest

from pyqmgr.bounded import TooLarge
from pyqmgr.postfix.lookup_table import open_table
from pyqmgr.pyqmgr_cf import PyqmgrCf
from pyqmgr.settings.scheduling import load_rules, scheduling_settings
from pyqmgr.settings.sites import site_settings
from pyqmgr.trust import RootFiles, UntrustedError, UntrustedFile

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")

NOBODY = pwd.getpwnam("nobody").pw_uid


@pytest.fixture
def etc(tmp_path: Path) -> Path:
    """A config_directory as Postfix keeps one: root's, 0755 (its parents, under
    /tmp, are Postfix's to answer for, as for pyqmgr.cf)."""
    path = tmp_path / "etc"
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    return path


def _file(path: Path, text: str = "a b\n", mode: int = 0o644) -> Path:
    path.write_text(text)
    os.chmod(path, mode)
    return path


def _refused(files: RootFiles, path: Path | str) -> str:
    began = time.monotonic()
    with pytest.raises(UntrustedFile) as err:
        files.read(str(path), 1 << 20)
    assert time.monotonic() - began < 1.0
    return str(err.value)


def test_a_good_file_is_read_whole(etc: Path) -> None:
    good = _file(etc / "classes", "alerts@shop.example transactional\n")
    assert RootFiles(str(etc)).read(str(good), 1 << 20) == \
        b"alerts@shop.example transactional\n"


def test_a_fifo_is_refused_at_once_by_name(etc: Path) -> None:
    fifo = etc / "classes"
    os.mkfifo(fifo, 0o644)
    assert _refused(RootFiles(str(etc)), fifo).startswith(f"{fifo}: is a FIFO; ")


def test_a_device_is_refused(etc: Path) -> None:
    assert _refused(RootFiles(str(etc)), "/dev/null").startswith(
        "/dev/null: is a character device; ")


def test_a_directory_is_refused(etc: Path) -> None:
    assert _refused(RootFiles(str(etc)), etc).startswith(f"{etc}: is a directory; ")


def test_another_users_file_is_refused_with_its_owner(etc: Path) -> None:
    theirs = _file(etc / "rules")
    os.chown(theirs, NOBODY, -1)
    text = _refused(RootFiles(str(etc)), theirs)
    assert text.startswith(f"{theirs}: owned by uid {NOBODY}, not root (user nobody)")


def test_a_link_to_another_users_file_is_refused(etc: Path) -> None:
    theirs = _file(etc / "theirs")
    os.chown(theirs, NOBODY, -1)
    link = etc / "classes"
    link.symlink_to(theirs)
    assert f"{theirs}: owned by uid {NOBODY}" in _refused(RootFiles(str(etc)), link)


def test_a_link_out_through_an_open_directory_is_refused(etc: Path, tmp_path: Path) -> None:
    """Outside config_directory the chain to the target is judged (here only below
    tmp_path: config_directory's own parents are Postfix's to answer for)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    link = etc / "classes"
    link.symlink_to(_file(shared / "classes"))
    assert _refused(RootFiles(str(etc)), link).startswith(
        f"{shared}: writable by others (on the way to {link})")


def test_a_group_writable_file_and_directory_are_refused(etc: Path) -> None:
    loose = _file(etc / "loose", mode=0o664)
    assert _refused(RootFiles(str(etc)), loose).startswith(f"{loose}: writable by group")
    sub = etc / "maps"
    sub.mkdir()
    os.chmod(sub, 0o777)
    inner = _file(sub / "tenants")
    assert f"{sub}: writable by others" in _refused(RootFiles(str(etc)), inner)


def test_an_oversized_file_is_refused_unread(etc: Path) -> None:
    big = _file(etc / "big", "x" * 2000)
    with pytest.raises(TooLarge, match=f"{big}: larger than 1000 bytes"):
        RootFiles(str(etc)).read(str(big), 1000)


def test_a_missing_file_is_the_callers_oserror(etc: Path) -> None:
    with pytest.raises(FileNotFoundError):
        RootFiles(str(etc)).read(str(etc / "none"), 1000)


def _settings(etc: Path, values: dict[str, str]) -> PyqmgrCf:
    return PyqmgrCf(str(etc / "pyqmgr.cf"), True, values, read_as_root=True)


def test_each_loader_goes_through_it(etc: Path) -> None:
    """A FIFO as a response rules file, a provider table, a pin file, a texthash
    and an indexed (hash:) table: each loader refuses it by name. The same settings
    without ``read_as_root`` (the simulator's) are not judged."""
    fifo = etc / "fifo"
    os.mkfifo(fifo, 0o644)
    os.mkfifo(etc / "fifo.db", 0o644)
    cases = [
        lambda: scheduling_settings(_settings(etc, {"smtp_response_rules": str(fifo)})),
        lambda: site_settings(_settings(etc, {"site_grouping": "mx",
                                              "site_providers": f"builtin {fifo}"}),
                              {"smtp": "smtp"}, ""),
        lambda: site_settings(_settings(etc, {"site_grouping": "mx",
                                              "site_pins": str(fifo)}), {"smtp": "smtp"}, ""),
        lambda: open_table(f"texthash:{fifo}", files=RootFiles(str(etc))),
        lambda: open_table(f"hash:{fifo}", files=RootFiles(str(etc))),
    ]
    for case in cases:
        with pytest.raises(UntrustedError, match=f"^{fifo}(.db)?: is a FIFO"):
            case()
    theirs = _file(etc / "theirs", "shop.example transactional\n")
    os.chown(theirs, NOBODY, -1)
    with pytest.raises(UntrustedError, match=f"owned by uid {NOBODY}"):
        load_rules(str(theirs), files=RootFiles(str(etc)))
    assert open_table(f"texthash:{theirs}").get("shop.example") == "transactional"
