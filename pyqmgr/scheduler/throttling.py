"""Throttling one server saw, applied on another (a fleet's shared state, issue #23).

A destination that one server of a fleet finds dead (stock's failed cohorts) or that
a response rule throttles is the same destination for every server: they all meet
its limits. So the server that saw it says so (:class:`Throttling`, in the decisions'
``throttled`` while :attr:`Core.share_throttling` is on) and the others apply it with
:func:`learnt` as if they had seen it, minus the trigger, which fired where it was
seen:

* **dead**: the destination is dead here too for what remains of the backoff, with
  stock's reason ("delivery temporarily suspended: ..."), and its waiting mail goes
  to the retry transport as for a site that died here; a success here revives it,
  as stock revives a dead site;
* **rule**: the rule of the same name (``file:line``, every server reads the same
  rules) takes its action here (the window cap from this server's own deliveries
  in flight, the rate cut, the backoff), and recovers by its own steps.

No I/O and no clock here: the daemon's fleet carries the record, the time comes in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyqmgr.scheduler.decisions import DEAD, Throttling
from pyqmgr.scheduler.defer import defer_todo
from pyqmgr.scheduler.gates import reduce
from pyqmgr.scheduler.queue import queue_obtain
from pyqmgr.scheduler.recovery import SITE_SUSPENDED
from pyqmgr.scheduler.structures import THROTTLED, Dsn

if TYPE_CHECKING:
    from pyqmgr.scheduler.state import Core

#: A server's own cut this recently makes another's news of the same burst redundant.
RECENT_CUT = 1.0


def learnt(core: Core, news: Throttling, who: str, now: float) -> None:
    """Apply what ``who`` (a server's name) saw of a destination, and say so."""
    core.now = now
    # A transport with no mail here yet comes into core as mail would bring it, so
    # that the news holds for the mail that comes next.
    t = core.transport(news.transport)
    where = f"{news.nexthop} ({news.transport})"
    said = f"\"{news.status} {news.reason}\" seen by {who}"
    if news.kind == DEAD:
        queue = queue_obtain(core, t, news.queue, news.nexthop)
        if not queue.ready:
            state = "dead here already" if queue.throttled else "paused here"
            core.out.log.append(("info", f"fleet: {where}: {said}: {state}"))
            return
        dsn = Dsn(news.status, SITE_SUSPENDED + (news.reason or "unknown error"))
        queue.window = THROTTLED
        queue.dsn = dsn
        queue.revive_at = now + news.lasts
        t.destinations_died += 1
        core.out.timers.append(queue.revive_at)
        waiting = queue.todo.size
        defer_todo(core, queue, dsn)
        t.sync(queue)
        core.out.log.append(("info", f"fleet: {where}: {said}: dead here too for "
                                     f"{news.lasts:g}s ({waiting} waiting deferred)"))
        return
    rule = next((r for r in t.shaping.rules if r.where == news.rule), None) if (
        t.shaping is not None) else None
    if rule is None:
        core.out.log.append(("warning", f"fleet: {where}: {said} matched {news.rule}, a "
                                        "response rule this server does not have: ignored"))
        return
    queue = queue_obtain(core, t, news.queue, news.nexthop)
    assert queue.shape is not None
    if now - queue.shape.last_cut < RECENT_CUT:
        core.out.log.append(("info", f"fleet: {where}: {said} matched {rule.where}: cut "
                                     "here already"))
        return
    done = reduce(core, queue, rule, now)
    core.out.log.append(("info", f"shaping: {where}: throttling reply {said} (fleet) "
                                 f"matched {rule.where}: {', '.join(done) or 'nothing to cut'}"))
