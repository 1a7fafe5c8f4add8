"""Prometheus metrics, the part that is always importable: settings and delivery counts.

Metrics are off unless pyqmgr.cf sets ``metrics_listen``; then :mod:`.metrics_exporter`
(which imports ``prometheus_client``) serves them. This module holds what must not
depend on that library:

* **The settings** (:func:`metrics_settings`), checked at start-up like every pyqmgr.cf
  value: a bad one is a fatal error naming pyqmgr.cf and the parameter, before
  anything else happens. With no ``metrics_listen`` nothing here runs and the
  exporter is never imported.
* **The delivery counts** (:class:`DeliveryStats`), raised by the daemon on every
  agent reply. They live on the delivery path, so they are plain ints and lists: no
  locks (everything runs on the event-loop thread), no label lookups, no
  prometheus_client objects. The exporter turns them into metric families when it is
  scraped.

What a delivery's outcome can honestly be: an agent's reply to qmgr carries one
final status for the whole request (0: every recipient got a final status, sent *or*
bounced; non-zero: some recipient must be tried again) and a hop status; which
recipients were sent and which bounced is only in the agent's log lines and the
bounce log, which qmgr does not read per delivery. So the outcomes are Postfix's own
words for the reply (``DEL_STAT_FINAL``, ``DEL_STAT_DEFER``), plus the reply that
never came:

========== ==================================================================
outcome    the maillog (one line per recipient, from the delivery agent)
========== ==================================================================
final      every recipient ``status=sent`` or ``status=bounced``
deferred   at least one recipient ``status=deferred`` (others may be sent or
           bounced in the same request; with one recipient per request, exactly
           that one line)
crashed    no usable reply: qmgr's ``warning: ... malformed response`` (the agent
           died or spoke garbage); no status line, the message is retried later
========== ==================================================================
"""

from __future__ import annotations

import dataclasses
import heapq
import ipaddress
import os
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from pyqmgr.postfix.config import ConfigError, QmgrConfig
from pyqmgr.postfix.host_port import HostPortError, host_port
from pyqmgr.postfix.master_cf import load_master_cf
from pyqmgr.pyqmgr_cf import PyqmgrCf, PyqmgrCfError
from pyqmgr.scheduler.explain import site_name

if TYPE_CHECKING:
    from pyqmgr.scheduler.entry import Entry
    from pyqmgr.scheduler.structures import Queue

LISTEN = "metrics_listen"
DESTINATION_LIMIT = "metrics_destination_limit"
SITE_LIMIT = "metrics_site_limit"
TENANT_LIMIT = "metrics_tenant_limit"
ALLOW_REMOTE = "metrics_allow_remote"

#: Per-destination series at most (the rest are summed into ``destination="_other"``).
DEFAULT_DESTINATION_LIMIT = 100
#: Per-site series at most (issue #44; the rest are summed into ``site="_other"``).
DEFAULT_SITE_LIMIT = 100
#: Per-tenant series at most (issue #34; the rest are summed into ``tenant="_other"``).
DEFAULT_TENANT_LIMIT = 100
OTHER = "_other"
#: The most series of one kind a setting may ask for: each costs a few lines of every
#: scrape, and 10,000 of them are 1 MB (issue #44's bound on a scrape).
MAX_DESTINATION_LIMIT = 10_000

#: What "activity" counts (issue #44): delivery requests answered over the last
#: ACTIVITY_SPAN seconds, kept in ACTIVITY_PARTS slices so that the oldest slice can
#: be let go whole (:class:`Activity`).
ACTIVITY_SPAN = 60.0
ACTIVITY_PARTS = 6
#: Where a bare port number listens: metrics name the destinations a server mails to,
#: which is nobody else's business unless the admin says so.
DEFAULT_HOST = "127.0.0.1"
#: The daemon binds after dropping privileges to mail_owner, so no privileged port.
MIN_PORT = 1024
#: Postfix's delivery agents: master.cf services running one of these are transports.
DELIVERY_AGENTS = frozenset({"smtp", "lmtp", "local", "virtual", "pipe", "error",
                             "discard"})

FINAL = 0
DEFERRED = 1
CRASHED = 2
#: Label values of the ``outcome`` label, by the indexes above.
OUTCOMES = ("final", "deferred", "crashed")

#: Delivery latency buckets (seconds), from a local discard (milliseconds) to an SMTP
#: session that runs into smtp's timeouts (minutes).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0, 300.0, 600.0)
#: Message age at delivery: qshape(1)'s columns (5, 10, 20, ... 1280 minutes and
#: beyond), in seconds, so the histogram reads like qshape's output.
AGE_BUCKETS = tuple(60.0 * minutes for minutes in (5, 10, 20, 40, 80, 160, 320, 640, 1280))


@dataclass(frozen=True)
class MetricsSettings:
    """Where to listen and how many destinations get series of their own."""

    host: str
    port: int
    destination_limit: int = DEFAULT_DESTINATION_LIMIT
    #: master.cf's delivery services, whose delivery counters exist from the start.
    transports: tuple[str, ...] = ()
    site_limit: int = DEFAULT_SITE_LIMIT
    tenant_limit: int = DEFAULT_TENANT_LIMIT

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_listen(text: str) -> tuple[str, int]:
    """``PORT``, ``:PORT``, ``HOST:PORT`` or ``[IPV6]:PORT``; ValueError says what is wrong.

    HOST is a numeric address or ``localhost`` (127.0.0.1): the daemon does no name
    lookups at start-up, and a name that resolves differently tomorrow is no place to
    publish a server's destinations.
    """
    if text.isdigit():
        host, port_text = DEFAULT_HOST, text
    else:
        try:
            host, port_text = host_port(text)
        except HostPortError as exc:
            if exc.kind != "host" or text.startswith("["):
                raise ValueError({
                    "bracket": "expected [IPV6-ADDRESS]:PORT",
                    "colon": "expected HOST:PORT or PORT",
                    "ipv6": "an IPv6 address goes in brackets: [ADDRESS]:PORT",
                    "host": '"" is not a numeric IP address (or localhost)'}[exc.kind]
                ) from None
            host, port_text = DEFAULT_HOST, text[1:]  # ":PORT"
    if host.lower() == "localhost":
        host = DEFAULT_HOST
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f'"{host}" is not a numeric IP address (or localhost)') from None
    if not port_text.isdigit() or not MIN_PORT <= int(port_text) <= 65535:
        raise ValueError(f'port "{port_text}" is not a number in {MIN_PORT}..65535 (the '
                         "daemon listens after dropping privileges: no port below "
                         f"{MIN_PORT})")
    return str(address), int(port_text)


def metrics_settings(settings: PyqmgrCf) -> MetricsSettings | None:
    """The metrics settings of pyqmgr.cf; None when metrics are off (the default).

    Raises PyqmgrCfError, naming the file and the parameter, for a value the daemon
    cannot use, and for an address that is not loopback unless ``metrics_allow_remote
    = yes``: a listener on every interface should be a decision, not a typo.
    """
    value = settings.get(LISTEN)
    if value is None or not value.strip():
        return None
    text = value.strip()
    try:
        host, port = parse_listen(text)
    except ValueError as exc:
        raise settings.error(LISTEN, f'bad value "{text}": {exc}') from None
    if not ipaddress.ip_address(host).is_loopback and not settings.get_bool(
            ALLOW_REMOTE, None, False):
        raise settings.error(LISTEN, f'"{text}" is not a loopback address; set '
                                     f"{ALLOW_REMOTE} = yes to publish metrics beyond "
                                     "this host")
    limit, sites, tenants = (
        settings.get_int(name, None, default, 0, MAX_DESTINATION_LIMIT)
        for name, default in ((DESTINATION_LIMIT, DEFAULT_DESTINATION_LIMIT),
                              (SITE_LIMIT, DEFAULT_SITE_LIMIT),
                              (TENANT_LIMIT, DEFAULT_TENANT_LIMIT)))
    return MetricsSettings(host, port, limit, site_limit=sites, tenant_limit=tenants)


def delivery_transports(config_dir: str) -> tuple[str, ...]:
    """master.cf's services that run a delivery agent (best effort: () if unreadable).

    Their delivery counters are exported as zeros before their first delivery. A
    counter series that first appears with a value N loses those N to Prometheus's
    rate() and increase() (there is no earlier sample to count from), so the
    transports known in advance get their series at once, as Prometheus's
    instrumentation advice has it. Others (a custom agent) appear on first use.
    """
    try:
        master = load_master_cf(config_dir)
    except (ConfigError, OSError):
        return ()
    return tuple(sorted({s.service for s in master.services if s.type == "unix"
                         and os.path.basename(s.command) in DELIVERY_AGENTS}))


def setup(settings: PyqmgrCf, cfg: QmgrConfig) -> MetricsSettings | None:
    """Start-up's whole metrics step, run as root before the chroot; None when off.

    Checks the settings (PyqmgrCfError if bad), imports the exporter, and reads
    master.cf's delivery services while it is in reach.
    """
    found = metrics_settings(settings)
    if found is None:
        return None
    import_exporter(settings)
    return dataclasses.replace(found, transports=delivery_transports(cfg.config_dir))


def import_exporter(settings: PyqmgrCf) -> None:
    """Import prometheus_client now, while the daemon is still root (start-up imports
    the exporter right after: it depends on this module, not this module on it).

    Start-up calls this before the chroot and the privilege drop (the library's files
    may not be reachable after them). The library runs as root, so every file of it
    passes the start-up trust check first, as a ``module:`` policy file does (the
    general check covers site-packages' top-level entries, not what is inside them);
    an offender raises :class:`pyqmgr.trust.UntrustedError`. prometheus_client's
    exposition module imports ``ssl`` at the top (it can serve HTTPS itself), which
    the launcher keeps out of the daemon to save OpenSSL's 4 MiB: with metrics on, ssl
    is let back in. The exporter never uses it.
    """
    from pyqmgr.extras import install_command
    from pyqmgr.libraries import import_trusted

    def missing(why: object) -> PyqmgrCfError:
        return PyqmgrCfError(f"{settings.path}: parameter {LISTEN}: the prometheus_client "
                             f"library does not load ({why}); install it "
                             f"({install_command(['metrics'])}) or remove the parameter")

    import_trusted(("prometheus_client",), ("prometheus_client",), missing)


class Histogram:
    """Counts per bucket, as cheap to observe as a bisect and two additions.

    ``counts[i]`` holds observations in (bounds[i-1], bounds[i]]; the last slot holds
    those beyond every bound (Prometheus's ``+Inf``). Cumulative counts are made when
    scraped, not on every observation.
    """

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[float, int]]:
        """``(le, count)`` pairs as Prometheus wants them, ``inf`` last."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            out.append((bound, running))
        out.append((float("inf"), running + self.counts[-1]))
        return out

    @property
    def count(self) -> int:
        return sum(self.counts)


class TransportStats:
    """One transport's delivery counts and histograms."""

    __slots__ = ("deliveries", "recipients", "latency", "age")

    def __init__(self) -> None:
        #: Delivery requests answered, by outcome index (FINAL, DEFERRED, CRASHED).
        self.deliveries = [0, 0, 0]
        #: Recipients those requests carried, by the request's outcome.
        self.recipients = [0, 0, 0]
        self.latency = Histogram(LATENCY_BUCKETS)
        self.age = Histogram(AGE_BUCKETS)


Key = TypeVar("Key", bound=Hashable)


class Activity(Generic[Key]):
    """Delivery requests answered per scope over the last :data:`ACTIVITY_SPAN` seconds.

    What ranks destinations, sites and tenants for a series of their own (issue #44):
    a reply costs two dict increments; the span is kept in :data:`ACTIVITY_PARTS`
    slices, and when the oldest slice goes its counts are taken off the running
    totals, so the work is paid once per count, never by walking every scope. Memory
    is the scopes answered within the span, whatever number of them are in core.
    """

    __slots__ = ("counts", "parts", "size", "step", "edge")

    def __init__(self, span: float = ACTIVITY_SPAN, parts: int = ACTIVITY_PARTS) -> None:
        #: Replies within the span, by scope: the activity.
        self.counts: dict[Key, int] = {}
        #: The slices, newest last, each the replies it counted by scope.
        self.parts: deque[dict[Key, int]] = deque([{}])
        self.size = parts
        self.step = span / parts
        #: When the newest slice ends (monotonic clock; 0: not started).
        self.edge = 0.0

    def add(self, key: Key) -> None:
        part = self.parts[-1]
        part[key] = part.get(key, 0) + 1
        counts = self.counts
        counts[key] = counts.get(key, 0) + 1

    def get(self, key: Key) -> int:
        return self.counts.get(key, 0)

    def advance(self, now: float) -> bool:
        """Let the slices older than the span go; whether one did."""
        if now < self.edge:
            return False
        size = self.size
        if now - self.edge >= self.step * size:
            self.counts.clear()  # quiet for the whole span: start over
            self.parts = deque([{}])
            self.edge = now + self.step
            return True
        while now >= self.edge:
            self.parts.append({})
            if len(self.parts) > size:
                counts = self.counts
                for key, n in self.parts.popleft().items():
                    left = counts[key] - n
                    if left:
                        counts[key] = left
                    else:
                        del counts[key]
            self.edge += self.step
        return True


class DeliveryStats:
    """What the daemon counts per agent reply, by transport (see the module's table).

    The transport label's values are bounded by master.cf: only a running service
    replies. Latency runs from the entry's selection to the reply (every outcome);
    message age from the queue file's arrival time to the reply, for final replies
    only: the age at which mail left.

    Beside them, each reply counts for the :class:`Activity` of its destination, its
    site and its tenant: the exporter gives series to the most active of each kind
    (issue #44).
    """

    def __init__(self, wall_clock: Callable[[], float] = time.time,
                 transports: tuple[str, ...] = (), class_names: tuple[str, ...] = (),
                 tenant_limit: int = DEFAULT_TENANT_LIMIT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.transports: dict[str, TransportStats] = {
            name: TransportStats() for name in transports}
        self.wall_clock = wall_clock
        self.clock = clock
        #: Replies that could not be counted (a bug here must not touch deliveries).
        self.errors = 0
        #: With message classes or tenants (issue #34): the same counts and the age
        #: at delivery by class, and by tenant for the ``tenant_limit`` most active
        #: tenants (the rest summed as ``_other``: a label per sender domain would be
        #: unbounded; :meth:`rank_tenants`).
        self.class_names = class_names
        self.classes: dict[str, TransportStats] = {}
        self.tenants: dict[str, TransportStats] = {}
        self.tenant_other: TransportStats | None = None
        self.tenant_limit = tenant_limit
        #: Replies by (transport, destination label), by (transport, site) and by
        #: tenant over the last minute.
        self.destination_activity: Activity[tuple[str, str]] = Activity()
        self.site_activity: Activity[tuple[str, str]] = Activity()
        self.tenant_activity: Activity[str] = Activity()

    def transport(self, name: str) -> TransportStats:
        stats = self.transports.get(name)
        if stats is None:
            stats = self.transports[name] = TransportStats()
        return stats

    def delivery_done(self, entry: Entry, status: int | None, latency: float) -> None:
        """An agent replied (``status``; None: no usable reply) ``latency`` s after selection."""
        try:
            if self.destination_activity.edge <= (now := self.clock()):
                self._advance(now)
            queue = entry.queue
            t = queue.transport
            name = t.name
            stats = self.transports.get(name)
            if stats is None:
                stats = self.transport(name)
            outcome = CRASHED if status is None else FINAL if status == 0 else DEFERRED
            stats.deliveries[outcome] += 1
            stats.recipients[outcome] += len(entry.recipients)
            stats.latency.observe(latency)
            kinds = [stats]
            message = entry.message
            if self.class_names:
                cls = self.class_names[min(message.rank, len(self.class_names) - 1)]
                kinds.append(self._of(self.classes, cls, len(self.class_names)))
            if message.tenant:
                kinds.append(self._tenant(message.tenant))
            for more in kinds[1:]:
                more.deliveries[outcome] += 1
                more.recipients[outcome] += len(entry.recipients)
                more.latency.observe(latency)
            if outcome == FINAL:
                owner = message.owner
                if owner is not None:
                    sec, usec = owner.qf.arrival_time
                    if sec:
                        age = max(0.0, self.wall_clock() - sec - usec * 1e-6)
                        for counted in kinds:
                            counted.age.observe(age)
            self._active(queue, name)
        except Exception:  # noqa: BLE001 - counting must never disturb a delivery
            self.errors += 1

    def _active(self, queue: Queue, transport: str) -> None:
        """The reply counts for its destination's and its site's activity."""
        per_nexthop = queue.transport.cfg.destination_recipient_limit == 1
        self.destination_activity.add(
            (transport, queue.nexthop if per_nexthop else queue.name))
        site = site_name(queue)
        if site is not None:
            self.site_activity.add((transport, site))

    def advance(self) -> None:
        """Time passed without replies (a scrape): let old activity go."""
        self._advance(self.clock())

    def _advance(self, now: float) -> None:
        self.destination_activity.advance(now)
        self.site_activity.advance(now)
        if self.tenant_activity.advance(now) and self.tenants:
            self.rank_tenants()

    def _tenant(self, tenant: str) -> TransportStats:
        """The tenant's counts: its own while it is among the most active (a new one
        gets its own at once while there is room), else ``_other``'s."""
        self.tenant_activity.add(tenant)
        stats = self.tenants.get(tenant)
        if stats is not None:
            return stats
        if len(self.tenants) < self.tenant_limit:
            stats = self.tenants[tenant] = TransportStats()
            return stats
        if self.tenant_other is None:
            self.tenant_other = TransportStats()
        return self.tenant_other

    def rank_tenants(self) -> None:
        """The ``tenant_limit`` most active tenants of the last minute keep or get
        series of their own; a tenant with a series makes way only for a more active
        one (among equals the series stay where they are: no churn), the least
        active first.

        A tenant that makes way loses its series (its counts so far stay in what
        Prometheus stored; its later ones go to ``_other``, so every series only
        grows); one that comes back starts a new series at 0, which rate() reads as
        a counter reset. Costs O(T log N) for the T tenants of the last minute, once
        a slice (10 s), never per reply.
        """
        limit, shown = self.tenant_limit, self.tenants
        active = self.tenant_activity.counts
        if all(tenant in shown for tenant in active):
            return
        best = heapq.nlargest(limit, active.items(),
                              key=lambda item: (item[1], item[0] in shown))
        keep = {tenant for tenant, _count in best}
        newcomers = [tenant for tenant, _count in best if tenant not in shown]
        need = len(newcomers) - (limit - len(shown))
        if need > 0:
            leaving = sorted((t for t in shown if t not in keep),
                             key=lambda t: active.get(t, 0))
            for tenant in leaving[:need]:
                del shown[tenant]
        for tenant in newcomers[:max(0, limit - len(shown))]:
            shown[tenant] = TransportStats()

    @staticmethod
    def _of(table: dict[str, TransportStats], name: str, limit: int) -> TransportStats:
        stats = table.get(name)
        if stats is None:
            if len(table) >= limit:
                name = OTHER
                stats = table.get(name)
            if stats is None:
                stats = table[name] = TransportStats()
        return stats
