"""The fleet's operator suspensions (``pyqmgr suspend --fleet``): shared through Redis.

A suspension made with ``--fleet`` goes into the fleet's table (a Redis hash) and
news of it to every server on one channel; each server brings its own suspensions in
line with the table when it hears news, and again whenever its subscription is
re-established (a server that was down reads what it missed). Who made or ended a
suspension, and on which server, is in every server's maillog, marked
:data:`FLEET_MARK`.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Protocol

from pyqmgr.fleet.client import RedisUnavailable

if TYPE_CHECKING:
    from collections.abc import Coroutine
    from typing import Any

    from pyqmgr.daemon.suspensions import Suspensions
    from pyqmgr.fleet.settings import FleetSettings
    from pyqmgr.fleet.shared import Shared
    from pyqmgr.postfix.maillog_client import MailLog
    from pyqmgr.scheduler.core import Scheduler

#: How a suspension made by the fleet's table says so in its "by" (and the maillog).
FLEET_MARK = " (fleet)"


class SuspensionsHost(Protocol):
    """What the fleet's suspensions need of the daemon (daemon/qmgr.py's Qmgr)."""

    @property
    def log(self) -> MailLog: ...

    @property
    def scheduler(self) -> Scheduler: ...

    @property
    def suspensions(self) -> Suspensions: ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...


class FleetSuspensions:
    def __init__(self, host: SuspensionsHost, shared: Shared,
                 settings: FleetSettings) -> None:
        self.host, self.shared, self.settings = host, shared, settings
        #: The fleet's suspensions in force here, by target: the record as read.
        self.applied: dict[str, dict[str, object]] = {}

    def share(self, target: str, reason: str, ttl: float, who: str) -> None:
        """A suspension made here with --fleet: into the fleet's table, news to all."""
        record = {"target": target, "reason": reason, "by": who,
                  "node": self.settings.node, "until": time.time() + ttl}
        self.applied[target] = record
        news = json.dumps({"by": who, "node": self.settings.node})
        self.host.spawn(self._set(target, json.dumps(record), news))

    def end(self, target: str, who: str) -> None:
        """``pyqmgr resume --fleet`` here: out of the table, news to all."""
        self.applied.pop(target, None)
        news = json.dumps({"by": who, "node": self.settings.node})
        self.host.spawn(self._set(target, "", news))

    async def _set(self, target: str, record: str, news: str) -> None:
        try:
            await self.shared.set_suspension(target, record, news)
        except RedisUnavailable as exc:
            self.host.log.warning(f"shared state {self.settings.endpoint}: the fleet did "
                                  f"not hear of the suspension of {target}: {exc}; it "
                                  "holds on this server only")

    def changed(self, news: bytes) -> None:
        self.host.spawn(self._sync(news))

    async def _sync(self, news: bytes) -> None:
        """Bring this server's suspensions in line with the fleet's table."""
        try:
            table = await self.shared.suspensions()
        except RedisUnavailable:
            return  # the next news, or the next resubscription, reads it again
        try:
            said = json.loads(news) if news else {}
        except ValueError:
            said = {}
        ender = (f"{said.get('by', '?')} on {said.get('node', '?')}{FLEET_MARK}"
                 if isinstance(said, dict) else "the fleet")
        now = time.time()
        current: dict[str, dict[str, object]] = {}
        for target, raw in table.items():
            record = _record(raw)
            if record is not None and float(record["until"]) > now:  # type: ignore[arg-type]
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
        ended = [t for t in self.applied if t not in current]
        for target in ended:
            record = self.applied.pop(target)
            if float(record["until"]) <= now:  # type: ignore[arg-type]
                ended.remove(target)  # ended by its ttl, here as everywhere
        # A fleet suspension this server kept across a restart (its state file) that
        # the fleet ended meanwhile: ended here too.
        ended += [s.target.spec for s in self.host.scheduler.suspensions
                  if s.who.endswith(FLEET_MARK) and s.target.spec not in current
                  and s.target.spec not in ended]
        for target in ended:
            try:
                controls.resume(target, ender)
            except Exception:  # noqa: BLE001, S110 - resumed here already
                pass


def _record(raw: bytes) -> dict[str, object] | None:
    """A suspension record from the fleet's table, or None if it is not one."""
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(record, dict) or not all(
            isinstance(record.get(k), str) for k in ("target", "reason", "by", "node")):
        return None
    if not isinstance(record.get("until"), int | float):
        return None
    return record
