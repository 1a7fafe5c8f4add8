"""Everything the daemon is assembled from, settled at start-up before the chroot.

Start-up reads main.cf, master.cf and pyqmgr.cf, opens the suspensions' state file
and checks every setting while it still can; what comes out is one
:class:`DaemonSetup`, and :class:`~pyqmgr.daemon.qmgr.Qmgr` is built from it in one
step, so no part of the daemon is made first and replaced later.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyqmgr.daemon.delegation import DelegationSetup
from pyqmgr.daemon.memory import MemoryGuard
from pyqmgr.daemon.metrics import MetricsSettings
from pyqmgr.daemon.policies import PolicySetup
from pyqmgr.daemon.sites import SiteSetup
from pyqmgr.daemon.suspensions import StateFile
from pyqmgr.events.settings import EventSetup
from pyqmgr.fleet.settings import FleetSettings
from pyqmgr.scheduler.tenant_cap import TenantLimitTable
from pyqmgr.settings.classes import Classifier
from pyqmgr.settings.sources import SourceSettings


@dataclass(frozen=True)
class DaemonSetup:
    """pyqmgr.cf's policies, shaping and retries, and the optional parts' settings."""

    policies: PolicySetup
    #: The operators' suspensions' state file (None: not kept across restarts).
    state: StateFile | None = None
    #: metrics_listen and its labels (None: no metrics).
    metrics: MetricsSettings | None = None
    #: delivery_policy_service and its settings (None: no delegation).
    delegation: DelegationSetup | None = None
    #: shared_state and the fleet's limits (None: one server, no fleet).
    fleet: FleetSettings | None = None
    #: The resident size for status, and memory_warning_limit's warning.
    memory: MemoryGuard | None = None
    #: site_grouping's settings and MX lookup (None: no sites).
    sites: SiteSetup | None = None
    #: message_classes and tenant_key, their tables read (None: one class, as stock).
    classes: Classifier | None = None
    #: Each tenant's limits per transport, for the core (None: none set).
    tenant_limits: TenantLimitTable | None = None
    #: source_pools and the warm-up plan (None: trivial-rewrite's transport stands).
    sources: SourceSettings | None = None
    #: delivery_events_file and its directory, opened (None: no delivery events).
    events: EventSetup | None = None
