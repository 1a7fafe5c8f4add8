"""The fleet's operator suspensions (``pyqmgr suspend --fleet``): shared through Redis.

A suspension made with ``--fleet`` goes into the fleet's table (a Redis hash) and
news of it to every server on one channel; each server brings its own suspensions in
line with the table when it hears news, and again whenever its subscription is
re-established (a server that was down reads what it missed). Who made or ended a
suspension, and on which server, is in every server's maillog, marked
:data:`FLEET_MARK`.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import TYPE_CHECKING, Protocol

from pyqmgr.daemon.host import QmgrCore
from pyqmgr.fleet.client import RedisUnavailable

if TYPE_CHECKING:
    from pyqmgr.daemon.suspensions import Suspensions
    from pyqmgr.fleet.settings import FleetSettings
    from pyqmgr.fleet.shared import Shared

#: How a suspension made by the fleet's table says so in its "by" (and the maillog).
FLEET_MARK = " (fleet)"


class SuspensionsHost(QmgrCore, Protocol):
    """What the fleet's suspensions need of the daemon (daemon/qmgr.py's Qmgr) beyond
    the core: its operator controls."""

    @property
    def suspensions(self) -> Suspensions: ...


class FleetSuspensions:
    """This server's part of the fleet's suspensions table.

    What ends a fleet suspension is its time (``until``) or a resume, nothing else:
    a resume leaves a tombstone in the table (the record with ``"ended": true``,
    kept until the suspension would have ended), so that a target missing from the
    table is one Redis lost (a restart, a flush, an eviction), not one resumed. A
    suspension in force here that the table lost is written back, and so is one made
    here while Redis was down (issue #31: both were once lifted on every server).
    """

    def __init__(self, host: SuspensionsHost, shared: Shared,
                 settings: FleetSettings) -> None:
        self.host, self.shared, self.settings = host, shared, settings
        #: The fleet's suspensions in force here, by target: the record as read.
        self.applied: dict[str, dict[str, object]] = {}
        #: Resumes made here that Redis has not taken yet (it was down): target ->
        #: tombstone, written at the next sync before the table is read as news.
        self.unsent: dict[str, str] = {}
        #: A sync under way, and news that came during it (one more read after it).
        self._syncing = False
        self._again = False

    def share(self, target: str, reason: str, ttl: float, who: str) -> None:
        """A suspension made here with --fleet: into the fleet's table, news to all."""
        record = {"target": target, "reason": reason, "by": who,
                  "node": self.settings.node, "until": time.time() + ttl}
        self.applied[target] = record
        news = json.dumps({"by": who, "node": self.settings.node})
        self.host.spawn(self._set(target, json.dumps(record), news))

    def end(self, target: str, who: str) -> None:
        """``pyqmgr resume --fleet`` here: a tombstone in the table, news to all."""
        record = self.applied.pop(target, None)
        until = float(record["until"]) if record is not None else 0.0  # type: ignore[arg-type]
        tomb = {"target": target, "reason": "", "by": who, "node": self.settings.node,
                "until": max(until, time.time() + TOMBSTONE), "ended": True}
        news = json.dumps({"by": who, "node": self.settings.node})
        self.unsent[target] = json.dumps(tomb)
        self.host.spawn(self._set(target, self.unsent[target], news))

    async def _set(self, target: str, record: str, news: str) -> None:
        try:
            await self.shared.set_suspension(target, record, news)
            if self.unsent.get(target) == record:
                del self.unsent[target]
        except RedisUnavailable as exc:
            self.host.log.warning(f"shared state {self.settings.endpoint}: the fleet did "
                                  f"not hear of the change to the suspension of {target}: "
                                  f"{exc}; it holds on this server until Redis is back, "
                                  "and then on every server")

    def changed(self, news: bytes) -> None:
        if self._syncing:
            self._again = True
            return
        self._syncing = True
        self.host.spawn(self._sync())

    async def _sync(self) -> None:
        """Read the table until it is read: news (or a resubscription) can come while
        the calls still fail fast after Redis came back (the subscription reconnects
        by itself), and a sync given up then would leave what Redis lost unwritten
        until the next news, which may never come."""
        try:
            while True:
                self._again = False
                try:
                    await self._sync_table()
                except RedisUnavailable:
                    await asyncio.sleep(SYNC_RETRY)
                    continue
                except Exception as exc:  # noqa: BLE001 - Redis is anyone's who reaches it
                    # A task that fails ends the daemon (Qmgr._task_done); what the table
                    # holds must not, or one bad record would restart every server.
                    self.host.log.warning(f"shared state {self.settings.endpoint}: the "
                                          f"fleet's suspensions not read: "
                                          f"{type(exc).__name__}: {exc}")
                if not self._again:
                    return
        finally:
            self._syncing = False

    async def _sync_table(self) -> None:
        """Bring this server's suspensions in line with the fleet's table, and the
        table in line with what this server holds that Redis lost."""
        for target, unsent in list(self.unsent.items()):
            news = json.dumps({"by": "resumed while Redis was away",
                               "node": self.settings.node})
            await self.shared.set_suspension(target, unsent, news)
            if self.unsent.get(target) == unsent:
                del self.unsent[target]
        table = await self.shared.suspensions()
        now = time.time()
        current: dict[str, dict[str, object]] = {}
        tombs: dict[str, dict[str, object]] = {}
        for target, raw in table.items():
            record = _record(raw)
            if record is None:
                continue
            if float(record["until"]) <= now:  # type: ignore[arg-type]
                self.host.spawn(self._forget(target, raw))
            elif record.get("ended") is True:
                tombs[target] = record
            else:
                current[target] = record
        controls = self.host.suspensions
        for target, record in current.items():
            if self.applied.get(target) == record:
                continue
            self.applied[target] = record
            if record["node"] == self.settings.node and any(
                    s.target.spec == target for s in self.host.scheduler.suspensions):
                continue  # made here (or in this node's last life) and in force here
            try:
                controls.suspend(target, str(record["reason"]),
                                 float(record["until"]) - now,  # type: ignore[arg-type]
                                 f"{record['by']} on {record['node']}{FLEET_MARK}")
            except Exception as exc:  # noqa: BLE001 - one bad record must not stop the rest
                self.host.log.warning(f"shared state: the fleet's suspension of "
                                      f"{target} cannot hold here: {exc}")
        # A fleet suspension this server kept across a restart (its state file).
        for s in self.host.scheduler.suspensions:
            spec = s.target.spec
            if s.who.endswith(FLEET_MARK) and spec not in current and spec not in \
                    self.applied:
                by, _, node = s.who[:-len(FLEET_MARK)].rpartition(" on ")
                self.applied[spec] = {"target": spec, "reason": s.reason, "by": by or s.who,
                                      "node": node, "until": s.wall_until}
        for target, record in list(self.applied.items()):
            if target in current:
                continue
            if float(record["until"]) <= now:  # type: ignore[arg-type]
                del self.applied[target]  # ended by its ttl, here as everywhere
            elif target in tombs:
                del self.applied[target]
                tomb = tombs[target]
                try:
                    controls.resume(target, f"{tomb['by']} on {tomb['node']}{FLEET_MARK}")
                except Exception:  # noqa: BLE001, S110 - resumed here already
                    pass
            else:
                self.host.log.warning(
                    f"shared state {self.settings.endpoint}: the fleet's suspension of "
                    f"{target} is missing from Redis (restarted, flushed or evicted?): "
                    "written back; it holds until its time or a resume")
                self.host.spawn(self._restore(target, record))

    async def _restore(self, target: str, record: dict[str, object]) -> None:
        try:
            await self.shared.restore_suspension(target, json.dumps(record))
        except RedisUnavailable:
            pass  # the next sync tries again

    async def _forget(self, target: str, raw: bytes) -> None:
        try:
            await self.shared.forget_suspension(target, raw)
        except RedisUnavailable:
            pass


#: How long a sync that found Redis unavailable waits before it reads again.
SYNC_RETRY = 1.0

#: How long a tombstone outlives a resume at least: a server down for less than
#: this learns the resume rather than reading the target as lost.
TOMBSTONE = 86400.0


#: The longest record read from the table (a reason is at most a few hundred bytes).
MAX_RECORD = 8192


def _record(raw: bytes) -> dict[str, object] | None:
    """A suspension record (or tombstone) from the fleet's table, or None: the table
    is anyone's who reaches Redis, and no record may raise (a 400-digit ``until``,
    JSON nested 100,000 deep)."""
    if len(raw) > MAX_RECORD:
        return None
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or not all(
            isinstance(record.get(k), str) for k in ("target", "reason", "by", "node")):
        return None
    until = record.get("until")
    if isinstance(until, bool) or not isinstance(until, int | float):
        return None
    try:
        record["until"] = float(until)
    except OverflowError:
        return None
    if not math.isfinite(record["until"]):  # type: ignore[arg-type]
        return None
    return record
