"""Provider sites in the simulator (issue #33): the scenario is the DNS.

A scenario turns sites on as pyqmgr.cf does (``[pyqmgr_cf] site_grouping = "mx"``,
``site_concurrency_limit``, ``site_rate``, ...) and says where each destination's mail
really goes with ``mx = "HOST"`` in its ``[destinations.NAME]`` table: destinations
that name one host share one server (its sessions, its rate limit), and the core's
lookups are answered from those hosts at once, named as the daemon names an MX set
(the provider table included). A destination without ``mx`` is its own site, as a
domain with no MX record is.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pyqmgr.pyqmgr_cf import PyqmgrCf, PyqmgrCfError
from pyqmgr.settings.sites import SiteSettings, site_settings
from pyqmgr.simulator.scenario import ScenarioError
from pyqmgr.site_names import site_name

if TYPE_CHECKING:
    from pyqmgr.scheduler.core import Scheduler
    from pyqmgr.scheduler.decisions import Decisions
    from pyqmgr.simulator.scenario import Scenario


def scenario_sites(sc: Scenario, section: str) -> SiteSettings | None:
    """The scenario's site settings (every transport it names counts as smtp);
    None when sites are off. Bad ones: ScenarioError, named as ``pyqmgr_cf.NAME``."""
    commands = {d.transport: "smtp" for d in sc.destinations.values()}
    commands.update({t: "smtp" for t in sc.process_limits})
    try:
        return site_settings(PyqmgrCf(section, True, dict(sc.pyqmgr_cf)), commands)
    except PyqmgrCfError as exc:
        raise ScenarioError(str(exc).replace(": parameter ", ".", 1)) from None


def answer(sc: Scenario, settings: SiteSettings, sched: Scheduler, domains: tuple[str, ...],
           now: float) -> list[Decisions]:
    """The core asked for these domains' sites: answer from the scenario's ``mx``.

    Answered at once and for ever (a scenario's records do not change); the caller
    applies the decisions as any other.
    """
    out = []
    for domain in domains:
        dest = sc.destinations.get(domain)
        mx = dest.mx if dest is not None else ""
        name = (site_name([(10, mx)], settings.providers) if mx else None) or domain
        out.append(sched.site_learnt(domain, name, math.inf, now))
    return out
