"""What every part of the daemon may read of the daemon that holds it.

The parts (the active queue, the retry controls, delegation) each declare as a
Protocol what they need of ``Qmgr``, so that none imports the module that imports it;
the settings, the log and the scheduler, which all of them read, are declared here
once and their Protocols extend :class:`QmgrCore`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pyqmgr.postfix.config import QmgrConfig
    from pyqmgr.postfix.maillog_client import MailLog
    from pyqmgr.scheduler.core import Scheduler


class QmgrCore(Protocol):
    """main.cf's settings, the maillog and the scheduler core of the running daemon."""

    @property
    def cfg(self) -> QmgrConfig: ...

    @property
    def log(self) -> MailLog: ...

    @property
    def scheduler(self) -> Scheduler: ...


class Fatal(Exception):
    """An error after which stock's qmgr calls msg_fatal: the daemon logs "fatal: ..."
    and exits, master starts a new one, and its start-up recovery puts back what was
    in flight. Raised in a task, it ends the daemon (Qmgr._task_done)."""
