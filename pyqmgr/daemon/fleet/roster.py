"""This server's part of the fleet's roster (issue #35): publish, read, agree.

Every third of the lease time, and at start, the server publishes its record
(:mod:`pyqmgr.fleet.roster`: its limits per transport, lease time, failure mode and
whether it is in force, the sessions it holds and the deliveries it has waiting per
destination, its last good answer from Redis, its version and key layout) and reads
everyone's. Where another server's limits, lease time or rate differ from this one's,
it logs a warning once per difference (again when it changes) and obeys the stricter
(:mod:`pyqmgr.fleet.agreement`), through :attr:`FleetUnits.overrides
<pyqmgr.daemon.fleet.units.FleetUnits.overrides>` and the lease time in force here:
pyqmgr.cf's settings are left as they are, and apply again once the other server
agrees or leaves the roster.

``pyqmgr status --fleet`` reads the roster on demand (:meth:`FleetRoster.report`),
with this server's own record as it is at that instant.

A server learns the others' limits at its first read, right after start-up: a
delivery that starts before that read ends goes by this server's own.

What another server publishes is obeyed only when signed with the fleet's key (issue
#45): without ``shared_state_key_file`` this server publishes and shows the roster,
and obeys none of it (anyone who can write to Redis could write a record). A record
not signed with the key is skipped, counted and warned of once a minute per server.
The read's parsing and agreeing run in a thread, off the event loop, each bounded
(:func:`pyqmgr.fleet.roster.examine`, :func:`pyqmgr.fleet.agreement.agree`); only
applying the outcome is the loop's. Both loops, this roster's and the leases'
renewal, keep to a third of this server's own lease time, whatever is in force.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from pyqmgr import __version__
from pyqmgr.fleet.agreement import (
    LAYOUT,
    MAX_COMPARED,
    Agreement,
    Difference,
    Ours,
    agree,
    wait_bound,
)
from pyqmgr.fleet.client import RedisUnavailable
from pyqmgr.fleet.roster import (
    ANY_TRANSPORT,
    DESTINATION,
    MAX_RECORDS,
    RECORD_LIFE,
    SITE,
    Fetched,
    Record,
    Roster,
    RosterRead,
    UnitShare,
    examine,
    give_way,
    limits_json,
)
from pyqmgr.fleet.settings import DESTINATION_PARAMS, PER_TRANSPORT, SITE_PARAMS
from pyqmgr.fleet.shared import KEY_LAYOUT, RECOUNT_MS
from pyqmgr.postfix.policy_delegation import WarnGate

if TYPE_CHECKING:
    from pyqmgr.daemon.fleet.stats import FleetStats
    from pyqmgr.daemon.fleet.units import FleetUnits
    from pyqmgr.daemon.host import QmgrCore
    from pyqmgr.fleet.settings import FleetSettings, Limits
    from pyqmgr.fleet.shared import Shared

#: The most difference warnings logged at one read, and the most skipped records
#: named; the rest in one line.
MAX_LOGGED = 20
#: A skipped record is warned of at most once in this many seconds per server.
SKIP_WARN_INTERVAL = 60.0

__all__ = ["LAYOUT", "RECORD_LIFE", "FleetRoster", "RosterSource", "server_reply"]


class RosterSource(Protocol):
    """What the roster needs of the fleet (daemon/fleet/node.py's Fleet)."""

    @property
    def host(self) -> QmgrCore: ...
    @property
    def settings(self) -> FleetSettings: ...
    @property
    def shared(self) -> Shared: ...
    @property
    def units(self) -> FleetUnits: ...
    @property
    def stats(self) -> FleetStats: ...
    @property
    def leases(self) -> Mapping[Any, tuple[str, str, str]]: ...
    @property
    def spares(self) -> Mapping[tuple[str, str], list[tuple[str, float]]]: ...
    @property
    def seen(self) -> Mapping[tuple[str, str], tuple[int, int]]: ...
    @property
    def down(self) -> bool: ...
    @property
    def clock(self) -> Callable[[], float]: ...


class FleetRoster:
    def __init__(self, source: RosterSource) -> None:
        self.source = source
        settings = source.settings
        self.redis = Roster(source.shared.client, settings.prefix, settings.key)
        #: The lease time in force: the longest in the fleet.
        self.lease_time = settings.lease_time
        #: Differences with other servers in force now, each logged once: (node,
        #: setting) -> the difference.
        self.differences: dict[tuple[str, str], Difference] = {}
        #: Servers in the roster at the last read, and records skipped in all.
        self.servers = 0
        self.skipped = 0
        #: When each server's skipped record was last warned of (bounded: pruned of
        #: those a minute old when it grows past twice the records a read takes).
        self.skip_warned: dict[str, float] = {}
        #: Differences beyond those kept at the last read, and transports only others
        #: name that it left uncompared.
        self.more_differences = 0
        self.uncompared = 0
        self.unsigned_said = False
        self.warn = WarnGate(60.0)
        self.cap_warn = WarnGate(60.0)

    @property
    def member(self) -> str:
        return f"{self.source.settings.node}/{self.source.shared.instance}"

    # -- this server's record ---------------------------------------------------------

    def record(self) -> Record:
        """This server's record now: its own settings, and what it holds and waits for,
        busiest destinations first."""
        src = self.source
        settings = src.settings
        held: Counter[tuple[str, str]] = Counter((t, q) for t, q, _ in src.leases.values())
        for key, spares in src.spares.items():
            held[key] += len(spares)
        shares = []
        for key in set(held) | set(src.seen):
            waiting = sum(q.todo.size for q in src.units.queues(*key))
            if held[key] or waiting:
                in_use, limit = src.seen.get(key, (0, 0))
                shares.append(UnitShare(key[0], key[1], held[key], waiting, in_use, limit))
        shares.sort(key=lambda u: (-u.leases - u.waiting, u.transport, u.unit))
        return Record(settings.node, src.shared.instance, os.getpid(), __version__,
                      KEY_LAYOUT, time.time(), settings.lease_time, settings.failure,
                      src.down, src.stats.errors_since_good, src.stats.last_sync,
                      self._own_limits(), tuple(shares), len(shares))

    def _named(self) -> set[str]:
        """Transports pyqmgr.cf gives fleet limits of their own."""
        cf = self.source.settings.settings
        found = set()
        for param in cf.values if cf is not None else ():
            name = next((n for n in PER_TRANSPORT if param.endswith("_" + n)), None)
            if name is not None and name in DESTINATION_PARAMS + SITE_PARAMS:
                found.add(param[:-len(name) - 1])
        return found

    def _own_limits(self) -> dict[str, dict[str, Limits]]:
        """The default limits (the bare parameters), and each transport's own where
        they differ from those."""
        units = self.source.units
        out: dict[str, dict[str, Limits]] = {}
        for transport in [ANY_TRANSPORT, *sorted(self._named())]:
            kinds = {kind: units.own(transport, kind) for kind in (DESTINATION, SITE)
                     if kind == DESTINATION or units.grouped(transport)}
            if transport != ANY_TRANSPORT:
                kinds = {k: v for k, v in kinds.items() if v != units.own(ANY_TRANSPORT, k)}
            if kinds:
                out[transport] = kinds
        return out

    # -- publish, read, agree -----------------------------------------------------------

    async def run(self) -> None:
        """Publish and read at start, then every third of this server's own lease
        time (a longer one in force never slows the roster: it is what would notice
        that the longer one went)."""
        while True:
            await self.sync()
            await asyncio.sleep(self.source.settings.lease_time / 3)

    async def sync(self) -> None:
        stats = self.source.stats
        try:
            with stats.timed():
                await self.redis.publish(self.record(), RECORD_LIFE * self.lease_time,
                                         time.time())
            with stats.timed():
                fetched = await self.redis.fetch(time.time())
            read, agreement = await asyncio.to_thread(self.weigh, fetched, self.ours(),
                                                      time.time())
            self.apply(read, agreement)
        except RedisUnavailable:
            pass  # the admissions' own failures warn; the next round tries again
        except Exception as exc:  # noqa: BLE001 - a bug here must not end the daemon
            held = self.warn.allow(self.source.clock())
            if held is not None:
                self.source.host.log.warning(
                    f"fleet: the roster not published or read: {type(exc).__name__}: "
                    f"{exc}; this warning at most once a minute")

    def ours(self) -> Ours:
        """What agreeing needs of this server, taken now, on the event loop."""
        src = self.source
        return Ours(src.settings.node, src.settings.lease_time, KEY_LAYOUT, src.units.own,
                    src.units.grouping(), frozenset(self._named()),
                    frozenset(src.host.scheduler.transports))

    def weigh(self, fetched: Fetched, ours: Ours, now: float
              ) -> tuple[RosterRead, Agreement | None]:
        """A read checked and agreed with (None: no key, nothing obeyed); pure, for a
        thread, which gives way to the event loop between records and transports."""
        read = examine(fetched, self.redis.fleet_key, self.redis.prefix, now, units=False,
                       pause=give_way)
        return read, self._agreed(read, ours, give_way)

    def _agreed(self, read: RosterRead, ours: Ours,
                pause: Callable[[], None] | None = None) -> Agreement | None:
        if not self.redis.fleet_key:
            return None
        return agree(ours, [r for r in read.records if r.node != ours.node], pause)

    async def leave(self) -> None:
        """At exit: out of the roster now, not three lease times from now (a reload
        with new limits would otherwise be compared with the old ones meanwhile)."""
        try:
            await self.redis.remove(self.member)
        except RedisUnavailable:
            pass  # it expires by itself

    def heard(self, read: RosterRead) -> None:
        """A read of the roster, agreed with here (tests; the daemon agrees in a
        thread, :meth:`sync`)."""
        self.apply(read, self._agreed(read, self.ours()))

    def apply(self, read: RosterRead, agreement: Agreement | None) -> None:
        """A read's outcome, on the event loop: warn of records skipped, obey what the
        others agree to (nothing without a key: this server's own settings)."""
        src = self.source
        self.servers = len(read.records)
        self._skipped(read.skipped)
        if agreement is None:
            agreement = Agreement({}, src.settings.lease_time)
            others = sum(1 for r in read.records if r.node != src.settings.node)
            if others and not self.unsigned_said:
                self.unsigned_said = True
                src.host.log.warning(
                    f"fleet: {others} other servers in the roster; without "
                    "shared_state_key_file no record is signed, so this node compares "
                    "and obeys none of their settings (set the same key on every server)")
        self.more_differences = agreement.more
        if agreement.uncompared > self.uncompared:
            src.host.log.warning(
                f"fleet: other servers name {agreement.uncompared + MAX_COMPARED} "
                f"transports this node does not have; {agreement.uncompared} of them not "
                "compared")
        self.uncompared = agreement.uncompared
        self._log(agreement.found)
        src.units.overrides = agreement.overrides
        self.lease_time = agreement.lease_time
        src.shared.lease_ms = max(1, int(agreement.lease_time * 1000))

    def _skipped(self, skipped: list[tuple[str, str]]) -> None:
        """Records skipped: counted, and each server's warned of at most once a
        minute (at most :data:`MAX_LOGGED` lines a read, the rest in one)."""
        if not skipped:
            return
        self.skipped += len(skipped)
        now = self.source.clock()
        warned = self.skip_warned
        if len(warned) > 2 * MAX_RECORDS:
            for member, when in list(warned.items()):
                if now - when >= SKIP_WARN_INTERVAL:
                    del warned[member]
            if len(warned) > 4 * MAX_RECORDS:
                warned.clear()  # a flood of new names: warned of again, still paced
        fresh = [(m, why) for m, why in skipped
                 if now - warned.get(m, -SKIP_WARN_INTERVAL) >= SKIP_WARN_INTERVAL]
        log = self.source.host.log
        for member, why in fresh[:MAX_LOGGED]:
            log.warning(f"fleet: skipped the roster record of {member}: {why}; this "
                        "warning at most once a minute per server")
        if len(fresh) > MAX_LOGGED:
            log.warning(f"fleet: skipped the roster records of {len(fresh) - MAX_LOGGED} "
                        "more servers (pyqmgr status --fleet lists them)")
        for member, _ in fresh:
            warned[member] = now

    def _log(self, found: dict[tuple[str, str], Difference]) -> None:
        log = self.source.host.log
        new = [(key, diff) for key, diff in sorted(found.items())
               if self.differences.get(key) != diff]
        for (node, _), diff in new[:MAX_LOGGED]:
            if diff.rule == LAYOUT:
                log.warning(f"fleet: node {node} publishes key layout {diff.theirs}, this "
                            f"node {diff.ours}: the two count each destination's sessions "
                            "under different keys, so the fleet's limits hold only among "
                            "servers of one layout; run one pyqmgr version on every server")
            else:
                log.warning(f"fleet: node {node} publishes {diff.setting} = {diff.theirs}, "
                            f"this node {diff.ours}; obeying the {diff.rule} ({diff.obeyed})")
        if len(new) > MAX_LOGGED:
            log.warning(f"fleet: {len(new) - MAX_LOGGED} more differences with other "
                        "servers (pyqmgr status --fleet lists them)")
        for node, setting in sorted(self.differences.keys() - found.keys()):
            log.info(f"fleet: node {node} no longer differs from this node on {setting}")
        self.differences = found

    # -- what Redis answers -----------------------------------------------------------

    def cap(self, wait: float, limits: Limits | None, transport: str, unit: str) -> float:
        """A wait Redis asked for, cut to what this server's settings explain
        (:func:`pyqmgr.fleet.agreement.wait_bound`)."""
        bound = wait_bound(limits, RECOUNT_MS / 1000)
        if wait <= bound:
            return wait
        self.source.stats.waits_capped += 1
        held = self.cap_warn.allow(self.source.clock())
        if held is not None:
            more = f" ({held} more since the last warning)" if held else ""
            self.source.host.log.warning(
                f"fleet: Redis asked {unit} ({transport}) to wait {wait:.0f}s, longer than "
                f"this node's settings explain: waiting {bound:g}s (a server with other "
                f"settings, or a damaged key){more}; this warning at most once a minute")
        return bound

    # -- status -------------------------------------------------------------------------

    def summary(self) -> dict[str, object]:
        """For ``pyqmgr status``: the roster's last read, in a few numbers."""
        return {"servers": self.servers, "differences": len(self.differences),
                "lease_time_in_force": self.lease_time,
                "waits_capped": self.source.stats.waits_capped,
                "roster_skipped": self.skipped}

    async def report(self) -> dict[str, object]:
        """``pyqmgr status --fleet``: every server in the roster, this one as it is
        now; bounded by shared_state_timeout. Redis not answering is said, with this
        server's own record."""
        settings = self.source.settings
        read: RosterRead | None = None
        error = ""
        try:
            async with asyncio.timeout(settings.timeout):
                with self.source.stats.timed():
                    read = await self.redis.read(time.time())
        except RedisUnavailable as exc:
            error = str(exc)
        except TimeoutError:
            error = f"no answer within {settings.timeout:g} s"
        own = self.record()
        now = time.time()
        records = [own, *(r for r in read.records if r.member != own.member)] if read else [own]
        return {
            "node": settings.node, "shared_state": str(settings.endpoint),
            "read": read is not None, "error": error,
            "total": read.total if read is not None else None,
            "servers": sorted((server_reply(r, now, r is own) for r in records),
                              key=lambda s: (str(s["node"]), str(s["instance"]))),
            "skipped": [{"server": m, "why": w} for m, w in (read.skipped if read else [])],
            "differences": [{"node": node, "setting": d.setting, "theirs": d.theirs,
                             "ours": d.ours, "obeyed": d.obeyed}
                            for (node, _), d in sorted(self.differences.items())],
            "lease_time_in_force": self.lease_time}


def server_reply(record: Record, now: float, this: bool = False) -> dict[str, object]:
    """One server of ``pyqmgr status --fleet`` (ages in seconds, by this clock)."""
    mode = record.mode
    return {
        "node": record.node, "instance": record.instance, "this": this,
        "pid": record.pid, "version": record.version, "layout": record.layout,
        "age": round(max(0.0, now - record.sent), 3), "lease_time": record.lease_time,
        "failure": record.failure, "mode": mode, "errors": record.errors,
        "last_sync_age": None if record.last_sync is None else round(
            max(0.0, now - record.last_sync), 3),
        "limits": {t: {k: {**limits_json(v), "rate": str(v.rate) if v.rate else None}
                       for k, v in kinds.items()} for t, kinds in record.limits.items()},
        "units": [{"transport": u.transport, "unit": u.unit, "leases": u.leases,
                   "waiting": u.waiting, "mode": mode, "fleet_sessions": u.in_use,
                   "limit": u.limit} for u in record.units],
        "units_total": record.units_total}
