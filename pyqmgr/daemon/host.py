"""What every part of the daemon may use of the daemon that holds it.

The parts (the active queue, the feeder, the retry controls, delegation, the applier,
the sites' lookups, the fleet and its halves, the operator controls) each declare as a
Protocol what they need of ``Qmgr``, so that none imports the module that imports it.
What all of them use is declared here once, :class:`QmgrCore`, and their Protocols
extend it: a part states only what it needs beyond the core (``ActiveHost`` the
resolver, ``FleetHost`` the agent hand-offs...), and one that needs nothing more takes
a ``QmgrCore``. ``tests/unit/test_host_protocols.py`` checks that each such Protocol
extends it and that none declares the core's members again.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pyqmgr.postfix.config import QmgrConfig
    from pyqmgr.postfix.maillog_client import MailLog
    from pyqmgr.scheduler.core import Scheduler
    from pyqmgr.scheduler.decisions import Decisions
    from pyqmgr.scheduler.entry import Entry


class QmgrCore(Protocol):
    """The running daemon as every part sees it: main.cf's settings, the maillog, the
    scheduler core, a task runner, and the ways a part hands the core's decisions back.
    """

    @property
    def cfg(self) -> QmgrConfig: ...

    @property
    def log(self) -> MailLog: ...

    @property
    def scheduler(self) -> Scheduler: ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task of the daemon's; one that raises ends the daemon."""

    def apply(self, decisions: Decisions) -> Entry | None:
        """Carry out what the core decided in one event; the entry it chose, if any."""

    def dispatch(self) -> None:
        """Connect agents for the work the core has now."""

    def after_control(self, decisions: Decisions) -> None:
        """Decisions made outside an event (a control, news): apply, then dispatch."""


class Fatal(Exception):
    """An error after which stock's qmgr calls msg_fatal: the daemon logs "fatal: ..."
    and exits, master starts a new one, and its start-up recovery puts back what was
    in flight. Raised in a task, it ends the daemon (Qmgr._task_done)."""
