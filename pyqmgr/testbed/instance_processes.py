"""Finding and ending a test-bed instance's processes (a part of PostfixInstance).

Processes are found by the ``MAIL_CONFIG`` that master exports to every child, so
nothing of an instance, not even a daemon master lost track of, survives its tear-down.
"""

from __future__ import annotations

import os
import signal
import time

from pyqmgr.testbed.instance_base import InstanceBase, TestbedError


def _read_proc(pid: str, name: str) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return None


class InstanceProcesses(InstanceBase):
    """The processes of one instance: listing, waiting for qmgr, killing leftovers."""

    def _kill_leftovers(self, grace: float = 3.0) -> None:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.05)
        survivors = self.processes()
        if survivors:
            raise TestbedError(f"processes of {self.root} survive SIGKILL: {survivors}")

    def processes(self) -> dict[int, list[str]]:
        """Live processes of this instance (found by MAIL_CONFIG), with their argv."""
        want = f"MAIL_CONFIG={self.config_dir}".encode()
        me = os.getpid()
        found: dict[int, list[str]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            env = _read_proc(entry, "environ")
            if env is None or want not in env:
                continue
            argv = _read_proc(entry, "cmdline")
            if not argv:
                continue  # exited (or a zombie) between the two reads
            found[int(entry)] = [a.decode(errors="replace") for a in argv if a]
        return found

    def pids(self, program: str | None = None) -> list[int]:
        """Pids of this instance's processes, optionally only those running ``program``.

        ``program`` is compared with the basename of the first words of argv, so
        ``"qmgr"`` finds stock qmgr (``qmgr -l -t unix -u``) as well as the pyqmgr
        launcher (``python -I .../pyqmgr/qmgr -l ...``), and ``"master"`` the master.
        """
        found = []
        for pid, argv in self.processes().items():
            if program is None or program in (os.path.basename(a) for a in argv[:3]):
                found.append(pid)
        return sorted(found)

    def master_pid(self) -> int:
        """The master's pid, from ``$queue_directory/pid/master.pid``.

        Counting processes named ``master`` is not enough: for an instant after each
        fork, the child that will become pickup or qmgr still runs master's image.
        """
        with open(os.path.join(self.queue_dir, "pid", "master.pid")) as f:
            return int(f.read().split()[0])

    def qmgr_pid(self, timeout: float = 10) -> int:
        """The pid of the running qmgr process, waiting for master to start one."""
        pids: list[int] = []

        def present() -> bool:
            pids[:] = self.pids("qmgr")
            return len(pids) == 1

        self.wait_until(present, timeout, "exactly one qmgr process")
        return pids[0]
