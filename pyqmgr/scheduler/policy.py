"""The policy seam: what one scheduler decides, behind a small interface.

Every scheduler pyqmgr runs shares the same machinery (:mod:`.core`, :mod:`.transport`,
:mod:`.queue`, :mod:`.entry`, :mod:`.message`): transports and their agent allocation,
destination queues with the Postfix 2.5 concurrency window and dead sites, entries that
carry a delivery request's recipients, messages and their recipient reading. What
differs between schedulers is small, and a :class:`Policy` says it for one transport:

* where a newly read recipient goes (:meth:`Policy.add`): nqmgr files it under the
  message's job and peer, the others straight into the destination queue;
* which entry the next agent of the transport delivers (:meth:`Policy.select`);
* the bookkeeping when an entry goes back (:meth:`Policy.unselect`) or ends
  (:meth:`Policy.done`), and when a rate-delayed destination resumes
  (:meth:`Policy.resumed`);
* optionally, how many deliveries one destination may have in flight whatever its
  window (:attr:`Policy.dest_cap`), and whether the transport has work for another
  agent beyond what the queues' windows say (:meth:`Policy.has_work`, consulted only
  when :attr:`Policy.gates_allocation` is set, so that nqmgr pays nothing for it);
* for the admin, what it holds in the order it picks from (:meth:`Policy.jobs_report`,
  ``pyqmgr jobs``) and why it is not delivering something (:meth:`Policy.explain`).

A policy is created per transport, the first time the transport is used, with the
transport and the scheduler (:class:`Context`: the clock, recipient refills, the
settings a policy reads). Policies never do I/O and never read the clock: time comes
in through the context.

Built-in policies, one module or package each, named after them: :mod:`.nqmgr`
(stock's, the default), :mod:`.oqmgr`, :mod:`.finch`, :mod:`.zmailer`. A user's own
policy is a Python file with a ``Policy`` subclass (``scheduler_policy =
module:PATH``), which :mod:`pyqmgr.settings.policies` loads: reading and running a file
is I/O, and no module here does any (tests/unit/test_architecture.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from itertools import islice
from typing import TYPE_CHECKING, ClassVar, Protocol

from pyqmgr.build import mypyc_attr
from pyqmgr.scheduler.entry import Entry, entry_link
from pyqmgr.scheduler.structures import ERROR, RETRY

if TYPE_CHECKING:
    from pyqmgr.scheduler.message import Message, Recipient
    from pyqmgr.scheduler.queue import Queue
    from pyqmgr.scheduler.structures import Site
    from pyqmgr.scheduler.transport import Transport


class Context(Protocol):
    """What a policy may ask of the scheduler that created it."""

    @property
    def clock(self) -> int: ...

    #: The scheduler clock (seconds) as of the latest event.
    now: float
    #: Recipients in core, all messages.
    rcpt_count: int
    #: The message classes' names by rank (pyqmgr.cf message_classes; empty: none).
    class_names: list[str]

    def realloc(self, message: Message) -> None:
        """Read the message's next recipient batch now (it lands through ``add``)."""

    def setting(self, name: str, transport: str, default: str) -> str:
        """One of the policy's own pyqmgr.cf parameters (its knobs, its declared
        ``parameters``), transport-specific form first (``<transport>_<name>``)."""

    def process_limit(self, transport: str) -> int:
        """The transport's master.cf process limit (maxproc): its workers."""


@mypyc_attr(allow_interpreted_subclasses=True)
class Policy:
    """One transport's scheduling decisions. Subclass it; override what differs.

    The defaults are the plainest scheduler that works: recipients go into the
    destination queue's todo list in arrival order, and :meth:`select` must be
    written by the subclass.
    """

    #: The name ``scheduler_policy`` knows it by (and logs and reports show).
    name: ClassVar[str] = ""
    #: Most deliveries in flight to one destination whatever its window (0: no cap).
    dest_cap: ClassVar[int] = 0
    #: Set when :meth:`has_work` must be asked before an agent is connected.
    gates_allocation: ClassVar[bool] = False
    #: Set when the policy gives each message recipient slots of its own (nqmgr's
    #: jobs); a message none of whose transports does is read by oqmgr's limits.
    holds_slots: ClassVar[bool] = False
    #: Set when, as the default policy, recipients are read as oqmgr reads them: no
    #: more files opened while the in-core recipient limit is reached, early refills.
    bounded_reading: ClassVar[bool] = False
    #: The policy's own pyqmgr.cf parameters: name -> (default, kind, min, max), kind
    #: "int", "number" or "bool" (yes/no); checked at start-up in every
    #: ``<transport>_`` form the file gives.
    knobs: ClassVar[dict[str, tuple[str, str, float, float | None]]] = {}
    #: Other pyqmgr.cf parameters the policy reads itself (``ctx.setting``), each also
    #: in its ``<transport>_`` forms: declared, so that ``pyqmgr check`` and start-up
    #: do not call them unknown (they know every name a policy in use declares).
    parameters: ClassVar[tuple[str, ...]] = ()

    def __init__(self, transport: Transport, ctx: Context) -> None:
        self.transport = transport
        self.ctx = ctx

    @property
    def tname(self) -> str:
        return self.transport.name

    def knob(self, name: str) -> float:
        """One of :attr:`knobs` for this transport (``<transport>_<name>`` first)."""
        default, kind, lo, hi = self.knobs[name]
        return parse_knob(self.ctx.setting(name, self.tname, default), kind, lo, hi)

    # -- recipients in ----------------------------------------------------------------

    def add(self, message: Message, queue: Queue, recipient: Recipient,
            last: Entry | None) -> Entry:
        """File one recipient; return the entry that now holds it.

        ``last`` is the entry the previous recipient of this batch went to, when it
        was for the same queue: stock's oqmgr fills that one up to the transport's
        recipient limit before it starts a new one. The default does the same.
        """
        limit = self.transport.recipient_limit
        if (last is None or message.single_rcpt
                or (limit != 0 and len(last.recipients) >= limit)):
            last = self.new_entry(message, queue)
        last.recipients.append(recipient)
        return last

    def new_entry(self, message: Message, queue: Queue) -> Entry:
        """A new, empty todo entry for ``message`` at ``queue`` (``qmgr_entry_create``)."""
        return entry_link(Entry(message, queue))

    def moved(self, entry: Entry, count: int) -> None:
        """``count`` recipients left (negative) or joined (positive) ``entry``."""

    @classmethod
    def message_assigned(cls, message: Message) -> None:
        """A batch of ``message`` is filed (once per batch, per policy class in use).

        A class method, because a policy that keeps per-message state across its
        transports (nqmgr's jobs) must revisit all of them, touched or not.
        """

    # -- deliveries -------------------------------------------------------------------

    def select(self) -> Entry | None:
        """The entry an agent of this transport that just announced itself delivers.

        Take it with :func:`pyqmgr.scheduler.entry.entry_select`; None sends the
        agent away.
        """
        raise NotImplementedError

    def unselect(self, entry: Entry) -> None:
        """The selected entry's request never reached the agent; it is todo again."""

    def requeued(self, entry: Entry) -> None:
        """An unselected entry stays todo for a while (a policy service said DEFER)."""

    def todo_entries(self, message: Message) -> list[Entry]:
        """The message's todo entries at this transport (its file goes on hold).

        The default walks the transport's todo lists; a policy that keeps a message's
        entries together (nqmgr's job peers) finds them without the walk.
        """
        return [e for q in self.transport.queues.values() for e in q.todo
                if e.message is message]

    def done(self, entry: Entry, busy: bool) -> None:
        """``entry`` is finished: its delivery came back (busy) or it left todo.

        Called after the shared counts were updated and a rate-delayed destination
        was suspended, before the entry's queue and message are settled.
        """

    @classmethod
    def message_done(cls, message: Message) -> None:
        """Every in-core entry of ``message`` is finished (per policy class in use)."""

    def resumed(self, queue: Queue) -> None:
        """A rate-delayed destination of this transport may deliver again."""

    def site_opened(self, site: Site) -> None:
        """A provider site of this transport (:mod:`.site`) may take deliveries again.

        Told once, not per member: a policy that keeps state per destination says so
        here. This one tells each member as :meth:`resumed` (O(members)); nqmgr clears
        its blocker tags at once instead.
        """
        for member in list(site.members):
            if member.site is site and member.gate is None:
                self.resumed(member)

    def queue_done(self, queue: Queue) -> None:
        """An idle destination queue is discarded (``qmgr_queue_done``); forget it."""

    def has_work(self) -> bool:
        """Would :meth:`select` find an entry now? (Asked when gates_allocation.)"""
        return True

    def describe(self) -> dict[str, object]:
        """The policy's own state for status reports (plain, JSON-able values)."""
        return {"policy": self.name}

    def jobs_report(self, now: float, limit: int | None = None) -> dict[str, object]:
        """The work this policy holds, in the order it picks from (``pyqmgr jobs``).

        Plain, JSON-able values: ``"kind"`` names the member with the list (nqmgr's
        ``"jobs"``, oqmgr's ``"queues"``, ...), ``"order"`` says in a sentence what
        the order means, since each policy's differs, and ``"total"`` counts the
        list's items when ``limit`` keeps only the first ones (the daemon builds the
        reply in one event-loop turn: 10,000 nqmgr jobs take it 50-85 ms). ``now``
        is the scheduler clock (for ages). Like every hook this must not change any
        state. (Not called ``jobs``: policies use that name for their own state.)

        The default knows no order of the policy's own, so it shows the shared
        structures: the transport's destinations as it created them, each with its
        todo entries oldest first. A policy with an order overrides it.
        """
        queues: list[dict[str, object]] = []
        for queue in islice(self.transport.queues.values(), limit):
            first = queue.todo.first()
            queues.append({
                "destination": queue.name,
                "nexthop": queue.nexthop,
                "window": max(queue.window, 0),
                "in_flight": queue.busy_count,
                "todo": len(queue.todo),
                "recipients": sum(len(e.recipients) for e in queue.todo),
                "oldest": first.message.queue_id if first is not None else None,
            })
        return {"policy": self.name, "kind": "queues",
                "order": "destinations in the order the transport created them (the "
                         "policy reports no order of its own)",
                "total": len(self.transport.queues), "queues": queues}

    def explain(self, queue: Queue | None, message: Message | None) -> list[Reason]:
        """Why this policy is not delivering ``message`` or to ``queue`` right now.

        Only the policy's own reasons (nqmgr: a blocker job, a preempted job); the
        shared ones (window, dead site, process limit, rate delay) are found by
        :mod:`.explain`. Each reason names the constraint and the setting behind it.
        """
        return []


#: One reason something is not being delivered: the constraint, the setting that
#: produced it (a main.cf/pyqmgr.cf/master.cf name, or "" for none), and a sentence.
Reason = dict[str, object]


def reason(constraint: str, setting: str, text: str, **extra: object) -> Reason:
    """A :data:`Reason` (keeps every producer's keys the same)."""
    return {"constraint": constraint, "setting": setting, "text": text, **extra}


#: The built-in policies: name -> "module:class", imported when first asked for.
BUILTIN = {
    "nqmgr": "pyqmgr.scheduler.nqmgr:Nqmgr",
    "oqmgr": "pyqmgr.scheduler.oqmgr:Oqmgr",
    "finch": "pyqmgr.scheduler.finch:Finch",
    "zmailer": "pyqmgr.scheduler.zmailer:Zmailer",
}

#: Stock's scheduler: the default, and always the retry and error transports' policy.
STOCK = "nqmgr"


PolicyClass = type[Policy]


def builtin(name: str) -> PolicyClass:
    """The built-in policy ``name`` (a key of :data:`BUILTIN`), imported by its dotted
    name from pyqmgr's own package as an import statement would be: by name, not from
    a path, so the core stays free of file I/O. (Not a plain import: each built-in
    imports this module.)"""
    modname, _, clsname = BUILTIN[name].partition(":")
    cls = getattr(importlib.import_module(modname), clsname)
    assert issubclass(cls, Policy)
    return cls


def parse_knob(value: str, kind: str, lo: float, hi: float | None = None) -> float:
    """A policy knob's value; ValueError with the reason when it is not acceptable.

    Booleans are Postfix's (``yes``/``no``, case-insensitive) and come back as 1 or 0.
    """
    text = value.strip()
    if kind == "bool":
        if text.lower() not in ("yes", "no"):
            raise ValueError(f'bad boolean configuration: "{value}" (yes or no)')
        return 1.0 if text.lower() == "yes" else 0.0
    try:
        number = int(text) if kind == "int" else float(text)
    except ValueError:
        what = "an integer" if kind == "int" else "a number"
        raise ValueError(f'bad numerical configuration: "{value}" is not {what}') from None
    if number < lo or (hi is not None and number > hi):
        upper = "" if hi is None else f" and at most {hi:g}"
        raise ValueError(f"value {number:g} must be at least {lo:g}{upper}")
    return number


class PolicyTable:
    """Which policy each transport runs: ``scheduler_policy`` and its transport forms.

    Built once at start-up (:func:`pyqmgr.settings.policies.policy_table`), before
    the privilege drop and chroot, because loading a ``module:PATH`` policy reads and
    runs a file; a bad name or a module that does not load is reported then, naming
    the parameter, and never during deliveries. ``setting`` answers a policy's own
    parameters (its :attr:`Policy.knobs` and :attr:`Policy.parameters`, through
    ``Context.setting``) and nothing else: every other pyqmgr.cf setting reaches the
    core parsed, as a typed table (sites, tenant limits, shaping).
    """

    def __init__(self, default: PolicyClass | None = None,
                 by_transport: dict[str, PolicyClass] | None = None,
                 setting: Callable[[str, str, str], str] | None = None) -> None:
        #: Stock's nqmgr, which the retry and error transports always run: loaded now,
        #: before the privilege drop, like every other policy. Loaded at their first
        #: message, the import came after it and failed from a checkout mail_owner
        #: cannot read (issue #43: a fatal with scheduler_policy = oqmgr).
        self.stock_policy: PolicyClass = builtin(STOCK)
        #: ``scheduler_policy``; stock's nqmgr when pyqmgr.cf names none.
        self.default: PolicyClass = default or self.stock_policy
        self.by_transport = dict(by_transport or {})
        self.setting = setting

    @property
    def bounded_reading(self) -> bool:
        """Recipients are read by oqmgr's limits when the default policy says so."""
        return self.default.bounded_reading

    @property
    def stock(self) -> bool:
        """nqmgr everywhere: the scheduler is exactly stock's."""
        return self.default.name == "nqmgr" and all(
            cls.name == "nqmgr" for cls in self.by_transport.values())

    def policy_for(self, transport: str) -> PolicyClass:
        """The policy of ``transport``; the retry and error transports run stock's."""
        if transport in (RETRY, ERROR):
            return self.stock_policy
        return self.by_transport.get(transport, self.default)
