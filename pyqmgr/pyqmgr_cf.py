"""pyqmgr's own settings: ``$config_directory/pyqmgr.cf``, in main.cf syntax.

Settings that only pyqmgr understands (scheduler policies, for one) do not go into
main.cf: ``postconf`` warns about every main.cf name it does not know, and stock qmgr
would silently ignore them after an uninstall. A file of our own keeps main.cf clean
and makes going back to stock qmgr a one-line change in master.cf.

The syntax is main.cf's, read by the same code (:func:`logical_lines`,
:func:`split_nameval` and :func:`parse_main_cf` of :mod:`pyqmgr.postfix.config`,
expansion by :mod:`pyqmgr.postfix.expand`), so an admin's knowledge of main.cf
carries over: comments, continuation lines, ``$name``/``${name}``, the fatal error for
a line without ``=``, the warning for a changed duplicate. ``$name`` looks in
pyqmgr.cf first and then in main.cf's dictionary, as if pyqmgr.cf were one more
layer on top of main.cf.

Every value is expanded when the file is loaded, not when it is first read: a broken
``$`` reference should stop the daemon at start-up (and show in ``pyqmgr check``)
rather than hours later when a rarely used transport is first seen.

A missing file means "no settings": pyqmgr then behaves as stock qmgr does.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from pyqmgr.postfix.config import ConfigError, parse_main_cf
from pyqmgr.postfix.expand import INT_MAX, INT_MIN, ConversionFatal, MacroError, expand, strtol
from pyqmgr.trust import RootFiles

#: The file's name inside config_directory.
PYQMGR_CF = "pyqmgr.cf"
#: Larger files are refused unread: a settings file this big is a mistake (or a
#: device or log file linked in its place), and the daemon reads it as root.
MAX_SIZE = 1 << 20
#: The value prefix that names a Python file holding a scheduler policy.
MODULE_PREFIX = "module:"

MainLookup = Callable[[str], "str | None"]


def _no_main(name: str) -> str | None:
    """The default main.cf lookup: no main.cf names at all."""
    return None


class PyqmgrCfError(Exception):
    """pyqmgr.cf is unusable; ``str(err)`` is what the daemon logs after ``fatal: ``.

    The text names the file and, where one is to blame, the parameter (the concrete
    name that was set, e.g. ``smtp_scheduler_policy`` rather than
    ``scheduler_policy``). ``warnings`` are logged before it, as main.cf's are.
    """

    def __init__(self, message: str, warnings: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.warnings = list(warnings)


@dataclass(frozen=True)
class PyqmgrCf:
    """The parsed and expanded settings of one pyqmgr.cf (empty if it does not exist).

    ``values`` holds every parameter set in the file, already expanded; ``warnings``
    are the texts to log as ``warning:`` (duplicates that change a value, a logical
    line that starts with whitespace), exactly as for main.cf.
    """

    path: str
    exists: bool
    values: Mapping[str, str] = field(default_factory=dict, repr=False, hash=False)
    warnings: tuple[str, ...] = ()
    #: The file's names that another of its values uses as ``$name``: the admin's own
    #: parameters (postconf(1) calls them user-defined and does not warn of them).
    referenced: frozenset[str] = frozenset()
    #: The daemon reads the files these settings name as root (``pyqmgr check`` reads
    #: them as it would): each is judged as this file is (:class:`trust.RootFiles`).
    #: Off for the simulator's and a replay's settings, whose files are the user's.
    read_as_root: bool = field(default=False, compare=False)

    def root_files(self) -> RootFiles | None:
        """How the files these settings name are read: judged when :attr:`read_as_root`."""
        if not self.read_as_root:
            return None
        return RootFiles(os.path.dirname(os.path.abspath(self.path)))

    def which(self, name: str, transport: str | None = None) -> str | None:
        """The concrete parameter name that answers for ``name``, or None.

        Postfix's rule for per-transport settings: ``<transport>_<name>`` wins over
        ``<name>``. Callers use this to name the right parameter in an error.
        """
        if transport:
            specific = f"{transport}_{name}"
            if specific in self.values:
                return specific
        return name if name in self.values else None

    def get(self, name: str, transport: str | None = None) -> str | None:
        """The expanded value of ``<transport>_<name>`` or else ``<name>``; None if unset.

        A parameter set to the empty string is set: it returns ``""``.
        """
        used = self.which(name, transport)
        return None if used is None else self.values[used]

    def get_int(self, name: str, transport: str | None, default: int,
                lo: int = INT_MIN, hi: int = INT_MAX) -> int:
        """An integer setting in ``lo..hi`` (a C int by default); ``default`` if unset.

        The number is read as Postfix reads one (``strtol`` with nothing after the
        digits), so ``+5`` passes and ``5k`` does not.
        """
        used = self.which(name, transport)
        if used is None:
            return default
        text = self.values[used]
        number, end, erange = strtol(text, 0)
        if not text or end != len(text) or erange:
            raise self.error(used, f'bad numerical value: "{text}"')
        if not lo <= number <= hi:
            raise self.error(used, f"value {number} is out of range {lo}..{hi}")
        return number

    def get_bool(self, name: str, transport: str | None, default: bool) -> bool:
        """A boolean setting: ``yes`` or ``no`` in any case, as Postfix accepts."""
        used = self.which(name, transport)
        if used is None:
            return default
        text = self.values[used]
        if text.isascii() and text.lower() in ("yes", "no"):
            return text.lower() == "yes"
        raise self.error(used, f'bad boolean value: "{text}" (use yes or no)')

    def names(self) -> list[str]:
        """The parameters set in the file, in the order they first appear."""
        return list(self.values)

    def error(self, name_used: str, text: str) -> PyqmgrCfError:
        """An error about one parameter, in the one format all callers share.

        ``name_used`` should come from :meth:`which`, so the admin is pointed at the
        line actually set.
        """
        return PyqmgrCfError(f"{self.path}: parameter {name_used}: {text}")

    def module_paths(self) -> dict[str, str]:
        """Parameter name -> file, for every value of the form ``module:PATH``.

        These files are Python code the daemon will import as root, so the start-up
        trust check covers them. PATH is returned as written: the policy loader
        (:mod:`pyqmgr.settings.policies`) accepts only absolute paths, and a relative
        one is reported by :meth:`relative_module_paths` rather than guessed at.
        """
        found: dict[str, str] = {}
        for name, value in self.values.items():
            text = value.strip()
            if text.startswith(MODULE_PREFIX):
                found[name] = text[len(MODULE_PREFIX):]
        return found

    def relative_module_paths(self) -> list[str]:
        """Problems for ``module:PATH`` values whose PATH is not absolute.

        Relative to what? The daemon's working directory is the queue directory and
        becomes / after a chroot: no answer is safe, so such a value is an error.
        """
        return [f"{self.path}: parameter {name}: module path \"{path}\" is not absolute"
                for name, path in self.module_paths().items() if not os.path.isabs(path)]


def from_text(text: str, path: str = PYQMGR_CF,
              main_lookup: MainLookup = _no_main) -> PyqmgrCf:
    """Parse and expand pyqmgr.cf's text; ``path`` is only used in messages.

    ``main_lookup`` returns a main.cf parameter's raw value (or None); it answers
    the ``$name`` references pyqmgr.cf itself does not define.
    """
    try:
        raw, warnings = parse_main_cf(text, path)
    except ConfigError as exc:
        raise PyqmgrCfError(str(exc), exc.warnings) from None

    referenced: set[str] = set()

    def lookup(name: str) -> str | None:
        own = raw.get(name)
        if own is not None:
            referenced.add(name)
            return own
        return main_lookup(name)

    values: dict[str, str] = {}
    for name, value in raw.items():
        try:
            values[name] = expand(value, lookup)
        except MacroError as exc:
            detail = "; ".join(exc.warnings) or "macro processing error"
            raise PyqmgrCfError(f"{path}: parameter {name}: bad $name expansion: {detail}",
                                warnings) from None
        except ConversionFatal as exc:
            raise PyqmgrCfError(f"{path}: parameter {name}: {exc}", warnings) from None
    return PyqmgrCf(path=path, exists=True, values=values, warnings=tuple(warnings),
                    referenced=frozenset(referenced))


def read_text(path: str) -> str | None:
    """The file's text, or None if there is no file; PyqmgrCfError if it is unusable.

    Opened once and checked through the open descriptor (no check-then-open race).
    ``O_NONBLOCK`` keeps a FIFO put in its place from hanging the daemon at open.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        if os.path.lexists(path):
            raise PyqmgrCfError(f"open {path}: {os.strerror(errno.ENOENT)} "
                                "(dangling symbolic link)") from None
        return None
    except OSError as exc:
        raise PyqmgrCfError(f"open {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise PyqmgrCfError(f"{path}: is a directory, not a settings file")
        if not stat.S_ISREG(st.st_mode):
            raise PyqmgrCfError(f"{path}: not a regular file")
        if st.st_size > MAX_SIZE:
            raise PyqmgrCfError(f"{path}: file too large ({st.st_size} bytes; "
                                f"the limit is {MAX_SIZE})")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(MAX_SIZE + 1)
        except OSError as exc:
            raise PyqmgrCfError(f"read {path}: {exc.strerror}") from None
    if len(data) > MAX_SIZE:  # it grew after fstat
        raise PyqmgrCfError(f"{path}: file too large (more than {MAX_SIZE} bytes)")
    return data.decode("utf-8", "surrogateescape")


def load(config_dir: str, main_lookup: MainLookup = _no_main) -> PyqmgrCf:
    """Read ``config_dir/pyqmgr.cf``; a missing file gives an empty, ``exists=False`` one.

    The daemon, ``pyqmgr check`` and ``install`` read it so: the files it names are
    the daemon's, read as root, and judged (:attr:`PyqmgrCf.read_as_root`)."""
    path = os.path.join(config_dir, PYQMGR_CF)
    text = read_text(path)
    if text is None:
        return PyqmgrCf(path=path, exists=False, read_as_root=True)
    return replace(from_text(text, path, main_lookup), read_as_root=True)
