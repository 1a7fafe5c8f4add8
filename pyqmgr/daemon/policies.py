"""The daemon's scheduling policies, from pyqmgr.cf, settled before the chroot.

``scheduler_policy`` and its ``<transport>_scheduler_policy`` forms name each
transport's policy; a ``module:PATH`` policy is a file to import, so the table is
built at start-up while the file system is whole (before chroot and the privilege
drop) and every mistake is a fatal start-up error naming pyqmgr.cf and the parameter,
never a surprise during deliveries. With no pyqmgr.cf the table is nqmgr everywhere,
exactly stock.

The table also carries what some policies need from outside the scheduler: master.cf's
process limits (finch's workers, and what ``pyqmgr explain`` names when a transport is
at its limit), read here for the same reason, and oqmgr's ``qmgr_fudge_factor`` from
main.cf. With stock scheduling an unreadable master.cf is no error: nothing but explain
uses the limits then.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pyqmgr.postfix.config import ConfigError, QmgrConfig, oqmgr_fudge_factor
from pyqmgr.postfix.master_cf import load_master_cf
from pyqmgr.pyqmgr_cf import PyqmgrCf
from pyqmgr.scheduler.policy import PolicyTable
from pyqmgr.scheduler.shaping import ShapingTable
from pyqmgr.settings.retry import RetrySettings
from pyqmgr.settings.scheduling import scheduling_settings


@dataclass(frozen=True)
class PolicySetup:
    table: PolicyTable
    #: master.cf maxproc per service (unix type); absent ones get default_process_limit.
    process_limits: dict[str, int]
    default_process_limit: int
    fudge_factor: int
    #: Rates and response rules (:mod:`pyqmgr.scheduler.shaping`); None: none set.
    shaping: ShapingTable | None = None
    #: Retry jitter and recovery (:mod:`pyqmgr.daemon.retry`); None: stock's retries.
    retry: RetrySettings | None = None
    #: master.cf's unix services and their commands (which transports are smtp).
    commands: dict[str, str] = field(default_factory=dict)

    def process_limit(self, transport: str) -> int:
        return self.process_limits.get(transport, self.default_process_limit)


def policy_setup(settings: PyqmgrCf, cfg: QmgrConfig) -> PolicySetup:
    """Load every policy pyqmgr.cf names and check its knobs; PyqmgrCfError if bad."""
    # Rules files are read here, as root and before the chroot.
    parsed = scheduling_settings(settings)
    table = parsed.policies
    limits: dict[str, int] = {}
    commands: dict[str, str] = {}
    try:
        master = load_master_cf(cfg.config_dir,
                                default_process_limit=cfg.default_process_limit)
    except (ConfigError, OSError) as exc:
        if not table.stock:
            raise settings.error("scheduler_policy",
                                 f"cannot read master.cf for process limits: {exc}") from None
        # Stock scheduling never needs them; explain then just cannot name them.
        master = None
    for service in master.services if master is not None else ():
        if service.type == "unix":
            limits[service.service] = service.process_limit
            commands[service.service] = service.command
    # Only the other policies' reading uses qmgr_fudge_factor; stock qmgr never reads
    # it, so a bad value must not stop stock scheduling either.
    fudge = 100 if table.stock else oqmgr_fudge_factor(cfg)
    return PolicySetup(table, limits, cfg.default_process_limit, fudge, parsed.shaping,
                       parsed.retry, commands)
