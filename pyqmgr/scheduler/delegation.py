"""A delivery policy service's answers, as core state (pyqmgr.cf ``delivery_policy_service``).

The daemon asks a policy service before it sends a selected entry to its agent; while
it waits, the entry stays selected (busy, inside the window). These verbs turn the
answer into scheduler state, synchronously and without I/O, so that the simulator
applies a scenario's policy function through the very same calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyqmgr.scheduler.defer import defer_todo
from pyqmgr.scheduler.entry import entry_done, entry_move_todo, entry_unselect
from pyqmgr.scheduler.gates import close, regate
from pyqmgr.scheduler.queue import error_queue
from pyqmgr.scheduler.shaping import Gate, Shape
from pyqmgr.scheduler.structures import ERROR

if TYPE_CHECKING:
    from pyqmgr.scheduler.state import Core
    from pyqmgr.scheduler.structures import Dsn, Entry


#: The gate a policy service's DEFER puts on a destination.
POLICY_GATE = "policy service"


def hold_back(core: Core, entry: Entry, until: float, setting: str, text: str,
              now: float, kind: str = POLICY_GATE) -> None:
    """The policy service said "not now": the entry waits, its destination too.

    The fleet's shared limits (:mod:`pyqmgr.daemon.fleet`) hold entries back the same
    way, with a gate of their own ``kind``.

    The selected entry goes back to its queue's todo list (its request never left)
    and the queue is gated until ``until`` with a ``policy service`` gate, so no
    agent is asked for it meanwhile; the gate heap reopens it. The recipients stay
    in core: nothing is deferred to disk and nothing is logged per recipient. A
    later gate already in force (a rate's spacing, a backoff) is kept. If the
    destination or its transport died while the service was asked, the entry
    follows the others of that queue to the retry transport.
    """
    core.now = now
    queue = entry.queue
    t = queue.transport
    entry_unselect(core, entry)
    if not t.broken:
        t.policy.requeued(entry)
    dsn = t.dsn if t.throttled else queue.dsn if queue.throttled else None
    if dsn is not None:
        defer_todo(core, queue, dsn)
    shape = queue.shape
    if shape is None:
        # A transport without shaping gets the destination's shape on demand; it
        # is kept by name like any shape, so a gate outlives an idle queue.
        shape = t.shapes.get(queue.name)
        if shape is None:
            shape = t.shapes[queue.name] = Shape()
        queue.shape = shape
    if shape.gate is None or shape.gate.until < until:
        close(core, queue, Gate(kind, until, setting, text))
    else:
        t.sync(queue)


def lift_hold(core: Core, transport: str, queue_name: str, kind: str, now: float) -> None:
    """Open a destination's hold of ``kind`` before its time: what it waited for
    came (the fleet: this node just gave a session back). Other gates stay."""
    core.now = now
    t = core.transports.get(transport)
    shape = t.shapes.get(queue_name) if t is not None else None
    if t is None or shape is None or shape.gate is None or shape.gate.kind != kind:
        return
    shape.gate = None
    queue = t.queues.get(queue_name)
    if queue is not None:
        regate(core, queue)


def reject_to_error(core: Core, entry: Entry, dsn: Dsn, now: float) -> bool:
    """The policy service rejected the delivery: its recipients go to error(8).

    As stock routes an undeliverable recipient (``error`` transport, the DSN as
    nexthop), so the error agent bounces them with the reply's status and text and
    the usual ``status=bounced`` lines. False when the error transport is dead too:
    the entry is then still selected and the caller holds it back instead.
    """
    core.now = now
    err = error_queue(core, ERROR, dsn)
    if err is None:
        return False
    entry_unselect(core, entry)
    entry_move_todo(core, err, entry)
    return True


def drop_message(core: Core, entry: Entry, now: float) -> None:
    """The message goes on hold: drop its waiting entries, none of them deferred.

    ``entry`` is the selected one the service answered about; every other entry
    of the message still waiting in core goes too, and no more recipients are
    read from its file. Deliveries already under way finish as usual; when the
    last one is back the message is finished (:attr:`finished`) and the daemon
    moves the file to hold/ instead of deferring or removing it. Entries are found
    through nqmgr's job peers where the transport runs nqmgr, else by a walk over
    the transport's todo lists.
    """
    core.now = now
    message = entry.message
    message.more = False
    entry_unselect(core, entry)
    waiting: list[Entry] = []
    for t in list(core.transports.values()):
        if t.broken:
            waiting += [e for q in t.queues.values() for e in q.todo
                        if e.message is message]
        else:
            waiting += t.policy.todo_entries(message)
    for e in waiting:
        entry_done(core, e, busy=False)
