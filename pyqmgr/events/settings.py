"""pyqmgr.cf's delivery events settings, checked and the file's directory opened at start-up.

Off unless ``delivery_events_file`` names a file (an absolute path). Its directory is
opened as root before the chroot, as the suspensions' state directory is
(:func:`pyqmgr.daemon.suspensions.open_state`): made if absent and handed to
mail_owner (mode 0750); an existing directory must already be mail_owner's, because
root does not hand over a directory the admin may share (``/var/log``). Everything
else is a start-up error naming the parameter.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pyqmgr.daemon.owned_dir import owned_directory

if TYPE_CHECKING:
    from pyqmgr.fleet.settings import FleetSettings
    from pyqmgr.pyqmgr_cf import PyqmgrCf

FILE = "delivery_events_file"
SIZE_LIMIT = "delivery_events_file_size_limit"
KEEP = "delivery_events_files_kept"
#: The admin's own reply categories, tried before the shipped ones (docs/events.md).
CATEGORIES = "delivery_event_categories"
#: The events also go to this stream on the fleet's Redis (under shared_state_prefix).
STREAM = "delivery_events_stream"
STREAM_MAX_LENGTH = "delivery_events_stream_max_length"
#: Every name this module reads (pyqmgr_cf_names.GLOBAL lists them too).
NAMES = (FILE, SIZE_LIMIT, KEEP, CATEGORIES, STREAM, STREAM_MAX_LENGTH)
#: Longest stream name accepted (a Redis key; the prefix comes before it).
MAX_STREAM_NAME = 200

DEFAULT_SIZE_LIMIT = 100 * 2**20
DEFAULT_KEEP = 10
DEFAULT_STREAM_MAX_LENGTH = 1_000_000


@dataclass(frozen=True)
class EventSettings:
    path: str
    size_limit: int
    keep: int
    #: The stream's name (empty: no stream), without the fleet's prefix.
    stream: str = ""
    stream_max_length: int = DEFAULT_STREAM_MAX_LENGTH

    @property
    def directory(self) -> str:
        return os.path.dirname(self.path)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


@dataclass(frozen=True)
class EventSetup:
    """The settings, the directory's descriptor (opened as root, kept) and the reply
    categories (loaded as root: the module and its rules are read before the chroot)."""

    settings: EventSettings
    dir_fd: int
    categorize: Callable[[str, str], str] | None = None
    #: The fleet's Redis, when the events also go to a stream there.
    fleet: FleetSettings | None = None


def categorizer(settings: PyqmgrCf) -> Callable[[str, str], str]:
    """The reply categories: the admin's file (``delivery_event_categories``) before the
    shipped rules, read now, as root, and judged as every file pyqmgr.cf names. A bad
    line, an oversized or untrusted file is a PyqmgrCfError naming the parameter, so
    that start-up and ``pyqmgr check`` say it alike."""
    from pyqmgr import trust
    from pyqmgr.events import categories

    path = (settings.get(CATEGORIES) or "").strip() or None
    try:
        return categories.load(path, settings.root_files()).category
    except (categories.CategoriesError, trust.UntrustedFile) as exc:
        raise settings.error(CATEGORIES, str(exc)) from None


def event_settings(settings: PyqmgrCf, fleet: bool | None = None) -> EventSettings | None:
    """None when events are off; PyqmgrCfError names a bad value. ``fleet``: whether
    shared_state is set (None: read it here)."""
    path = (settings.get(FILE) or "").strip()
    stream = stream_name(settings, fleet)
    if not path:
        if stream:
            raise settings.error(STREAM, f"needs {FILE}: the stream gets what the events "
                                 "file's writer wrote")
        return None
    if not os.path.isabs(path) or path.endswith("/") or os.path.basename(path) in (".", ".."):
        raise settings.error(FILE, f'"{path}" is not an absolute file name')
    size = settings.get_int(SIZE_LIMIT, None, DEFAULT_SIZE_LIMIT, 4096, 2**62)
    keep = settings.get_int(KEEP, None, DEFAULT_KEEP, 0, 1000)
    length = settings.get_int(STREAM_MAX_LENGTH, None, DEFAULT_STREAM_MAX_LENGTH, 1000, 2**40)
    return EventSettings(os.path.normpath(path), size, keep, stream, length)


def stream_name(settings: PyqmgrCf, fleet: bool | None) -> str:
    """The stream's name (empty: none), checked: a name a key can have, and a fleet."""
    name = (settings.get(STREAM) or "").strip()
    if not name:
        return ""
    if len(name) > MAX_STREAM_NAME or any(c.isspace() or ord(c) < 32 for c in name):
        raise settings.error(STREAM, f"a stream name has at most {MAX_STREAM_NAME} "
                             "characters and no spaces or control characters")
    if fleet is None:
        fleet = bool((settings.get("shared_state") or "").strip())
    if not fleet:
        raise settings.error(STREAM, "needs shared_state: the stream is on the fleet's "
                             "Redis (docs/fleet.md)")
    return name


def open_events_directory(found: EventSettings, mail_owner: str) -> int:
    """The file's directory, opened; OSError says why not (the caller logs it fatal).

    Made for mail_owner when absent; an existing one must be mail_owner's already.
    """
    path = found.directory
    pw = pwd.getpwnam(mail_owner)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return owned_directory(path, mail_owner, 0o750)
    if os.geteuid() == 0 and st.st_uid != pw.pw_uid:
        raise PermissionError(0, f"not owned by {mail_owner} (pyqmgr makes the directory "
                              "when it is absent; give it one of its own)", path)
    return owned_directory(path, mail_owner, st.st_mode & 0o7777)


def setup(settings: PyqmgrCf, mail_owner: str,
          fleet: FleetSettings | None = None) -> EventSetup | None:
    """Settings read and the directory opened, or None (off)."""
    found = event_settings(settings, fleet is not None)
    if found is None:
        return None
    try:
        fd = open_events_directory(found, mail_owner)
    except (OSError, KeyError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise settings.error(FILE, f"{found.directory}: {why}") from None
    try:
        categorize = categorizer(settings)
    except BaseException:
        os.close(fd)
        raise
    return EventSetup(found, fd, categorize, fleet if found.stream else None)


__all__ = ["NAMES", "EventSettings", "EventSetup", "event_settings", "setup"]
