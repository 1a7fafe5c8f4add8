"""pyqmgr.cf's scheduling settings, turned into one parsed setup by one function.

The daemon (at start-up, before the chroot), the simulator (a scenario's
``[pyqmgr_cf]``) and ``pyqmgr check`` read the same parameters, so they go through
the same :func:`scheduling_settings`: the policies with their knobs checked, the rates
and response rules, the deferred retry jitter and recovery. A value one of them
accepts the others accept, and a bad one is refused by each with the same text
(the daemon logs it as fatal, check lists it, the simulator says it of the scenario).

Its I/O is reading the response rules files the parameters name (:func:`load_rules`;
the daemon's call happens as root, before the chroot) and loading a ``module:``
policy (:mod:`.policies`): the core is handed both parsed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from pyqmgr.bounded import TooLarge
from pyqmgr.pyqmgr_cf import PyqmgrCf, PyqmgrCfError
from pyqmgr.scheduler.policy import PolicyTable
from pyqmgr.scheduler.shaping import Rule, ShapingError, ShapingTable, parse_rules
from pyqmgr.settings.policies import policy_table
from pyqmgr.settings.retry import RetrySettings, retry_settings
from pyqmgr.trust import RootFiles, file_reader


def load_rules(path: str, max_bytes: int = 1 << 20, files: RootFiles | None = None
               ) -> list[Rule]:
    """Read and parse a rules file (start-up, before the chroot); with ``files`` (the
    daemon's, as root) judged first: trust.UntrustedFile for a FIFO or a file others
    can change."""
    try:
        data = file_reader(files)(path, max_bytes)
    except OSError as exc:
        raise ShapingError(f"{path}: {exc.strerror}") from None
    except TooLarge as big:
        raise ShapingError(str(big)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ShapingError(f"{path}: not UTF-8") from None
    return parse_rules(text, path)


@dataclass(frozen=True)
class SchedulingSettings:
    """What pyqmgr.cf says about scheduling, checked; None: that part is stock's."""

    policies: PolicyTable
    shaping: ShapingTable | None
    retry: RetrySettings | None


def scheduling_settings(settings: PyqmgrCf,
                        read_rules: Callable[[str], list[Rule]] | None = None
                        ) -> SchedulingSettings:
    """pyqmgr.cf's policies, shaping and retry settings; PyqmgrCfError if one is bad.

    The error names the file and the parameter in the one format of
    :meth:`PyqmgrCf.error`, whichever part refused it.
    """
    values = dict(settings.values)
    if read_rules is None:
        read_rules = partial(load_rules, files=settings.root_files())

    def setting(name: str, transport: str, default: str) -> str:
        value = settings.get(name, transport)
        return default if value is None else value

    table = policy_table(values, setting, settings.error)
    try:
        shaping = ShapingTable(values, setting, read_rules)
    except ShapingError as exc:
        raise PyqmgrCfError(f"{settings.path}: parameter {exc}") from None
    return SchedulingSettings(table, shaping if shaping.active else None,
                              retry_settings(settings))
