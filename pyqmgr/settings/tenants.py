"""Each tenant's limits (issue #34), read from pyqmgr.cf once into the core's table.

``tenant_concurrency_limit``, ``tenant_site_concurrency_limit``, ``tenant_rate`` and
``tenant_site_rate``, each also per transport (``smtp_tenant_rate``), are read and
checked here, every form the file sets, and what comes out is the
:class:`~pyqmgr.scheduler.tenant_cap.TenantLimitTable` the core makes each
transport's caps from (:func:`pyqmgr.scheduler.tenant_cap.caps_for`). The core once
read them itself as strings, per transport, and took a value it could not read as
"no limit": checked here first and then thrown away, a typo could never lift a limit,
but the two readings could drift apart (``+5`` passed the check and then read as no
limit). Now there is one reading.

A bad value is a start-up error naming the line, as every other pyqmgr.cf mistake. A
limit with no tenants (``tenant_key = none``) would hold nothing: an error too; a
site limit without sites is a warning, since the destination is then a site of its
own and the limit still holds per destination.
"""

from __future__ import annotations

from collections.abc import Callable

from pyqmgr.pyqmgr_cf import PyqmgrCf
from pyqmgr.scheduler.shaping import ShapingError, parse_rate
from pyqmgr.scheduler.tenant_cap import (
    PARAM,
    RATE_PARAM,
    SITE_PARAM,
    SITE_RATE_PARAM,
    TenantLimits,
    TenantLimitTable,
)

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


def _spacing(settings: PyqmgrCf, name: str, transport: str | None) -> float:
    """Seconds between a tenant's entries by the rate ``name`` (0: no rate)."""
    used = settings.which(name, transport)
    if used is None:
        return 0.0
    try:
        rate = parse_rate(settings.values[used], used)
    except ShapingError as exc:
        raise settings.error(used, str(exc).partition(": ")[2] or str(exc)) from None
    return rate.interval if rate is not None else 0.0


def _limits(settings: PyqmgrCf, transport: str | None) -> TenantLimits:
    return TenantLimits(settings.get_int(PARAM, transport, 0, 0, MAX_CAP),
                        settings.get_int(SITE_PARAM, transport, 0, 0, MAX_CAP),
                        _spacing(settings, RATE_PARAM, transport),
                        _spacing(settings, SITE_RATE_PARAM, transport))


def tenant_limits(settings: PyqmgrCf, tenant_key: str, sites_on: bool,
                  warn: Callable[[str], None]) -> TenantLimitTable | None:
    """The tenant limits the file sets, every form checked; None when it sets none.
    Raises PyqmgrCfError for a bad value or a limit without tenants."""
    transports: set[str] = set()
    for name in settings.names():
        param = _base(name)
        if param is None:
            continue
        if param in COUNTS:
            settings.get_int(name, None, 0, 0, MAX_CAP)
        else:
            _spacing(settings, name, None)
        if tenant_key == "none":
            raise settings.error(name, "has no effect without tenant_key")
        if param in (SITE_PARAM, SITE_RATE_PARAM) and not sites_on:
            warn(f"pyqmgr.cf: {name}: sites are off (site_grouping): each destination "
                 "is a site of its own, so the limit holds per destination")
        if name != param:
            transports.add(name[:-len(param) - 1])
    if tenant_key == "none" or not any(_base(name) for name in settings.names()):
        return None
    return TenantLimitTable(_limits(settings, None),
                            {t: _limits(settings, t) for t in sorted(transports)})
