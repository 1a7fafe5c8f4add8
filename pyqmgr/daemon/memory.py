"""The qmgr's own memory, visible: its resident size in ``pyqmgr status``, and a warning.

A queue manager runs for months. Issue #30 found pyqmgr's growing by 35 KB a message
and minute while a site was down, where stock's stayed at 12 MiB, and nothing showed
it until the machine ran short. Its memory is bounded now (finished messages leave
no reference cycles: tests/unit/test_no_cycles.py; ``./dev bench deadsite`` watches
it in CI); this module keeps it in sight in production:

* ``pyqmgr status`` shows the resident size and its peak (and the metrics exporter's
  ``process_resident_memory_bytes`` has had it all along);
* with ``memory_warning_limit`` in pyqmgr.cf (bytes, as Postfix writes sizes; 0, the
  default, is off), the qmgr logs a warning once its resident size passes the limit,
  again each hour while it stays over, and an info line when it is back under.

The resident size and its peak come from one read of ``/proc/self/status`` (VmRSS
and VmHWM), opened at start-up before the chroot (the default master.cf chroots the
qmgr, and /proc is not there) and read again through the same descriptor. They must
come from one read: Linux counts a process's pages in per-CPU counters and sums them
only roughly, so ``/proc/self/statm`` and ``getrusage``'s ``ru_maxrss``, read a moment
apart, are two different roughnesses: status once showed ``22.2 MiB resident, peak
22.0 MiB``, and a loop of both reads while Python allocated found statm above the peak
in 127 of 300 reads (by up to 244 KiB), where VmRSS never passed VmHWM. Where /proc
cannot be opened, ``getrusage``'s peak stands in for both.
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
from dataclasses import dataclass

from pyqmgr.postfix.maillog_client import MailLog
from pyqmgr.pyqmgr_cf import PyqmgrCf

LIMIT = "memory_warning_limit"
#: Larger than any machine this runs on: a bigger value is a typo.
MAX_LIMIT = 1 << 50
#: While over the limit, the warning is repeated this often (seconds).
REPEAT = 3600.0


def warning_limit(settings: PyqmgrCf) -> int:
    """``memory_warning_limit`` in bytes (0: off); PyqmgrCfError names a bad value."""
    return settings.get_int(LIMIT, None, 0, 0, MAX_LIMIT)


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@dataclass
class MemoryGuard:
    """Reads the qmgr's resident size and warns past the limit (``check``, each second)."""

    log: MailLog
    limit: int = 0
    #: /proc/self/status, open across the chroot; -1 when it could not be opened.
    status_fd: int = -1
    #: When the last warning was logged (the caller's clock); None: under the limit.
    warned_at: float | None = None

    @classmethod
    def open(cls, log: MailLog, limit: int) -> MemoryGuard:
        """Before the chroot: open what will be read after it."""
        try:
            fd = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            fd = -1
        return cls(log, limit, fd)

    def sizes(self) -> tuple[int, int]:
        """Bytes resident now and at the peak, from one reading: the peak never
        below the current size."""
        if self.status_fd >= 0:
            try:
                found = _status_sizes(os.pread(self.status_fd, 8192, 0))
            except OSError:
                found = None
            if found is not None:
                return found
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return peak, peak

    def peak(self) -> int:
        return self.sizes()[1]

    def resident(self) -> int:
        """Bytes resident now (the peak where /proc is out of reach)."""
        return self.sizes()[0]

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Check once a second from now on, when there is a limit to check."""
        if self.limit:
            loop.call_later(1.0, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self.check(time.monotonic())
        loop.call_later(1.0, self._tick, loop)

    def check(self, now: float) -> None:
        if not self.limit:
            return
        rss = self.resident()
        if rss > self.limit:
            if self.warned_at is None or now - self.warned_at >= REPEAT:
                self.log.warning(f"resident memory {mib(rss)} is over {LIMIT} "
                                 f"({mib(self.limit)}); pyqmgr status shows what is in "
                                 "core")
                self.warned_at = now
        elif self.warned_at is not None:
            self.log.info(f"resident memory {mib(rss)} is back under {LIMIT} "
                          f"({mib(self.limit)})")
            self.warned_at = None

    def status(self) -> dict[str, object]:
        resident, peak = self.sizes()
        return {"resident_bytes": resident, "peak_bytes": peak,
                "warning_limit": self.limit or None}


def _status_sizes(text: bytes) -> tuple[int, int] | None:
    """VmRSS and VmHWM of a /proc/PID/status, in bytes (the kernel writes kB)."""
    found: dict[bytes, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(b":")
        if name in (b"VmRSS", b"VmHWM"):
            parts = value.split()
            if not parts or not parts[0].isdigit():
                return None
            found[name] = int(parts[0]) * 1024
    if len(found) != 2:
        return None
    return found[b"VmRSS"], max(found[b"VmHWM"], found[b"VmRSS"])
