"""Modules imported after the daemon dropped its privileges: named, once each.

Why: the daemon imports as root, then becomes mail_owner and may chroot into the queue
directory. A module imported after that is read as mail_owner, from a path that may be
out of its reach (a checkout under a 0700 directory such as /root, anything outside a
chroot), and the import fails where the feature needs it, far from start-up: dnspython
imported its asyncio backend at the first MX lookup, and every lookup failed (issue
#43). Start-up imports what each setting needs (each part's setup, called by
:mod:`pyqmgr.daemon.startup`); this watcher names what was missed in the maillog, so
that a gap is one clear line, not a feature that silently does nothing.

How: a finder at the head of ``sys.meta_path`` is asked only for modules not loaded
yet, so it costs nothing on the delivery path. It finds nothing itself: the import
goes on, and works where the file happens to be reachable. With ``PYQMGR_IMPORT_AUDIT``
in the environment (main.cf's ``import_environment``), an audit hook
(``sys.addaudithook``) reports the imports the C import path audits as well; audit
hooks cannot be removed and see every audited event, so that is for tests, which run
the daemon from a 0700 directory with every feature on and want no such line.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Only a name: importlib.abc at run time brings tempfile, random and more into
    # every daemon (tests/unit/test_daemon_imports.py). A finder is any object with
    # find_spec.
    from importlib.machinery import ModuleSpec

#: The environment variable that adds the audit hook (tests set it).
AUDIT_ENV = "PYQMGR_IMPORT_AUDIT"
#: At most this many modules are named; more would only repeat the lesson.
MAX_REPORTED = 50


class LateImports:
    """Names each module first imported after privileges were dropped, once."""

    def __init__(self, warn: Callable[[str], None]) -> None:
        self.warn = warn
        self.seen: set[str] = set()

    def report(self, name: str) -> None:
        if name in self.seen or len(self.seen) >= MAX_REPORTED:
            return
        self.seen.add(name)
        self.warn(f"module {name} imported after dropping privileges{_caller()}: its "
                  "files may be out of this process's reach (a chroot, a directory that "
                  "mail_owner cannot read); pyqmgr should have imported it at start-up, "
                  "please report this")

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        self.report(fullname)
        return None

    def audit(self, event: str, args: tuple[object, ...]) -> None:
        if event == "import" and args and isinstance(args[0], str):
            self.report(args[0])


def _caller() -> str:
    """Where the import came from: the innermost frame outside the import system."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        name = frame.filename
        if "importlib" in name or name.startswith("<frozen") or name == __file__:
            continue
        return f" (by {os.path.basename(name)}:{frame.lineno})"
    return ""


def watch(warn: Callable[[str], None], environ: dict[str, str] | None = None) -> LateImports:
    """Start naming late imports; call right after privileges are dropped."""
    watcher = LateImports(warn)
    sys.meta_path.insert(0, watcher)
    if (environ if environ is not None else os.environ).get(AUDIT_ENV):
        sys.addaudithook(watcher.audit)
    return watcher
