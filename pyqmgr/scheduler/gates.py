"""Gates on destination queues: operators' suspensions, full sites, pyqmgr.cf's shaping.

A gated queue takes no delivery (``Transport.room`` is 0) until its gate opens. The
gate is an operator's :class:`~pyqmgr.scheduler.suspension.Suspension` when one covers
the queue, else the shaping's (:mod:`.shaping`): a rate's spacing between starts, a
backoff after a throttling reply, a policy service's hold. Deadlines sit on one heap
(``Core.gate_heap``) popped by :func:`open_gates` in O(log n), never by a walk over every
queue; the response rules' recovery steps ride on it too.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

from pyqmgr.durations import duration
from pyqmgr.scheduler.decisions import RULE, Throttling
from pyqmgr.scheduler.shaping import (
    Gate,
    effective_interval,
    observed_rate,
    recovery_step,
    recovery_text,
    take_start,
    triggered,
)

if TYPE_CHECKING:
    from pyqmgr.scheduler.shaping import Rule, Shape
    from pyqmgr.scheduler.state import Core
    from pyqmgr.scheduler.structures import Dsn, Queue, Transport
    from pyqmgr.scheduler.suspension import Suspension


def gate_for(core: Core, queue: Queue) -> Suspension | Gate | None:
    """The gate a queue should have of its own now: an operator's suspension, else
    shaping's. Its site's gate stays the site's (``Queue.gate`` joins the two)."""
    if core.suspensions:
        s = core.suspensions.for_queue(queue.transport.name, queue.name, queue.nexthop,
                                       queue.site.name if queue.site is not None else None)
        if s is not None:
            return s
    shape = queue.shape
    return shape.gate if shape is not None else None


def regate(core: Core, queue: Queue) -> None:
    """Bring a queue's gate in line; an opened queue delivers (or goes, if idle)."""
    t = queue.transport
    was = queue.own_gate
    queue.own_gate = gate_for(core, queue)
    t.sync(queue)
    if was is not None and queue.own_gate is None and not t.broken:
        if queue.ready and queue.idle:
            core.queue_done(queue)
        else:
            t.policy.resumed(queue)


def push_gate(core: Core, when: float, t: Transport, name: str, what: str) -> None:
    if not core.gate_heap or when < core.gate_heap[0][0]:
        core.out.gate_timers.append(when)
    heapq.heappush(core.gate_heap, (when, next(core.gate_seq), t, name, what))


def close(core: Core, queue: Queue, gate: Gate) -> None:
    assert queue.shape is not None
    queue.shape.gate = gate
    push_gate(core, gate.until, queue.transport, queue.name, "gate")
    regate(core, queue)


def started(core: Core, queue: Queue) -> None:
    """A delivery to a shaped destination starts: space the next by the rate."""
    t = queue.transport
    shaping, shape = t.shaping, queue.shape
    assert shaping is not None and shape is not None
    nxt = take_start(shaping, shape, core.now)
    if nxt is not None and (shape.gate is None or shape.gate.until < nxt):
        rate = shaping.rate
        setting = f"{t.name}_{shaping.rate_setting}"
        if shape.rate_factor < 1.0 and shape.rule is not None:
            setting = shape.rule.where
        every = effective_interval(shaping, shape)
        text = (f"{queue.nexthop} starts a delivery at most every {duration(every)}"
                + (f" ({t.name}_{shaping.rate_setting} = {rate}"
                   + (f", burst {shaping.burst})" if shaping.burst > 1 else ")")
                   if rate and shape.rate_factor >= 1.0 else
                   f" ({shape.rule.describe()})" if shape.rule is not None else ""))
        close(core, queue, Gate("rate", nxt, setting, text))


def throttled(core: Core, queue: Queue, rule: Rule, hop: Dsn, now: float,
               started: float) -> None:
    """A reply a rule calls throttling: cap, slow or gate the destination.

    One reduction per round trip, as TCP cuts once per window: replies to
    deliveries that started before the last reduction were sent at the old pace
    and say nothing about the new one, so they are counted but cut nothing (a
    burst of 421s to one burst of starts is one signal, not five).
    """
    t = queue.transport
    shape = queue.shape
    assert shape is not None and t.shaping is not None
    if not triggered(rule, shape, now) or started < shape.last_cut:
        return
    # The matches that led here are spent: the next reduction needs new ones.
    shape.matches.clear()
    done = reduce(core, queue, rule, now)
    core.out.log.append(("info", f"shaping: {queue.nexthop} ({t.name}): throttling reply "
                             f"\"{hop.status} {hop.reason}\" matched {rule.where}: "
                             f"{', '.join(done) or 'not counted as a failure'}"))
    if core.share_throttling:
        core.out.throttled.append(Throttling(t.name, queue.name, queue.nexthop, RULE,
                                             hop.status, hop.reason, rule=rule.where))


def reduce(core: Core, queue: Queue, rule: Rule, now: float) -> list[str]:
    """A rule's action on a destination (its trigger fired, here or on another server
    of the fleet): what it did, for the log line."""
    t = queue.transport
    shape = queue.shape
    assert shape is not None and t.shaping is not None
    shape.last_cut = now
    first = shape.rule is None
    shape.rule = rule
    shape.last_match = now
    done = []
    if rule.window is not None:
        in_flight = queue.busy_count
        cap = max(rule.window_floor, math.floor(in_flight * rule.window))
        if shape.cap:
            cap = min(cap, shape.cap)
        shape.cap = queue.cap = cap
        if queue.window > cap:
            queue.window = cap
        done.append(f"window capped at {cap} ({in_flight} in flight)")
    if rule.rate is not None:
        if first and t.shaping.rate is None:
            shape.learnt_rate = observed_rate(shape, now)
        if t.shaping.rate is not None or shape.learnt_rate > 0:
            shape.rate_factor *= rule.rate
            base = t.shaping.rate.count / t.shaping.rate.period if t.shaping.rate else (
                shape.learnt_rate)
            per_s = base * shape.rate_factor
            if rule.rate_floor is not None:
                per_s = max(per_s, rule.rate_floor.count / rule.rate_floor.period)
            done.append(f"rate lowered to {per_s:.3g}/s")
    if rule.suspend is not None:
        close(core, queue, Gate("backoff", now + rule.suspend, rule.where,
                                f"{queue.nexthop} is held back {duration(rule.suspend)} after "
                                f"a throttling reply ({rule.describe()})"))
        done.append(f"held back {duration(rule.suspend)}")
    shape.next_step = now + rule.quiet
    push_gate(core, shape.next_step, t, queue.name, "step")
    t.sync(queue)
    return done


def step_up(core: Core, t: Transport, name: str, shape: Shape, now: float) -> None:
    """A quiet interval passed with no throttling reply: give back one step."""
    rule = shape.rule
    if rule is None or now < shape.next_step:
        return
    nexthop = t.queues[name].nexthop if name in t.queues else name
    if recovery_step(shape, rule, now, t.cfg.destination_concurrency_limit):
        push_gate(core, shape.next_step, t, name, "step")
        what = recovery_text(shape, rule, "window")
    else:
        what = "throttling over: cap and rate back to normal"
    queue = t.queues.get(name)
    if queue is not None:
        queue.cap = shape.cap
        t.sync(queue)
    core.out.log.append(("info", f"shaping: {nexthop} ({t.name}): {what}"))


def open_gates(core: Core, now: float) -> None:
    """Time passed: open the gates and take the recovery steps that are due."""
    core.now = now
    heap = core.gate_heap
    while heap and heap[0][0] <= now:
        _, _, t, name, what = heapq.heappop(heap)
        shape = t.shapes.get(name)
        if shape is None:
            continue
        if what == "gate":
            if shape.gate is not None and shape.gate.until <= now:
                shape.gate = None
                queue = t.queues.get(name)
                if queue is not None:
                    regate(core, queue)
        elif what == "step":
            step_up(core, t, name, shape, now)
        if name not in t.queues and shape.neutral(now):
            t.shapes.pop(name, None)
    if heap:
        core.out.gate_timers.append(heap[0][0])
