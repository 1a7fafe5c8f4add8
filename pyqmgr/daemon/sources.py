"""Source pools in the daemon (issue #46): the choice at routing and the state file.

The core's :class:`~pyqmgr.scheduler.source.SourceBook` picks a pool's member;
:meth:`ActiveQueue.route` asks it through
:class:`~pyqmgr.scheduler.source_route.SourceRouter` (one call per recipient whose
transport is a ``source_pool_transports`` one: the steps the simulator takes too),
which puts the scope kinds that tell it when a cold source's delivery starts and
ends on the member transports' chains. This module keeps the window's counts in
``$data_directory/pyqmgr/sources.json``, beside the operators' suspensions and
through the same directory descriptor, opened as root before the chroot
(:mod:`.suspensions`): written atomically, at most once a second while deliveries
start, and on the way out.

A state file that cannot be read, does not parse or is of another plan's window is a
warning and counts start from zero: a cold source may then send up to one more
window's plan that window (the docs say so).

In a fleet (``shared_state``) the servers share each cold source's count at a site:
the book counts against credits taken from Redis in chunks
(:mod:`pyqmgr.daemon.fleet.warmup`), asked for after a choice that ran low, never
waited for. The state file still keeps this server's own counts (status, and the
count ``shared_state_failure = local`` falls back to).

The site a cold source's count is kept at is the one the site table knows for the
domain (an earlier MX lookup, or a pin); with site_grouping off, a domain is its own
site. A domain not known yet goes to a warm member (:mod:`pyqmgr.scheduler.source`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pyqmgr.daemon.fleet.warmup import FleetWarmup
from pyqmgr.scheduler.source_route import MAX_DOMAINS, SourceRouter

if TYPE_CHECKING:
    from pyqmgr.daemon.host import QmgrCore
    from pyqmgr.daemon.suspensions import StateFile
    from pyqmgr.scheduler.message import Message, Recipient
    from pyqmgr.settings.classes import Classifier
    from pyqmgr.settings.sources import SourceSettings

STATE_FILE = "sources.json"
FORMAT_VERSION = 1
#: Largest state file read: 100,000 counts of long site names fit.
MAX_STATE_BYTES = 8 << 20
#: A started delivery's count reaches the file within this (kill -9 loses at most it).
SAVE_DELAY = 1.0


def sources_for(host: QmgrCore, settings: SourceSettings | None, state: StateFile | None,
                classes: Classifier | None) -> Sources | None:
    """The daemon's source pools, None when pyqmgr.cf sets none."""
    if settings is None:
        return None
    return Sources(host, settings, state, list(classes.classes) if classes else None)


class Sources(SourceRouter):
    """The pools' choice per recipient (:class:`SourceRouter`) and the counts' state
    file."""

    def __init__(self, host: QmgrCore, settings: SourceSettings, state: StateFile | None,
                 class_names: list[str] | None, clock: Callable[[], float] = time.time) -> None:
        self.host = host
        self.state = state
        self._save_at: asyncio.TimerHandle | None = None
        super().__init__(settings.book(), settings, class_names, host.scheduler, clock,
                         self._dirty)
        #: The fleet's share of the counts (shared_state with a cold source); None: the
        #: counts are this server's alone.
        self.warmup: FleetWarmup | None = None
        fleet = getattr(host, "fleet", None)
        if fleet is not None and self.book.starts and self.book.plan is not None:
            self.warmup = FleetWarmup(host, fleet, self.book, clock)

    def route(self, message: Message, rcpt: Recipient, transport: str,
              nexthop: str) -> tuple[str, str]:
        """The router's choice; in a fleet, then the credits it ran low of asked for
        (after the choice, never waited for)."""
        got = super().route(message, rcpt, transport, nexthop)
        if self.warmup is not None:
            self.warmup.poke()
        return got

    # -- the state file -------------------------------------------------------------------

    def _dirty(self) -> None:
        if self.state is None or self._save_at is not None or self.book.plan is None:
            return
        with contextlib.suppress(RuntimeError):  # no loop: a test's direct call
            self._save_at = asyncio.get_running_loop().call_later(SAVE_DELAY, self.save)

    def save(self) -> bool:
        """Write the window's counts atomically; a failure is a warning."""
        self._save_at = None
        state = self.state
        if state is None or self.book.plan is None:
            return False
        body = json.dumps({"version": FORMAT_VERSION, **self.book.snapshot(),
                           "sites": sorted(self.domain_sites.items())}).encode()
        try:
            state.write(STATE_FILE, body + b"\n")
        except OSError as exc:
            self.host.log.warning(f"{os.path.join(state.path, STATE_FILE)}: cannot save "
                                  f"the sources' counts: {exc.strerror}")
            return False
        return True

    def restore(self) -> None:
        """The window's counts from the state file, before any mail is routed."""
        state = self.state
        if state is None or self.book.plan is None:
            return
        path = os.path.join(state.path, STATE_FILE)
        why = None
        try:
            fd = os.open(STATE_FILE, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=state.dir_fd)
            with os.fdopen(fd, "rb") as f:
                data = f.read(MAX_STATE_BYTES + 1)
        except FileNotFoundError:
            return
        except OSError as exc:
            why = exc.strerror or str(exc)
            data = b""
        if why is None:
            try:
                window, seconds, records, sites = parse_state(data)
            except ValueError as exc:
                why = str(exc)
        if why is not None:
            self.host.log.warning(f"{path}: {why}; the sources' counts start from zero, "
                                  "and a cold source may send up to one more window's plan")
            return
        self.domain_sites = dict(sites[:MAX_DOMAINS])
        kept = self.book.restore(records, window, seconds, self.clock())
        if kept:
            self.host.log.info(f"sources: {kept} counts of this {self._window()}'s "
                               f"warm-up restored from {path}")

    def status(self) -> dict[str, object]:
        """What ``pyqmgr status`` shows: the pools, the window's counts, the file."""
        return {**self.book.status(self.clock()),
                **(self.warmup.status() if self.warmup is not None else {}),
                "state_file": (os.path.join(self.state.path, STATE_FILE)
                               if self.state is not None and self.book.plan is not None
                               else None)}

    def close(self) -> None:
        if self._save_at is not None:
            self._save_at.cancel()
            self.save()


def parse_state(data: bytes) -> tuple[int, float, list[tuple[str, str, int]],
                                      list[tuple[str, str]]]:
    """The state file's window, its length, counts and domains' sites; ValueError
    says why not."""
    if len(data) > MAX_STATE_BYTES:
        raise ValueError(f"larger than {MAX_STATE_BYTES} bytes")
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(obj, dict) or obj.get("version") != FORMAT_VERSION:
        raise ValueError(f"not a version {FORMAT_VERSION} sources' state file")
    window, seconds, counts = obj.get("window"), obj.get("window_seconds"), obj.get("counts")
    if (not isinstance(window, int) or not isinstance(seconds, int | float)
            or not isinstance(counts, list)):
        raise ValueError("window, window_seconds or counts missing")
    records: list[tuple[str, str, int]] = []
    for item in counts:
        if (not isinstance(item, list) or len(item) != 3 or not isinstance(item[0], str)
                or not isinstance(item[1], str) or not isinstance(item[2], int)
                or item[2] < 0 or len(item[0]) > 200 or len(item[1]) > 300):
            raise ValueError(f"a count that is not [source, site, number]: {item!r:.80}")
        records.append((item[0], item[1], item[2]))
    sites: list[tuple[str, str]] = []
    for item in obj.get("sites", []):
        if (not isinstance(item, list) or len(item) != 2
                or not all(isinstance(x, str) and len(x) <= 300 for x in item)):
            raise ValueError(f"a site that is not [domain, site]: {item!r:.80}")
        sites.append((item[0], item[1]))
    return window, float(seconds), records, sites
