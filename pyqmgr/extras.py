"""The optional extras (pyproject.toml's ``[project.optional-dependencies]``), as the
commands and the daemon's settings that need one check for it.

An admin may install pyqmgr with ``pip install .`` and no extras: the daemon and the
commands around it must run on that. The few that need more (compare and demo start
sink SMTP servers, ``simulate --plot`` draws) and the pyqmgr.cf settings that turn on a
feature built on a library (:data:`FEATURES`) ask here first and say in one line what
to install, rather than dying deep inside with a ModuleNotFoundError: ``pyqmgr check``
names each such setting, and the daemon's start-up makes it one ``fatal:`` line before
anything is imported. The README's install line takes the ``all`` extra, which holds
every other one.

The install command is the one that works for this installation (:func:`install_command`):
a checkout installs ``'/path/to/checkout[sites]'`` (``'.[sites]'`` from inside it), a
package from an index ``'pyqmgr[sites]'``, each with this venv's own pip.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: The modules each extra provides, for the extras commands ask about. Distribution
#: names are in pyproject.toml; tests/test_base_install.py keeps the two in step.
EXTRAS: dict[str, tuple[str, ...]] = {
    "testbed": ("aiosmtpd",),
    "plot": ("matplotlib",),
    "metrics": ("prometheus_client",),
    "sites": ("dns",),
    "classes": ("inotify_simple",),
    "fleet": ("redis", "hiredis"),
}

#: The extra that holds every other one (the README's install line).
ALL = "all"


@dataclass(frozen=True)
class Feature:
    """A pyqmgr.cf setting that turns on a feature built on a library."""

    parameter: str
    extra: str
    #: The module the daemon cannot do without (an extra may hold optional ones too:
    #: hiredis only speeds the fleet's replies up).
    module: str
    #: The library's distribution name, as an admin knows it.
    library: str

    def on(self, value: str) -> bool:
        """Does this value of :attr:`parameter` turn the feature on (as start-up reads it)?"""
        text = value.strip().lower()
        if self.parameter == "site_grouping":
            return text == "mx"
        if self.parameter == "message_classes":
            # One class orders nothing, and is read without the kernel's file events.
            return len(text.replace(",", " ").split()) > 1
        return bool(text)


#: Every setting whose feature needs an extra, in pyproject.toml's order.
FEATURES: tuple[Feature, ...] = (
    Feature("metrics_listen", "metrics", "prometheus_client", "prometheus-client"),
    Feature("site_grouping", "sites", "dns", "dnspython"),
    Feature("message_classes", "classes", "inotify_simple", "inotify-simple"),
    Feature("shared_state", "fleet", "redis", "redis-py"),
)


def _checkout() -> str | None:
    """The source tree this pyqmgr is installed from, when one is there to install from:
    the package's own parent (an editable install, or run from a checkout), else the
    directory ``pip install DIR`` recorded (PEP 610's direct_url.json)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if _is_source(here):
        return here
    try:
        import json
        from importlib import metadata

        text = metadata.distribution("pyqmgr").read_text("direct_url.json")
        found = json.loads(text) if text else {}
    except (ImportError, OSError, ValueError):
        return None
    url = found.get("url", "") if isinstance(found, dict) else ""
    if not url.startswith("file://") or "dir_info" not in found:
        return None
    from urllib.parse import unquote, urlsplit

    path = unquote(urlsplit(url).path)
    return path if _is_source(path) else None


def _is_source(path: str) -> bool:
    try:
        with open(os.path.join(path, "pyproject.toml"), encoding="utf-8") as f:
            return 'name = "pyqmgr"' in f.read(4096)
    except OSError:
        return False


def _pip() -> str:
    """This interpreter's pip: the venv's ``bin/pip``, else ``python -m pip``."""
    import shlex

    if sys.prefix != sys.base_prefix:
        pip = os.path.join(sys.prefix, "bin", "pip")
        if os.path.exists(pip):
            return shlex.quote(pip)
    return f"{shlex.quote(sys.executable)} -m pip"


def install_command(extras: Sequence[str]) -> str:
    """The command that adds ``extras`` to this installation, ready to paste.

    From a checkout, its path (``'/opt/pyqmgr[sites]'``: what ``'.[sites]'`` says from
    inside it, and it works from anywhere); from a package, ``'pyqmgr[sites]'``.
    """
    import shlex

    target = f"{_checkout() or 'pyqmgr'}[{','.join(extras)}]"
    return f"{_pip()} install {shlex.quote(target)}"


def missing(extra: str) -> str | None:
    """None when ``extra``'s modules load; else "needs the EXTRA extra: pip install ...".

    The modules are imported, not just looked up: a package that is there but whose own
    dependencies are not fails only when imported, and the callers import it right
    after anyway. That case names the module and the error, since the fix is then to
    repair an install rather than to add the extra.
    """
    for module in EXTRAS[extra]:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            why = "" if exc.name == module else f" ({module} does not load: {exc})"
            return f"needs the {extra} extra{why}: {install_command([extra])}"
    return None


def lacking(values: Mapping[str, str]) -> list[Feature]:
    """The features pyqmgr.cf's ``values`` turn on whose library is not installed.

    Looked up, not imported (``check`` runs before anything is trusted, and the daemon
    imports each library later, its files checked first): a library that is there but
    does not load is named by the import itself.
    """
    found = []
    for feature in FEATURES:
        value = values.get(feature.parameter)
        if value is None or not feature.on(value):
            continue
        try:
            spec = importlib.util.find_spec(feature.module)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            found.append(feature)
    return found


def lacking_texts(path: str, features: Sequence[Feature]) -> list[str]:
    """One line per feature, as ``check`` lists them."""
    return [f"{path}: parameter {f.parameter}: needs the {f.extra} extra ({f.library}), "
            f"which is not installed: {install_command([f.extra])}" for f in features]


def lacking_fatal(path: str, features: Sequence[Feature]) -> str:
    """The daemon's one fatal line for all of them, with one command that adds them all."""
    if len(features) == 1:
        return lacking_texts(path, features)[0]
    names = ", ".join(f.parameter for f in features)
    extras = [f.extra for f in features]
    return (f"{path}: parameters {names}: need the {', '.join(extras)} extras "
            f"({', '.join(f.library for f in features)}), which are not installed: "
            f"{install_command(extras)}")
