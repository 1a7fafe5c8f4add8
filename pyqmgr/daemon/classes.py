"""Message classes and tenants in the daemon (issue #34): start-up's setup, and each
queue file's envelope and headers, which the classifier is asked by.

pyqmgr.cf's parameters, the tables and the classifier itself are
:mod:`pyqmgr.settings.classes`, shared with the simulator and ``pyqmgr check``; what
is here reads queue files (:func:`envelope`, :func:`read_headers`) or belongs to the
daemon's start-up (:func:`setup`: the scheduler it needs, the inotify library).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from pyqmgr.daemon.policies import PolicySetup
from pyqmgr.extras import install_command
from pyqmgr.postfix.message_headers import HeaderSection, header_section
from pyqmgr.postfix.queue_file import Message
from pyqmgr.pyqmgr_cf import PyqmgrCf
from pyqmgr.scheduler.message import Message as SchedMessage
from pyqmgr.settings.classes import (
    CLASSES,
    TENANT_KEY,
    Classifier,
    Envelope,
    Unreadable,
    classifier,
)


def envelope(qf: Message, headers: dict[str, str] | None = None) -> Envelope:
    """The lookup keys of a queue file's envelope as its first read left them (and the
    header values a key names, read apart: :func:`read_headers`)."""
    return Envelope(qf.sender or "", qf.sasl_username or "", qf.client_address or "",
                    qf.client_name or "", headers or {})


def place(classes: Classifier, sched: SchedMessage, rank: int, tenant: str,
          weight: int | None = None) -> None:
    """A loaded message's class and tenant, as the classifier found them (``weight``:
    the tenant's, when the proxy: worker looked it up), the tenant admitted under
    unlisted_tenant_limit here, on the event loop. Made _other: that tenant's weight."""
    sched.rank, sched.tenant = rank, classes.admit(tenant)
    if sched.tenant:
        sched.weight = (weight if weight is not None and sched.tenant == tenant
                        else classes.weight(sched.tenant))


def read_headers(classes: Classifier, qf: Message, path: str, fd: int | None = None,
                 warn: Callable[[str], None] | None = None) -> dict[str, str]:
    """The values of the headers the keys name, from the queue file at ``path`` (or
    the open ``fd``); none, and nothing read, when no key names a header. A header
    the look could not reach (damaged content, a header section past the bound) is
    one ``warn`` line and counts as absent: the message takes the defaults, and is
    delivered as ever. A file that cannot be opened gives none: the scan reports it.
    """
    names = classes.header_names
    if not names or not classes.trusts(envelope(qf)):
        # A client not trusted: its headers would not count (issue #45), so they
        # are not read either.
        return {}
    if fd is not None:
        found = header_section(fd, qf.data_offset, names, path)
    else:
        try:
            # Non-blocking: a FIFO put in the file's place must not stop the daemon.
            own = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return {}
        try:
            found = header_section(own, qf.data_offset, names, path)
        finally:
            os.close(own)
    if found.problem and warn is not None and len(found.values) < len(names):
        warn(_unread(qf.queue_id, names, found))
    return found.values


def _unread(queue_id: str, names: frozenset[str], found: HeaderSection) -> str:
    missing = ", ".join(sorted(name for name in names if name not in found.values))
    return (f"{queue_id}: classes: header {missing} not read: {found.problem}; "
            "counted as absent (the default class or tenant)")


def setup(settings: PyqmgrCf, policies: PolicySetup, warn: Callable[[str], None],
          config_dir: str | None = None, unreadable: Unreadable | None = None,
          proxymap: str | None = None, mynetworks: str | None = None
          ) -> Classifier | None:
    """:func:`classifier` at start-up: classes and tenants order deliveries in nqmgr's
    job list only, so another scheduler_policy with them is refused, not quietly
    ignored. ``mynetworks``: main.cf's, whose clients the sender's keys count for."""
    found = classifier(settings, warn, config_dir, unreadable, proxymap, mynetworks)
    if found is not None and not policies.table.stock:
        name = CLASSES if len(found.classes) > 1 else TENANT_KEY
        raise settings.error(name, "classes and tenants order deliveries in stock's "
                                   "scheduler (nqmgr) only: scheduler_policy names another")
    if found is not None and len(found.classes) > 1:
        # Imported now, before the chroot: it finds the C library through ldconfig.
        try:
            import inotify_simple  # type: ignore[import-untyped]  # noqa: F401
        except (ImportError, OSError) as exc:
            raise settings.error(CLASSES, f"the inotify_simple library does not load "
                                          f"({exc}); install it "
                                          f"({install_command(['classes'])})") from None
    return found
