"""Queue directories: names, hashing, readiness, scanning and moves (``mail_queue.c``).

Paths are relative to the queue directory, qmgr's working directory (also inside a
chroot). Hashed queues (``hash_queue_names``) put a file under one single-character
directory per ``hash_queue_depth`` level, taken from the queue id's hex microseconds, so
that the same file lands in the same place whichever Postfix program computes the path:
postsuper, showq and the delivery agents all compute it independently.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import stat
import time
from collections.abc import Callable, Iterable, Iterator

#: ``VALID_HOSTNAME_LEN``: the longest acceptable queue file name.
MAX_ID_LEN = 255
# One regex match per name instead of a per-character loop: these checks run several
# times per message on qmgr's hot path. \Z, not $, so that a trailing newline fails.
_ID_OK = re.compile(rf"[A-Za-z0-9_]{{1,{MAX_ID_LEN}}}\Z").match
_QUEUE_NAME_OK = re.compile(r"[A-Za-z0-9]{1,100}\Z").match

#: The long-id alphabet (``safe_ultostr.c``): digits and consonants, no vowels.
SAFE_CHARS = "0123456789BCDFGHJKLMNPQRSTVWXYZbcdfghjklmnpqrstvwxyz"
_SAFE_VALUE = {ch: i for i, ch in enumerate(SAFE_CHARS)}
MQID_LG_SEC_PAD = 6
MQID_LG_USEC_PAD = 4
MQID_LG_TIME_PAD = MQID_LG_SEC_PAD + MQID_LG_USEC_PAD
MQID_LG_INUM_SEP = "z"

#: ``MAIL_QUEUE_STAT_READY``: cleanup sets the user bits to rwx once the file is complete.
MAIL_QUEUE_STAT_READY = stat.S_IRWXU

Warn = Callable[[str], None]


def mail_queue_id_ok(qid: str) -> bool:
    """A valid queue file name: 1..255 of ``[A-Za-z0-9_]``.

    The ``_`` is there because ``flush/`` logs are named after domains; everything else
    (cleanup's ``usec.pid`` temporaries, postsuper's ``ID#FIX``) is skipped by scans.
    """
    return _ID_OK(qid) is not None


#: Older name, kept for callers.
queue_id_ok = mail_queue_id_ok


def mail_queue_name_ok(queue: str) -> bool:
    """A valid queue directory name: 1..100 alphanumerics."""
    return _QUEUE_NAME_OK(queue) is not None


def long_id_separator(qid: str) -> int:
    """Index of the long-id time/inode separator, or -1 for a short (hex) id.

    The last ``z`` with at least 10 characters before it (``MQID_FIND_LG_INUM_SEPARATOR``).
    """
    z = qid.rfind(MQID_LG_INUM_SEP)
    return z if z >= MQID_LG_TIME_PAD else -1


def safe_strtoul(text: str, base: int) -> int | None:
    """Decode a base-``base`` number in the long-id alphabet; None unless all of it is
    valid (stock's ``MQID_LG_DECODE`` error rule)."""
    value = 0
    if not text:
        return None
    for ch in text:
        digit = _SAFE_VALUE.get(ch, base)
        if digit >= base:
            return None
        value = value * base + digit
    return value


def long_id_usec(qid: str) -> int | None:
    """The microseconds of a long queue id, or None for a short id.

    An undecodable field gives 0, as stock's ``MQID_LG_GET_HEX_USEC`` does.
    """
    z = long_id_separator(qid)
    if z < 0:
        return None
    usec = safe_strtoul(qid[z - MQID_LG_USEC_PAD:z], 52)
    return usec if usec is not None else 0


#: ``MQID_SH_USEC_PAD``: a short id starts with the microseconds as 5 hex digits.
MQID_SH_USEC_PAD = 5
_SHORT_ID = re.compile(r"[0-9A-F]{6,}\Z").match


def queue_id_usec(qid: str) -> int | None:
    """The microseconds of the time the queue file was made, which every queue id
    holds (``mail_queue_enter``: gettimeofday, then the id); None for what is no queue
    id of either form. With a log's whole-second time stamps it places a message's
    arrival to the millisecond: smtpd takes the arrival time at MAIL FROM, and the
    cleanup server it opens makes the file at once."""
    usec = long_id_usec(qid)
    if usec is not None:
        return usec if usec < 1_000_000 else None
    if _SHORT_ID(qid) is None:
        return None
    usec = int(qid[:MQID_SH_USEC_PAD], 16)
    return usec if usec < 1_000_000 else None


def hash_name(qid: str) -> str:
    """The string whose leading characters name the hash directories.

    Short ids are used as they are (they start with 5 hex digits of microseconds); a
    long id's base-52 microseconds are re-encoded as ``%05X`` so both forms of the same
    instant hash alike.
    """
    usec = long_id_usec(qid)
    return qid if usec is None else f"{usec:05X}"


def dir_forest(name: str, depth: int) -> str:
    """``dir_forest``: one single-character directory per level, ``_`` past the end."""
    if not name:
        raise ValueError("dir_forest: empty path")
    if depth < 1:
        raise ValueError(f"dir_forest: depth {depth}")
    parts = []
    for i in range(depth):
        ch = name[i] if i < len(name) else "_"
        if ch in "./" or not ch.isprintable() or not ch.isascii():
            raise ValueError(f"dir_forest: invalid pathname: {name}")
        parts.append(ch + "/")
    return "".join(parts)


def is_hashed(queue: str, hash_queue_names: Iterable[str] | str) -> bool:
    """Whether ``queue`` is listed in ``hash_queue_names`` (case-insensitive)."""
    names = (_hashed_names(hash_queue_names) if isinstance(hash_queue_names, str)
             else frozenset(name.lower() for name in hash_queue_names))
    return queue.lower() in names


@functools.lru_cache(maxsize=16)
def _hashed_names(hash_queue_names: str) -> frozenset[str]:
    """The parsed ``hash_queue_names`` value; parsed once, not once per path."""
    return frozenset(name.lower() for name in hash_queue_names.replace(",", " ").split())


def mail_queue_dir(queue: str, qid: str, hash_queue_names: Iterable[str] | str,
                   hash_queue_depth: int) -> str:
    """The directory of a queue file, with a trailing slash (``mail_queue_dir``)."""
    if not mail_queue_name_ok(queue):
        raise ValueError(f"mail_queue_dir: bad queue name: {queue}")
    if not mail_queue_id_ok(qid):
        raise ValueError(f"mail_queue_dir: bad queue id: {qid}")
    if is_hashed(queue, hash_queue_names):
        return f"{queue}/{dir_forest(hash_name(qid), hash_queue_depth)}"
    return f"{queue}/"


def mail_queue_path(queue: str, qid: str, hash_queue_names: Iterable[str] | str,
                    hash_queue_depth: int) -> str:
    """The path of a queue file relative to the queue directory (``mail_queue_path``)."""
    return mail_queue_dir(queue, qid, hash_queue_names, hash_queue_depth) + qid


#: Older name, kept for callers.
queue_path = mail_queue_path


def mail_open_ok(path: str, *, warn: Warn | None = None) -> os.stat_result | None:
    """The lstat of a complete queue file, or None (``mail_open_ok``).

    Complete means a regular file whose user bits are exactly rwx: cleanup sets them
    last, so anything else is still being written (or was marked corrupt, 0400) and is
    skipped silently. ``warn`` receives stock's warnings for the odd cases (lstat errors
    other than ENOENT, not a regular file, a second hard link older than a minute).
    """
    try:
        st = os.lstat(path)
    except OSError as exc:
        if exc.errno != errno.ENOENT and warn is not None:
            warn(f"{path}: {exc.strerror}")
        return None
    if not stat.S_ISREG(st.st_mode):
        if warn is not None:
            warn(f"{path}: uid {st.st_uid}: not a regular file")
        return None
    if st.st_mode & stat.S_IRWXU != MAIL_QUEUE_STAT_READY:
        return None
    if st.st_nlink > 1 and warn is not None and st.st_ctime < time.time() - 60:
        warn(f"{path}: uid {st.st_uid}: file has {st.st_nlink} links")
    return st


def scan_all(queue: str, *, warn: Warn | None = None) -> Iterator[str]:
    """Yield the names in a queue directory tree, as ``mail_scan_dir_next`` does.

    Any one-character name is taken to be a hash subdirectory and descended into at the
    point it is met; every other name (``.``/``..`` excepted) is yielded, unfiltered and
    in readdir order, without sorting. The caller validates names: startup recovery
    logs the invalid ones, the feeder skips them.

    A generator holding its directories open, so the daemon can take one name per
    event-loop pass and the scan sees the directory as it changes, like stock's. Stock
    dies when a directory cannot be opened; so does the scan (:class:`ScanError`)
    unless ``warn`` is given, which is told and the directory skipped. (Skipping in
    silence once left mail in incoming for good while the qmgr was out of file
    descriptors: issue #31.)
    """
    stack: list = []  # open os.scandir iterators, innermost last
    try:
        top = _scan_dir_push(queue, warn)
        if top is None:
            return
        stack.append(top)
        paths = [queue]
        while stack:
            entry = next(stack[-1], None)
            if entry is None:
                stack.pop().close()
                paths.pop()
                continue
            name = entry.name
            if len(name) == 1:
                sub = f"{paths[-1]}/{name}"
                inner = _scan_dir_push(sub, warn)
                if inner is not None:
                    stack.append(inner)
                    paths.append(sub)
            else:
                yield name
    finally:
        for it in stack:
            it.close()


class ScanError(Exception):
    """A queue directory that cannot be opened: stock's scan_dir_push is fatal.

    Not an OSError subclass: this module is compiled (pyqmgr.build), and mypyc does
    not subclass most built-in types."""


def _scan_dir_push(path: str, warn: Warn | None) -> Iterator[os.DirEntry[str]] | None:
    """Open one directory of the scan; None (and ``warn`` told) where stock would die,
    or :class:`ScanError` without ``warn``."""
    try:
        return os.scandir(path)
    except OSError as exc:
        text = f"scan_dir_push: open directory {path}: {exc.strerror}"
        if warn is None:
            raise ScanError(text) from None
        warn(text)
        return None


#: Stock's name for the scanner.
mail_scan_dir = scan_all


def mail_queue_mkdirs(path: str) -> None:
    """Create the missing directories above ``path`` with mode 0700 (``make_dirs``).

    Like stock, a new directory gets the process's effective group if the system gave
    it another one.
    """
    parent = os.path.dirname(path)
    if not parent:
        raise ValueError(f"mail_queue_mkdirs: no slash in: {path}")
    egid = os.getegid()
    current = "/" if parent.startswith("/") else ""
    for part in parent.split("/"):
        if not part:
            continue
        current = os.path.join(current, part) if current else part
        try:
            st = os.stat(current)
        except FileNotFoundError:
            try:
                os.mkdir(current, 0o700)
            except FileExistsError:
                pass  # lost a race: fine if it is a directory
            st = os.stat(current)
            if stat.S_ISDIR(st.st_mode) and st.st_gid != egid:
                os.chown(current, -1, egid)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), current)


def sane_rename(src: str, dst: str, *, info: Warn | None = None) -> None:
    """rename(2), treating "source gone, destination present" as success.

    That is stock's workaround for NFS reporting a failure for a rename that did happen.
    """
    try:
        os.rename(src, dst)
    except OSError:
        if not os.path.exists(src) and os.path.exists(dst):
            if info is not None:
                info(f"sane_rename({src},{dst}): worked around spurious NFS error")
            return
        raise


def rename_path(src: str, dst: str, *, info: Warn | None = None) -> None:
    """Move a queue file, creating missing hash directories (``mail_queue_rename``).

    Any failure is retried once after creating the destination's directories; the
    error of the retry (or of the first attempt, if the directories cannot be made)
    propagates, so a vanished source still raises FileNotFoundError.
    """
    try:
        sane_rename(src, dst, info=info)
        return
    except OSError as first:
        try:
            mail_queue_mkdirs(dst)
        except OSError:
            raise first from None
    sane_rename(src, dst, info=info)


def mail_queue_rename(qid: str, old_queue: str, new_queue: str,
                      hash_queue_names: Iterable[str] | str, hash_queue_depth: int,
                      *, info: Warn | None = None) -> str:
    """Move ``qid`` from one queue to another; returns the new path."""
    src = mail_queue_path(old_queue, qid, hash_queue_names, hash_queue_depth)
    dst = mail_queue_path(new_queue, qid, hash_queue_names, hash_queue_depth)
    rename_path(src, dst, info=info)
    return dst


def set_file_times(path: str, when: int) -> None:
    """Set atime and mtime to whole seconds, as stock's ``utime()`` does.

    For deferred files the mtime is the earliest next retry; stock's time stamps have no
    sub-second part, and neither do ours.
    """
    ns = int(when) * 1_000_000_000
    os.utime(path, ns=(ns, ns))


def save_removed(path: str, qid: str) -> str:
    """``dont_remove``: keep the file as ``saved/<name>``, appending ``+`` until the name
    is free (``REMOVE()``); returns the new path."""
    target = f"saved/{os.path.basename(path) or qid}"
    while os.path.exists(target):  # stat(), as stock
        target += "+"
    try:
        os.rename(path, target)
    except FileNotFoundError:
        if os.path.isdir("saved") or not os.path.exists(path):
            raise
        os.makedirs("saved", mode=0o700, exist_ok=True)
        os.rename(path, target)
    return target
