"""Source pools in the daemon (issue #46): the choice at routing and the state file.

The core's :class:`~pyqmgr.scheduler.source.SourceBook` picks a pool's member; this
module asks it from :meth:`ActiveQueue.route` (one call per recipient whose
transport is a ``source_pool_transports`` one), puts the scope kinds that tell it
when a cold source's delivery starts and ends on the member transports' chains
(:func:`pyqmgr.scheduler.source.source_kinds`, beside the book), and keeps the window's counts in
``$data_directory/pyqmgr/sources.json``, beside the operators' suspensions and
through the same directory descriptor, opened as root before the chroot
(:mod:`.suspensions`): written atomically, at most once a second while deliveries
start, and on the way out.

A state file that cannot be read, does not parse or is of another plan's window is a
warning and counts start from zero: a cold source may then send up to one more
window's plan that window (the docs say so). Fleets share nothing here yet: each
node counts its own.

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

from pyqmgr.scheduler.core import RETRY
from pyqmgr.scheduler.source import source_kinds
from pyqmgr.scheduler.structures import site_domain

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
#: Domains whose site is remembered (and kept in the state file) at most.
MAX_DOMAINS = 10_000
MISSING = object()


def sources_for(host: QmgrCore, settings: SourceSettings | None, state: StateFile | None,
                classes: Classifier | None) -> Sources | None:
    """The daemon's source pools, None when pyqmgr.cf sets none."""
    if settings is None:
        return None
    return Sources(host, settings, state, list(classes.classes) if classes else None)


class Sources:
    """The pools' choice per recipient and the counts' state file."""

    def __init__(self, host: QmgrCore, settings: SourceSettings, state: StateFile | None,
                 class_names: list[str] | None, clock: Callable[[], float] = time.time) -> None:
        self.host = host
        self.settings = settings
        self.book = settings.book()
        self.transports = settings.transports
        self.state = state
        self.class_names = class_names or []
        self.clock = clock
        self._save_at: asyncio.TimerHandle | None = None
        #: Each pool domain's site as last known, kept across restarts: a new qmgr's
        #: site table knows none until its first lookups answer, and the mail it
        #: recovers from active/ is routed at once (it would all go warm).
        self.domain_sites: dict[str, str] = {}
        #: The cold sources' counts are per MX site only when every cold source's
        #: transport is grouped by site (site_grouping, site_transports); else per
        #: domain: no lookup would ever name their sites, and the mail would all go warm.
        table = host.scheduler.sites
        self.by_site = table is not None and all(
            table.limits(m) is not None for m in self.book.starts)
        #: Each (tenant, class rank)'s pool, or None (source_pool_maps, asked once).
        self.pools: dict[tuple[str, int], str | None] = {}
        # Only cold sources count: a warm one's deliveries pass no extra step. A todo
        # entry moved to the retry transport (its source or destination dead) takes its
        # recipients along: their count is given back when that entry ends. (Made
        # now: a transport, once made, lasts the process.)
        self.kind, retried = source_kinds(self.book, self._dirty)
        if self.book.starts:
            for member in self.book.starts:
                host.scheduler.transport(member).chain += (self.kind,)
            host.scheduler.transport(RETRY).chain += (retried,)

    # -- routing ------------------------------------------------------------------------

    def route(self, message: Message, rcpt: Recipient, transport: str,
              nexthop: str) -> tuple[str, str]:
        """The recipient's transport and next hop: a pool member's, or the retry
        transport's with the reason when it must wait; unchanged when no pool."""
        if transport not in self.transports:
            return transport, nexthop
        pool = self._pool(message.tenant, message.rank)
        if pool is None:
            return transport, nexthop
        site = self._site(nexthop)
        member = self.book.choose(pool, site, self.clock(), rcpt, self._dead(pool))
        if member is None:
            where = f"at site {site}" if site is not None else "for a site not known yet"
            return RETRY, (f"4.7.0 source pool {pool}: no source may take more mail "
                           f"{where} this {self._window()} (source_warmup_plan)")
        return member, nexthop

    def _pool(self, tenant: str, rank: int) -> str | None:
        """The pool of a tenant and class, asked of source_pool_maps once a process
        (a proxy: table is a round trip to proxymap: not one a recipient)."""
        key = (tenant, rank)
        got = self.pools.get(key, MISSING)
        if got is MISSING:
            classes = self.class_names
            got = self.settings.pool_for(tenant, classes[rank] if rank < len(classes) else "")
            if len(self.pools) >= MAX_DOMAINS:
                self.pools.clear()
            self.pools[key] = got
        return got  # type: ignore[return-value]

    def _dead(self, pool: str) -> list[str]:
        """The pool's members whose transport is dead (its agent unreachable): their
        share goes to the others meanwhile, unless all are (then the mail goes on to
        wait at a member, as stock's would at its transport)."""
        transports = self.host.scheduler.transports
        members = self.book.pools[pool].members
        dead = [m for m in members if (t := transports.get(m)) is not None and t.throttled]
        return dead if len(dead) < len(members) else []

    def _window(self) -> str:
        return self.book.plan.window_name if self.book.plan is not None else "day"

    def _site(self, nexthop: str) -> str | None:
        domain = site_domain(nexthop)
        if domain is None:
            return nexthop.lower()
        table = self.host.scheduler.sites
        if table is None or not self.by_site:
            return domain
        pin = table.pinned.get(domain)
        if pin is not None:
            return pin
        known = table.known.get(domain)
        if known is None:
            return self.domain_sites.get(domain)
        if self.domain_sites.get(domain) != known[0] and (
                domain in self.domain_sites or len(self.domain_sites) < MAX_DOMAINS):
            self.domain_sites[domain] = known[0]
            self._dirty()
        return known[0]

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
