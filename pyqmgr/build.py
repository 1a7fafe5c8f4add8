"""Which build is running: the pure one, or the one compiled with mypyc.

The compiled build (``PYQMGR_COMPILE=1`` at install time, see setup.py and
docs/performance.md) turns the scheduler, the queue-file and protocol layers and the
daemon's hot modules into C extensions: the same source, about a seventh less CPU.
Its classes are native, and a native class cannot be subclassed by interpreted code
unless it says so: :func:`mypyc_attr` is how :class:`~pyqmgr.scheduler.policy.Policy`
and the entries own policies build on say it. In the pure build, and wherever
``mypy_extensions`` is not installed, it does nothing.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr
else:
    try:
        from mypy_extensions import mypyc_attr
    except ImportError:  # the pure build needs nothing from it
        def mypyc_attr(*_attrs: Any, **_kw: Any) -> Any:
            return lambda cls: cls

__all__ = ["mypyc_attr", "compiled", "name"]

#: The modules setup.py compiles (``PYQMGR_COMPILE=1``): the scheduler whole, the wire
#: layer a message crosses, and the daemon's modules on the path of every delivery.
COMPILED = (
    "pyqmgr/scheduler/",
    "pyqmgr/postfix/record.py",
    "pyqmgr/postfix/queue_file.py",
    "pyqmgr/postfix/attr.py",
    "pyqmgr/postfix/deliver_request.py",
    "pyqmgr/postfix/mail_queue.py",
    "pyqmgr/daemon/active.py",
    "pyqmgr/daemon/delivery.py",
    "pyqmgr/daemon/request.py",
    "pyqmgr/daemon/qmgr.py",
)


def compiled() -> bool:
    """True when the scheduler's core is a mypyc extension module.

    Found by its file rather than imported: the scheduler imports this module.
    """
    spec = importlib.util.find_spec("pyqmgr.scheduler.core")
    return spec is not None and spec.origin is not None and not spec.origin.endswith(".py")


def name() -> str:
    """The build's name as ``pyqmgr check`` and status print it."""
    return "compiled (mypyc)" if compiled() else "pure Python"
