"""pyqmgr.cf's limits on each tenant (issue #34), checked at start-up.

The core reads them per transport (:mod:`pyqmgr.scheduler.tenant_cap`) and takes a
value it cannot read as "no limit": a typo there would quietly lift the limit an
admin believed in. So every form of them the file sets (``tenant_rate``,
``smtp_tenant_rate``...) is read here first, and a bad one is a start-up error
naming the line, as every other pyqmgr.cf mistake. A limit with no tenants
(``tenant_key = none``) would hold nothing: an error too; a site limit without sites
is a warning, since the destination is then a site of its own and the limit still
holds per destination.
"""

from __future__ import annotations

from collections.abc import Callable

from pyqmgr.pyqmgr_cf import PyqmgrCf
from pyqmgr.scheduler.shaping import ShapingError, parse_rate
from pyqmgr.scheduler.tenant_cap import PARAM, RATE_PARAM, SITE_PARAM, SITE_RATE_PARAM

#: A tenant's most entries at one destination or site.
MAX_CAP = 10_000
COUNTS = (PARAM, SITE_PARAM)
RATES = (RATE_PARAM, SITE_RATE_PARAM)


def _base(name: str) -> str | None:
    """The tenant limit a pyqmgr.cf name sets (itself or a transport form), or None."""
    for param in (*COUNTS, *RATES):
        if name == param or name.endswith("_" + param):
            # "smtp_tenant_site_rate" ends in "_tenant_site_rate", never "_tenant_rate":
            # the underscore before each name keeps the four apart.
            return param
    return None


def check(settings: PyqmgrCf, tenant_key: str, sites_on: bool,
          warn: Callable[[str], None]) -> None:
    """Every tenant limit the file sets is readable and has tenants to hold; raises
    PyqmgrCfError otherwise."""
    for name in settings.names():
        param = _base(name)
        if param is None:
            continue
        if param in COUNTS:
            settings.get_int(name, None, 0, 0, MAX_CAP)
        else:
            try:
                parse_rate(settings.values[name], name)
            except ShapingError as exc:
                raise settings.error(name, str(exc).partition(": ")[2] or str(exc)) \
                    from None
        if tenant_key == "none":
            raise settings.error(name, "has no effect without tenant_key")
        if param in (SITE_PARAM, SITE_RATE_PARAM) and not sites_on:
            warn(f"pyqmgr.cf: {name}: sites are off (site_grouping): each destination "
                 "is a site of its own, so the limit holds per destination")
