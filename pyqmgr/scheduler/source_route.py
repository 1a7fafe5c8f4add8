"""A recipient's source at routing (issue #46), for whatever drives the core.

The daemon (:mod:`pyqmgr.daemon.sources`, after trivial-rewrite answers) and the
simulator (:mod:`pyqmgr.simulator.sources`, as a scenario's recipients are read) route
a recipient to a pool's member by the same steps, kept here, I/O-free: the pool of
the message's tenant or class (``source_pool_maps``, asked once per tenant and class),
the destination's site as the core's site table knows it (a domain not known yet has
none: :class:`~pyqmgr.scheduler.source.SourceBook` sends it to a warm member), the
members whose transport is dead left out, and the scope kinds that tell the book when
a cold source's delivery starts and ends put on the member transports' chains
(:func:`~pyqmgr.scheduler.source.source_kinds`). The daemon adds the state file.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Protocol

from pyqmgr.scheduler.core import RETRY, Scheduler
from pyqmgr.scheduler.source import SourceBook, source_kinds
from pyqmgr.scheduler.structures import site_domain

if TYPE_CHECKING:
    from pyqmgr.scheduler.message import Message, Recipient

#: Domains whose site is remembered (and kept in the daemon's state file) at most;
#: (tenant, class) pairs whose pool is remembered at most.
MAX_DOMAINS = 10_000
MISSING = object()


class PoolMaps(Protocol):
    """What routing needs of the settings (pyqmgr.settings.sources.SourceSettings)."""

    @property
    def transports(self) -> Collection[str]: ...

    def pool_for(self, tenant: str, class_name: str) -> str | None: ...


class SourceRouter:
    """The pools' choice per recipient over one scheduler core."""

    def __init__(self, book: SourceBook, settings: PoolMaps, class_names: list[str] | None,
                 scheduler: Scheduler, clock: Callable[[], float],
                 changed: Callable[[], None]) -> None:
        self.book = book
        self.settings = settings
        self.transports = settings.transports
        self.class_names = class_names or []
        self.scheduler = scheduler
        self.clock = clock
        self.changed = changed
        #: Each pool domain's site as last known (the daemon keeps it across
        #: restarts: a new qmgr's site table knows none until its first lookups
        #: answer, and the mail it recovers from active/ is routed at once).
        self.domain_sites: dict[str, str] = {}
        #: The cold sources' counts are per MX site only when every cold source's
        #: transport is grouped by site (site_grouping, site_transports); else per
        #: domain: no lookup would ever name their sites, and the mail would all go warm.
        table = scheduler.sites
        self.by_site = table is not None and all(
            table.limits(m) is not None for m in book.starts)
        #: Each (tenant, class rank)'s pool, or None (source_pool_maps, asked once).
        self.pools: dict[tuple[str, int], str | None] = {}
        # Only cold sources count: a warm one's deliveries pass no extra step. A todo
        # entry moved to the retry transport (its source or destination dead) takes its
        # recipients along: their count is given back when that entry ends. (Made
        # now: a transport, once made, lasts the process.)
        self.kind, retried = source_kinds(book, changed)
        if book.starts:
            for member in book.starts:
                scheduler.transport(member).chain += (self.kind,)
            scheduler.transport(RETRY).chain += (retried,)

    def route(self, message: Message, rcpt: Recipient, transport: str,
              nexthop: str) -> tuple[str, str]:
        """The recipient's transport and next hop: a pool member's, or the retry
        transport's with the reason when it must wait; unchanged when no pool."""
        if transport not in self.transports:
            return transport, nexthop
        pool = self._pool(message.tenant, message.rank)
        if pool is None:
            return transport, nexthop
        site = self.site_of(nexthop)
        member = self.book.choose(pool, site, self.clock(), rcpt, self._dead(pool))
        if member is None:
            if site is None:
                self._look_up(nexthop)
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
        transports = self.scheduler.transports
        members = self.book.pools[pool].members
        dead = [m for m in members if (t := transports.get(m)) is not None and t.throttled]
        return dead if len(dead) < len(members) else []

    def _look_up(self, nexthop: str) -> None:
        """A pool with no warm member waits for the domain's site: ask the core for
        the lookup (the next decisions' ``resolve``), which no queue of its would
        ever ask, as its mail all goes to the retry transport meanwhile."""
        table = self.scheduler.sites
        domain = site_domain(nexthop)
        if table is not None and domain is not None and self.by_site:
            table.name_of(domain, self.scheduler.now, self.scheduler.out.resolve)

    def _window(self) -> str:
        return self.book.plan.window_name if self.book.plan is not None else "day"

    def site_of(self, nexthop: str) -> str | None:
        """The site a cold source's count is kept at; None: not known yet."""
        domain = site_domain(nexthop)
        if domain is None:
            return nexthop.lower()
        table = self.scheduler.sites
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
            self.changed()
        return known[0]
