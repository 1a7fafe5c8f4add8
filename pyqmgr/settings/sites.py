"""Provider sites' settings (issue #33): pyqmgr.cf read into the core's site table.

``site_grouping = mx`` turns sites on for the transports whose master.cf command is
smtp or lmtp (``site_transports`` names others or fewer). Each grouped transport's
limits (``site_concurrency_limit``, ``site_rate``, ``site_dead_scope``), the sites'
own limits (``site_concurrency_limit_maps``), the provider tables and pins that name
a site from its MX hosts, and the MX lookups' timings are read and checked here once
(:func:`site_settings`); the core is handed :meth:`SiteSettings.table`, the daemon's
resolver (:mod:`pyqmgr.daemon.sites`) the lookups' settings, the simulator the same
settings for a scenario. A bad value is a start-up error naming the parameter.

The fleet's own site limits (``fleet_site_*``) are the fleet's to read
(:mod:`pyqmgr.fleet.settings`); the daemon checks them against these at start-up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pyqmgr.postfix.lookup_table import LookupTableError, open_table, table_specs
from pyqmgr.pyqmgr_cf import PyqmgrCf
from pyqmgr.scheduler.shaping import Shaping, ShapingError, parse_duration, parse_rate
from pyqmgr.scheduler.structures import SITE_LIMIT_MAPS, SiteLimits, SiteTable
from pyqmgr.site_names import (
    Providers,
    ProviderTableError,
    load_providers,
    read_table,
    replied_from_site,
)

GROUPING = "site_grouping"
TRANSPORTS = "site_transports"
LIMIT = "site_concurrency_limit"
RATE = "site_rate"
DEAD_SCOPE = "site_dead_scope"
PROVIDERS = "site_providers"
PINS = "site_pins"
TIMEOUT = "site_dns_timeout"
NEGATIVE_TTL = "site_dns_negative_ttl"
MAX_TTL = "site_dns_max_ttl"
LOOKUPS = "site_dns_lookups"
WAIT = "site_dns_wait"

#: master.cf commands whose next hops are mail exchangers to group.
GROUPED_COMMANDS = ("smtp", "lmtp")


@dataclass(frozen=True)
class SiteSettings:
    """pyqmgr.cf's site settings, checked; the core's table is made from them."""

    limits: dict[str, SiteLimits]
    providers: Providers
    pins: dict[str, str]
    skip: frozenset[str]
    timeout: float = 5.0
    negative_ttl: float = 300.0
    max_ttl: float = 86400.0
    lookups: int = 16
    wait: float = 0.2
    #: Sites' own concurrency limits (site_concurrency_limit_maps), by lowercased name.
    own_limits: dict[str, int] = field(default_factory=dict)

    def table(self) -> SiteTable:
        providers = self.providers
        return SiteTable(self.limits.get, self.pins, self.skip, self.wait, self.own_limits,
                         lambda site, reason: replied_from_site(site, reason, providers))


def _duration(settings: PyqmgrCf, name: str, default: float) -> float:
    text = settings.get(name)
    if text is None:
        return default
    try:
        return parse_duration(text, name)
    except ShapingError as exc:
        raise settings.error(name, str(exc).partition(": ")[2]) from None


def site_settings(settings: PyqmgrCf, commands: dict[str, str],
                  relayhost: str = "") -> SiteSettings | None:
    """pyqmgr.cf's sites; None when ``site_grouping`` is unset or ``none``.

    ``commands``: master.cf's unix services and their commands (which transports
    deliver to mail exchangers); ``relayhost``: main.cf's, never grouped.
    """
    grouping = (settings.get(GROUPING) or "none").strip().lower()
    if grouping == "none":
        return None
    if grouping != "mx":
        raise settings.error(GROUPING, f'"{grouping}" is not one of: none, mx')
    listed = settings.get(TRANSPORTS)
    if listed is not None:
        transports = [t for t in listed.replace(",", " ").split() if t]
        unknown = [t for t in transports if t not in commands]
        if unknown:
            raise settings.error(TRANSPORTS, f"no master.cf unix service {unknown[0]!r}")
    else:
        transports = [t for t, cmd in commands.items() if cmd in GROUPED_COMMANDS]
    limits = {}
    for t in transports:
        n = settings.get_int(LIMIT, t, 0, 0, 100_000)
        try:
            rate = parse_rate(settings.get(RATE, t) or "", settings.which(RATE, t) or RATE)
        except ShapingError as exc:
            raise settings.error(settings.which(RATE, t) or RATE,
                                 str(exc).partition(": ")[2]) from None
        scope = (settings.get(DEAD_SCOPE, t) or "destination").strip().lower()
        if scope not in ("destination", "site"):
            raise settings.error(settings.which(DEAD_SCOPE, t) or DEAD_SCOPE,
                                 f'"{scope}" is not one of: destination, site')
        limits[t] = SiteLimits(n, f"{settings.which(LIMIT, t) or LIMIT} in pyqmgr.cf",
                               Shaping(rate=rate),
                               f"{settings.which(RATE, t) or RATE} in pyqmgr.cf",
                               dead_takes_site=scope == "site")
    try:
        providers = load_providers((settings.get(PROVIDERS) or "builtin").replace(
            ",", " ").split(), settings.root_files())
    except (ProviderTableError, OSError) as exc:
        raise settings.error(PROVIDERS, str(exc)) from None
    pins: dict[str, str] = {}
    pin_file = (settings.get(PINS) or "").strip()
    if pin_file:
        try:
            pins = Providers.parse(read_table(pin_file, settings.root_files()),
                                   pin_file).by_suffix
        except (ProviderTableError, OSError) as exc:
            raise settings.error(PINS, str(exc)) from None
    relay = relayhost.strip().lower()
    return SiteSettings(
        limits, providers, pins, frozenset({relay} if relay else ()),
        own_limits=_own_limits(settings),
        timeout=_duration(settings, TIMEOUT, 5.0),
        negative_ttl=_duration(settings, NEGATIVE_TTL, 300.0),
        max_ttl=_duration(settings, MAX_TTL, 86400.0),
        lookups=settings.get_int(LOOKUPS, None, 16, 1, 1000),
        wait=0.0 if (settings.get(WAIT) or "").strip() == "0" else _duration(settings, WAIT, 0.2))


def _own_limits(settings: PyqmgrCf) -> dict[str, int]:
    """``site_concurrency_limit_maps``: tables of ``SITE LIMIT`` (``google 20``), read
    whole at start-up; the first table that names a site wins. A table that cannot be
    read, or a limit that is not a number from 0 to 100000, is a start-up error: a
    provider's cap left out would let the relay open its transport's limit there."""
    own: dict[str, int] = {}
    # postmap reads the instance's main.cf: pyqmgr.cf's directory is its config_dir.
    config_dir = os.path.dirname(settings.path) if settings.exists else None
    for spec in table_specs(settings.get(SITE_LIMIT_MAPS) or ""):
        try:
            table = open_table(spec, config_dir, files=settings.root_files())
        except LookupTableError as exc:
            raise settings.error(SITE_LIMIT_MAPS, str(exc)) from None
        if not table.fixed or not table.entries:
            raise settings.error(SITE_LIMIT_MAPS, f"{spec}: expected a table of site names "
                                                  "and limits (texthash:, hash:, inline:)")
        for name, value in table.entries.items():
            if not value.isdigit() or int(value) > 100_000:
                raise settings.error(SITE_LIMIT_MAPS, f"{spec}: {name}: {value!r} is not "
                                                      "a limit from 0 to 100000")
            own.setdefault(name, int(value))
    return own


def on(settings: PyqmgrCf) -> bool:
    """Does pyqmgr.cf turn sites on (for the checks of settings that need them)?"""
    return (settings.get(GROUPING) or "none").strip().lower() != "none"
