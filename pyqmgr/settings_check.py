"""pyqmgr.cf judged as the daemon's start-up would judge it, for ``pyqmgr check``.

Every value goes through the same functions start-up runs (policies, shaping, rules
files, retry, metrics, delivery policy delegation, fleet, memory, sites, classes and
tenants), so a value the daemon would refuse is refused here first, with the daemon's
own words. Beyond what would stop the daemon, ``check`` names where it would run but
not do what the file says (issue #43), each a problem (exit status 1):

- a name nothing reads (:mod:`pyqmgr.pyqmgr_cf_names`), with the nearest known name:
  a misspelled setting leaves its feature off without a word;
- a class or tenant table that cannot be read: the daemon leaves it out with a
  warning, and its mail takes the defaults;
- a feature turned on whose extra is not installed (:mod:`pyqmgr.extras`), with the
  command that installs it: the daemon would not start.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pyqmgr import extras
from pyqmgr.postfix.config import ConfigError, QmgrConfig
from pyqmgr.postfix.master_cf import load_master_cf
from pyqmgr.pyqmgr_cf import PyqmgrCf, PyqmgrCfError
from pyqmgr.pyqmgr_cf_names import Unknown, unknown_parameters
from pyqmgr.trust import UntrustedError

if TYPE_CHECKING:
    from pyqmgr.daemon.policies import PolicySetup

#: How check words a refusal, before the daemon's own text.
REFUSE = "the daemon would refuse to start: "


@dataclass
class SettingsFindings:
    """What :func:`settings_problems` found beyond the daemon's refusals, by kind
    (``pyqmgr check --json`` lists each)."""

    unknown: list[Unknown] = field(default_factory=list)
    #: Tables named in pyqmgr.cf that cannot be read, as the daemon would log them.
    unreadable: list[str] = field(default_factory=list)
    lacking: list[extras.Feature] = field(default_factory=list)
    #: What could not be judged (a proxy: table while Postfix is stopped): notes.
    notes: list[str] = field(default_factory=list)

    def as_json(self, path: str) -> dict[str, object]:
        return {
            "unknown_parameters": [u.as_json() for u in self.unknown],
            "unreadable_tables": self.unreadable,
            "missing_extras": [{"parameter": f.parameter, "extra": f.extra,
                                "library": f.library,
                                "command": extras.install_command([f.extra])}
                               for f in self.lacking],
        }


def settings_problems(settings: PyqmgrCf, cfg: QmgrConfig,
                      findings: SettingsFindings | None = None) -> list[str]:
    """Every problem of pyqmgr.cf's values, in the order an admin fixes them: names
    nothing reads, what the daemon would refuse, tables it would leave out, missing
    extras. Run only once the installation is trusted: a ``module:`` policy is code
    that this imports."""
    from pyqmgr.daemon.policies import policy_setup
    from pyqmgr.settings.policies import PolicyError

    found = findings if findings is not None else SettingsFindings()
    found.lacking = extras.lacking(settings.values)
    lacking = {f.extra for f in found.lacking}
    policies: list[PolicySetup] = []
    problems: list[str] = []
    proxymap = os.path.join(cfg.queue_directory, "private", "proxymap")

    def unreadable(spec: str, text: str) -> None:
        # Asked only then: each connection has master(8) start a proxymap.
        if spec.startswith("proxy:") and not _answers(proxymap):
            found.notes.append(f"{settings.path}: {spec} not checked: proxymap(8) answers "
                               f"proxy: tables, and nothing answers at {proxymap} "
                               "(Postfix is not running?)")
        else:
            found.unreadable.append(text)

    checks: list[Callable[[], object]] = [
        lambda: policies.append(policy_setup(settings, cfg)),
        *_checks(settings, cfg, policies, lacking, unreadable, proxymap)]
    for check in checks:
        try:
            check()
        except (PyqmgrCfError, PolicyError, ConfigError, UntrustedError) as exc:
            # UntrustedError: a table or rules file the daemon would not read as root.
            problems.append(f"{REFUSE}{exc}")
        except Exception as exc:  # noqa: BLE001 - what nobody foresaw (an own policy's code)
            # The daemon would stop on it too, with its own fatal line: named here as
            # a problem, not a traceback of check's.
            problems.append(f"{REFUSE}{settings.path}: unexpected error: "
                            f"{type(exc).__name__}: {exc}")
    if policies:
        table = policies[0].table
        found.unknown = unknown_parameters(settings, policies[0].commands,
                                           [table.default, *table.by_transport.values()])
    elif not settings.module_paths():
        # No policy of the admin's to know names of: the built-in ones are all known.
        found.unknown = unknown_parameters(settings, None)
    # Said once each: two steps may read the same parameter (the fleet's, for sites).
    problems = list(dict.fromkeys(problems))
    return ([u.text(settings.path) for u in found.unknown] + problems
            + [f"{settings.path}: the daemon would warn: {text}" for text in found.unreadable]
            + extras.lacking_texts(settings.path, found.lacking))


def _answers(path: str) -> bool:
    """Does a server accept connections on the UNIX socket ``path``?"""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2.0)
            sock.connect(path)
    except OSError:
        return False
    return True


def _checks(settings: PyqmgrCf, cfg: QmgrConfig, policies: list[PolicySetup],
            lacking: set[str], unreadable: Callable[[str, str], None], proxymap: str
            ) -> list[Callable[[], object]]:
    """Start-up's steps after the policies, each as check runs it: a feature whose
    extra is missing has its settings checked without importing its library (that it
    is missing is said once, with the command)."""
    from pyqmgr.daemon import classes, delegation, memory, metrics
    from pyqmgr.events.settings import categorizer, event_settings
    from pyqmgr.fleet.settings import check_site_limits, fleet_settings
    from pyqmgr.settings.classes import classifier
    from pyqmgr.settings.sites import on as sites_on
    from pyqmgr.settings.sites import site_settings
    from pyqmgr.settings.sources import source_settings
    from pyqmgr.settings.tenants import tenant_limits

    def sites() -> None:
        # The settings only: start-up also makes dnspython's resolver, which check
        # need not (it reads resolv.conf, not pyqmgr.cf). With policies refused,
        # master.cf's commands are unknown and that refusal is the one said.
        if policies:
            found = site_settings(settings, policies[0].commands,
                                  cfg.get("relayhost") or "")
            if fleet_settings(settings, cfg.myhostname) is not None:
                check_site_limits(settings, found.limits.__contains__
                                  if found is not None else None)

    def classes_check() -> None:
        # check's working directory is not the queue directory, where the daemon finds
        # proxymap's socket as private/proxymap.
        if "classes" in lacking:
            classifier(settings, lambda text: None, cfg.config_dir, unreadable, proxymap,
                       cfg.mynetworks)
        elif policies:
            classes.setup(settings, policies[0], lambda text: None, cfg.config_dir,
                          unreadable, proxymap, cfg.mynetworks)
        tenant_limits(settings, (settings.get("tenant_key") or "none").strip(),
                      sites_on(settings), lambda text: None)

    return [lambda: (metrics.metrics_settings(settings) if "metrics" in lacking
                     else metrics.setup(settings, cfg)),
            lambda: delegation.setup(settings),
            lambda: fleet_settings(settings, cfg.myhostname),
            lambda: memory.warning_limit(settings), sites, classes_check,
            # Source pools: their members are master.cf's (unknown with policies refused).
            lambda: source_settings(settings, policies[0].commands) if policies else None,
            # Delivery events: the file's name and the admin's reply categories (the
            # directory is made by the daemon, as root, at start-up).
            lambda: event_settings(settings) and categorizer(settings)]


def unknown_names_only(settings: PyqmgrCf, config_dir: str,
                       findings: SettingsFindings) -> list[str]:
    """The names nothing reads, when the values cannot be judged (the installation is
    not trusted, so no policy file may be imported): with a ``module:`` policy its own
    parameters are unknown until it loads, so then nothing is said."""
    if settings.module_paths():
        return []
    try:
        master = load_master_cf(config_dir)
        transports: list[str] | None = [s.service for s in master.services
                                        if s.type == "unix"]
    except (ConfigError, OSError):
        transports = None
    findings.unknown = unknown_parameters(settings, transports)
    return [u.text(settings.path) for u in findings.unknown]
