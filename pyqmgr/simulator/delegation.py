"""The simulator's delivery policy service: a scenario's answers through the core's API.

As the daemon asks a policy service before each delivery (pyqmgr.cf
``delivery_policy_service``), the simulator asks the scenario's ``[delegation]``: a
function of the request, or rates per destination. Each answer goes through the very
calls the daemon makes (``reselect``, ``hold_back``, ``reject_to_error``,
``drop_message``), so a scenario exercises the same core code.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Protocol

from pyqmgr.postfix.policy_delegation import DeliveryRequest, Verdict, classify
from pyqmgr.scheduler.queue import Dsn

if TYPE_CHECKING:
    from collections.abc import Callable

    from pyqmgr.scheduler.core import Scheduler
    from pyqmgr.scheduler.decisions import Decisions
    from pyqmgr.scheduler.entry import Entry
    from pyqmgr.simulator.scenario import Delegation


class Counts(Protocol):
    """The run's figures the policy service adds to (the engine's ``Result``)."""

    decisions: int
    asked: int
    held: int
    rejected: dict[str, int]
    held_back: dict[str, int]


class Host(Protocol):
    """What the policy service needs of the engine that asks it."""

    sched: Scheduler
    now: float

    @property
    def result(self) -> Counts: ...

    def at(self, when: float, action: Callable[[], None]) -> None: ...
    def apply(self, d: Decisions) -> Entry | None: ...
    def _attempt(self, name: str, entry: Entry) -> None: ...
    def _release(self, name: str) -> None: ...


class PolicyService:
    """The scenario's policy service, asked before each delivery."""

    def __init__(self, host: Host, settings: Delegation) -> None:
        self.host = host
        self.settings = settings
        #: Rate windows per destination: (opened at, requests).
        self._rate_windows: dict[str, tuple[float, int]] = {}
        self._instance = itertools.count(1)

    def ask(self, name: str, entry: Entry) -> None:
        """Ask the scenario's policy service, after its latency, as the daemon does."""
        deleg = self.settings
        if deleg.latency > 0:
            self.host.at(self.host.now + deleg.latency, lambda: self.answer(name, entry))
        else:
            self.answer(name, entry)

    def answer(self, name: str, entry: Entry | None) -> None:
        """Apply answers until one lets a delivery start or nothing is left to ask about.

        Every answer but DELIVER gates a queue or takes the entry out of it, so the
        loop ends; with a latency, the next question waits for it.
        """
        deleg = self.settings
        while entry is not None:
            if self._act(name, entry):
                return
            entry = self.host.apply(self.host.sched.reselect(name, self.host.now))
            if entry is not None:
                self.host.result.decisions += 1
                if deleg.latency > 0:
                    self.ask(name, entry)
                    return
        self.host._release(name)

    def _policy_action(self, entry: Entry) -> str:
        deleg = self.settings
        self.host.result.asked += 1
        dest = entry.queue.nexthop
        if deleg.function is not None:
            queue = entry.queue
            request = DeliveryRequest(
                queue_id=entry.message.queue_id, sender="",
                recipient=entry.recipients[0].address if entry.recipients else "",
                recipient_count=len(entry.recipients), size=0,
                instance=f"{entry.message.queue_id}.{next(self._instance)}",
                transport=queue.transport.name, nexthop=dest,
                destination_window=max(queue.window, 0),
                destination_in_flight=max(queue.busy_count - 1, 0), attempt=1)
            return deleg.function(dict(request.attrs()), self.host.now)
        rate = deleg.rates.get(dest)
        if rate is None:
            return "DUNNO"
        limit, period = rate
        opened, count = self._rate_windows.get(dest, (-period, 0))
        if self.host.now >= opened + period:
            opened, count = self.host.now, 0
        count += 1
        self._rate_windows[dest] = (opened, count)
        return deleg.reply if count > limit else "DUNNO"

    def _act(self, name: str, entry: Entry) -> bool:
        """One answer through the core's delegation API; True when delivery starts."""
        deleg = self.settings
        decision = classify(self._policy_action(entry))
        dest = entry.queue.nexthop
        res = self.host.result
        verdict = decision.verdict
        if verdict in (Verdict.DELIVER, Verdict.UNKNOWN):
            self.host._attempt(name, entry)
            return True
        if verdict is Verdict.HOLD:
            res.held += 1
            self.host.apply(self.host.sched.drop_message(entry, self.host.now))
            return False
        if verdict is Verdict.REJECT and deleg.reject == "bounce":
            n = len(entry.recipients)
            assert decision.dsn is not None
            rejected = self.host.sched.reject_to_error(entry, Dsn(decision.dsn, decision.text),
                                                  self.host.now)
            self.host.apply(rejected)
            if rejected.rejected:
                res.rejected[dest] = res.rejected.get(dest, 0) + n
                return False
        # DEFER, or REJECT without bounce (or with the error transport dead).
        delay = decision.delay if decision.delay is not None else deleg.defer_delay
        res.held_back[dest] = res.held_back.get(dest, 0) + 1
        host = self.host
        host.apply(host.sched.hold_back(entry, host.now + delay, "delivery_policy_service",
                                        f"{dest}: policy service replied "
                                        f"\"{decision.action}\"", host.now))
        return False
