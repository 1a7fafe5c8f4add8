"""The daemon's imports stay lean: what they map is resident in every qmgr.

Stock qmgr's whole process is 10.4 MiB with 50,000 recipients in core; the memory
benchmark allows pyqmgr three times that, and a bare interpreter with asyncio is
already 15 MiB of it. A module that maps a shared library is a megabyte or more
that nobody sees in a diff: ``secrets`` (imported for one random name) brought in
hashlib and with it libcrypto, 4.3 MiB together with ctypes, and the benchmark
missed its target. This test imports the daemon as the launcher does, in a fresh
interpreter, and names what must stay out unless a setting asks for it.
"""

from __future__ import annotations

import json
import subprocess
import sys

from pyqmgr.install import launcher_text

#: Modules the default daemon must not import, each with what it costs.
KEPT_OUT = {
    "ssl": "libssl and libcrypto (asyncio imports it when it can; the launcher refuses it)",
    "_hashlib": "libcrypto, through hashlib (secrets, hmac, random's fallback)",
    "ctypes": "libffi; only the mynetworks default needs it (inet_addr_local)",
    "tempfile": "shutil, bz2, lzma and random, through ctypes.util",
    "prometheus_client": "only with metrics_listen",
}


def _daemon_modules(also: str = "") -> set[str]:
    launcher = launcher_text(sys.executable)
    # The launcher's own lines up to the daemon's entry, then what main() imports
    # first; main() itself would start serving.
    preamble = launcher.split("from pyqmgr.daemon import main")[0]
    script = (preamble.split("\n", 1)[1]
              + f"import pyqmgr.daemon.startup, pyqmgr.daemon.qmgr, json{also}\n"
              + "print(json.dumps(sorted(k for k, v in sys.modules.items() if v)))\n")
    out = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True,
                         text=True, timeout=60, check=True)
    return set(json.loads(out.stdout))


def test_the_default_daemon_imports_nothing_heavy() -> None:
    loaded = _daemon_modules()
    assert "pyqmgr.daemon.qmgr" in loaded
    heavy = {name: why for name, why in KEPT_OUT.items() if name in loaded}
    assert not heavy, f"the daemon now imports {heavy}"


def test_the_check_sees_a_heavy_import() -> None:
    """The same route reports a heavy module once something imports it: the test can fail."""
    loaded = _daemon_modules(", pyqmgr.postfix.inet_addr_local")
    assert {"ctypes", "tempfile"} <= loaded
