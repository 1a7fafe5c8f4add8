"""Queue directories: names, hashing, readiness, scanning and moves (``mail_queue.c``).

Paths are relative to the queue directory, qmgr's working directory (also inside a
chroot). Hashed queues (``hash_queue_names``) put a file under one single-character
directory per ``hash_queue_depth`` level, derived from the queue id's microseconds.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

_VALID = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")
_B52 = "0123456789BCDFGHJKLMNPQRSTVWXYZbcdfghjklmnpqrstvwxyz"


def queue_id_ok(qid: str) -> bool:
    """Valid queue file names: non-empty, at most 255 of ``[A-Za-z0-9_]``."""
    return 0 < len(qid) <= 255 and all(c in _VALID for c in qid)


def _hash_chars(qid: str) -> str:
    """The characters hashing uses: the id's hex microseconds."""
    z = qid.rfind("z")
    if z >= 10:  # long queue id: 4 base-52 microsecond digits before the last 'z'
        usec = 0
        for ch in qid[z - 4:z]:
            pos = _B52.find(ch)
            if pos < 0:
                return qid
            usec = usec * 52 + pos
        return f"{usec:05X}"
    return qid


def queue_path(queue: str, qid: str, hashed: list[str], depth: int) -> str:
    if queue.lower() not in hashed:
        return f"{queue}/{qid}"
    chars = _hash_chars(qid)
    parts = [chars[i] if i < len(chars) else "_" for i in range(depth)]
    return "/".join([queue, *parts, qid])


def mail_open_ok(path: str) -> os.stat_result | None:
    """The stat of a complete queue file (regular, user bits exactly rwx), else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_mode & stat.S_IRWXU != stat.S_IRWXU:
        return None
    return st


def scan_all(queue: str) -> Iterator[str]:
    """Yield candidate names in readdir order, descending one-character directories.

    A generator, so the daemon can take one name per event-loop pass as stock does.
    """
    stack = [queue]
    while stack:
        directory = stack.pop()
        try:
            with os.scandir(directory) as it:
                entries = list(it)
        except OSError:
            continue
        subdirs = []
        for entry in entries:
            if len(entry.name) == 1:
                subdirs.append(f"{directory}/{entry.name}")
            elif queue_id_ok(entry.name):
                yield entry.name
        stack.extend(reversed(subdirs))


def rename_path(src: str, dst: str) -> None:
    """Rename, creating missing hash directories (mode 0700) once on ENOENT."""
    try:
        os.rename(src, dst)
    except FileNotFoundError:
        if not os.path.exists(src):
            raise
        os.makedirs(os.path.dirname(dst), mode=0o700, exist_ok=True)
        os.rename(src, dst)


def save_removed(path: str, qid: str) -> None:
    """``dont_remove``: keep the file under saved/, appending + until the name is free."""
    target = f"saved/{qid}"
    while os.path.exists(target):
        target += "+"
    os.makedirs("saved", mode=0o700, exist_ok=True)
    os.rename(path, target)
