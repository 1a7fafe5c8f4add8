"""Shared by the trust tests: a directory root alone can change, and a real stranger.

Test beds normally live under /tmp, which the trust check rightly refuses (anyone may
create names there). Tests that need a path the check accepts make their files under
a fresh directory in a root-only location instead, and remove it afterwards.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from pyqmgr.trust import untrusted_paths

#: Root-owned, not group/other-writable on a stock Debian; the first that passes is used.
TRUSTED_PARENTS = ("/run", "/var/lib", "/var/cache", "/srv", "/opt")


@contextmanager
def trusted_dir(prefix: str = "pyqmgr-trust-") -> Iterator[str]:
    """A new directory (mode 0755, traversable by postfix) whose whole chain is root's."""
    for parent in TRUSTED_PARENTS:
        if os.path.isdir(parent) and not untrusted_paths([parent]):
            break
    else:
        raise RuntimeError(f"none of {TRUSTED_PARENTS} is trusted on this machine")
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        os.chmod(path, 0o755)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def throwaway_user() -> Iterator[pwd.struct_passwd]:
    """A system user made for one test and deleted afterwards, even if the test failed.

    No home, no shell. Its name carries the pid so parallel runs do not collide.
    """
    name = f"pyqmgr-stranger-{os.getpid()}"[:32]
    try:
        pwd.getpwnam(name)
    except KeyError:
        pass
    else:  # left over by a killed run of this same pid: start clean
        subprocess.run(["userdel", name], check=False, capture_output=True, timeout=60)
    subprocess.run(["useradd", "--system", "--no-create-home", "--user-group",
                    "--shell", "/usr/sbin/nologin", name], check=True, capture_output=True,
                   timeout=60)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True, timeout=60)
