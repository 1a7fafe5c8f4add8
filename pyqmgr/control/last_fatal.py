"""The daemon's last fatal error, kept where ``pyqmgr status`` can read it.

When the daemon cannot start (a bad pyqmgr.cf, a file someone else may change, a
missing library), it logs a ``fatal:`` line and exits; master(8) then holds the qmgr
service back for ``service_throttle_time`` and tries again. ``pyqmgr status`` finds
no daemon to ask, and the line that names the problem is in a maillog that the users
allowed to run ``status`` may not be able to read. So the daemon also writes the line,
with its time, to ``$queue_directory/pyqmgr/last-fatal``, and removes it once a start
succeeds; ``pyqmgr`` reads it when the daemon does not answer.

Why it looks the way it does:

* **Where.** ``$queue_directory/pyqmgr/`` is the daemon's own directory (the control
  socket's, mail_owner's, mode 0755), and the queue directory is the daemon's working
  directory before and after a chroot (master(8) starts it there), so one relative
  path serves a fatal before the privilege drop and one after it. Before the drop the
  daemon is root, and makes the directory when it is not there yet (a first start
  that fails), owned by the owner of the queue's own ``active`` directory (mail_owner),
  as the control channel would; after it, the directory is there already.
* **Who may read it**: the users who may run ``status``. The line may name files and
  settings. It is readable by everyone (0644) when ``authorized_mailq_users`` lets
  everyone read the scheduler's state (its default, ``static:anyone``); when it names
  login names, the file is 0600 with a POSIX access ACL that lets those users read it
  (where the file system has no ACLs, root alone reads it, and ``pyqmgr`` says so).
* **Safely written as root** in a directory mail_owner can write: a new file of a
  unique name, made without following a link, then renamed over the old one.
* **Bounded**: the text and the warnings before it are cut to a few kilobytes, and
  the reader reads at most :data:`MAX_BYTES`.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import stat
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from pyqmgr.daemon.owned_dir import owned_directory

#: The record, relative to the queue directory.
DIRECTORY = "pyqmgr"
NAME = "last-fatal"
PATH = os.path.join(DIRECTORY, NAME)

MAX_TEXT = 2000
MAX_WARNINGS = 20
#: What the reader reads at most: a record is far smaller.
MAX_BYTES = 64 * 1024

#: Linux's ``system.posix_acl_access`` value (``posix_acl_xattr.h``): a version, then
#: (tag, permissions, id) entries sorted by tag and id.
_ACL_XATTR = "system.posix_acl_access"
_ACL_VERSION = 2
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_ACL_UNDEFINED_ID = 0xFFFFFFFF
_READ, _READ_WRITE = 4, 6


@dataclass(frozen=True)
class LastFatal:
    """A kept fatal error: its text, the warnings logged with it, when and by whom."""

    text: str
    time: float
    pid: int = 0
    warnings: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, object]:
        return {"text": self.text, "time": self.time, "pid": self.pid,
                "warnings": list(self.warnings)}


def _is_queue_directory() -> bool:
    """The working directory is a Postfix queue directory (master's, or the chroot)."""
    for name in ("active", "deferred", "incoming"):
        try:
            if not stat.S_ISDIR(os.lstat(name).st_mode):
                return False
        except OSError:
            return False
    return True


def _directory() -> bool:
    """``pyqmgr/`` is there (made now, as root, when it is not); False: it cannot be."""
    try:
        st = os.lstat(DIRECTORY)
    except FileNotFoundError:
        st = None
    except OSError:
        return False
    if st is not None:
        return stat.S_ISDIR(st.st_mode)
    if os.geteuid() != 0:
        return False
    try:
        owner = pwd.getpwuid(os.lstat("active").st_uid).pw_name
        os.close(owned_directory(DIRECTORY, owner, 0o755))
    except (KeyError, OSError):
        return False
    return True


def readers_acl(uids: Iterable[int]) -> bytes:
    """A POSIX access ACL: the owner reads and writes, ``uids`` read, no one else."""
    entries = [(_ACL_USER_OBJ, _READ_WRITE, _ACL_UNDEFINED_ID)]
    entries += [(_ACL_USER, _READ, uid) for uid in sorted(set(uids))]
    entries += [(_ACL_GROUP_OBJ, 0, _ACL_UNDEFINED_ID), (_ACL_MASK, _READ, _ACL_UNDEFINED_ID),
                (_ACL_OTHER, 0, _ACL_UNDEFINED_ID)]
    return struct.pack("<I", _ACL_VERSION) + b"".join(
        struct.pack("<HHI", *entry) for entry in entries)


def keep(text: str, warnings: list[str] | tuple[str, ...] = (), *, public: bool,
         readers: Iterable[int] = (), now: float | None = None) -> bool:
    """Write the record in the queue directory (the working directory); False when
    it could not be written (the maillog still has the line). ``public``: everyone
    may read it; else root and ``readers`` (uids) only."""
    if not _is_queue_directory() or not _directory():
        return False
    record = LastFatal(text[:MAX_TEXT], time.time() if now is None else now, os.getpid(),
                       tuple(w[:MAX_TEXT] for w in warnings[:MAX_WARNINGS]))
    data = json.dumps(record.as_dict()).encode("utf-8")
    temp = os.path.join(DIRECTORY, f".{NAME}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temp)
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o644 if public else 0o600)
    except OSError:
        return False
    try:
        os.fchmod(fd, 0o644 if public else 0o600)  # whatever the umask says
        readers = list(readers)
        if not public and readers:
            with contextlib.suppress(OSError):  # no ACLs here: root alone reads it
                os.setxattr(fd, _ACL_XATTR, readers_acl(readers))
        os.write(fd, data)
        os.close(fd)
        os.rename(temp, PATH)
    except OSError:
        with contextlib.suppress(OSError):
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temp)
        return False
    return True


def clear() -> None:
    """A start succeeded: the kept fatal, if any, no longer says why there is none."""
    with contextlib.suppress(OSError):
        os.unlink(PATH)


def read(queue_directory: str) -> LastFatal | None:
    """The kept record of the instance at ``queue_directory``, or None when there is
    none (or it does not parse). PermissionError when only root may read it."""
    path = os.path.join(queue_directory, PATH)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except PermissionError:
        raise
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, MAX_BYTES)
    finally:
        os.close(fd)
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str) or not isinstance(
            obj.get("time"), int | float):
        return None
    warnings = obj.get("warnings")
    pid = obj.get("pid")
    return LastFatal(obj["text"][:MAX_TEXT], float(obj["time"]),
                     pid if isinstance(pid, int) else 0,
                     tuple(str(w)[:MAX_TEXT] for w in warnings[:MAX_WARNINGS])
                     if isinstance(warnings, list) else ())
