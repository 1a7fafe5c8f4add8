"""Message classes and tenants in a scenario (issue #34), as pyqmgr.cf gives them.

``[pyqmgr_cf] message_classes``, ``message_class_maps``, ``tenant_key`` and the rest
are read by the daemon's own :func:`pyqmgr.settings.classes.classifier`; each arriving
message is classified by its spec's ``sender`` (``[[messages]] sender = ...``), the
only envelope field a scenario has (so ``message_class_key`` and ``tenant_key`` can
only be sender-based here). A table the daemon would leave out with a warning is a
scenario error: a simulation with a silently missing table answers the wrong question.
Relative table paths are the scenario file's.
"""

from __future__ import annotations

import os

from pyqmgr.pyqmgr_cf import PyqmgrCf, PyqmgrCfError
from pyqmgr.scheduler.message import Message
from pyqmgr.scheduler.tenant_cap import TenantLimitTable
from pyqmgr.settings.classes import TENANT_KEY, Classifier, Envelope, classifier
from pyqmgr.settings.sites import on as sites_on
from pyqmgr.settings.tenants import tenant_limits
from pyqmgr.simulator.scenario import Scenario, ScenarioError

SENDER_KEYS = ("sender", "sender_domain", "none")


def scenario_classifier(sc: Scenario, section: str) -> Classifier | None:
    """The scenario's classes and tenants; None when it names none (stock)."""
    values = dict(sc.pyqmgr_cf)
    for name, value in values.items():
        if name.endswith("_maps"):
            values[name] = ", ".join(absolute_spec(spec.strip(), sc.base_dir)
                                     for spec in value.split(",") if spec.strip())
    warnings: list[str] = []
    try:
        found = classifier(PyqmgrCf(section, True, values), warnings.append)
    except PyqmgrCfError as exc:
        raise ScenarioError(str(exc).replace(": parameter ", ".", 1)) from None
    if warnings:
        raise ScenarioError(f"{section}: {warnings[0]}")
    if found is not None and found.tenant_key not in SENDER_KEYS:
        raise ScenarioError(f"{section}.{TENANT_KEY}: a scenario's messages have a sender "
                            f"and nothing else: {', '.join(SENDER_KEYS)}")
    if found is not None and found.class_key != "sender":
        raise ScenarioError(f"{section}.message_class_key: a scenario's messages have a "
                            "sender and nothing else")
    return found


def scenario_tenant_limits(sc: Scenario, section: str) -> TenantLimitTable | None:
    """The scenario's tenant limits (``tenant_concurrency_limit`` and the rest), read
    as the daemon reads them; None when it sets none. Bad ones: ScenarioError."""
    settings = PyqmgrCf(section, True, dict(sc.pyqmgr_cf))
    try:
        # The daemon's one warning (a site limit with sites off holds per destination)
        # says how the limit applies, which the simulation shows as it is.
        return tenant_limits(settings, (settings.get(TENANT_KEY) or "none").strip(),
                             sites_on(settings), lambda text: None)
    except PyqmgrCfError as exc:
        raise ScenarioError(str(exc).replace(": parameter ", ".", 1)) from None


def absolute_spec(spec: str, base: str) -> str:
    kind, sep, name = spec.partition(":")
    if sep and kind not in ("inline", "static") and name and not os.path.isabs(name):
        return f"{kind}:{os.path.normpath(os.path.join(base, name))}"
    return spec


def classify(found: Classifier | None, message: Message, sender: str) -> None:
    """Give an arriving message its class and tenant, as the daemon's feeder does."""
    if found is None:
        return
    message.rank, tenant = found.classify(Envelope(sender=sender))
    message.tenant = found.admit(tenant)
    if message.tenant:
        message.weight = found.weight(message.tenant)
