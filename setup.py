"""The build: pure Python by default; ``PYQMGR_COMPILE=1`` compiles with mypyc.

Everything else (metadata, scripts, package data) is in pyproject.toml. The compiled
build needs mypy (its mypyc), setuptools, wheel and a C compiler in the building
environment, so install it without build isolation::

    pip install mypy setuptools wheel
    PYQMGR_COMPILE=1 pip install --no-build-isolation .

``./dev compiled`` makes such an environment (.venv-compiled) for the tests and the
benchmarks. The list of modules is ``pyqmgr.build.COMPILED``.
"""

import ast
import os

from setuptools import setup


def compiled_modules() -> list[str]:
    # Read without importing pyqmgr: the build must not depend on the package's imports.
    with open(os.path.join("pyqmgr", "build.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "COMPILED"):
            return list(ast.literal_eval(node.value))
    raise SystemExit("pyqmgr/build.py has no COMPILED list")


ext_modules = []
if os.environ.get("PYQMGR_COMPILE") == "1":
    from mypyc.build import mypycify

    # The optional extras (prometheus_client) need not be installed to build: what
    # the compiled modules call of them is typed Any.
    ext_modules = mypycify(["--ignore-missing-imports", *compiled_modules()],
                           opt_level="3")

setup(ext_modules=ext_modules)
