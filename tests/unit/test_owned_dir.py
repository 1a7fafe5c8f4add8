"""The daemon's own directories: made, reused, and never anything else at the name."""

from __future__ import annotations

import os
import pwd
import stat

import pytest

from pyqmgr.daemon.owned_dir import owned_directory

ME = pwd.getpwuid(os.geteuid()).pw_name


def test_made_then_reused(tmp_path):
    path = str(tmp_path / "pyqmgr")
    for _ in range(2):
        fd = owned_directory(path, ME, 0o700)
        try:
            assert stat.S_ISDIR(os.fstat(fd).st_mode)
        finally:
            os.close(fd)


def test_unknown_owner_makes_nothing(tmp_path):
    with pytest.raises(KeyError):
        owned_directory(str(tmp_path / "pyqmgr"), "no-such-user-pyqmgr", 0o700)
    assert not os.path.exists(tmp_path / "pyqmgr")


@pytest.mark.parametrize("kind", ["file", "symlink", "dangling"])
def test_anything_else_at_the_name_is_left_alone(tmp_path, kind):
    path = tmp_path / "pyqmgr"
    if kind == "file":
        path.write_text("in the way\n")
    elif kind == "symlink":
        (tmp_path / "elsewhere").mkdir()
        path.symlink_to(tmp_path / "elsewhere")
    else:
        path.symlink_to(tmp_path / "nowhere")
    with pytest.raises(NotADirectoryError):
        owned_directory(str(path), ME, 0o700)
    assert os.path.lexists(path) and not (tmp_path / "nowhere").exists()


def test_other_failures_are_os_errors(tmp_path):
    with pytest.raises(OSError) as info:
        owned_directory(str(tmp_path / "missing" / "pyqmgr"), ME, 0o700)
    assert not isinstance(info.value, NotADirectoryError)
    assert info.value.strerror
