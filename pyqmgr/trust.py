"""Are the files the daemon runs changeable only by root?

master(8) starts qmgr as root. Stock qmgr is one binary that ``postfix check`` keeps an
eye on; pyqmgr is an interpreter, a virtual environment, a package directory, a settings
file and possibly policy modules, and every one of them is code or configuration that
root executes (before the privilege drop) or that the daemon imports later. If any of
them, or any directory above one of them, can be changed by another user, that user
can run code as root at the next ``postfix reload``. So the daemon refuses to start,
and ``pyqmgr install`` refuses to install, unless every such path is owned by root and
writable by no group and by no one else: the standard ``postfix check`` applies to
Postfix's own files, extended to the whole chain of directories.

A symbolic link is followed the way the kernel follows it: the directories leading to
the link are judged, and so are those leading to its target (and the target itself).
A sticky world-writable directory such as /tmp is judged untrusted too: its sticky bit
stops others from replacing root's entries, but it also lets anyone create a name
that a later check-then-use would trust, and nothing pyqmgr needs lives there.

Cost: one ``lstat`` per distinct path component, cached within a call. The daemon runs
this at every start on a few hundred paths (see :func:`daemon_paths`).
"""

from __future__ import annotations

import glob
import grp
import os
import pwd
import stat
import sys
import sysconfig
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from types import ModuleType

from pyqmgr.bounded import TooLarge, read_bounded

#: The kernel's limit on symbolic links followed in one lookup (ELOOP after 40).
MAX_SYMLINKS = 40


class UntrustedError(Exception):
    """Paths the daemon would run as root can be changed by others.

    ``str(err)`` is the fatal text (it names the first offending path); ``warnings``
    are the other problems, logged before it, so every offender is in the log.
    """

    def __init__(self, problems: Iterable[str]) -> None:
        problems = list(problems)
        more = (f" (and {len(problems) - 1} more, logged above)"
                if len(problems) > 1 else "")
        super().__init__(f"{problems[0]}{more}; pyqmgr starts as root and uses no file "
                         "that anyone but root can change")
        self.problems = problems
        self.warnings = [f"untrusted: {text}" for text in problems[1:]]


def _user(uid: int) -> str:
    try:
        return f" (user {pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return ""


def _group(gid: int) -> str:
    try:
        return f"gid {gid}, {grp.getgrgid(gid).gr_name}"
    except KeyError:
        return f"gid {gid}"


def judge(path: str, st: os.stat_result) -> list[str]:
    """What is wrong with one file system object, without looking at its parents.

    A symbolic link's own mode bits mean nothing on Linux (they are always 0777), so
    only its owner is judged; what it points to is judged separately.
    """
    problems: list[str] = []
    if st.st_uid != 0:
        problems.append(f"{path}: owned by uid {st.st_uid}, not root{_user(st.st_uid)}")
    if stat.S_ISLNK(st.st_mode):
        return problems
    # Writable by others says all there is to say; its group bit would only add noise.
    if st.st_mode & stat.S_IWOTH:
        if stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX:
            problems.append(f"{path}: writable by others (a sticky world-writable "
                            "directory such as /tmp is not trusted either)")
        else:
            problems.append(f"{path}: writable by others")
    elif st.st_mode & stat.S_IWGRP:
        problems.append(f"{path}: writable by group ({_group(st.st_gid)})")
    return problems


class _Checker:
    """One :func:`untrusted_paths` call: its lstat cache and its problems, in order."""

    def __init__(self, assume_trusted: Collection[str]) -> None:
        self.assume_trusted = {os.path.normpath(p) for p in assume_trusted}
        self.stats: dict[str, os.stat_result | OSError] = {}
        self.judged: set[str] = set()
        self.problems: dict[str, None] = {}

    def _lstat(self, path: str) -> os.stat_result | OSError:
        cached = self.stats.get(path)
        if cached is None:
            try:
                cached = os.lstat(path)
            except OSError as exc:
                cached = exc
            self.stats[path] = cached
        return cached

    def _report(self, texts: Iterable[str], origin: str, offender: str) -> None:
        for text in texts:
            if offender != origin:
                text = f"{text} (on the way to {origin})"
            self.problems.setdefault(text)

    def _judge(self, path: str, st: os.stat_result, origin: str) -> None:
        if path in self.assume_trusted or path in self.judged:
            return
        self.judged.add(path)
        self._report(judge(path, st), origin, path)

    def check(self, path: str) -> None:
        """Walk ``path`` component by component from /, following links as the kernel."""
        # Made absolute but not normalised: "link/.." means the link target's parent,
        # as the kernel resolves it, which lexical normalisation would get wrong.
        origin = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
        root = self._lstat("/")
        if isinstance(root, OSError):  # pragma: no cover - / always exists
            self._report([f"/: cannot be checked: {root.strerror}"], origin, "/")
            return
        self._judge("/", root, origin)
        pending = [c for c in origin.split("/") if c]
        current = "/"
        links = 0
        while pending:
            part = pending.pop(0)
            if part == ".":
                continue
            if part == "..":
                current = os.path.dirname(current)
                continue
            candidate = os.path.join(current, part)
            st = self._lstat(candidate)
            if isinstance(st, OSError):
                self._report([f"{candidate}: cannot be checked: {st.strerror}"], origin,
                             candidate)
                return
            self._judge(candidate, st, origin)
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > MAX_SYMLINKS:
                    self._report([f"{origin}: too many levels of symbolic links"], origin,
                                 origin)
                    return
                try:
                    target = os.readlink(candidate)
                except OSError as exc:
                    self._report([f"{candidate}: cannot be checked: {exc.strerror}"],
                                 origin, candidate)
                    return
                pending[:0] = [c for c in target.split("/") if c]
                if target.startswith("/"):
                    current = "/"
            else:
                current = candidate


def untrusted_paths(paths: Iterable[str], *,
                    assume_trusted: Collection[str] = ()) -> list[str]:
    """Human-readable problems, each naming the offending path; empty when all is well.

    A path is untrusted when it, or any directory on the way to it (for a symbolic
    link: on the way to the link and on the way to its target), is not owned by
    root or is writable by its group or by others. A path that does not exist is a
    problem too (the caller asked about it). Each offender is reported once per
    reason, with the first checked path it was found on when that is another one.

    ``assume_trusted`` lists directories whose own owner and mode are not judged
    (they are still walked through): directories that belong to Postfix, such as
    daemon_directory and its parents, which ``postfix check`` answers for.
    """
    checker = _Checker(assume_trusted)
    for path in paths:
        checker.check(path)
    return list(checker.problems)


# -- what the daemon runs ------------------------------------------------------------------


def venv_root(python_executable: str) -> str | None:
    """The virtual environment an interpreter path belongs to, or None.

    The path is taken as given, not resolved: a venv's ``bin/python`` is a symbolic
    link to the base interpreter, and it is the link's location that makes it a venv.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(python_executable)))
    return root if os.path.isfile(os.path.join(root, "pyvenv.cfg")) else None


def _listing(directory: str) -> list[str]:
    try:
        return sorted(os.path.join(directory, name) for name in os.listdir(directory))
    except OSError:
        return []


def _import_dirs(python_executable: str) -> list[str]:
    """Directories the interpreter imports from: stdlib, lib-dynload, site-packages.

    For the running interpreter sysconfig knows; for another one only a venv's layout
    can be guessed without running it (and running it as root is what we must not do
    before it is trusted).
    """
    dirs: list[str] = []
    same = os.path.abspath(python_executable) == os.path.abspath(sys.executable)
    if same:
        paths = sysconfig.get_paths()
        stdlib = paths["stdlib"]
        dirs += [stdlib, os.path.join(stdlib, "lib-dynload"), paths["platstdlib"],
                 paths["purelib"], paths["platlib"]]
        # And whatever else the running interpreter imports from: a venv made with
        # --system-site-packages adds the system's dist-packages, a .pth file its own
        # directories; sysconfig names none of them (issue #31).
        dirs += [p for p in sys.path if p and os.path.isabs(p)]
    venv = venv_root(python_executable)
    if venv is not None:
        dirs += sorted(glob.glob(os.path.join(venv, "lib*", "python*", "site-packages")))
    seen: dict[str, None] = {}
    for d in dirs:
        if os.path.isdir(d):
            seen.setdefault(os.path.normpath(d))
    return list(seen)


def _is_site_dir(path: str) -> bool:
    return os.path.basename(path) in ("site-packages", "dist-packages")


def daemon_paths(python_executable: str, package_dir: str,
                 extra: Iterable[str] = ()) -> list[str]:
    """Every path the daemon runs or imports as root that pyqmgr is answerable for.

    - the interpreter and, for a venv, its directory and ``pyvenv.cfg``;
    - the import directories (stdlib, lib-dynload, site-packages); in site-packages
      also every top-level entry and its ``__pycache__``, because ``*.pth`` files there
      run code at every interpreter start (an editable install's finder lives there);
    - the pyqmgr package directory, walked: every directory and file in it,
      ``__pycache__`` included, since a stale ``.pyc`` is what actually gets loaded;
    - ``extra``: pyqmgr.cf, ``module:PATH`` policy files, loaded module files.

    Only existing paths are returned for the walked parts; ``extra`` is passed through.
    """
    paths: list[str] = [python_executable]
    venv = venv_root(python_executable)
    if venv is not None:
        paths += [venv, os.path.join(venv, "pyvenv.cfg")]
    for directory in _import_dirs(python_executable):
        paths.append(directory)
        if _is_site_dir(directory):
            entries = _listing(directory)
            paths += entries
            paths += _listing(os.path.join(directory, "__pycache__"))
    for dirpath, dirnames, filenames in os.walk(package_dir):
        dirnames.sort()
        paths.append(dirpath)
        paths += [os.path.join(dirpath, name) for name in sorted(filenames)]
    paths += list(extra)
    return list(dict.fromkeys(paths))


def ancestors(directory: str) -> list[str]:
    """``directory`` and every directory above it, up to / (for ``assume_trusted``)."""
    found = []
    path = os.path.abspath(directory)
    while True:
        found.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            return found
        path = parent


def _inside(path: str, directory: str) -> bool:
    return os.path.abspath(path).startswith(os.path.abspath(directory).rstrip("/") + "/")


def untrusted_installation(python_executable: str, package_dir: str, *, config_dir: str,
                           daemon_dir: str, settings: Iterable[str] = (),
                           launcher: Iterable[str] = (),
                           extra: Iterable[str] = ()) -> list[str]:
    """The one check the daemon and ``pyqmgr check`` share; problems, as above.

    - ``settings`` (pyqmgr.cf, ``module:PATH`` files): judged up to /, except that for
      those inside config_directory the directories *above* config_directory are
      walked through but not judged. Whoever can change those can replace main.cf and
      master.cf, which master(8) reads as root: pyqmgr cannot be safer than Postfix
      there, and ``postfix check`` is what answers for them. config_directory itself,
      and everything below it, is judged.
    - ``launcher`` (the launcher and its directory): the same, for daemon_directory,
      from which master(8) runs every Postfix daemon.
    - the interpreter, venv, import directories and package (:func:`daemon_paths`)
      and ``extra`` (loaded module files): judged all the way up to /.
    """
    settings = list(settings)
    inside = [p for p in settings if _inside(p, config_dir)]
    outside = [p for p in settings if not _inside(p, config_dir)]
    problems = untrusted_paths(inside, assume_trusted=ancestors(config_dir)[1:])
    problems += untrusted_paths(launcher, assume_trusted=ancestors(daemon_dir)[1:])
    problems += untrusted_paths(daemon_paths(python_executable, package_dir,
                                             [*outside, *extra]))
    return list(dict.fromkeys(problems))


def loaded_module_files(modules: Iterable[ModuleType | None]) -> list[str]:
    """The source and cached files of modules already imported (``sys.modules``).

    These are exactly the files that ran as root before the check could; checking them
    tells the admin which one to fix, even though it is too late for this start.
    """
    files: list[str] = []
    for module in modules:
        for attr in ("__file__", "__cached__"):
            path = getattr(module, attr, None)
            if isinstance(path, str) and os.path.exists(path):
                files.append(path)
    return files


def package_dir() -> str:
    """The directory of the pyqmgr package this code was imported from."""
    import pyqmgr

    return os.path.dirname(os.path.abspath(pyqmgr.__file__))


# -- files the settings name, read as root ---------------------------------------------------


#: What ``stat`` calls the file types a table, rules or pin file must not be.
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


class UntrustedFile(UntrustedError):
    """A file a pyqmgr.cf setting names (a table, response rules, provider or pin
    file) that the daemon will not read as root: ``str(err)`` names the path and why."""

    def __init__(self, problems: Iterable[str], why: str) -> None:
        problems = list(problems)
        Exception.__init__(self, f"{problems[0]}; {why}")
        self.problems = problems
        self.warnings = [f"untrusted: {text}" for text in problems[1:]]


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


@dataclass(frozen=True)
class RootFiles:
    """The files pyqmgr.cf names, judged as pyqmgr.cf is before root reads them.

    master(8) starts the daemon as root, and it reads its tables, response rules,
    provider and pin files before it drops privileges: whoever can change one steers
    every message's class, tenant, site or pace, and a FIFO put in a table's place
    would hang start-up (and ``postfix reload``) at the ``open``. So each file is
    opened without blocking and judged through its open descriptor: a regular file,
    root's, writable by no group and by no one else, no larger than its ceiling,
    with every directory on the way to it (and to a symbolic link's target) judged
    as :func:`untrusted_paths` does. As for pyqmgr.cf, the directories *above*
    ``config_dir`` are Postfix's to answer for when the file lies inside it.

    Cost: one open, one fstat and one lstat per path component, at start-up only.
    """

    config_dir: str

    def read(self, path: str, limit: int) -> bytes:
        """The whole file; OSError when it cannot be opened or read (a missing table
        is its caller's business), TooLarge beyond ``limit``, UntrustedFile when it
        is not a file root alone can change."""
        fd = self._open(path)
        try:
            st = self._judge(path, fd)
            if st.st_size > limit:
                raise TooLarge(f"{path}: larger than {limit} bytes")
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read(limit + 1)
        finally:
            os.close(fd)
        if len(data) > limit:  # it grew after the fstat
            raise TooLarge(f"{path}: larger than {limit} bytes")
        return data

    def check(self, path: str) -> None:
        """Judge a file another program reads for the daemon as root (an indexed
        table's ``.db`` file, which ``postmap -s`` lists); OSError when it cannot be
        opened (postmap then says why), UntrustedFile as :meth:`read`."""
        fd = self._open(path)
        try:
            self._judge(path, fd)
        finally:
            os.close(fd)

    @staticmethod
    def _open(path: str) -> int:
        # O_NONBLOCK: a FIFO opens at once instead of waiting for a writer; O_NOCTTY:
        # a terminal device named here does not become the daemon's.
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)

    def _judge(self, path: str, fd: int) -> os.stat_result:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedFile([f"{path}: is {_kind(st.st_mode)}"],
                                "pyqmgr reads only regular files named in pyqmgr.cf")
        # The walk names the offender (a link's target, a directory on the way); the
        # open descriptor's own judgement is for a file swapped in after the walk.
        inside = _inside(path, self.config_dir)
        problems = untrusted_paths(
            [path], assume_trusted=ancestors(self.config_dir)[1:] if inside else ())
        problems = problems or judge(path, st)
        try:
            same = os.stat(path)
        except OSError:
            same = None
        if same is None or (same.st_dev, same.st_ino) != (st.st_dev, st.st_ino):
            problems.append(f"{path}: replaced while it was checked")
        if problems:
            raise UntrustedFile(list(dict.fromkeys(problems)),
                                "pyqmgr starts as root and reads no file that anyone "
                                "but root can change")
        return st


def file_reader(files: RootFiles | None) -> Callable[[str, int], bytes]:
    """``files.read`` when the daemon (or ``pyqmgr check`` for it) reads as root, else
    a plain bounded read (the simulator, a replay: the user's own files)."""
    return files.read if files is not None else read_bounded
