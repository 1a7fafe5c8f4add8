"""The watcher that names modules imported after the daemon dropped its privileges.

Each case runs in a fresh interpreter: the watcher stays in ``sys.meta_path`` and an
audit hook can never be removed, so neither may be left in the test process.
"""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, os, sys
from pyqmgr.daemon import late_imports
said = []
late_imports.watch(said.append, environ={ENV})
{BODY}
print(json.dumps(said))
"""


def _said(body: str, env: str = "{}") -> list[str]:
    script = SCRIPT.replace("{ENV}", env).replace("{BODY}", body)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout)


def test_a_module_imported_late_is_named_once_with_its_importer() -> None:
    said = _said("import colorsys\nimport colorsys\nimport importlib\n"
                 "importlib.import_module('colorsys')")
    assert len(said) == 1, said
    assert said[0].startswith("module colorsys imported after dropping privileges (by <string>:")


def test_modules_loaded_before_cost_nothing_and_say_nothing() -> None:
    assert _said("import os, sys, json") == []


def test_a_failed_late_import_is_named_too() -> None:
    said = _said("try:\n    import no_such_module_here\nexcept ImportError:\n    pass")
    assert [s.split(" (")[0] for s in said] == [
        "module no_such_module_here imported after dropping privileges"]


def test_the_audit_hook_sees_what_a_finder_ahead_of_the_watcher_hides() -> None:
    """A library may put its own finder ahead of the watcher (as setuptools' distutils
    shim does): then only the audit hook, added when PYQMGR_IMPORT_AUDIT is set, sees
    the import. Without the variable no hook is added (it could not be removed)."""
    ahead = ("import importlib.machinery\n"
             "class Ahead:\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        return importlib.machinery.PathFinder.find_spec(name, path)\n"
             "sys.meta_path.insert(0, Ahead())\n"
             "import colorsys")
    assert _said(ahead) == []
    (said,) = _said(ahead, env="{'PYQMGR_IMPORT_AUDIT': '1'}")
    assert said.startswith("module colorsys imported after dropping privileges")


def test_the_number_of_names_is_bounded() -> None:
    body = ("for i in range(80):\n    try:\n        __import__(f'no_such_{i}')\n"
            "    except ImportError:\n        pass")
    assert len(_said(body)) == 50


def test_a_table_of_other_policies_loads_stock_for_the_retry_and_error_transports() -> None:
    """The retry and error transports run stock's nqmgr whatever scheduler_policy says:
    its module is loaded with the table, at start-up. Loaded at their first message,
    it came after the privilege drop, and from /root the daemon died on it (CI, with
    scheduler_policy = oqmgr)."""
    script = ("import sys\nfrom pyqmgr.scheduler.policy import PolicyTable\n"
              "from pyqmgr.settings.policies import load\n"
              "table = PolicyTable(load('oqmgr'))\n"
              "print('pyqmgr.scheduler.nqmgr' in sys.modules, table.policy_for('retry').name,"
              " table.policy_for('error').name, table.policy_for('smtp').name)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == ["True", "nqmgr", "nqmgr", "oqmgr"]
