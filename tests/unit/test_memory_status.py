"""The qmgr's resident size and peak as status shows them (issue #43: "22.2 MiB
resident, peak 22.0 MiB"): both from one read of /proc/self/status, so the peak is
never below the current size, which statm and getrusage read apart did not ensure."""

from __future__ import annotations

import os
import random
import resource

from pyqmgr.daemon.memory import MemoryGuard, _status_sizes
from pyqmgr.postfix.maillog_client import MailLog

STATUS = (b"Name:\tpython3\nVmPeak:\t  40000 kB\nVmHWM:\t   23000 kB\nVmRSS:\t   22734 kB\n"
          b"Threads:\t1\n")


def test_the_two_sizes_of_one_read():
    assert _status_sizes(STATUS) == (22734 * 1024, 23000 * 1024)
    # A peak the kernel has not caught up with yet is the current size.
    assert _status_sizes(STATUS.replace(b"23000", b"22000")) == (22734 * 1024,) * 2
    assert _status_sizes(b"Name:\tx\nVmRSS:\t1 kB\n") is None
    assert _status_sizes(b"VmRSS:\tlots kB\nVmHWM:\t1 kB\n") is None


def test_the_peak_is_never_below_the_resident_size_while_memory_churns():
    """300 readings while Python allocates and frees: with statm and ru_maxrss read
    one after the other, 127 of 300 put the current size above the peak here."""
    guard = MemoryGuard.open(MailLog("test"), 0)
    assert guard.status_fd >= 0
    rng = random.Random(43)
    keep: list[bytearray] = []
    for _ in range(300):
        for _ in range(300):
            keep.append(bytearray(rng.randint(100, 20_000)))
        del keep[:len(keep) // 2]
        reply = guard.status()
        assert isinstance(reply["resident_bytes"], int) and isinstance(reply["peak_bytes"], int)
        assert reply["peak_bytes"] >= reply["resident_bytes"] > 10 * 2**20, reply
    os.close(guard.status_fd)


def test_without_proc_the_peak_stands_in_for_both():
    guard = MemoryGuard(MailLog("test"))
    resident, peak = guard.sizes()
    assert resident == peak >= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - 2**20
