"""The daemon's parts state what they need of Qmgr as Protocols on one core (#44).

Each part (the active queue, the feeder, retry, delegation, the applier, the fleet and
its halves, the metrics' collector...) declares what it needs of the daemon as a
Protocol, so that it does not import the module that imports it. What every part uses
(the settings, the log, the scheduler, the task runner, the ways decisions go back) is
declared once, in daemon/host.py's ``QmgrCore``, and the parts' Protocols extend it: a
Protocol in daemon/ that declared one of the core's members again would be a second
place to keep in step, and a new part would copy it.
"""

from __future__ import annotations

import ast
import importlib
import os

import pyqmgr
from pyqmgr.daemon.host import QmgrCore

DAEMON = os.path.join(os.path.dirname(pyqmgr.__file__), "daemon")

#: The daemon's parts' Protocols of what they need of Qmgr, by module.
HOSTS = {
    "pyqmgr.daemon.active": "ActiveHost",
    "pyqmgr.daemon.feeder": "FeederHost",
    "pyqmgr.daemon.retry": "RetryHost",
    "pyqmgr.daemon.delegation": "DelegationHost",
    "pyqmgr.daemon.applier": "ApplierHost",
    "pyqmgr.daemon.fleet": "FleetHost",
    "pyqmgr.daemon.fleet.suspensions": "SuspensionsHost",
    "pyqmgr.daemon.metrics_exporter": "Source",
}


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _members(cls: ast.ClassDef) -> set[str]:
    """The names a class body declares: methods, properties and annotated fields."""
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    names |= {n.target.id for n in cls.body
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return names


def _core_members() -> set[str]:
    with open(os.path.join(DAEMON, "host.py")) as f:
        tree = ast.parse(f.read())
    core = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "QmgrCore"]
    assert len(core) == 1, "daemon/host.py declares QmgrCore"
    return _members(core[0])


def repeated(source: str, core: set[str]) -> dict[str, set[str]]:
    """Protocols in ``source`` (other than QmgrCore) that declare a core member again."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.ClassDef) and node.name != "QmgrCore"
                and any(_base_name(b) == "Protocol" for b in node.bases)):
            again = _members(node) & core
            if again:
                found[node.name] = again
    return found


def test_the_core_declares_what_every_part_uses():
    assert {"cfg", "log", "scheduler", "spawn", "apply", "dispatch",
            "after_control"} <= _core_members()


def test_no_protocol_in_the_daemon_repeats_the_core():
    core = _core_members()
    found = {}
    for base, _dirs, files in os.walk(DAEMON):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(base, name)
                with open(path) as f:
                    for cls, again in repeated(f.read(), core).items():
                        found[f"{os.path.relpath(path, DAEMON)}:{cls}"] = sorted(again)
    assert not found, (f"Protocols that declare QmgrCore's members again (extend "
                       f"pyqmgr.daemon.host.QmgrCore instead): {found}")


def test_each_part_s_host_extends_the_core():
    not_core = []
    for module, name in HOSTS.items():
        cls = getattr(importlib.import_module(module), name)
        if QmgrCore not in cls.__mro__:
            not_core.append(f"{module}.{name}")
    assert not not_core, f"Protocols of what a part needs of Qmgr not on QmgrCore: {not_core}"


def test_the_check_finds_a_repeated_member():
    """The finder on a Protocol that declares the log and a task runner again."""
    source = ("from typing import Protocol\n"
              "class PartHost(Protocol):\n"
              "    log: object\n"
              "    def spawn(self, coro: object) -> None: ...\n"
              "    def own(self) -> None: ...\n"
              "class Fine(QmgrCore, Protocol):\n"
              "    def own(self) -> None: ...\n")
    assert repeated(source, _core_members()) == {"PartHost": {"log", "spawn"}}
