"""Operator suspensions: ``pyqmgr suspend``, ``resume`` and ``retry``, without I/O.

An admin whose remote side asked for a pause, or who is investigating a destination,
wants its mail to stay queued and go out the moment the pause ends, by itself if
they forget: PowerMTA's "pause queue", KumoMTA's suspensions. Postfix has no such
thing for a destination (``defer_transports`` is main.cf, a whole transport, and
moves the mail to the deferred queue where it waits for its retry time).

A suspended destination keeps its entries in core: no agent is given one, and no
agent is asked for on their account (the destination is out of the transport's
ready set), so nothing is deferred and nothing is logged per recipient. When the
suspension ends the destination takes deliveries again at once, with the window it
had. A suspended transport gets no agents at all. Deliveries already under way when
a suspension starts finish normally (their outcome still feeds the window and can
still make the destination dead, as for any delivery).

The suspensions are kept here, in a table by target, not only on the queues: a queue
that goes idle is discarded by the core and a new one made when mail comes again, and
the new one must be suspended too. The table is consulted when a queue or transport is
made, so its cost is one dict test per new queue while any suspension exists.

Naming: what Postfix's source calls a suspended queue is ``destination_rate_delay``'s
pause, here :attr:`.queue.Queue.paused`, so that "suspended" means one thing: an
operator's hold, a :class:`Suspension` in
``queue.gate``, the attribute that every reason to hold a live destination shares.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass


class TargetError(ValueError):
    """A target that names nothing suspendable; the text says what was wrong."""


@dataclass(frozen=True, slots=True)
class Target:
    """What a control names: a destination (in one transport or in all) or a transport.

    ``transport`` None with a ``destination``: that destination in every transport.
    ``destination`` None: the whole ``transport``. Destinations are compared without
    regard to case, as the scheduler's queue names are. A ``site`` with a
    ``transport``: that transport's site alone (``out11:site:google``, issue #46: one
    source at one provider site); with none, the site in every transport.
    """

    transport: str | None
    destination: str | None
    #: A provider site (issue #33; ``site:NAME``): every destination counted there.
    site: str | None = None
    #: A tenant (issue #34; ``tenant:NAME[@TARGET]``): only its mail, at the rest of
    #: the target, or everywhere when the rest names nothing.
    tenant: str | None = None

    @property
    def key(self) -> tuple[str | None, str | None, str | None]:
        if self.site is not None:
            return (site_key(self.transport), self.site, self.tenant)
        return (self.transport, self.destination, self.tenant)

    @property
    def everywhere(self) -> bool:
        """A tenant's target with nothing more: all its mail."""
        return self.transport is None and self.destination is None and self.site is None

    @property
    def spec(self) -> str:
        """The target as a control names it (``TRANSPORT:``, ``DEST``, ``T:DEST``,
        ``site:NAME``, ``T:site:NAME``, ``tenant:NAME``, ``tenant:NAME@...``): what
        :func:`parse_target` reads back, and the fleet's table's key."""
        if self.tenant is not None:
            rest = "" if self.everywhere else "@" + Target(
                self.transport, self.destination, self.site).spec
            return f"{TENANT_PREFIX}{self.tenant}{rest}"
        if self.site is not None:
            return (f"{SITE_PREFIX}{self.site}" if self.transport is None
                    else f"{self.transport}:{SITE_PREFIX}{self.site}")
        if self.destination is None:
            return f"{self.transport}:"
        return self.destination if self.transport is None else (
            f"{self.transport}:{self.destination}")

    def __str__(self) -> str:
        if self.tenant is not None:
            return f"tenant {self.tenant}" + ("" if self.everywhere else " at " + str(
                Target(self.transport, self.destination, self.site)))
        if self.site is not None:
            return (f"site {self.site}" if self.transport is None
                    else f"site {self.site} in transport {self.transport}")
        if self.destination is None:
            return f"transport {self.transport}"
        if self.transport is None:
            return f"destination {self.destination}"
        return f"destination {self.transport}:{self.destination}"


#: Longest target accepted (a domain is at most 255; a nexthop adds brackets, a port).
MAX_TARGET = 300
#: How a control names a site: ``site:google`` (unless master.cf has a "site" service).
SITE_PREFIX = "site:"
#: How a control names a tenant: ``tenant:acme``, ``tenant:acme@site:yahoo``.
TENANT_PREFIX = "tenant:"


def site_key(transport: str | None) -> str:
    """The first part of a site target's key in :class:`SuspensionTable`: ``site:``
    for a site in every transport, ``out11:site:`` for one transport's. No transport
    name has a colon, so neither can be a destination target's transport."""
    return SITE_PREFIX if transport is None else f"{transport}:{SITE_PREFIX}"


def parse_target(text: str, transports: Collection[str]) -> Target:
    """The target an admin typed: ``DEST``, ``TRANSPORT:DEST``, ``TRANSPORT:`` or ``TRANSPORT``.

    Postfix writes a next hop as ``transport:nexthop`` (transport_maps), so that form
    names a destination in one transport and ``smtp:`` the whole transport. A bare
    name is a transport when ``transports`` (master.cf's services and the transports
    in core) has it and it has no dot, else a destination in every transport. A
    bracketed nexthop with a port (``[10.0.0.1]:25``) is a destination, not a
    transport prefix.

    ``TRANSPORT:site:NAME`` is one transport's site: with source pools, one source at
    one provider site (``out11:site:google``). It is the ``transport:nexthop`` form
    with a site where the next hop goes, as ``out11:example.com`` is a destination in
    out11, so that it reads beside the other forms and nests in a tenant's target
    with no second ``@`` (``tenant:acme@out11:site:google``); ``site:google@out11``
    would have read as a site "at" a transport, the wrong way round, and made that
    ``tenant:acme@site:google@out11``. A next hop whose host is the bare name "site"
    with a port (``out11:site:25``) can no longer be named; no real host has that
    name. The transport must be one ``transports`` knows: a typo would otherwise hold
    nothing, silently.
    """
    text = text.strip()
    if not text:
        raise TargetError("empty target")
    if len(text) > MAX_TARGET:
        raise TargetError(f"target longer than {MAX_TARGET} characters")
    if any(ch.isspace() or ord(ch) < 32 for ch in text):
        raise TargetError("a target has no spaces or control characters")
    if text.lower().startswith(TENANT_PREFIX) and "tenant" not in transports:
        name, at, rest = text[len(TENANT_PREFIX):].partition("@")
        if not name:
            raise TargetError("no tenant name after 'tenant:'")
        if not at:
            return Target(None, None, tenant=name)
        base = parse_target(rest, transports)
        if base.tenant is not None:
            raise TargetError("one tenant a target")
        return Target(base.transport, base.destination, base.site, tenant=name)
    if text.startswith("["):
        return Target(None, text.lower())
    if text.lower().startswith(SITE_PREFIX) and "site" not in transports:
        name = text[len(SITE_PREFIX):].lower()
        if not name:
            raise TargetError("no site name after 'site:'")
        return Target(None, None, site=name)
    transport, sep, dest = text.partition(":")
    if sep:
        if not transport:
            raise TargetError("no transport before ':'")
        if dest.lower().startswith(SITE_PREFIX):
            return _transport_site(transport, dest[len(SITE_PREFIX):].lower(), transports)
        return Target(transport, dest.lower() or None)
    if "." not in text and text in transports:
        return Target(text, None)
    return Target(None, text.lower())


def _transport_site(transport: str, name: str, transports: Collection[str]) -> Target:
    """``TRANSPORT:site:NAME`` (:func:`parse_target`), checked."""
    if not name:
        raise TargetError(f"no site name after '{transport}:{SITE_PREFIX}'")
    if ":" in name or "@" in name:
        raise TargetError(f"site name {name!r} has a ':' or '@' (write "
                          f"{transport}:{SITE_PREFIX}NAME)")
    if transport not in transports:
        raise TargetError(f"no transport {transport!r} (not a master.cf service)")
    return Target(transport, None, site=name)


@dataclass(frozen=True, slots=True)
class Suspension:
    """One operator suspension: its target, who asked, why, and until when.

    ``since`` and ``until`` are scheduler-clock times (the daemon's monotonic clock);
    ``wall_until`` is the same end as a Unix time, for logs and the state file that
    outlives this process.
    """

    target: Target
    reason: str
    who: str
    since: float
    until: float
    wall_until: float

    @property
    def ttl(self) -> float:
        return self.until - self.since

    @property
    def kind(self) -> str:
        return "suspended"


class SuspensionTable:
    """The suspensions in force, by target; :class:`~.core.Scheduler` owns one."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[str | None, str | None, str | None], Suspension] = {}
        #: The tenants' suspensions, by tenant (issue #34: :mod:`.tenant_hold`).
        self.tenants: dict[str, list[Suspension]] = {}
        #: Unix time minus the scheduler clock (the daemon sets it), for the wall
        #: time of suspensions the core makes itself (a response rule's).
        self.wall_offset = 0.0

    def __bool__(self) -> bool:
        return bool(self.by_key)

    def __len__(self) -> int:
        return len(self.by_key)

    def __iter__(self) -> Iterator[Suspension]:
        return iter(list(self.by_key.values()))

    def add(self, s: Suspension) -> Suspension | None:
        """Put ``s`` in force; return the one it replaces for the same target."""
        old = self.by_key.get(s.target.key)
        self.by_key[s.target.key] = s
        if s.target.tenant is not None:
            self._index(s.target.tenant)
        return old

    def remove(self, target: Target) -> Suspension | None:
        s = self.by_key.pop(target.key, None)
        if s is not None and target.tenant is not None:
            self._index(target.tenant)
        return s

    def _index(self, tenant: str) -> None:
        found = [s for s in self.by_key.values() if s.target.tenant == tenant]
        if found:
            self.tenants[tenant] = found
        else:
            self.tenants.pop(tenant, None)

    def for_transport(self, transport: str) -> Suspension | None:
        return self.by_key.get((transport, None, None)) if self.by_key else None

    def for_queue(self, transport: str, name: str, nexthop: str,
                  site: str | None = None) -> Suspension | None:
        """The suspension covering a destination queue (or its site), the one ending
        last if several."""
        if not self.by_key:
            return None
        found = None
        if site is not None:
            found = self.by_key.get((SITE_PREFIX, site, None))
            s = self.by_key.get((site_key(transport), site, None))
            if s is not None and (found is None or s.until > found.until):
                found = s
        for dest in {name.lower(), nexthop.lower()}:
            for key in ((transport, dest, None), (None, dest, None)):
                s = self.by_key.get(key)
                if s is not None and (found is None or s.until > found.until):
                    found = s
        return found

    def next_end(self) -> float | None:
        return min((s.until for s in self.by_key.values()), default=None)
