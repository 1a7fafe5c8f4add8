"""The optional extras (pyproject.toml's ``[project.optional-dependencies]``), as the
commands that need one check for it.

An admin installs pyqmgr with ``pip install .`` and no extras: the daemon and the
commands around it must run on that. The few that need more (compare and demo start
sink SMTP servers, ``simulate --plot`` draws) ask here first and say in one line what
to install, rather than dying deep inside with a ModuleNotFoundError. The daemon's
``metrics_listen`` has its own check (:func:`pyqmgr.daemon.metrics.import_exporter`),
since prometheus_client must pass the trust check before it is imported as root.
"""

from __future__ import annotations

import importlib

#: The modules each extra provides, for the extras commands ask about. Distribution
#: names are in pyproject.toml; tests/test_base_install.py keeps the two in step.
EXTRAS: dict[str, tuple[str, ...]] = {
    "testbed": ("aiosmtpd",),
    "plot": ("matplotlib",),
    "metrics": ("prometheus_client",),
    "classes": ("inotify_simple",),
    "fleet": ("redis", "hiredis"),
}


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
            return f"needs the {extra} extra{why}: pip install 'pyqmgr[{extra}]'"
    return None
