"""What the scheduler's verb modules share: the core's state, as a Protocol.

Stock's ``qmgr.h`` declares the queue manager's globals (recipient counts, the
transport list, limits) beside its structures, and each ``qmgr_*.c`` file works on
them. Here :class:`~pyqmgr.scheduler.core.Scheduler` holds that state and the verbs
live in modules named after what they change (:mod:`.queue`, :mod:`.entry`,
:mod:`.defer`, :mod:`.reading`, :mod:`.deliver`, :mod:`.enable`, :mod:`.transport`,
:mod:`.gates`, :mod:`.controls`, :mod:`.recovery`, :mod:`.delegation`); each takes
the core as :class:`Core`, so none imports the class that imports them all. The few
verbs a lower module needs of a higher one (a gate that opens discards an idle queue)
are Core's methods.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pyqmgr.scheduler.decisions import Outbox, Throttling
    from pyqmgr.scheduler.message import Message, Route
    from pyqmgr.scheduler.qlist import QList
    from pyqmgr.scheduler.structures import Queue, SiteTable, Transport
    from pyqmgr.scheduler.suspension import SuspensionTable

#: refill(message, limit): read up to ``limit`` more recipients of the message, set
#: ``message.more`` and ``message.rcpt_unread``, and return their routes sorted by
#: transport and queue (None: the file could not be read; ``more`` must be False then).
#: The port through which the core reads recipients: the daemon reads queue files,
#: the simulator its scenario.
Refill = Callable[["Message", int], "list[Route] | None"]


class PolicyHooks(Protocol):
    """A policy class's per-message hooks (:class:`~pyqmgr.scheduler.policy.Policy`)."""

    @classmethod
    def message_assigned(cls, message: Message) -> None: ...
    @classmethod
    def message_done(cls, message: Message) -> None: ...


class Core(Protocol):
    """The core's state and the verbs modules call across (the Scheduler has them)."""

    #: The decisions of the event under way.
    out: Outbox
    #: The scheduler clock as of the latest event that carried a time.
    now: float
    transports: dict[str, Transport]
    #: Transports in round-robin order for agent allocation (new ones go first).
    transport_list: QList[Transport]
    suspensions: SuspensionTable
    #: Provider sites (:mod:`.site`); None: off, limits per destination as stock's.
    sites: SiteTable | None
    #: Recipients in core (stock's qmgr_recipient_count), queues in core, messages.
    rcpt_count: int
    queue_count: int
    message_count: int
    #: qmgr_message_recipient_limit (at least the active limit), _minimum.
    rcpt_limit: int
    msg_rcpt_limit: int
    #: oqmgr's qmgr_fudge_factor, and whether recipients are read as oqmgr reads them.
    fudge_factor: int
    bounded_reading: bool
    #: A policy without job slots is in use (oqmgr's limits for messages without jobs).
    slotless: bool
    active_limit: int
    clog_warn_time: float
    helpful_warnings: bool
    transport_retry_time: float
    min_backoff_time: float
    refill: Refill | None
    #: Destinations watched for deferred-mail recovery (None: recovery is off).
    recovery_watch: dict[tuple[str, str], str] | None
    share_throttling: bool
    #: A fleet's news of destinations with no mail here yet, by (transport, queue
    #: name): (the news, who saw it, until when it holds); pyqmgr.scheduler.throttling.
    fleet_heard: dict[tuple[str, str], tuple[Throttling, str, float]]
    #: Shaping deadlines: (when, seq, transport, queue name, what).
    gate_heap: list[tuple[float, int, Transport, str, str]]
    gate_seq: itertools.count[int]

    @property
    def clock(self) -> int: ...
    @property
    def fudge_limit(self) -> int: ...
    @property
    def policy_classes(self) -> Sequence[type[PolicyHooks]]: ...

    def transport(self, name: str) -> Transport: ...
    def transport_unthrottle(self, t: Transport) -> None: ...
    def queue_done(self, queue: Queue) -> None: ...
    def realloc(self, message: Message) -> None: ...
    def policy_failed(self, t: Transport, where: str, exc: Exception) -> None: ...
