"""Which policy ``scheduler_policy`` names: a built-in, or an admin's ``module:PATH``.

The scheduler (:mod:`pyqmgr.scheduler.policy`) holds the ``Policy`` seam, the table of
which transport runs which, and the built-in policies, which it imports by name from
pyqmgr's own package. An admin's own policy is a file: reading it, compiling it and
running it is I/O the scheduler must not do (its modules import no ``os`` and open
no file, tests/unit/test_architecture.py), so it happens here, at start-up, before
the privilege drop and chroot, and the core is handed the classes.
"""

from __future__ import annotations

import inspect
import os
import sys
import types
from collections.abc import Callable

from pyqmgr.scheduler.policy import (
    BUILTIN,
    Policy,
    PolicyClass,
    PolicyTable,
    builtin,
    parse_knob,
)

MODULE_PREFIX = "module:"
POLICY_PARAM = "scheduler_policy"


class PolicyError(Exception):
    """``scheduler_policy`` names nothing usable; the text says why."""


def load(spec: str) -> PolicyClass:
    """The policy class ``scheduler_policy`` names: a built-in or ``module:PATH``.

    A module file must define exactly one :class:`Policy` subclass of its own
    (imported ones, such as a built-in it extends, do not count); its ``name`` is
    what the logs show. Errors are :class:`PolicyError` with the reason, for a fatal
    log line.
    """
    spec = spec.strip()
    if spec in BUILTIN:
        return builtin(spec)
    if not spec.startswith(MODULE_PREFIX):
        known = ", ".join(BUILTIN)
        raise PolicyError(f'unknown scheduler policy "{spec}" (known: {known}, '
                          f"or {MODULE_PREFIX}PATH)")
    return _load_module(spec[len(MODULE_PREFIX):])


def _load_module(path: str) -> PolicyClass:
    if not os.path.isabs(path):
        raise PolicyError(f'policy module "{path}": the path must be absolute')
    modname = "pyqmgr_policy_" + "".join(c if c.isalnum() else "_" for c in path)
    if not path.endswith(".py"):
        raise PolicyError(f'policy module "{path}": not a Python file')
    try:
        # From the source the trust check judged, compiled here: never from a
        # __pycache__ beside it, where a .pyc with a matching header would run as
        # root instead of the source (issue #31).
        with open(path, "rb") as f:
            source = f.read()
        module = types.ModuleType(modname)
        module.__file__ = path
        sys.modules[modname] = module  # dataclasses and typing look modules up there
        try:
            exec(compile(source, path, "exec", dont_inherit=True), module.__dict__)
        except BaseException:
            del sys.modules[modname]
            raise
    except FileNotFoundError:
        raise PolicyError(f'policy module "{path}": no such file') from None
    except Exception as exc:  # noqa: BLE001 - any error in user code is a load failure
        raise PolicyError(f'policy module "{path}" does not load: '
                          f"{type(exc).__name__}: {exc}") from None
    found = [obj for obj in vars(module).values()
             if inspect.isclass(obj) and issubclass(obj, Policy) and obj is not Policy
             and getattr(obj, "__module__", None) == module.__name__]
    if len(found) != 1:
        raise PolicyError(f'policy module "{path}" must define one Policy subclass, '
                          f"found {len(found)}")
    cls = found[0]
    if not cls.name:
        cls.name = f"module:{os.path.basename(path)}"
    return cls


def policy_table(values: dict[str, str], setting: Callable[[str, str, str], str],
                 fail: Callable[[str, str], Exception]) -> PolicyTable:
    """Each transport's policy from pyqmgr.cf's parameters (all of them, by name,
    values expanded); ``setting`` is what an own policy reads its knobs through.

    ``fail(parameter, text)`` makes the exception to raise for a bad value. Each
    policy's own knobs (:attr:`Policy.knobs`) are checked here as well, in every
    form the file gives them, so that a bad number is a start-up error.
    """
    default: PolicyClass | None = None
    by_transport: dict[str, PolicyClass] = {}
    for name, value in values.items():
        if name != POLICY_PARAM and not name.endswith("_" + POLICY_PARAM):
            continue
        try:
            policy = load(value)
        except PolicyError as exc:
            raise fail(name, str(exc)) from None
        if name == POLICY_PARAM:
            default = policy
        else:
            by_transport[name[:-len(POLICY_PARAM) - 1]] = policy
    table = PolicyTable(default, by_transport, setting)
    for policy in {table.default, *by_transport.values()}:
        for knob, (_, kind, lo, hi) in policy.knobs.items():
            for name, value in values.items():
                if name == knob or name.endswith("_" + knob):
                    try:
                        parse_knob(value, kind, lo, hi)
                    except ValueError as bad:
                        raise fail(name, str(bad)) from None
    return table
