"""The modules the compiled build compiles keep to what mypyc compiles correctly.

mypyc compiles what mypy believes, and checks it at run time. Two habits that are
harmless in Python broke the compiled daemon and only real runs showed it (issue #30):

* one ``except ... as name`` per function and name: mypyc gives the name the type of
  its first handler, so ``except ValueError as exc`` after ``except PolicyError as
  exc`` raised TypeError instead of reporting a bad knob (the daemon died without its
  fatal line);
* no code mypy takes for unreachable: an attribute narrowed to None before a call
  that sets it is read as None after it (``./dev test`` runs mypy with
  ``--warn-unreachable`` over these modules for that one).

The source is read, not imported, so this runs in the pure build too.
"""

from __future__ import annotations

import ast
import glob
import os

from pyqmgr.build import COMPILED

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def compiled_files() -> list[str]:
    out: list[str] = []
    for entry in COMPILED:
        path = os.path.join(ROOT, entry)
        if entry.endswith("/"):
            out += sorted(glob.glob(os.path.join(path, "**", "*.py"), recursive=True))
        else:
            out.append(path)
    return out


def handler_names_with_two_types(source: str) -> list[tuple[str, int, str, set[str]]]:
    """(function, line, name, types) where one function binds a name in handlers of
    different exception types."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        types: dict[str, set[str]] = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.ExceptHandler) and node.name and node.type is not None:
                types.setdefault(node.name, set()).add(ast.unparse(node.type))
        found += [(fn.name, fn.lineno, name, t) for name, t in types.items() if len(t) > 1]
    return found


def test_the_list_names_existing_modules():
    files = compiled_files()
    assert all(os.path.isfile(f) for f in files), [f for f in files if not os.path.isfile(f)]
    assert len(files) > 30  # the scheduler package and the wire and daemon modules


def test_the_check_finds_a_name_bound_by_two_handler_types():
    bad = ("def f():\n    try:\n        g()\n    except KeyError as exc:\n        pass\n"
           "    try:\n        g()\n    except ValueError as exc:\n        pass\n")
    same = ("def f():\n    try:\n        g()\n    except KeyError as exc:\n        pass\n"
            "    try:\n        g()\n    except KeyError as exc:\n        pass\n")
    assert handler_names_with_two_types(bad) == [("f", 1, "exc", {"KeyError", "ValueError"})]
    assert handler_names_with_two_types(same) == []


def test_no_compiled_function_binds_a_handler_name_to_two_types():
    found = []
    for path in compiled_files():
        with open(path, encoding="utf-8") as f:
            found += [(os.path.relpath(path, ROOT), *hit)
                      for hit in handler_names_with_two_types(f.read())]
    assert not found, found


#: Built-in types mypyc lets a compiled class have in its MRO (mypyc's
#: can_subclass_builtin, BaseException and dict special-cased); any other ("Inheriting
#: from most builtin types is unimplemented": a ScanError(OSError) once broke the
#: compiled build while the pure suite passed).
COMPILABLE_BUILTINS = {"object", "Exception", "BaseException", "LookupError", "IndexError",
                       "Warning", "UserWarning", "ValueError", "dict"}


def builtin_bases(source: str) -> list[tuple[str, int, str]]:
    """(class, line, base) for every class with a built-in base mypyc refuses."""
    import builtins

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                name = ast.unparse(base)
                kind = getattr(builtins, name, None)
                if isinstance(kind, type) and any(
                        c.__name__ not in COMPILABLE_BUILTINS for c in kind.__mro__):
                    found.append((node.name, node.lineno, name))
    return found


def test_the_check_finds_a_class_based_on_a_builtin():
    assert builtin_bases("class E(OSError):\n    pass\n") == [("E", 1, "OSError")]
    assert builtin_bases("class E(Exception):\n    pass\n") == []
    assert builtin_bases("class E(ValueError):\n    pass\n") == []
    assert builtin_bases("class E(KeyError):\n    pass\n") == [("E", 1, "KeyError")]


def test_no_compiled_class_is_based_on_a_builtin_mypyc_refuses():
    found = []
    for path in compiled_files():
        with open(path, encoding="utf-8") as f:
            found += [(os.path.relpath(path, ROOT), *hit) for hit in builtin_bases(f.read())]
    assert not found, found
