"""Provider sites in the daemon: start-up's setup and the MX lookups (issue #33).

``site_grouping = mx`` turns sites on for the transports whose master.cf command is
smtp or lmtp (``site_transports`` names others or fewer; pyqmgr.cf's site settings
are read by :mod:`pyqmgr.settings.sites`, shared with the simulator). The core asks for a
domain's site when it first sees the domain (``Decisions.resolve``); this module
has its MX records looked up, names the site (:mod:`pyqmgr.site_names`) and answers
the core with ``site_learnt``. The lookups run in a helper process
(:mod:`pyqmgr.daemon.site_lookupd`, spawned at start-up): qmgr writes it names
and reads back records, and does no DNS itself, as Postfix's qmgr does none (#44:
a lookup in qmgr cost it 150-210 us of CPU). If the helper goes, qmgr looks up
with dnspython itself (:class:`DnsLookup`, made at start-up for that). Until then,
and for ``site_dns_negative_ttl`` after a lookup failed, the domain is a site of its
own, and a failure logs one line (the domain and the cause), not one per message,
and at most ten a minute for each cause, the next saying how many more failed so
(the rest are counted in ``pyqmgr status``).
A domain's very first queue waits ``site_dns_wait`` (200 ms) for its lookup: a local
resolver answers in milliseconds, and without the wait the first deliveries of fifty
new domains at one provider would each count at a site of their own and together
overrun the provider's limit (measured: 2 of 200 messages refused at a 5-session
server, none with the wait). A lookup slower than that lets the mail go at the
domain's own site.

The event loop never waits on DNS either: lookups run as tasks, at most
``site_dns_lookups`` at once (the rest wait their turn in a FIFO), each bounded by
``site_dns_timeout``. An answer holds for its TTL, at most ``site_dns_max_ttl``;
the core asks again for a domain whose answer ran out the next time it makes the
domain's queue, and keeps the old site meanwhile.

dnspython reads /etc/resolv.conf when the resolver is made, which start-up does
before the chroot (the helper: before it drops its privileges).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyqmgr.daemon import site_lookupd
from pyqmgr.daemon.mx_lookup import MxLookup
from pyqmgr.daemon.site_lookupd import Found, LookupHelper
from pyqmgr.extras import install_command
from pyqmgr.fleet.settings import check_site_limits
from pyqmgr.postfix.policy_delegation import WarnGate
from pyqmgr.pyqmgr_cf import PyqmgrCf
from pyqmgr.settings.sites import GROUPING, SiteSettings, site_settings
from pyqmgr.site_names import site_name

if TYPE_CHECKING:
    from pyqmgr.daemon.host import QmgrCore

#: Failed lookups' warnings: the first WARN_BURST of each cause in a WARN_INTERVAL,
#: each naming its domain; the rest are counted (``pyqmgr status``) and the next
#: warning says how many.
WARN_INTERVAL = 60.0
WARN_BURST = 10
#: Lookups waiting their turn at most; beyond, a domain stays its own site until the
#: core asks again (a flood of new domains cannot grow memory).
MAX_WAITING = 10_000


@dataclass(frozen=True)
class SiteSetup:
    """The settings and the lookup made at start-up (before the chroot): the helper
    process's (:class:`LookupHelper`), or dnspython in qmgr."""

    settings: SiteSettings
    lookup: Callable[[str], Any] | LookupHelper


def setup(settings: PyqmgrCf, commands: dict[str, str], relayhost: str,
          fleet: bool = False, helper_user: str = "",
          config_dir: str = "") -> SiteSetup | None:
    """Start-up's sites: the settings checked and dnspython's resolver made; None: off.
    ``fleet``: a fleet is on, whose ``fleet_site_*`` must apply to grouped transports
    (fleet.settings.check_site_limits). ``helper_user``: start the lookup helper,
    which runs as this user (mail_owner); ``config_dir`` is its MAIL_CONFIG."""
    checked = site_settings(settings, commands, relayhost)
    if fleet:
        check_site_limits(settings, checked.limits.__contains__ if checked else None)
    if checked is None:
        return None
    try:
        lookup = DnsLookup(checked)
    except ImportError as exc:
        # Start-up names a dnspython that is not installed (pyqmgr.extras); this is one
        # that is there but does not load: the same fatal line, not a traceback.
        raise settings.error(GROUPING, f"the dnspython library does not load ({exc}); "
                                       f"install it ({install_command(['sites'])})") from None
    if not helper_user:
        return SiteSetup(checked, lookup.found)
    try:
        proc = site_lookupd.spawn(checked, helper_user, config_dir)
    except OSError as exc:
        # Mail waits while master throttles the service and tries again: better than
        # a qmgr that does its own DNS without anyone having chosen it.
        raise settings.error(GROUPING, f"cannot start the MX lookup helper: "
                                       f"{exc.strerror or exc}") from None
    return SiteSetup(checked, LookupHelper(proc, lookup.found, checked))


class SiteResolver:
    """The daemon's MX lookups for the core, bounded and off the event loop's path."""

    def __init__(self, host: QmgrCore, settings: SiteSettings,
                 lookup: Callable[[str], Any] | LookupHelper | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.host = host
        self.settings = settings
        self.clock = clock
        #: The helper process's side in qmgr, when the lookups run there.
        self.helper: LookupHelper | None = None
        own: Callable[[str], Any]
        if isinstance(lookup, LookupHelper):
            self.helper = lookup
            lookup.attach(self._answered, host.log.warning, self._queries_went, clock)
            own = lookup.fallback
        else:
            own = lookup or DnsLookup(settings).found
        #: The coroutine function that looks a domain up in qmgr: dnspython's unless
        #: a test gives its own; with the helper, only once it is gone.
        self.lookup = own
        #: Lookups waiting their turn, by zone (LookupLine).
        self.waiting = LookupLine(max(1, settings.lookups // 4))
        self.running = 0
        #: Counters for status: lookups answered, failed by cause.
        self.answered = 0
        self.failed: dict[str, int] = {}
        #: One warning a WARN_INTERVAL for each cause of failure.
        self.warn_gates: dict[str, WarnGate] = {}

    def resolve(self, domains: tuple[str, ...]) -> None:
        """The core asked for these domains' sites (``Decisions.resolve``).

        A lookup that must wait its turn tells the core so: the domain's first queue,
        held for ``site_dns_wait`` from now, is held up to the lookup's timeout
        instead, and given its wait again when the query goes (``_one``)."""
        queued: list[str] = []
        line = self.waiting
        for domain in domains:
            zone = lookup_zone(domain)
            if self.running < self.settings.lookups and line.has_room(zone):
                self._start(zone, domain)
            elif len(line) < MAX_WAITING:
                line.add(zone, domain)
                queued.append(domain)
            else:
                self._learnt(domain, None, self.settings.negative_ttl, "too many lookups")
        if queued and self.settings.wait > 0:
            now = self.clock()
            self.host.apply(self.host.scheduler.site_lookup_waits(
                tuple(queued), now + self.settings.timeout, now))

    def _start(self, zone: str, domain: str) -> None:
        self.running += 1
        self.waiting.started(zone)
        helper = self.helper
        if helper is not None and helper.gone is None:
            helper.ask(zone, domain)
        else:
            self.host.spawn(self._one(zone, domain))

    def _answered(self, zone: str, domain: str, found: Found | None) -> None:
        """The helper's answer; None: it went with this lookup in flight, which is
        asked in qmgr now (and counts as running until then)."""
        if found is None:
            self.host.spawn(self._one(zone, domain))
            return
        line = self.waiting
        line.ended(zone)
        self._learnt(domain, *found)
        self.running -= 1
        while self.running < self.settings.lookups and (more := line.take()) is not None:
            self._start(*more)
            self._query_goes(more[1])

    def _query_goes(self, domain: str) -> None:
        """A lookup that waited its turn starts: its domain waits site_dns_wait from now."""
        self._queries_went((domain,))

    def _queries_went(self, domains: tuple[str, ...]) -> None:
        """These lookups' queries go now: a lookup that waited its turn here, or those
        written to the helper before it was ready (its start-up is no part of the
        wait either)."""
        if self.settings.wait > 0 and domains:
            now = self.clock()
            self.host.apply(self.host.scheduler.site_lookup_waits(
                domains, now + self.settings.wait, now))

    async def _one(self, zone: str, domain: str) -> None:
        """Look domains up one after another: this one, then the line's next while
        there is one (a task reused, not one a lookup)."""
        line = self.waiting
        try:
            while True:
                try:
                    name, ttl, why = await self.lookup(domain)
                except Exception as exc:  # noqa: BLE001 - a resolver bug must not stop mail
                    name, ttl, why = None, self.settings.negative_ttl, f"error: {exc!r}"
                line.ended(zone)
                self._learnt(domain, name, ttl, why)
                following = line.take()
                if following is None:
                    return
                zone, domain = following
                line.started(zone)
                self._query_goes(domain)
                # A zone that had no room may have some now: run its lookups beside.
                while self.running < self.settings.lookups and (
                        more := line.take()) is not None:
                    self._start(*more)
                    self._query_goes(more[1])
        finally:
            self.running -= 1

    def _learnt(self, domain: str, name: str | None, ttl: float, why: str | None) -> None:
        if why is not None:
            cause = why.split(":")[0]
            self.failed[cause] = self.failed.get(cause, 0) + 1
            # Paced per cause (issue #45): a flood of new domains in a zone that times
            # out, or of typos, made a warning each.
            gate = self.warn_gates.setdefault(cause, WarnGate(WARN_INTERVAL, WARN_BURST))
            held = gate.allow(self.clock())
            if held is not None:
                more = (f" ({held} more lookups failed so in the last "
                        f"{WARN_INTERVAL:g}s: pyqmgr status counts them)" if held else "")
                self.host.log.warning(f"sites: {domain}: MX lookup failed ({why}); its "
                                      f"own site for {ttl:g}s{more}")
        else:
            self.answered += 1
        now = self.clock()
        ttl = min(ttl, self.settings.max_ttl)
        self.host.apply(self.host.scheduler.site_learnt(domain, name or domain, now + ttl,
                                                        now))
        self.host.dispatch()

    def status(self) -> dict[str, object]:
        found: dict[str, object] = {
            "lookups_running": self.running, "lookups_waiting": len(self.waiting),
            "answered": self.answered, "failed": dict(self.failed)}
        if self.helper is not None:
            found["helper"] = self.helper.status()
        return found


def lookup_zone(domain: str) -> str:
    """Which zone a domain's lookup counts in for fairness: its last two labels. A
    zone that answers slowly (a wildcard behind which anyone mints new domains, each
    lookup taking site_dns_timeout) takes at most a quarter of the lookups at once,
    so other domains' lookups go on (issue #45). Two labels, not the registered
    domain (no public suffix list here): all of co.uk shares a quarter, which at a
    local resolver's pace is thousands of lookups a second."""
    labels = domain.lower().rstrip(".").rsplit(".", 2)
    return ".".join(labels[-2:])


class LookupLine:
    """Lookups waiting their turn, by zone (:func:`lookup_zone`): a zone runs at most
    ``per_zone`` at once, and zones with room take turns, oldest first. O(1) a lookup."""

    def __init__(self, per_zone: int) -> None:
        self.per_zone = per_zone
        self.by_zone: dict[str, deque[str]] = {}
        self.running: dict[str, int] = {}
        #: Zones with lookups waiting and room to run one, each once, in turn.
        self.ready: dict[str, None] = {}
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def has_room(self, zone: str) -> bool:
        return self.running.get(zone, 0) < self.per_zone

    def add(self, zone: str, domain: str) -> None:
        self.by_zone.setdefault(zone, deque()).append(domain)
        self.count += 1
        if self.has_room(zone):
            self.ready[zone] = None

    def started(self, zone: str) -> None:
        self.running[zone] = self.running.get(zone, 0) + 1

    def ended(self, zone: str) -> None:
        left = self.running.get(zone, 0) - 1
        if left > 0:
            self.running[zone] = left
        else:
            self.running.pop(zone, None)
        if zone in self.by_zone:
            self.ready[zone] = None

    def take(self) -> tuple[str, str] | None:
        """The next lookup to run (its zone, its domain), or None."""
        while self.ready:
            zone = next(iter(self.ready))
            del self.ready[zone]
            waiting = self.by_zone.get(zone)
            if not waiting or not self.has_room(zone):
                continue
            domain = waiting.popleft()
            self.count -= 1
            if not waiting:
                del self.by_zone[zone]
            elif self.running.get(zone, 0) + 1 < self.per_zone:
                self.ready[zone] = None  # its turn again after the others'
            return zone, domain
        return None

    def clear(self) -> None:
        self.by_zone.clear()
        self.ready.clear()
        self.count = 0


class DnsLookup(MxLookup):
    """dnspython in qmgr itself, the site named from the records: the lookup when
    the helper is gone (and tests' own). Made at start-up, as root, before the
    chroot (:class:`MxLookup` says why)."""

    def __init__(self, settings: SiteSettings) -> None:
        super().__init__(settings.timeout, settings.negative_ttl)
        self.providers = settings.providers

    async def found(self, domain: str) -> Found:
        records, ttl, why = await self.mx(domain)
        return (site_name(records, self.providers) if records else None), ttl, why
