"""Third-party libraries the daemon imports when a setting asks for them, at start-up.

Why at start-up, and checked: the daemon starts as root and then chroots and drops its
privileges, after which a library's files may not be reachable; and a library that
runs as root must pass the start-up trust check first, file by file, as a ``module:``
policy file does (the general check covers site-packages' top-level entries, not what
is inside them). The launcher keeps ``ssl`` out of the daemon (OpenSSL's 4 MiB):
libraries that import it at the top (prometheus_client for its HTTPS server,
redis-py for TLS to Redis) let it back in here, and only when set up.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence


def allow_ssl() -> None:
    """Lift the launcher's block on ``ssl``: a setting needs it (TLS to Redis, a
    library that imports it at the top). asyncio, imported while ``ssl`` was blocked,
    kept None for it in three modules; they get the module now, or a TLS connection
    would fail with asyncio's "stdlib ssl module not available"."""
    if "ssl" not in sys.modules or sys.modules["ssl"] is not None:
        return
    del sys.modules["ssl"]
    import ssl

    for name in ("asyncio.base_events", "asyncio.selector_events", "asyncio.sslproto"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "ssl", ssl) is None:
            module.ssl = ssl  # type: ignore[attr-defined]
    sslproto = sys.modules.get("asyncio.sslproto")
    if sslproto is not None and not hasattr(sslproto, "SSLAgainErrors"):
        sslproto.SSLAgainErrors = (ssl.SSLWantReadError,  # type: ignore[attr-defined]
                                   ssl.SSLSyscallError)


def import_trusted(packages: Sequence[str], imports: Sequence[str],
                   missing: Callable[[object], Exception]) -> None:
    """Check every file of ``packages`` (pyqmgr.trust), then import ``imports``.

    ``missing(why)`` is the error to raise when a package is not installed or does not
    load; an untrusted file raises :class:`pyqmgr.trust.UntrustedError`."""
    from pyqmgr import trust

    files: list[str] = []
    for name in packages:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError) as exc:
            raise missing(exc) from None
        if spec is None:
            raise missing(f"no module named {name!r}")
        for directory in spec.submodule_search_locations or ():
            for dirpath, dirnames, filenames in os.walk(directory):
                dirnames.sort()
                files.append(dirpath)
                files += [os.path.join(dirpath, n) for n in sorted(filenames)]
        if spec.origin and spec.origin not in files:
            files.append(spec.origin)
    problems = trust.untrusted_paths(files)
    if problems:
        raise trust.UntrustedError(problems)
    allow_ssl()
    for name in imports:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise missing(exc) from None
