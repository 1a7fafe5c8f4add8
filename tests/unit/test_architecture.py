"""The shape of pyqmgr/, read from its source: import circles, oversized code, layering.

Issue #22 asks for no import circle in pyqmgr/, no class over 400 lines and no function
over 80. There is no import circle, and any new one fails: the daemon's parts declare
the Protocol of what they need of it (``ActiveHost``, ``RetryHost``, ``DelegationHost``),
and the scheduler's structures that name each other are declared together
(``scheduler/structures.py``, ``scheduler/nqmgr/structures.py``), as ``qmgr.h`` declares
stock's. Imports under ``if TYPE_CHECKING:`` and inside functions count: they are
circles of knowledge even where Python never sees them at run time. Oversized code fails
unless it is one of the few exceptions listed with its size and its reason; a bigger
one fails, and one that shrank or went away fails too until its entry is updated, so
the list only gets shorter.

The layering of issue #44: the simulator imports no module of the daemon (it shares
the settings layer, pyqmgr/settings/, with it instead), and the scheduler does no I/O
(the rule is stated at :func:`scheduler_io`). Each rule has a control: the checker run
on a small package that breaks it, to show that it can fail.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "pyqmgr")
MAX_CLASS = 400
MAX_FUNCTION = 80

#: The exceptions: classes and functions over the limits, with their length in lines and
#: why they are still whole. Few, and only ever shorter.
KNOWN_OVERSIZE: dict[str, tuple[int, str]] = {
    "daemon/active.py:ActiveQueue": (443, (
        "a message's whole way through active/ (move in, open, read, route, finish, "
        "defer, bounce, hold), as qmgr_active.c and qmgr_message.c's I/O halves; its "
        "steps share the open queue file and its counters")),
}


def _modules() -> dict[str, str]:
    found = {}
    for base, _dirs, files in os.walk(ROOT):
        if "__pycache__" in base:
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(base, name)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                found[rel.removesuffix(".__init__")] = path
    return found


def _imports(module: str, path: str, known: dict[str, str]) -> Iterator[str]:
    with open(path) as f:
        tree = ast.parse(f.read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                target = ".".join(parts + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    yield sub
                elif target in known:
                    yield target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name


def import_circles() -> set[frozenset[str]]:
    """The strongly connected components of pyqmgr's import graph (Tarjan's)."""
    known = _modules()
    graph = {m: set(_imports(m, p, known)) - {m} for m, p in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.add(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def oversize() -> dict[str, int]:
    found = {}
    for path in _modules().values():
        with open(path) as f:
            tree = ast.parse(f.read())
        rel = os.path.relpath(path, ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                length = node.end_lineno - node.lineno + 1
                limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
                if length > limit:
                    found[f"{rel}:{node.name}"] = length
    return found


def test_no_import_circle():
    circles = import_circles()
    assert not circles, f"import circles in pyqmgr/: {[sorted(c) for c in circles]}"


def test_no_new_oversized_class_or_function():
    found = oversize()
    new = {k: v for k, v in found.items() if k not in KNOWN_OVERSIZE}
    assert not new, (f"over {MAX_CLASS} lines a class or {MAX_FUNCTION} a function: {new}; "
                     "split it")
    grown = {k: (KNOWN_OVERSIZE[k][0], v) for k, v in found.items()
             if k in KNOWN_OVERSIZE and v > KNOWN_OVERSIZE[k][0]}
    assert not grown, f"known oversized code grew (listed, now): {grown}"
    shrunk = {k: (v, found.get(k)) for k, (v, _why) in KNOWN_OVERSIZE.items()
              if found.get(k, 0) < v}
    assert len(KNOWN_OVERSIZE) <= 3 and all(why for _n, why in KNOWN_OVERSIZE.values()), (
        "the exceptions are few and each says why")
    assert not shrunk, f"smaller now: update KNOWN_OVERSIZE (listed, now): {shrunk}"


def test_the_circle_finder_finds_a_circle(tmp_path, monkeypatch):
    """The finder on a package of two modules that import each other."""
    pkg = tmp_path / "pyqmgr"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pyqmgr.b import x\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from pyqmgr import a\nx = 1\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(pkg))
    assert import_circles() == {frozenset({"pyqmgr.a", "pyqmgr.b"})}


# -- layering (issue #44) ---------------------------------------------------------------


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {m: set(_imports(m, p, known)) - {m} for m, p in known.items()}


def simulator_daemon_imports() -> dict[str, list[str]]:
    """Each module of pyqmgr.simulator that reaches a module of pyqmgr.daemon through
    pyqmgr's imports (directly or through any chain of modules, imports under
    ``TYPE_CHECKING`` and inside functions included), with one such chain."""
    graph = _graph()
    found: dict[str, list[str]] = {}
    for start in sorted(m for m in graph if m.split(".")[:2] == ["pyqmgr", "simulator"]):
        came_from: dict[str, str | None] = {start: None}
        todo = [start]
        while todo:
            module = todo.pop()
            if module.split(".")[:2] == ["pyqmgr", "daemon"]:
                chain = [module]
                while (prev := came_from[chain[-1]]) is not None:
                    chain.append(prev)
                found[start] = chain[::-1]
                break
            for nxt in sorted(graph[module]):
                if nxt not in came_from:
                    came_from[nxt] = module
                    todo.append(nxt)
    return found


#: Standard-library modules a scheduler module may import: computation only. None of
#: them reaches the file system, a socket, a process, the clock, or code from a path.
PURE_STDLIB = frozenset({
    "__future__", "abc", "bisect", "collections", "collections.abc", "dataclasses",
    "enum", "functools", "heapq", "itertools", "math", "operator", "random", "re",
    "typing",
    # import_module only: the built-in policies by dotted name, from pyqmgr's own
    # package, as an import statement would (scheduler/policy.py's ``builtin``). Its
    # submodules that load code from a path (util, machinery) are not on this list.
    "importlib",
})
#: Modules of pyqmgr outside the scheduler that it may import, and what each may
#: import beyond PURE_STDLIB (held to the same rule otherwise).
PURE_HELPERS: dict[str, frozenset[str]] = {
    # Durations as an admin reads them: arithmetic on seconds.
    "pyqmgr.durations": frozenset(),
    # mypyc_attr, the compiled build's class decorator (from mypy_extensions when
    # installed). Its compiled(), which the scheduler never calls, asks the import
    # system where the core was found (importlib.util.find_spec: no file read).
    "pyqmgr.build": frozenset({"importlib.util", "mypy_extensions"}),
}
#: Builtins that read, write or run something from outside: never called here.
IO_BUILTINS = frozenset({"open", "exec", "eval", "compile", "__import__", "input",
                         "print", "breakpoint"})
#: Attributes that reach importlib's loading from a path without importing it by name.
PATH_LOADING = frozenset({"util", "machinery"})


def _io_in(module: str, path: str, allowed: frozenset[str]) -> Iterator[str]:
    """What in one module breaks rules 1 and 3 (see :func:`scheduler_io`)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        for name in names:
            if name.split(".")[0] == "pyqmgr":
                continue
            if name not in PURE_STDLIB and name not in allowed:
                yield f"{module}:{node.lineno}: imports {name}"
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in IO_BUILTINS):
            yield f"{module}:{node.lineno}: calls {node.func.id}()"
        if (isinstance(node, ast.Attribute) and node.attr in PATH_LOADING
                and isinstance(node.value, ast.Name) and node.value.id == "importlib"
                and f"importlib.{node.attr}" not in allowed):
            yield f"{module}:{node.lineno}: uses importlib.{node.attr}"


def scheduler_io() -> list[str]:
    """Every place a module of pyqmgr/scheduler/ may do I/O, by this rule:

    1. it imports from outside pyqmgr only the modules of :data:`PURE_STDLIB`, whose
       work is computation: no ``os``, ``io``, ``pathlib``, ``shutil``, ``socket``,
       ``subprocess``, ``asyncio``, ``time``, ``sys``, ``importlib.util``...;
    2. it imports from pyqmgr only the scheduler's own modules and the helpers of
       :data:`PURE_HELPERS`, which are held to rules 1 and 3 themselves (with the
       imports listed beside each): a file read through a helper (``pyqmgr.bounded``'s
       ``read_bounded``, ``pyqmgr.pyqmgr_cf``) is an import this rule refuses;
    3. it calls none of the builtins of :data:`IO_BUILTINS` (``open``, ``exec``,
       ``compile``...), and touches no ``importlib.util`` or ``importlib.machinery``.

    Imports under ``TYPE_CHECKING`` and inside functions count, as for the circles.
    """
    known = _modules()
    found: list[str] = []
    for module, path in sorted(known.items()):
        if module.split(".")[:2] == ["pyqmgr", "scheduler"]:
            found += _io_in(module, path, frozenset())
            found += [f"{module}: imports {target}, neither the scheduler's nor a pure helper"
                      for target in sorted(set(_imports(module, path, known)))
                      if target.split(".")[:2] != ["pyqmgr", "scheduler"]
                      and target not in PURE_HELPERS]
        elif module in PURE_HELPERS:
            found += _io_in(module, path, PURE_HELPERS[module])
            found += [f"{module}: a pure helper imports {target}"
                      for target in sorted(set(_imports(module, path, known)))
                      if target not in PURE_HELPERS]
    return found


def test_the_simulator_imports_no_daemon_module():
    """The simulator runs the daemon's settings and classifier through the shared
    layer (pyqmgr/settings/), not by loading the daemon."""
    found = simulator_daemon_imports()
    assert not found, ("the simulator reaches the daemon: "
                       + "; ".join(" -> ".join(chain) for chain in found.values()))


def test_the_simulator_loads_no_daemon_module_when_run():
    """The same at run time, where an import by name (importlib) would also show:
    every module of the simulator imported, no module of pyqmgr.daemon loaded."""
    script = ("import pkgutil, sys, importlib, pyqmgr.simulator as s\n"
              "for m in pkgutil.iter_modules(s.__path__):\n"
              "    importlib.import_module('pyqmgr.simulator.' + m.name)\n"
              "print(sorted(n for n in sys.modules if n.startswith('pyqmgr.daemon')))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(ROOT))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"daemon modules loaded by the simulator: {out.stdout}"


def test_the_scheduler_does_no_io():
    found = scheduler_io()
    assert not found, "I/O in the scheduler core:\n" + "\n".join(found)


def _package(tmp_path, monkeypatch, files: dict[str, str]) -> None:
    """A pyqmgr/ of the given modules (each package gets its __init__), as ROOT."""
    pkg = tmp_path / "pyqmgr"
    for name, text in {"__init__.py": "", **files}.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(pkg))


def test_the_daemon_check_finds_a_daemon_module_behind_another(tmp_path, monkeypatch):
    """The control: the simulator reaches the daemon through a module between them."""
    _package(tmp_path, monkeypatch, {
        "simulator/engine.py": "from pyqmgr.settings.sites import x\n",
        "settings/sites.py": "def f():\n    from pyqmgr.daemon.sites import y\nx = 1\n",
        "daemon/sites.py": "y = 1\n"})
    assert simulator_daemon_imports() == {"pyqmgr.simulator.engine": [
        "pyqmgr.simulator.engine", "pyqmgr.settings.sites", "pyqmgr.daemon.sites"]}


@pytest.mark.parametrize(("source", "says"), [
    ("import os\n", "imports os"),
    ("from pathlib import Path\n", "imports pathlib"),
    ("import importlib.util\n", "imports importlib.util"),
    ("import importlib\nf = importlib.util.spec_from_file_location\n", "importlib.util"),
    ("def f(p):\n    with open(p) as g:\n        return g.read()\n", "calls open()"),
    ("def f(s):\n    exec(s)\n", "calls exec()"),
    ("from pyqmgr.bounded import read_bounded\n", "imports pyqmgr.bounded"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import io\n", "imports io"),
    ("from pyqmgr.durations import duration\n", "a pure helper imports pyqmgr.bounded"),
])
def test_the_io_check_finds_each_kind_of_io(tmp_path, monkeypatch, source, says):
    """The control: a scheduler module that breaks the rule one way each, and a pure
    helper that reads a file through another module."""
    _package(tmp_path, monkeypatch, {
        "scheduler/bad.py": source,
        "scheduler/good.py": "import heapq\nfrom pyqmgr.scheduler.bad import f\n",
        "bounded.py": "def read_bounded(path):\n    return open(path).read()\n",
        "durations.py": "from pyqmgr.bounded import read_bounded\nduration = 1\n"
                        if "pure helper" in says else "duration = 1\n"})
    found = scheduler_io()
    assert any(says in text for text in found), found
    assert not any("scheduler.good" in text for text in found), found
