"""Provider sites in the daemon: start-up's setup and the MX lookups (issue #33).

``site_grouping = mx`` turns sites on for the transports whose master.cf command is
smtp or lmtp (``site_transports`` names others or fewer; pyqmgr.cf's site settings
are read by :mod:`pyqmgr.settings.sites`, shared with the simulator). The core asks for a
domain's site when it first sees the domain (``Decisions.resolve``); this module
looks up its MX records with dnspython's asyncio resolver, names the site
(:mod:`pyqmgr.site_names`) and answers the core with ``site_learnt``. Until then,
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
before the chroot.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
    """The settings and the lookup made at start-up (before the chroot)."""

    settings: SiteSettings
    lookup: Callable[[str], Any]


def setup(settings: PyqmgrCf, commands: dict[str, str], relayhost: str,
          fleet: bool = False) -> SiteSetup | None:
    """Start-up's sites: the settings checked and dnspython's resolver made; None: off.
    ``fleet``: a fleet is on, whose ``fleet_site_*`` must apply to grouped transports
    (fleet.settings.check_site_limits)."""
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
    return SiteSetup(checked, lookup.found)


#: What one lookup found: the site (None: the domain is its own), how long the answer
#: holds, and why it failed (None: it did not).
Found = tuple[str | None, float, str | None]


class SiteResolver:
    """The daemon's MX lookups for the core, bounded and off the event loop's path."""

    def __init__(self, host: QmgrCore, settings: SiteSettings,
                 lookup: Callable[[str], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.host = host
        self.settings = settings
        self.clock = clock
        #: The coroutine function that looks a domain up: dnspython's unless a test
        #: gives its own.
        self.lookup = lookup or DnsLookup(settings).found
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
        self.host.spawn(self._one(zone, domain))

    def _query_goes(self, domain: str) -> None:
        """A lookup that waited its turn starts: its domain waits site_dns_wait from now."""
        if self.settings.wait > 0:
            now = self.clock()
            self.host.apply(self.host.scheduler.site_lookup_waits(
                (domain,), now + self.settings.wait, now))

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
        return {"lookups_running": self.running, "lookups_waiting": len(self.waiting),
                "answered": self.answered, "failed": dict(self.failed)}


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


class DnsLookup:
    """dnspython's asyncio resolver, made now (it reads /etc/resolv.conf: before the
    chroot), asked for MX records with a bounded lifetime.

    Made at start-up, as root: dnspython imports its asyncio backend at the first
    lookup and each record type's class at the first answer holding one, and after
    the daemon dropped its privileges those files may be out of reach (a checkout under
    /root, a chroot): every lookup failed (issue #43). So the backend is taken now and
    every record type loaded (15 ms, 1 MiB, only with sites on), which also stops
    dnspython from importing at all later: a record type nobody expected in an
    answer's additional section is read as generic data, not imported as mail_owner.
    """

    def __init__(self, settings: SiteSettings) -> None:
        import dns.asyncbackend
        import dns.asyncresolver
        import dns.exception
        import dns.rdata
        import dns.resolver

        dns.asyncbackend.set_default_backend("asyncio")
        dns.rdata.load_all_types()
        self.settings = settings
        self.resolver = dns.asyncresolver.Resolver()

    async def found(self, domain: str) -> Found:
        import dns.exception
        import dns.resolver

        s = self.settings
        began = time.monotonic()
        quick = await self._quick(domain)
        if quick is not None:
            return quick
        lifetime = s.timeout - (time.monotonic() - began)
        if lifetime <= 0:
            return None, s.negative_ttl, f"timeout after {s.timeout:g}s"
        try:
            answer = await self.resolver.resolve(domain, "MX", lifetime=lifetime,
                                                 search=False)
        except dns.resolver.NXDOMAIN:
            return None, s.negative_ttl, "NXDOMAIN"
        except dns.resolver.NoAnswer:
            # No MX: smtp(8) delivers to the domain's own address; it is its own site.
            return None, s.negative_ttl, None
        except dns.resolver.LifetimeTimeout:
            return None, s.negative_ttl, f"timeout after {s.timeout:g}s"
        except dns.resolver.NoNameservers as exc:
            return None, s.negative_ttl, f"no server answered: {_short(exc)}"
        except dns.exception.DNSException as exc:
            return None, s.negative_ttl, f"{type(exc).__name__}: {_short(exc)}"
        mx = [(int(r.preference), r.exchange.to_text(omit_final_dot=True)) for r in answer]
        ttl = float(answer.rrset.ttl) if answer.rrset is not None else s.negative_ttl
        return site_name(mx, s.providers), ttl, None

    async def _quick(self, domain: str) -> Found | None:
        """The common case at about half the resolver's CPU: one MX query to the
        first name server, over a UDP socket of its own, the answer read by dnspython.

        A new domain costs qmgr one lookup, and the resolver's machinery around the
        query (an asyncio endpoint a query, its futures and retries) took 275-350 us
        of CPU; a query of our own took 175-195 with dnspython building the query and
        asyncio's sock_recv under a timeout, and 150-160 now that the query's few
        bytes are written here and the answer is checked in the socket's own reader
        callback (#44: 1,000 messages to 1,000 new domains spent half of qmgr's CPU in
        the resolver; tests/test_sites_dns.py measures both). Anything but a plain
        answer (truncated, an error other than NXDOMAIN, a CNAME, the server silent
        within its timeout, a name server that is not an address, a name that is not
        plain ASCII) returns None, and the resolver asks as before. The answer is
        checked as dnspython's own query checks it (the ID, the question, from the
        connected server's address, the source port the kernel's random pick)."""
        servers = self.resolver.nameservers
        if not servers or not isinstance(servers[0], str):
            return None
        query = _mx_query(domain)
        if query is None:
            return None
        wire, question = query
        address, port = servers[0], self.resolver.port
        loop = asyncio.get_running_loop()
        s = self.settings
        got: asyncio.Future[Any] = loop.create_future()
        try:
            sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET,
                                 socket.SOCK_DGRAM)
        except OSError:
            return None
        with sock:
            sock.setblocking(False)
            fd = sock.fileno()

            def readable() -> None:
                # Reads on past what is not the answer (garbage, another ID, another
                # question), as dnspython does; the first answer ends the wait.
                while not got.done():
                    try:
                        data = sock.recv(65535)
                    except BlockingIOError:
                        return
                    except OSError:
                        got.set_result(None)
                        return
                    reply = _answer_to(data, wire, question)
                    if reply is not None:
                        got.set_result(reply)

            try:
                sock.connect((address, port))
                sock.send(wire)  # a datagram: sent whole or not at all
            except OSError:
                return None
            loop.add_reader(fd, readable)
            expired = False

            def expire() -> None:
                nonlocal expired
                expired = True
                got.cancel()

            timer = loop.call_later(min(s.timeout, self.resolver.timeout), expire)
            try:
                reply = await got
            except asyncio.CancelledError:
                if not expired:  # cancelled from outside (shutdown): not the timeout
                    raise
                return None
            finally:
                timer.cancel()
                loop.remove_reader(fd)
        if reply is None:
            return None
        return _found_in(reply, s.negative_ttl, s.providers)


#: The header of an MX query: recursion desired, one question (the ID goes first).
_QUERY_FLAGS = b"\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"
#: The question's type and class: MX, IN.
_MX_IN = b"\x00\x0f\x00\x01"


def _mx_query(domain: str) -> tuple[bytes, bytes] | None:
    """An MX query for a plain ASCII domain (its wire and its question section), or
    None for anything else (an IDN, an empty or overlong label): dnspython's
    resolver asks for those. The ID is 16 random bits, as dnspython's."""
    try:
        labels = domain.rstrip(".").encode("ascii").lower().split(b".")
    except UnicodeEncodeError:
        return None
    if sum(len(label) + 1 for label in labels) > 254 or not all(
            0 < len(label) < 64 for label in labels):
        return None
    question = b"".join(bytes((len(label),)) + label for label in labels) + b"\x00" + _MX_IN
    return os.urandom(2) + _QUERY_FLAGS + question, question


def _answer_to(data: bytes, wire: bytes, question: bytes) -> Any:
    """The datagram read as the answer to this query (dnspython's Message), or None:
    another ID, not a response, another opcode or question, not a DNS message."""
    import dns.exception
    import dns.message

    end = 12 + len(question)
    if (len(data) < end or data[:2] != wire[:2] or not data[2] & 0x80
            or data[2] & 0x78 or data[4:6] != b"\x00\x01"
            or data[12:end].lower() != question):
        return None
    try:
        return dns.message.from_wire(data)
    except dns.exception.DNSException:
        return None


def _found_in(reply: Any, negative_ttl: float, providers: Any) -> Found | None:
    """What an answer says, or None: truncated, an error but NXDOMAIN, a CNAME."""
    import dns.flags
    import dns.rcode
    import dns.rdataclass
    import dns.rdatatype

    if reply.flags & dns.flags.TC:
        return None
    rcode = reply.rcode()
    if rcode == dns.rcode.NXDOMAIN:
        return None, negative_ttl, "NXDOMAIN"
    if rcode != dns.rcode.NOERROR:
        return None
    name = reply.question[0].name
    for rrset in reply.answer:
        if (rrset.rdtype == dns.rdatatype.MX and rrset.rdclass == dns.rdataclass.IN
                and rrset.name == name):
            mx = [(int(r.preference), r.exchange.to_text(omit_final_dot=True))
                  for r in rrset]
            return site_name(mx, providers), float(rrset.ttl), None
    if reply.answer:
        return None  # a CNAME: the resolver follows it
    return None, negative_ttl, None  # no MX: the domain's own site


def _short(exc: Exception) -> str:
    text = str(exc)
    return text if len(text) <= 200 else text[:197] + "..."
