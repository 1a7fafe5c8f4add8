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

News routes nothing. It names a destination by transport and queue name and holds
only where this server's own routing (its trivial-rewrite) sends mail to that queue
with the nexthop the news names. News of a queue in core with another nexthop is
logged and changes nothing; news of a destination with no mail here is kept
(:attr:`Core.fleet_heard`, bounded, until it lapses) and holds when this server's
own routing makes that queue with that nexthop. (A notice once made the queue,
nexthop and all, and the next mail for that destination went where it said.)

No I/O and no clock here: the daemon's fleet carries the record, the time comes in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyqmgr.durations import duration
from pyqmgr.scheduler.decisions import DEAD, Throttling
from pyqmgr.scheduler.defer import defer_todo
from pyqmgr.scheduler.gates import reduce
from pyqmgr.scheduler.recovery import SITE_SUSPENDED
from pyqmgr.scheduler.structures import THROTTLED, Dsn

if TYPE_CHECKING:
    from pyqmgr.scheduler.state import Core
    from pyqmgr.scheduler.structures import Queue, Transport

#: A server's own cut this recently makes another's news of the same burst redundant.
RECENT_CUT = 1.0
#: News of destinations with no mail here, kept at most (the oldest goes first).
MAX_HEARD = 10_000
#: How long news of a rule's throttling is kept for mail that may come (a dead
#: site's news is kept for its backoff): a provider's "slow down" is about now, and
#: mail that comes later meets the provider's answer, and this server's rule, itself.
RULE_KEPT = 60.0


def learnt(core: Core, news: Throttling, who: str, now: float) -> None:
    """Apply what ``who`` (a server's name) saw of a destination, and say so."""
    core.now = now
    t = core.transports.get(news.transport)
    queue = t.queues.get(news.queue) if t is not None else None
    if t is None or queue is None:
        until = now + (news.lasts if news.kind == DEAD else RULE_KEPT)
        heard = core.fleet_heard
        heard.pop((news.transport, news.queue), None)
        while len(heard) >= MAX_HEARD or (heard and next(iter(heard.values()))[2] <= now):
            del heard[next(iter(heard))]
        heard[(news.transport, news.queue)] = (news, who, until)
        core.out.log.append(("info", f"fleet: {_where(news)}: {_said(news, who)}: no mail "
                                     f"here for it yet: holds for mail that comes within "
                                     f"{duration(until - now)}"))
        return
    _apply(core, t, queue, news, who, now, news.lasts)


def arrived(core: Core, t: Transport, queue: Queue) -> None:
    """This server's routing made a queue the fleet had news of: the news holds now,
    if the news's nexthop is the one this server routes to, and it has not lapsed."""
    kept = core.fleet_heard.pop((t.name, queue.name), None)
    if kept is None:
        return
    news, who, until = kept
    if until > core.now:
        _apply(core, t, queue, news, who, core.now, until - core.now)


def _where(news: Throttling) -> str:
    return f"{news.nexthop} ({news.transport})"


def _said(news: Throttling, who: str) -> str:
    return f"\"{news.status} {news.reason}\" seen by {who}"


def _apply(core: Core, t: Transport, queue: Queue, news: Throttling, who: str,
           now: float, lasts: float) -> None:
    """Hold ``queue`` as the news says, for ``lasts`` seconds if it is dead."""
    where, said = _where(news), _said(news, who)
    if queue.nexthop != news.nexthop:
        core.out.log.append(("warning", f"fleet: {where}: {said}: this server routes "
                                        f"{news.queue} to {queue.nexthop}, not "
                                        f"{news.nexthop}: ignored"))
        return
    if news.kind == DEAD:
        if not queue.ready:
            state = "dead here already" if queue.throttled else "paused here"
            core.out.log.append(("info", f"fleet: {where}: {said}: {state}"))
            return
        dsn = Dsn(news.status, SITE_SUSPENDED + (news.reason or "unknown error"))
        queue.window = THROTTLED
        queue.dsn = dsn
        queue.revive_at = now + lasts
        t.timed_at(queue, queue.revive_at)
        t.destinations_died += 1
        core.out.timers.append(queue.revive_at)
        waiting = queue.todo.size
        defer_todo(core, queue, dsn)
        t.sync(queue)
        core.out.log.append(("info", f"fleet: {where}: {said}: dead here too for "
                                     f"{duration(lasts)} ({waiting} waiting deferred)"))
        return
    rule = next((r for r in t.shaping.rules if r.where == news.rule), None) if (
        t.shaping is not None) else None
    if rule is None:
        core.out.log.append(("warning", f"fleet: {where}: {said} matched {news.rule}, a "
                                        "response rule this server does not have: ignored"))
        return
    assert queue.shape is not None
    if now - queue.shape.last_cut < RECENT_CUT:
        core.out.log.append(("info", f"fleet: {where}: {said} matched {rule.where}: cut "
                                     "here already"))
        return
    done = reduce(core, queue, rule, now)
    core.out.log.append(("info", f"shaping: {where}: throttling reply {said} (fleet) "
                                 f"matched {rule.where}: {', '.join(done) or 'nothing to cut'}"))
