"""Shared by the trust tests: a directory root alone can change, a real stranger, and a
pyqmgr that users other than root can run.

Test beds normally live under /tmp, which the trust check rightly refuses (anyone may
create names there). Tests that need a path the check accepts make their files under
a fresh directory in a root-only location instead, and remove it afterwards.

The suite's own checkout may lie under a 0700 directory (a clone under /root, where the
README's first commands put it): other users cannot even start its venv's python. They
run pyqmgr as an admin's users do (README section 6: from an installation they can
read): :func:`pyqmgr_for_others` copies the working tree's package to a world-readable
directory, run with Debian's python3.
"""

from __future__ import annotations

import compileall
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata

from packaging.requirements import Requirement

from pyqmgr.extras import EXTRAS
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


#: The interpreter users other than root run here: Debian's own, which anyone can start
#: (the suite's venv python may lie under a 0700 directory they cannot enter).
OTHERS_PYTHON = "/usr/bin/python3"

#: The working tree the suite runs from: its pyqmgr/ is what other users run, so that
#: a developer's edits are what the tests see, whoever runs them.
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The extras whose libraries the copy carries beside pyqmgr. status, explain, jobs,
#: top, check and the refusals of install, uninstall and demo need none; compare looks
#: for the sinks' aiosmtpd before it checks for root (a base install is told what to
#: install first), and an admin's installation has it (the README installs '.[all]').
OTHERS_EXTRAS = ("testbed",)


@dataclass(frozen=True)
class PyqmgrForOthers:
    """pyqmgr in a directory every user can read (0755 directories, 0644 files)."""

    #: The directory on PYTHONPATH: pyqmgr/ and the extras' libraries.
    path: str

    def env(self) -> dict[str, str]:
        """A user's plain environment, with the copy first on the module path."""
        return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
                "PYTHONPATH": self.path, "PYTHONDONTWRITEBYTECODE": "1"}

    def pyqmgr(self, *args: str) -> list[str]:
        """``pyqmgr ARGS`` from the copy."""
        return [OTHERS_PYTHON, "-m", "pyqmgr.cli", *args]

    def python(self, *args: str) -> list[str]:
        """``python3 ARGS``, importing pyqmgr from the copy."""
        return [OTHERS_PYTHON, *args]

    def share(self, relative: str) -> str:
        """A readable copy of the checkout's file ``relative`` (at the same relative
        path, so that files it names by relative path may be shared beside it)."""
        target = os.path.join(self.path, "shared", relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(CHECKOUT, relative), target)
        make_readable(os.path.join(self.path, "shared"))
        return target

    def run(self, argv: Sequence[str], user: pwd.struct_passwd | None, timeout: float = 30,
            ) -> subprocess.CompletedProcess[str]:
        """``argv`` as ``user`` (as the suite's own user when None), in this environment."""
        return run_as(argv, user, self.env(), timeout)


def run_as(argv: Sequence[str], user: pwd.struct_passwd | None, env: dict[str, str],
           timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``argv`` as ``user``'s uid and gid with no other groups (as the suite's own user
    when None), from /.

    The ids are dropped before the exec, so the exec itself is the user's: it cannot
    start a program under a directory the user may not enter (PermissionError).
    setpriv(1) is not used: the exec it ends with still looked the path up with root's
    capabilities (a 0700 directory's venv python started for nobody that way).
    """

    def drop() -> None:
        if user is not None:
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)

    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                          cwd="/", env=env, preexec_fn=drop, check=False)


@contextmanager
def pyqmgr_for_others() -> Iterator[PyqmgrForOthers]:
    """A fresh copy under /tmp, removed afterwards. Only other users run it, never root:
    /tmp's trust does not matter here. Compiled first (as root), since they cannot
    write its __pycache__ and would otherwise compile every module on every run."""
    top = tempfile.mkdtemp(prefix="pyqmgr-for-others-", dir="/tmp")
    try:
        shutil.copytree(os.path.join(CHECKOUT, "pyqmgr"), os.path.join(top, "pyqmgr"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        _copy_libraries([m for extra in OTHERS_EXTRAS for m in EXTRAS[extra]], top)
        compileall.compile_dir(top, quiet=1, workers=1)
        make_readable(top)
        yield PyqmgrForOthers(top)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _copy_libraries(modules: list[str], into: str) -> None:
    """The installed distributions that provide ``modules``, with what they require,
    copied into ``into`` as they lie in site-packages."""
    owners = metadata.packages_distributions()
    todo = [name for module in modules for name in owners[module]]
    done: set[str] = set()
    while todo:
        dist = metadata.distribution(todo.pop())
        name = dist.metadata["Name"].lower()
        if name in done:
            continue
        done.add(name)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        for file in dist.files or []:
            if file.parts[0] == ".." or "__pycache__" in file.parts:
                continue  # scripts in bin/; byte code is compiled afresh
            target = os.path.join(into, *file.parts)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(str(file.locate()), target)


def make_readable(top: str) -> None:
    """Every directory under ``top`` 0755, every file 0644, whatever the umask or the
    checkout's own modes were."""
    os.chmod(top, 0o755)
    for base, dirs, files in os.walk(top):
        for name in dirs:
            os.chmod(os.path.join(base, name), 0o755)
        for name in files:
            os.chmod(os.path.join(base, name), 0o644)
