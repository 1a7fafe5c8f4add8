"""Deferring the mail of a dead destination or transport (``qmgr_defer.c``).

A dead destination's waiting entries move to the retry transport, whose agent defers
them with the reason; when the retry transport is dead too, the recipients are deferred
here, as decisions the driver writes to the defer log itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyqmgr.scheduler import recovery
from pyqmgr.scheduler.decisions import DeferRecipient
from pyqmgr.scheduler.entry import entry_done, entry_move_todo
from pyqmgr.scheduler.queue import error_queue
from pyqmgr.scheduler.structures import RETRY, Dsn

if TYPE_CHECKING:
    from pyqmgr.scheduler.state import Core
    from pyqmgr.scheduler.structures import Queue, Transport

#: Why mail waits when a transport's policy raised (as for an unreachable agent).
POLICY_DSN = Dsn("4.3.0", "mail transport unavailable: scheduler policy error")


def defer_todo(core: Core, queue: Queue, dsn: Dsn) -> None:
    """A dead destination: move its waiting entries to retry, or defer them."""
    if core.recovery_watch is not None:
        recovery.watch(core, queue.transport.name, queue.name, recovery.why(dsn))
        for entry in queue.todo:
            recovery.wait(core, entry.message, queue.transport.name, queue.name, None)
    retry = error_queue(core, RETRY, dsn)
    for entry in list(queue.todo):
        if retry is not None:
            entry_move_todo(core, retry, entry)
            continue
        entry.message.deferred = True
        for rcpt in entry.recipients:
            core.out.deferrals.append(DeferRecipient(entry.message, rcpt, dsn))
        entry_done(core, entry, busy=False)


def defer_transport(core: Core, name: str, dsn: Dsn, now: float) -> None:
    """The transport's agent is unreachable: dead for transport_retry_time
    (``qmgr_defer_transport``); its waiting mail goes to the retry transport."""
    core.now = now
    t = core.transport(name)
    if not t.throttled:
        t.times_died += 1
        t.dsn = dsn
        t.revive_at = now + core.transport_retry_time
        core.out.timers.append(t.revive_at)
    for queue in list(t.queues.values()):
        defer_todo(core, queue, dsn)


def defer_broken_policy(core: Core, t: Transport, where: str, exc: Exception) -> None:
    """A policy raised: log it with its name, and treat it as a failed agent.

    The transport is dead for transport_retry_time, so its waiting mail goes to
    the retry transport and is deferred, never lost; its policy is not asked again
    until the transport revives with a fresh one.
    """
    if t.broken:
        return
    t.broken = True
    core.out.log.append(("warning", f"transport {t.name}: scheduler policy {t.policy.name}: "
                                f"{where}: {type(exc).__name__}: {exc}"))
    defer_transport(core, t.name, POLICY_DSN, core.now)
