"""What ``pyqmgr install`` keeps so that ``uninstall`` can give everything back.

**master.cf.** Install replaces one word, the ``qmgr unix`` entry's command column,
in place: every other byte of master.cf (the admin's alignment, comments, line
breaks, the entry's place) stays, which ``postconf -F`` does not promise (it
rewrites the entry in its own layout, after the comment lines that follow it).
Before that, install saves master.cf as ``master.cf.pyqmgr-backup``: the last
master.cf that ran no pyqmgr. So the backup is written whenever install switches a
qmgr that is not pyqmgr's (an older backup from an earlier round is replaced, and
install says so), and kept when master.cf already runs a pyqmgr (switching from
another installation: that master.cf is no stock one).

Uninstall puts back the command word the backup's qmgr entry has (``qmgr`` without a
backup), and then decides between the two cases exactly:

* **nothing else changed since install**: master.cf, with that word back, equals the
  backup byte for byte, or differs from it only in the qmgr entry's layout (an
  install by an older pyqmgr through ``postconf -F``: the same columns and arguments,
  the entry at most moved across comment lines). The backup's bytes are written and
  the backup removed: it says nothing master.cf does not.
* **otherwise** (a service added, another line or a comment changed since install):
  only the command word is replaced, so those edits survive, and the backup is kept
  for ``diff``, named with its date.

**State.** The daemon keeps two directories of its own, both named ``pyqmgr``: the
control socket's in queue_directory and the suspensions' in data_directory. They
mean nothing to stock qmgr, so uninstall removes them once the pyqmgr daemon that
used them has exited (reload ends it; uninstall waits for that, within a bound).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import time
from collections.abc import Callable

from pyqmgr.postfix.expand import C_SPACE
from pyqmgr.postfix.master_cf import EntryText, locate_entry, replace_command

BACKUP_SUFFIX = ".pyqmgr-backup"
#: The daemon's own directory in queue_directory and in data_directory.
STATE_DIR = "pyqmgr"
#: Seconds uninstall waits for the pyqmgr daemon to exit after the reload.
EXIT_WAIT = 15.0


class RollbackError(Exception):
    """A file could not be read or written; says which and why."""


def _decode(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RollbackError(f"cannot read {path}: {exc.strerror}") from None


def write_file(path: str, data: bytes, like: str | None = None) -> None:
    """Replace ``path``'s content in one rename, with the owner and mode of ``like``
    (default: of ``path`` itself).

    A reader (master(8) at reload, postconf) sees the old file or the new one, never
    half of one. A master.cf that is a symbolic link (configuration management)
    stays one: the file it points to is replaced.
    """
    real = os.path.realpath(path)
    tmp = f"{real}.pyqmgr-tmp"
    try:
        st = os.stat(os.path.realpath(like) if like else real)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chown(tmp, st.st_uid, st.st_gid)
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
            os.replace(tmp, real)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        raise RollbackError(f"cannot write {path}: {exc.strerror}") from None


def saved_at(path: str) -> str:
    """When the backup was saved (its modification time), as a person reads it."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(os.stat(path).st_mtime))
    except OSError:
        return "an unknown date"


def _qmgr(text: str) -> EntryText | None:
    return locate_entry(text, "qmgr", "unix")


def command_word(text: str) -> str | None:
    """The qmgr/unix entry's command word in a master.cf text, or None."""
    entry = _qmgr(text)
    return None if entry is None else entry.columns[7]


def set_command(master_cf: str, current: str, word: str) -> bool:
    """Replace the qmgr/unix command word ``current`` by ``word``, every other byte kept.

    False (nothing written) when this reader does not find ``current`` where
    postconf did: the caller then lets ``postconf -F`` edit the entry.
    """
    data = _read(master_cf)
    if data is None:
        raise RollbackError(f"{master_cf}: no such file")
    text = _decode(data)
    entry = _qmgr(text)
    if entry is None or entry.columns[7] != current:
        return False
    write_file(master_cf, _encode(replace_command(text, entry, word)))
    return True


def save_backup(master_cf: str, runs_pyqmgr: bool) -> list[str]:
    """Keep ``master.cf.pyqmgr-backup`` the last master.cf that ran no pyqmgr.

    ``runs_pyqmgr``: master.cf's qmgr already runs a pyqmgr (another installation's
    launcher), so it is not saved over the backup. Returns what was done.
    """
    backup = master_cf + BACKUP_SUFFIX
    old = _read(backup)
    if runs_pyqmgr:
        if old is None:
            return [f"note: no backup saved: {master_cf} already runs pyqmgr, and "
                    f"{os.path.basename(backup)} must be a master.cf from before pyqmgr"]
        return [f"kept {backup} (saved {saved_at(backup)}): the last master.cf before "
                "pyqmgr"]
    data = _read(master_cf)
    if data is None:
        raise RollbackError(f"{master_cf}: no such file")
    if old == data:
        return [f"kept {backup} (saved {saved_at(backup)}, the same as master.cf)"]
    when = saved_at(backup)
    write_file(backup, data, like=master_cf)
    if old is None:
        return [f"saved {backup}"]
    return [f"replaced {backup} of {when} (master.cf has changed since) with today's "
            "master.cf: uninstall restores that one"]


def stock_word(master_cf: str, is_pyqmgr: Callable[[str], bool],
               default: str = "qmgr") -> str:
    """The command uninstall gives back: the backup's, unless it has none or a pyqmgr one."""
    data = _read(master_cf + BACKUP_SUFFIX)
    word = command_word(_decode(data)) if data is not None else None
    return word if word is not None and not is_pyqmgr(word) else default


def _outside(text: str, entry: EntryText) -> tuple[list[str], int]:
    """The physical lines of ``text`` but the entry's own (its comment lines stay), and
    the index among them where the entry was."""
    own = {offset for offset, _length in entry.lines}
    lines: list[str] = []
    where = -1
    offset = 0
    for line in text.split("\n"):
        line += "\n"  # one too many at the very end: the same for both texts
        if offset in own:
            where = len(lines) if where < 0 else where
        else:
            lines.append(line)
        offset += len(line)
    return lines, where


def _is_comment(line: str) -> bool:
    content = line.lstrip(C_SPACE)
    return not content or content.startswith("#")


def only_layout_differs(current: str, backup: str) -> bool:
    """Do two master.cf texts differ in the qmgr entry's layout alone?

    The same lines outside the entry; the entry with the same columns and arguments
    (``-o`` values compared as ``name=value``); and at most moved across comment or
    blank lines, as ``postconf -F`` moves it.
    """
    a, b = _qmgr(current), _qmgr(backup)
    if a is None or b is None or a.meaning() != b.meaning():
        return False
    (lines_a, at_a), (lines_b, at_b) = _outside(current, a), _outside(backup, b)
    if lines_a != lines_b:
        return False
    low, high = sorted((at_a, at_b))
    return all(_is_comment(line) for line in lines_a[low:high])


def _changed_lines(a: str, b: str) -> int:
    """Lines added, removed or changed (a changed line counts once)."""
    import difflib

    matcher = difflib.SequenceMatcher(None, a.split("\n"), b.split("\n"), autojunk=False)
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in matcher.get_opcodes()
               if tag != "equal")


def restore(master_cf: str, current: str, word: str) -> list[str] | None:
    """Give the qmgr entry back ``word``; from the backup when nothing else changed.

    None (nothing written) when the entry is not where postconf found it: the caller
    edits with ``postconf -F``. Returns what was done, the backup's fate included.
    """
    backup = master_cf + BACKUP_SUFFIX
    data = _read(master_cf)
    old = _read(backup)
    text = _decode(data or b"")
    entry = _qmgr(text)
    if data is None or entry is None or entry.columns[7] != current:
        return None
    edited = _encode(replace_command(text, entry, word))
    if old is None:
        write_file(master_cf, edited)
        return [f"qmgr service command: {word}",
                f"edited the qmgr line of {master_cf} in place (no {backup} to restore from)"]
    when = saved_at(backup)
    if edited == old or only_layout_differs(_decode(edited), _decode(old)):
        write_file(master_cf, old)
        done = [f"qmgr service command: {word}",
                f"restored {master_cf} from {backup} (saved {when}), byte for byte: "
                "nothing else in it had changed since install"]
        remove_noted(os.unlink, backup, backup, done, ": master.cf is the same file again")
        return done
    write_file(master_cf, edited)
    changed = _changed_lines(_decode(old), _decode(edited))
    return [f"qmgr service command: {word}",
            f"edited only the qmgr line of {master_cf}: it has changed since install "
            f"({changed} line(s) differ from the backup), and those changes are kept",
            f"kept {backup} (saved {when}): master.cf as it was before install; "
            f"'diff -u {backup} {master_cf}' shows what changed since"]


# -- the daemon's own directories --------------------------------------------------------


def _children_running(master_pid_file: str, launcher: str) -> list[int]:
    """The pids of master's children that run ``launcher`` (the pyqmgr daemon)."""
    try:
        with open(master_pid_file) as f:
            master = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return []
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, IndexError):
            continue
        if int(fields[1]) == master and os.fsencode(launcher) in argv:
            found.append(int(name))
    return found


def daemon_pids(queue_dir: str, launcher: str) -> list[int]:
    """The instance's pyqmgr daemons: master's children running ``launcher``.

    master's pid is in ``$queue_directory/pid/master.pid``; another instance's
    master has another pid, so its qmgr is never counted here.
    """
    return _children_running(os.path.join(queue_dir, "pid", "master.pid"), launcher)


def _wait_exited(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def _state_in(directory: str) -> str:
    """What the state directory held, in words."""
    try:
        with open(os.path.join(directory, "suspensions.json"), "rb") as f:
            records = json.loads(f.read(1 << 20)).get("suspensions") or []
    except FileNotFoundError:
        records = []
    except (OSError, ValueError, AttributeError):
        return "pyqmgr's state: an unreadable suspensions.json"
    count = len(records) if isinstance(records, list) else 0
    if not count:
        return "pyqmgr's state, no suspension in it"
    return (f"pyqmgr's state: {count} suspension{'s' if count != 1 else ''}, which stock "
            "qmgr does not know")


def remove_noted(remove: Callable[[str], object], path: str, label: str,
                 done: list[str], removed: str = "") -> bool:
    """Remove ``path`` with ``remove`` (os.unlink, shutil.rmtree) and say so in
    ``done``: 'removed LABEL' (and ``removed``'s words) or 'could not remove LABEL:
    why'; whether it went. Uninstall says each thing it removes, or why it could
    not, the same way wherever it removes it."""
    try:
        remove(path)
    except OSError as exc:
        done.append(f"could not remove {label}: {exc.strerror or exc}")
        return False
    done.append(f"removed {label}{removed}")
    return True


def _remove_tree(path: str, what: str, done: list[str]) -> None:
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        done.append(f"left {path}: not a directory (pyqmgr made a directory there)")
        return
    remove_noted(shutil.rmtree, path, f"{path} ({what})", done)


def remove_state(queue_dir: str, data_dir: str, pids: list[int],
                 timeout: float = EXIT_WAIT) -> list[str]:
    """Remove the daemon's directories once the daemons ``pids`` have exited.

    Stock qmgr reads neither: a suspension kept there would only come back in
    force at a later install, unasked.
    """
    control = os.path.join(queue_dir, STATE_DIR)
    state = os.path.join(data_dir, STATE_DIR)
    present = [p for p in (control, state) if os.path.lexists(p)]
    if not present:
        return []
    alive = _wait_exited(pids, timeout)
    if alive:
        return [f"left {' and '.join(present)}: the pyqmgr daemon (pid "
                f"{', '.join(map(str, alive))}) had not exited {timeout:g} s after the "
                "reload; 'pyqmgr uninstall' again removes them once it has"]
    done: list[str] = []
    _remove_tree(control, "the control socket's directory", done)
    _remove_tree(state, _state_in(state), done)
    return done
