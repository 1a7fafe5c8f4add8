"""Postfix releases other than the machine's own, each run from a Debian root of its own.

The machine's Postfix (Debian 12's 3.7) stays the default and is never touched. Another
release comes from Debian's archive: ``debootstrap`` makes a minimal root of the suite
that ships it (Debian 13 "trixie" has 3.10, "forky" 3.11), with ``postfix`` and
``python3`` inside (and trixie's ``valkey-server``, which the fleet's tests run as
Debian 13's Valkey, issue #35), kept under ``$PYQMGR_ROOTS`` (default /var/cache/pyqmgr/roots) so
that a machine that keeps its disk builds each root once.

A test instance in a root is an ordinary :class:`~pyqmgr.testbed.instance.PostfixInstance`
whose commands run through :meth:`ReleaseRoot.command`: a private mount namespace
(``unshare --mount``, so nothing it mounts outlives it or shows outside) binds the test
bed's directory and this checkout into the root at the same paths, then ``chroot``.
Paths therefore read the same inside and out: main.cf names /tmp/pyqmgr-tb-XXXX/spool,
and so does the test that reads a queue file. Postfix's daemons start inside that
namespace and keep it while they run; stopping them ends it. Inside, the root's own
python3 imports pyqmgr from the bound checkout (a ``.pth`` file in the root's
dist-packages, naming /pyqmgr-checkout, where each namespace binds its own checkout),
so the daemon runs the code under test with the release's postconf.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: Where the roots are kept between runs.
ROOTS_ENV = "PYQMGR_ROOTS"
DEFAULT_ROOTS = "/var/cache/pyqmgr/roots"
#: Set to a release name (``3.10``) to run every test instance in that release's root.
RELEASE_ENV = "PYQMGR_POSTFIX_RELEASE"
MIRROR = "http://deb.debian.org/debian"
#: The file that says a root is complete, with the release ``postconf -dh
#: mail_version`` reported when it was made.
READY = ".pyqmgr-root"
#: This checkout: bound into the root at the same path so its python3 imports it.
CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Where each namespace binds the checkout it runs for, inside the root: the root's
#: .pth names this one path, so that two checkouts using one root never race on it.
CHECKOUT_INSIDE = "/pyqmgr-checkout"
#: The unprivileged user the test bed delivers local mail to (instance.LOCAL_USER).
LOCAL_USER = "pyqmgrtest"


class ReleaseError(Exception):
    """A root could not be made or used; the text says what failed and what to do."""


@dataclass(frozen=True)
class Release:
    """A Postfix release as Debian's archive ships it."""

    name: str
    #: The Debian suite whose ``postfix`` package is this release.
    suite: str
    #: What the suite's package was when this table was written (the root's own
    #: ``postconf -dh mail_version`` is what counts).
    expected: str
    #: Packages the root holds besides postfix and python3, each with a file it
    #: installs: a root made before a package joined this list lacks that file, and
    #: :meth:`ReleaseRoot.ensure` installs the package into it.
    extra: tuple[tuple[str, str], ...] = ()


#: The releases the test bed can run besides the machine's own. 3.8 and 3.9 are in no
#: suite of Debian's archive (compat/matrix.md says so).
RELEASES = {
    "3.10": Release("3.10", "trixie", "3.10.13",
                    extra=(("valkey-server", "/usr/bin/valkey-server"),)),
    "3.11": Release("3.11", "forky", "3.11.7"),
}
#: The machine's own Postfix, run without a root.
HOST = "host"


def roots_dir() -> str:
    return os.environ.get(ROOTS_ENV) or DEFAULT_ROOTS


def selected() -> str | None:
    """The release named by $PYQMGR_POSTFIX_RELEASE, or None for the machine's own."""
    name = os.environ.get(RELEASE_ENV, "").strip()
    if name in ("", HOST):
        return None
    if name not in RELEASES:
        raise ReleaseError(f"${RELEASE_ENV}={name}: the test bed knows "
                           f"{', '.join([HOST, *RELEASES])}")
    return name


class ReleaseRoot:
    """One release's Debian root: made once, then used by every instance of it."""

    def __init__(self, name: str, directory: str | None = None) -> None:
        if name not in RELEASES:
            raise ReleaseError(f"unknown release {name!r}; the test bed knows "
                               f"{', '.join(RELEASES)}")
        self.release = RELEASES[name]
        self.path = os.path.join(directory or roots_dir(), self.release.suite)

    def __repr__(self) -> str:
        return f"ReleaseRoot({self.release.name!r}, {self.path!r})"

    # -- making it --------------------------------------------------------------------

    def ready(self) -> bool:
        return os.path.isfile(os.path.join(self.path, READY))

    def version(self) -> str:
        """The root's Postfix release, as recorded when it was made."""
        try:
            with open(os.path.join(self.path, READY)) as f:
                return f.read().strip()
        except OSError as exc:
            raise ReleaseError(f"{self.path} is not a finished root ({exc}); "
                               f"make it with: ./dev root {self.release.name}") from exc

    def ensure(self, say: Callable[[str], None] = lambda _: None) -> ReleaseRoot:
        """Make the root unless a finished one is there, add the release's extra
        packages it lacks; return self."""
        if not self.ready():
            self.make(say)
        if self._missing():
            self._add_missing(say)
        self._link_checkout()
        return self

    def _missing(self) -> list[str]:
        return [package for package, path in self.release.extra
                if not os.path.exists(self.host_path(path))]

    def _add_missing(self, say: Callable[[str], None]) -> None:
        """apt-get install the extra packages a root made before them lacks, with the
        root's own apt, its services kept from starting (policy-rc.d); one process at a
        time (a lock beside the root), for two test runs may share it."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            missing = self._missing()
            if not missing:
                return
            say(f"apt-get install {' '.join(missing)} into {self.path}")
            policy = self.host_path("/usr/sbin/policy-rc.d")
            made_policy = not os.path.exists(policy)
            if made_policy:
                with open(policy, "w") as f:
                    f.write("#!/bin/sh\nexit 101\n")
                os.chmod(policy, 0o755)
            try:
                apt = ["env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "-qq"]
                _checked(self.command([*apt, "update"]), timeout=600,
                         what=f"apt-get update in {self.path}")
                _checked(self.command([*apt, "install", "-y", "--no-install-recommends",
                                       *missing]), timeout=900,
                         what=f"apt-get install {' '.join(missing)} in {self.path}")
            finally:
                if made_policy:
                    os.unlink(policy)

    def make(self, say: Callable[[str], None] = lambda _: None) -> None:
        """debootstrap the suite with postfix and python3, then prepare it for tests.

        Built beside its final place and renamed at the end, so that an interrupted
        build never passes for a finished root.
        """
        if shutil.which("debootstrap") is None:
            raise ReleaseError("debootstrap is not installed (apt-get install debootstrap)")
        building = self.path + ".building"
        shutil.rmtree(building, ignore_errors=True)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        packages = ",".join(["postfix", "python3", *(p for p, _ in self.release.extra)])
        say(f"debootstrap {self.release.suite} into {building} ({packages})")
        started = time.monotonic()
        # Bookworm's debootstrap has no script for newer testing suites; sid's fits all.
        script = "/usr/share/debootstrap/scripts/sid"
        _checked(["debootstrap", "--variant=minbase", f"--include={packages}",
                  self.release.suite, building, MIRROR, script], timeout=1800,
                 what=f"debootstrap of {self.release.suite}")
        _checked(["chroot", building, "useradd", "--system", "--no-create-home", "--shell",
                  "/usr/sbin/nologin", LOCAL_USER], timeout=60, what=f"useradd {LOCAL_USER}")
        version = _checked(["chroot", building, "postconf", "-dh", "mail_version"],
                           timeout=60, what="postconf -dh mail_version").strip()
        with open(os.path.join(building, READY), "w") as f:
            f.write(version + "\n")
        if os.path.exists(self.path):
            shutil.rmtree(self.path)
        os.rename(building, self.path)
        say(f"root of Postfix {version} ready in {self.path} "
            f"({time.monotonic() - started:.0f} s)")

    def _link_checkout(self) -> None:
        """Let the root's python3 import this checkout's pyqmgr (the daemon runs ``-I``,
        which ignores PYTHONPATH but still reads .pth files in dist-packages)."""
        lib = os.path.join(self.path, "usr", "local", "lib")
        pythons = sorted(d for d in os.listdir(os.path.join(self.path, "usr", "lib"))
                         if d.startswith("python3."))
        if not pythons:
            raise ReleaseError(f"{self.path} has no python3")
        site = os.path.join(lib, pythons[-1], "dist-packages")
        os.makedirs(site, exist_ok=True)
        pth = os.path.join(site, "pyqmgr-checkout.pth")
        text = CHECKOUT_INSIDE + "\n"
        try:
            with open(pth) as f:
                if f.read() == text:
                    return
        except OSError:
            pass
        with open(pth, "w") as f:
            f.write(text)

    # -- using it ---------------------------------------------------------------------

    def host_path(self, path: str) -> str:
        """Where a file of the root (an absolute path inside it) is on the machine."""
        return os.path.join(self.path, path.lstrip("/"))

    def command(self, args: Sequence[str], binds: Sequence[str] = ()) -> list[str]:
        """``args`` run inside the root, with ``binds`` (and this checkout) at their own
        paths, in a mount namespace of their own."""
        mounts = []
        pairs = [(d, d) for d in sorted({CHECKOUT, *binds})]
        # This checkout again where the root's .pth looks (see _link_checkout).
        pairs.append((CHECKOUT, CHECKOUT_INSIDE))
        for directory, at in pairs:
            inside = shlex.quote(self.host_path(at))
            mounts.append(f"mkdir -p {inside} && mount --bind {shlex.quote(directory)} "
                          f"{inside}")
        proc = shlex.quote(self.host_path("/proc"))
        script = " && ".join([*mounts, f"mount -t proc proc {proc}",
                              f'exec chroot {shlex.quote(self.path)} "$@"'])
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                "release-root", *args]

    def user(self, name: str) -> tuple[int, int]:
        """(uid, gid) of a user in the root's own /etc/passwd."""
        with open(self.host_path("/etc/passwd")) as f:
            for line in f:
                fields = line.split(":")
                if fields[0] == name and len(fields) > 3:
                    return int(fields[2]), int(fields[3])
        raise ReleaseError(f"{self.path}: no user {name}")


def _checked(args: Sequence[str], timeout: float, what: str) -> str:
    try:
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired as exc:
        raise ReleaseError(f"{what} did not finish in {timeout:g} s") from exc
    except OSError as exc:
        raise ReleaseError(f"{what}: {exc}") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise ReleaseError(f"{what} failed ({proc.returncode}):\n{tail}")
    return proc.stdout


def main(argv: list[str]) -> int:
    """``./dev root NAME...``: make (or check) the roots; prints each one's release
    (``host``: the machine's own Postfix, which needs no root)."""
    names = argv or list(RELEASES)
    for name in names:
        try:
            if name == HOST:
                version = _checked(["postconf", "-dh", "mail_version"], timeout=60,
                                   what="postconf -dh mail_version").strip()
                print(f"{HOST}: Postfix {version}")
                continue
            root = ReleaseRoot(name).ensure(lambda text: print(text, flush=True))
        except ReleaseError as exc:
            print(f"root {name}: {exc}", file=sys.stderr)
            return 1
        print(f"{name}: Postfix {root.version()} in {root.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
