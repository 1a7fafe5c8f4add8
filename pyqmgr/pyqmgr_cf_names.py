"""Every parameter pyqmgr.cf may set, and the names in a file that are none of them.

Why: a misspelled setting (``metrics_lisen``, ``smtp_destinaton_rate``,
``site_groupping``) used to be accepted in silence, and the feature it meant to turn on
stayed off (issue #43). postconf(1) warns of a main.cf parameter nobody uses; ``pyqmgr
check`` and the daemon's start-up do the same for pyqmgr.cf, naming the nearest known
name, from this one list. tests/unit/test_pyqmgr_cf_names.py keeps it in step with the
code that reads the parameters and with pyqmgr(8), which documents each of them.

The naming rule is Postfix's: ``<transport>_<name>`` overrides ``<name>`` for the
parameters the code reads per transport (:data:`PER_TRANSPORT`, those it asks with a
transport: ``which(name, transport)``, ``get(name, transport)``, a policy's knobs).
postconf knows such a name when ``<transport>`` is a master.cf service
(``postconf_service.c``); so does this, with the master.cf unix services (the only ones
a queue manager delivers through). A transport form whose transport master.cf does not
have applies to nothing, and is said so. When master.cf is not known (``transports``
None) any prefix is taken, never guessed at.

A name another value of the file uses as ``$name`` is the admin's own (postconf's
"user-defined" parameters), and a ``module:`` policy's own parameters (its
:attr:`~pyqmgr.scheduler.policy.Policy.knobs` and ``parameters``) are per-transport
names of that policy, known once the policy is loaded.

Pure data and string work: no pyqmgr module is imported at run time, so the daemon,
``check`` and the tests can all use it without an import circle.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyqmgr.pyqmgr_cf import PyqmgrCf

#: Parameters read per transport: each also as ``<transport>_<name>``.
PER_TRANSPORT: frozenset[str] = frozenset({
    # scheduler/policy.py: each transport's policy, and the built-in policies' knobs.
    "scheduler_policy",
    "finch_max_message_concurrency", "finch_scale_max_concurrency",
    "zmailer_ageorder",
    # scheduler/shaping.py
    "destination_rate", "destination_rate_burst", "response_rules",
    # daemon/delegation.py
    "delivery_policy_service", "delivery_policy_timeout",
    "delivery_policy_default_action", "delivery_policy_defer_delay",
    "delivery_policy_reject", "delivery_policy_hold", "delivery_policy_connections",
    "delivery_policy_context",
    # settings/sites.py
    "site_concurrency_limit", "site_rate", "site_dead_scope",
    # fleet/settings.py
    "fleet_destination_concurrency_limit", "fleet_destination_rate",
    "fleet_destination_rate_burst", "fleet_throttling", "fleet_site_concurrency_limit",
    "fleet_site_rate", "fleet_site_rate_burst",
    # settings/tenants.py, scheduler/tenant_cap.py
    "tenant_concurrency_limit", "tenant_site_concurrency_limit", "tenant_rate",
    "tenant_site_rate",
    # settings/sources.py: a source's first day (src1_source_warmup_start)
    "source_warmup_start",
})

#: Parameters read once for the whole daemon: no transport form.
GLOBAL: frozenset[str] = frozenset({
    # settings/retry.py
    "deferred_retry_jitter", "deferred_recovery_rate", "deferred_recovery_limit",
    # settings/sites.py, scheduler/structures.py
    "site_grouping", "site_transports", "site_providers", "site_pins",
    "site_dns_timeout", "site_dns_negative_ttl", "site_dns_max_ttl", "site_dns_lookups",
    "site_dns_wait", "site_concurrency_limit_maps",
    # fleet/settings.py
    "shared_state", "shared_state_user", "shared_state_password_file",
    "shared_state_sentinel_password_file", "shared_state_tls_ca_file",
    "shared_state_tls_cert_file", "shared_state_tls_key_file", "shared_state_key_file",
    "shared_state_failure", "shared_state_timeout", "shared_state_lease_time",
    "shared_state_prefix", "shared_state_node",
    # settings/classes.py
    "message_classes", "message_class_maps", "message_class_key",
    "default_message_class", "message_class_active_reserve", "tenant_key",
    "tenant_maps", "tenant_weight_maps", "sender_keys_trusted_clients",
    "unlisted_tenant_limit",
    # daemon/metrics.py
    "metrics_listen", "metrics_destination_limit", "metrics_site_limit",
    "metrics_tenant_limit", "metrics_allow_remote",
    # daemon/memory.py
    "memory_warning_limit",
    # events/settings.py
    "delivery_events_file", "delivery_events_file_size_limit", "delivery_events_files_kept",
    "delivery_event_categories", "delivery_events_stream", "delivery_events_stream_max_length",
    # settings/sources.py (each pool's <pool>_sources: pool_member_names)
    "source_pools", "source_pool_maps", "source_pool_transports", "source_warmup_plan",
})

KNOWN: frozenset[str] = PER_TRANSPORT | GLOBAL

#: How alike a name must be to be offered as "did you mean" (difflib's ratio).
CUTOFF = 0.75


@dataclass(frozen=True)
class Unknown:
    """A name of the file that pyqmgr does not read, and what it may have meant."""

    name: str
    #: The nearest name that would be read, or None when nothing is near.
    suggestion: str | None = None
    #: Why it is not read, when more than "nothing by that name" (a transport form of
    #: a parameter that has none, a transport master.cf does not have).
    why: str = ""

    def text(self, path: str) -> str:
        """The line ``check`` prints and the daemon logs after ``warning:``."""
        hint = [self.why] if self.why else []
        if self.suggestion:
            hint.append(f"did you mean {self.suggestion}?")
        return (f"{path}: unknown parameter {self.name}"
                + (f" ({'; '.join(hint)})" if hint else ""))

    def as_json(self) -> dict[str, str | None]:
        return {"name": self.name, "suggestion": self.suggestion, "why": self.why or None}


class Names:
    """The names one pyqmgr.cf may set, given master.cf's transports and the policies."""

    def __init__(self, transports: Collection[str] | None = None,
                 policy_parameters: Iterable[str] = ()) -> None:
        #: master.cf's unix services; None when master.cf was not read.
        self.transports = None if transports is None else frozenset(transports)
        self.per_transport = PER_TRANSPORT | frozenset(policy_parameters)
        self.known = KNOWN | self.per_transport

    def _splits(self, name: str) -> list[tuple[str, str]]:
        """Each (transport, parameter) reading of ``name`` whose parameter is known,
        the shortest transport first."""
        found = []
        at = name.find("_")
        while 0 < at < len(name) - 1:
            rest = name[at + 1:]
            if rest in self.known:
                found.append((name[:at], rest))
            at = name.find("_", at + 1)
        return found

    def check(self, name: str) -> Unknown | None:
        """None when pyqmgr reads ``name``; else what is wrong with it."""
        if name in self.known:
            return None
        splits = self._splits(name)
        per_transport = [(t, p) for t, p in splits if p in self.per_transport]
        if per_transport and (self.transports is None
                              or any(t in self.transports for t, _ in per_transport)):
            return None
        if per_transport:
            transport, param = per_transport[0]
            near = self._near_transport(transport)
            return Unknown(name, f"{near}_{param}" if near else None,
                           f"master.cf has no {transport} service: it applies to nothing")
        if splits:
            transport, param = splits[0]
            return Unknown(name, None, f"{param} has no per-transport form")
        return Unknown(name, self._nearest(name))

    def unknown(self, names: Iterable[str], referenced: Collection[str] = ()) -> list[Unknown]:
        """The names pyqmgr does not read, in the file's order; ``referenced`` are the
        admin's own (another value uses them as ``$name``)."""
        found = []
        for name in names:
            if name in referenced:
                continue
            problem = self.check(name)
            if problem is not None:
                found.append(problem)
        return found

    def _near_transport(self, transport: str) -> str | None:
        import difflib  # only for a name that is wrong: not in every daemon

        if not self.transports:
            return None
        close = difflib.get_close_matches(transport, sorted(self.transports), 1, 0.6)
        return close[0] if close else None

    def _nearest(self, name: str) -> str | None:
        """The known name nearest to ``name``: the bare names, and for each reading of
        it as ``<transport>_<rest>`` with a transport of master.cf (any prefix when it is
        not known), that transport's form of the parameter nearest to ``rest``."""
        import difflib

        candidates = {c: c for c in difflib.get_close_matches(name, sorted(self.known), 3,
                                                              CUTOFF)}
        at = name.find("_")
        while 0 < at < len(name) - 1:
            transport, rest = name[:at], name[at + 1:]
            if self.transports is None or transport in self.transports:
                for param in difflib.get_close_matches(rest, sorted(self.per_transport), 1,
                                                       CUTOFF):
                    candidates[f"{transport}_{param}"] = param
            at = name.find("_", at + 1)
        if not candidates:
            return None
        return max(sorted(candidates),
                   key=lambda c: difflib.SequenceMatcher(None, name, c).ratio())


def policy_parameters(policies: Iterable[object]) -> set[str]:
    """The names the given policy classes declare: their knobs and ``parameters``."""
    found: set[str] = set()
    for policy in policies:
        found.update(getattr(policy, "knobs", {}))
        found.update(getattr(policy, "parameters", ()))
    return found


def unknown_parameters(settings: PyqmgrCf, transports: Collection[str] | None,
                       policies: Iterable[object] = ()) -> list[Unknown]:
    """pyqmgr.cf's names that nothing reads. ``transports``: master.cf's unix services
    (empty or None when master.cf was not read: any transport form is then taken);
    ``policies``: the policy classes in use, whose own parameters are known."""
    names = Names(transports or None, policy_parameters(policies))
    return names.unknown(settings.names(),
                         set(settings.referenced) | pool_member_names(settings))


def pool_member_names(settings: PyqmgrCf) -> set[str]:
    """``<pool>_sources`` for each pool ``source_pools`` names: a pool is no master.cf
    service, so its members' parameter is named by the admin's own pool names."""
    pools = (settings.get("source_pools") or "").replace(",", " ").split()
    return {f"{pool}_sources" for pool in pools}
