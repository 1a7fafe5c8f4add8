"""A directory of the daemon's own, made as root before the privilege drop.

The control socket's directory (``$queue_directory/pyqmgr``) and the suspensions'
state directory (``$data_directory/pyqmgr``) are both made while the daemon is still
root and handed to mail_owner, so that the daemon can use them after it drops to
mail_owner (and after a chroot). The one way to do that safely is written here once:
whatever is at the name is opened without following a symbolic link, and only a real
directory is chowned and chmodded, through its descriptor, so that root never changes
what someone else pointed the name at.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import stat


def owned_directory(path: str, owner: str, mode: int) -> int:
    """Make ``path`` if absent; return it opened, owned by ``owner`` with ``mode``.

    The owner and mode are set only when running as root (a test run as a user makes
    the directory its own). The caller closes the descriptor.

    Raises KeyError when ``owner`` is no user (before anything is made),
    NotADirectoryError when the name is there but is not a directory (a file or a
    symbolic link: left as it is), and OSError for any other failure.
    """
    pw = pwd.getpwnam(owner)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, mode)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            raise NotADirectoryError(exc.errno, exc.strerror, path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
        if os.geteuid() == 0:
            if (st.st_uid, st.st_gid) != (pw.pw_uid, pw.pw_gid):
                os.fchown(fd, pw.pw_uid, pw.pw_gid)
            if stat.S_IMODE(st.st_mode) != mode:
                os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd
