"""A destination queue and its concurrency window (``qmgr_queue.c``).

This is the Postfix 2.5 concurrency scheduler of the seed document: a per-destination
window grown by positive feedback after deliveries without hop failure and shrunk by
negative feedback after hop failures, with hysteresis, the safety rule that the window
only grows while it is below busy + initial concurrency, and "dead" destinations after
``failed_cohort_limit`` pseudo-cohorts of failures. A window of 0 means throttled (dead).

The structure and its window methods are declared in :mod:`.structures`, beside the
structures they name; the verbs here put queues in and out of the core's books.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyqmgr.scheduler.gates import gate_for, push_gate
from pyqmgr.scheduler.shaping import Shape
from pyqmgr.scheduler.site import site_attach, site_leave
from pyqmgr.scheduler.structures import PAUSED, THROTTLED, Dsn, Queue

if TYPE_CHECKING:
    from pyqmgr.scheduler.state import Core
    from pyqmgr.scheduler.structures import Transport

__all__ = ["PAUSED", "THROTTLED", "Dsn", "Queue", "clog_warning", "error_queue",
           "queue_done", "queue_obtain", "queue_unthrottle"]


def queue_obtain(core: Core, t: Transport, name: str, nexthop: str) -> Queue:
    queue = t.queues.get(name)
    if queue is None:
        queue = t.queue(name, nexthop)
        core.queue_count += 1
        if t.shaping is not None:
            shape = t.shapes.get(name)
            if shape is None:
                shape = t.shapes[name] = Shape()
            queue.shape = shape
            queue.cap = shape.cap
            if queue.cap and queue.window > queue.cap:
                queue.window = queue.cap
        if core.sites is not None:
            site_attach(core, queue)
        if core.suspensions or (queue.shape is not None and queue.shape.gate is not None):
            queue.own_gate = gate_for(core, queue)
    return queue


def queue_done(core: Core, queue: Queue) -> None:
    """Discard an idle, live in-core queue."""
    t = queue.transport
    if t.queues.get(queue.name) is queue:
        del t.queues[queue.name]
        core.queue_count -= 1
    t.ready_queues.pop(queue, None)
    t.over_busy.pop(queue, None)
    if queue.site is not None:
        site_leave(core, queue)
    if not t.broken:
        t.policy.queue_done(queue)
    shape = queue.shape
    if shape is not None:
        if shape.neutral(core.now):
            t.shapes.pop(queue.name, None)
        elif shape.gate is None and shape.rule is None:
            # Only the rate's spacing remains: forget it once it has passed.
            push_gate(core, shape.tat, t, queue.name, "prune")


def error_queue(core: Core, service: str, dsn: Dsn) -> Queue | None:
    """The retry/error queue for ``dsn``, or None when that is dead too."""
    t = core.transport(service)
    if t.throttled:
        return None
    q = queue_obtain(core, t, dsn.nexthop, dsn.nexthop)
    return None if q.throttled else q


def queue_unthrottle(queue: Queue) -> None:
    queue.unthrottle()
    queue.transport.sync(queue)


def clog_warning(core: Core, queue: Queue) -> None:
    """One destination filling the active queue: stock's advice, at most so often."""
    length = len(queue.todo) + queue.busy_count
    if length <= core.active_limit // 5 or core.now < queue.clog_time_to_warn:
        return
    count = max(core.message_count, 1)
    share = length / count
    t = queue.transport
    warn = [f"mail for {queue.nexthop} is using up {length} of {count} active queue "
            "entries"]
    if share < 0.9:
        warn.append("this may slow down other mail deliveries")
    limit = t.cfg.destination_concurrency_limit
    if 0 < limit <= queue.busy_count + 1:
        warn.append(f"you may need to increase the main.cf {t.name}"
                    f"_destination_concurrency_limit from {limit}")
    elif queue.window > core.active_limit * share:
        warn.append("you may need to increase the main.cf qmgr_message_active_limit "
                    f"from {core.active_limit}")
    elif len(t.queues) > 1:
        warn.append(f"you may need a separate master.cf transport for {queue.nexthop}")
    else:
        warn += [
            f"you may need to reduce {t.name} connect and helo timeouts",
            "so that Postfix quickly skips unavailable hosts",
            "you may need to increase the main.cf minimal_backoff_time and "
            "maximal_backoff_time",
            "so that Postfix wastes less time on undeliverable mail",
            f"you may need to increase the master.cf {t.name} process limit",
        ]
    warn += [
        "please avoid flushing the whole queue when you have",
        "lots of deferred mail, that is bad for performance",
        "to turn off these warnings specify: qmgr_clog_warn_time = 0",
    ]
    core.out.log.extend(("warning", w) for w in warn)
    queue.clog_time_to_warn = core.now + core.clog_warn_time
