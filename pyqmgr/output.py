"""Where the command-line tools write: directories and files no one else can redirect.

``pyqmgr compare`` and ``replay --compare`` need root (they start Postfix), and by
default write under the current directory. Run from a directory others can write to,
``makedirs(exist_ok=True)`` and a plain ``open`` would follow a symbolic link planted
there, and root would overwrite whatever it points at (issue #31). So an output
directory must be a real directory of the user running the tool, writable by no one
else, and files in it are created without following a link.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import IO, Any


class OutputError(Exception):
    """An output path pyqmgr will not write to; the text says why and what to do."""


def output_dir(path: str) -> str:
    """Make ``path`` (and what is missing above it), or accept it as it is: a real
    directory owned by this user, writable by no one else, under directories where
    no one else can swap it for a link (each is root's or this user's, and writable
    by no one else unless sticky, as /tmp is). OutputError otherwise."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        os.makedirs(parent, 0o755, exist_ok=True)
    _check_ancestors(os.path.realpath(parent))
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass
    except OSError as exc:
        raise OutputError(f"{path}: cannot make the directory: {exc.strerror}") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise OutputError(f"{path}: a symbolic link; name a directory of your own")
    if not stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{path}: not a directory")
    if st.st_uid != os.geteuid():
        raise OutputError(f"{path}: belongs to uid {st.st_uid}, not to you (uid "
                          f"{os.geteuid()}); name a directory of your own")
    if st.st_mode & 0o022:
        raise OutputError(f"{path}: others can write to it (mode "
                          f"{stat.S_IMODE(st.st_mode):04o}); name another or chmod go-w")
    return path


def _check_ancestors(directory: str) -> None:
    """Every directory from / down to ``directory`` (links resolved): one whose
    entries another user may rename is one where the output could be swapped for a
    link while a run writes into it."""
    me = os.geteuid()
    current = directory
    while True:
        st = os.stat(current)
        sticky = bool(st.st_mode & stat.S_ISVTX)
        if st.st_uid not in (0, me):
            raise OutputError(f"{current} belongs to uid {st.st_uid}: another user could "
                              "swap the output for a link; write elsewhere")
        if st.st_mode & 0o022 and not sticky:
            raise OutputError(f"{current} can be written by others (mode "
                              f"{stat.S_IMODE(st.st_mode):04o}, not sticky): another user "
                              "could swap the output for a link; write elsewhere")
        up = os.path.dirname(current)
        if up == current:
            return
        current = up


def open_new(path: str, mode: str = "w", **kw: Any) -> IO[Any]:
    """``open(path, mode)`` for writing that never follows a symbolic link at ``path``
    (ELOOP is an OutputError) and makes a new file mode 0644."""
    def opener(name: str, flags: int) -> int:
        return os.open(name, flags | os.O_NOFOLLOW, 0o644)

    try:
        return open(path, mode, opener=opener, **kw)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link where the file goes
            raise OutputError(f"{path}: a symbolic link; not written") from None
        raise
