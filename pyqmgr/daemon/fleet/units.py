"""What a delivery counts at across the fleet: its destination or its site (#23, #33).

A fleet's limits are per destination (``fleet_destination_*``) or, with sites on,
per provider site (``fleet_site_*``): a destination at a site then counts at the
site's keys, named ``site NAME`` where a destination is named by its queue name (no
queue name has a space; :data:`pyqmgr.fleet.shared.SITE_UNIT`). The fleet
(:mod:`.node`) asks this which unit an entry's delivery takes a session of, what
its limits are, and which of this node's queues wait for a unit.

A unit's name is bounded (:func:`pyqmgr.fleet.shared.unit_name`, issue #45): a site
named by its MX hosts can pass 2,000 characters, and every server bounds it the same
way, in its keys, its messages and its roster record. This node remembers the whole
name behind each bounded one it made, to find its queues again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyqmgr.fleet.roster import ANY_TRANSPORT, DESTINATION, SITE
from pyqmgr.fleet.shared import SITE_UNIT, unit_name
from pyqmgr.scheduler.structures import ERROR, RETRY

if TYPE_CHECKING:
    from collections.abc import Callable

    from pyqmgr.daemon.host import QmgrCore
    from pyqmgr.fleet.settings import FleetSettings, Limits
    from pyqmgr.scheduler.entry import Entry
    from pyqmgr.scheduler.structures import Queue


#: Whole names remembered behind bounded ones: past this many, forgotten and made again
#: as deliveries ask (a forgotten one only finds no queue until then).
MAX_LONG_NAMES = 10_000


class FleetUnits:
    """Each transport's fleet limits, per destination and per site, read once."""

    def __init__(self, host: QmgrCore, settings: FleetSettings) -> None:
        self.host, self.settings = host, settings
        self._limits: dict[str, Limits | None] = {}
        self._site_limits: dict[str, Limits | None] = {}
        #: Transports whose destinations are grouped into sites here.
        self._grouped: set[str] = set()
        #: Whether each transport's throttling is the fleet's (``fleet_throttling``).
        self._shares: dict[str, bool] = {}
        #: The limits obeyed in place of this server's own while another server of
        #: the fleet runs with stricter ones (:mod:`.roster`): (transport or
        #: ``*``, kind) -> limits (None: no fleet limit), kind ``destination`` or
        #: ``site``; a transport not named takes ``*``'s. Empty while the fleet
        #: agrees. pyqmgr.cf's settings are not touched: when the other server is
        #: gone or agrees, this one's own apply again.
        self.overrides: dict[tuple[str, str], Limits | None] = {}
        #: Bounded unit name -> the whole name, for units whose name was too long.
        self._long: dict[str, str] = {}

    def limits(self, transport: str) -> Limits | None:
        """The transport's fleet limits, or None when its deliveries ask nobody."""
        found = self._own_limits(transport)
        if self.overrides and transport not in (RETRY, ERROR):
            return self._override(transport, DESTINATION, found)
        return found

    def _override(self, transport: str, kind: str, found: Limits | None) -> Limits | None:
        key = (transport, kind)
        if key in self.overrides:
            return self.overrides[key]
        return self.overrides.get((ANY_TRANSPORT, kind), found)

    def _own_limits(self, transport: str) -> Limits | None:
        if transport in self._limits:
            return self._limits[transport]
        found: Limits | None = None
        if transport not in (RETRY, ERROR):
            limits = self.settings.limits_for(transport)
            found = limits if limits.active else None
        self._limits[transport] = found
        t = self.host.scheduler.transports.get(transport)
        if found is not None and t is not None and t.recipient_limit == 1:
            self.host.log.warning(
                f"{transport}_destination_recipient_limit = 1 makes each recipient a "
                "destination of its own (Postfix's rule), so the fleet's limits for "
                f"{transport} count per recipient, not per destination host")
        return found

    def site_limits(self, transport: str) -> Limits | None:
        """The transport's fleet limits per site (issue #33), or None: none set, or
        the transport's destinations are not grouped into sites (then only the bare
        ``fleet_site_*`` can apply to it, which means the grouped transports: a
        transport's own is refused at start-up, fleet.settings.check_site_limits)."""
        if transport not in self._site_limits:
            found: Limits | None = None
            sites = self.host.scheduler.sites
            if transport not in (RETRY, ERROR) and sites is not None and (
                    sites.limits(transport) is not None):
                self._grouped.add(transport)
                limits = self.settings.site_limits_for(transport)
                found = limits if limits.active else None
            self._site_limits[transport] = found
        if self.overrides and transport in self._grouped:
            return self._override(transport, SITE, self._site_limits[transport])
        return self._site_limits[transport]

    def own(self, transport: str, kind: str) -> Limits:
        """This server's own limits of ``kind`` for the transport (``*``: the bare
        parameters), as pyqmgr.cf sets them, in force or not: what it publishes."""
        name = "" if transport == ANY_TRANSPORT else transport
        if kind == SITE:
            return self.settings.site_limits_for(name)
        return self.settings.limits_for(name)

    def grouping(self) -> Callable[[str], bool]:
        """:meth:`grouped` as a pure function of the settings, for a thread: whether
        sites are on is read now, and each transport's grouping from the sites'
        settings table, never from the core's structures."""
        sites = self.host.scheduler.sites
        limits_for = sites.limits_for if sites is not None else None

        def grouped(transport: str) -> bool:
            if limits_for is None:
                return False
            return transport == ANY_TRANSPORT or limits_for(transport) is not None

        return grouped

    def grouped(self, transport: str) -> bool:
        """Whether the transport's destinations are grouped into sites here (``*``:
        whether sites are on at all)."""
        sites = self.host.scheduler.sites
        if sites is None:
            return False
        return transport == ANY_TRANSPORT or sites.limits(transport) is not None

    def unit(self, entry: Entry) -> tuple[str, Limits] | None:
        """What the entry's delivery counts at across the fleet, and its limits: its
        site (``site NAME``) when the transport has fleet site limits and the
        destination is at a site; else the destination (its queue name) when the
        transport has fleet destination limits; None: nothing to ask."""
        queue = entry.queue
        transport = queue.transport.name
        if queue.site is not None and (limits := self.site_limits(transport)) is not None:
            return self._bounded(SITE_UNIT + queue.site.name), limits
        limits = self.limits(transport)
        return (self._bounded(queue.name), limits) if limits is not None else None

    def _bounded(self, name: str) -> str:
        bounded = unit_name(name)
        if bounded is not name:
            if len(self._long) >= MAX_LONG_NAMES:
                self._long.clear()
            self._long[bounded] = name
        return bounded

    def whole(self, unit: str) -> str:
        """The unit's whole name (``site NAME`` or a queue name) behind a bounded one."""
        return self._long.get(unit, unit)

    def unit_limits(self, transport: str, unit: str) -> Limits | None:
        if unit.startswith(SITE_UNIT):
            return self.site_limits(transport)
        return self.limits(transport)

    def queues(self, transport: str, unit: str) -> list[Queue]:
        """This node's queues in core that count at the unit."""
        unit = self.whole(unit)
        if unit.startswith(SITE_UNIT):
            sites = self.host.scheduler.sites
            site = sites.sites.get((transport, unit[len(SITE_UNIT):])) if sites else None
            return list(site.members) if site is not None else []
        t = self.host.scheduler.transports.get(transport)
        queue = t.queues.get(unit) if t is not None else None
        return [queue] if queue is not None else []

    def waiting(self, transport: str, unit: str) -> bool:
        """Whether this node has deliveries waiting for the unit."""
        return any(q.todo.size > 0 for q in self.queues(transport, unit))

    def shares(self, transport: str) -> bool:
        """Whether the transport's dead sites and throttling are the fleet's."""
        found = self._shares.get(transport)
        if found is None:
            found = self._shares[transport] = (
                transport not in (RETRY, ERROR) and self.settings.shares_throttling(transport))
        return found
