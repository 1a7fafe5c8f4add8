"""What the core decided in answer to one event: one immutable value (in the manner of h11).

Every event into the core (:class:`~pyqmgr.scheduler.core.Scheduler`'s ``assign``,
``select``, ``done``, ``tick`` ...) returns one :class:`Decisions`. The driver applies it
in one place (the daemon's ``Qmgr.apply``, the simulator's ``Engine.apply``) and the core
keeps nothing for it to collect later, so a decision can neither be forgotten nor be
applied twice, and a test reads the outcome of exactly the event it sent.

While an event runs, the verbs append to an :class:`Outbox`; the event's last step is
:meth:`Outbox.take`, which hands the lists over as tuples and starts afresh. Most events
decide nothing beyond their entry, so the empty value is shared (:data:`NOTHING`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

# Imported at run time, not for type checking only: the compiled build (mypyc) needs
# the classes its NamedTuple and dataclasses name when the module loads.
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.structures import Dsn, Entry
from pyqmgr.scheduler.suspension import Suspension


@dataclass(frozen=True, slots=True)
class DeferRecipient:
    """Write a defer-log record for this recipient now (the retry transport is dead too)."""

    message: Message
    recipient: Recipient
    dsn: Dsn


#: What a server of a fleet saw of a destination: it is dead, or a response rule
#: throttled it (:class:`Throttling`; applied elsewhere by :mod:`.throttling`).
DEAD, RULE = "dead", "rule"


@dataclass(frozen=True, slots=True)
class Throttling:
    """One destination's throttling, as one server tells the others."""

    transport: str
    queue: str
    nexthop: str
    #: :data:`DEAD` or :data:`RULE`.
    kind: str
    #: The reply that did it: its enhanced status and text (the hop's, as logged).
    status: str
    reason: str
    #: Seconds it lasts from when it was seen: a dead site's backoff; for a rule, 0.
    lasts: float = 0.0
    #: The rule's name (``file:line``) for :data:`RULE`.
    rule: str = ""


class Decisions(NamedTuple):
    """One event's decisions, each a tuple the driver acts on in order."""

    #: The entry an agent delivers now (``select``, ``reselect``); None: nothing to do.
    deliver: Entry | None = None
    #: (severity, text) lines to log, in order.
    log: tuple[tuple[str, str], ...] = ()
    #: Recipients to append to the defer log synchronously.
    deferrals: tuple[DeferRecipient, ...] = ()
    #: Messages whose last in-core entry finished: defer, remove or hold their files.
    finished: tuple[Message, ...] = ()
    #: Times at which ``tick`` has work: arm a timer for each.
    timers: tuple[float, ...] = ()
    #: Times at which ``open_gates`` has work (shaping gates, recovery steps).
    gate_timers: tuple[float, ...] = ()
    #: Operators' suspensions whose time ran out (log them, rewrite the state file).
    ended: tuple[Suspension, ...] = ()
    #: (message, transport, queue name) whose mail waits for a failed destination.
    waits: tuple[tuple[Message, str, str], ...] = ()
    #: (transport, queue name, nexthop, why watched): watched destinations delivered again.
    recovered: tuple[tuple[str, str, str, str], ...] = ()
    #: The in-core queues or transports an operator's control now covers or revived.
    affected: tuple[str, ...] = ()
    #: The suspension ``resume`` ended (None: there was none for that target).
    resumed: Suspension | None = None
    #: ``reject_to_error``: the recipients went to the error transport.
    rejected: bool = False
    #: Destinations this server just found dead or throttled by a response rule, for
    #: the fleet's other servers (only while ``share_throttling`` is on).
    throttled: tuple[Throttling, ...] = ()
    #: Domains whose site the core needs (sites on): look them up, then answer with
    #: ``site_learnt``. Each is asked once until answered.
    resolve: tuple[str, ...] = ()


NOTHING = Decisions()


class Outbox:
    """The decisions of the event under way; :meth:`take` ends the event."""

    __slots__ = ("log", "deferrals", "finished", "timers", "gate_timers", "ended", "waits",
                 "recovered", "affected", "throttled", "resolve", "_lists")

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.deferrals: list[DeferRecipient] = []
        self.finished: list[Message] = []
        self.timers: list[float] = []
        self.gate_timers: list[float] = []
        self.ended: list[Suspension] = []
        self.waits: list[tuple[Message, str, str]] = []
        self.recovered: list[tuple[str, str, str, str]] = []
        self.affected: list[str] = []
        self.throttled: list[Throttling] = []
        self.resolve: list[str] = []
        # In the order of Decisions' fields after ``deliver``.
        self._lists: tuple[list[Any], ...] = (
            self.log, self.deferrals, self.finished, self.timers, self.gate_timers,
            self.ended, self.waits, self.recovered, self.affected, self.throttled,
            self.resolve)

    def take(self, deliver: Entry | None = None) -> Decisions:
        """The event is over: its decisions as one value; the outbox starts empty.

        On the hot path (every select and every finished delivery), so the common
        cases cost little: nothing decided but the entry, or a few lists to copy.
        """
        lists = self._lists
        if not any(lists):
            return NOTHING if deliver is None else Decisions(deliver)
        # Spelt out, so that the usual case (a finished message, a timer) copies and
        # clears only what is there.
        (log, deferrals, finished, timers, gate_timers, ended, waits, recovered, affected,
         throttled, resolve) = lists
        decisions = Decisions(
            deliver,
            tuple(log) if log else (),
            tuple(deferrals) if deferrals else (),
            tuple(finished) if finished else (),
            tuple(timers) if timers else (),
            tuple(gate_timers) if gate_timers else (),
            tuple(ended) if ended else (),
            tuple(waits) if waits else (),
            tuple(recovered) if recovered else (),
            tuple(affected) if affected else (),
            throttled=tuple(throttled) if throttled else (),
            resolve=tuple(resolve) if resolve else ())
        for pending in lists:
            if pending:
                pending.clear()
        return decisions

    def take_control(self, resumed: Suspension | None = None,
                     rejected: bool = False) -> Decisions:
        """:meth:`take` for the events whose answer says more: ``resume`` and
        ``reject_to_error``."""
        return self.take()._replace(resumed=resumed, rejected=rejected)
