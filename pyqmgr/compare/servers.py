"""The Postfix servers of one compare run: one, or a fleet of N (``[fleet] servers``).

A fleet is N test-bed instances on loopback against the same sinks, each submitted
every N-th message of the workload in turn, as a load balancer would deal them. For
pyqmgr contenders they share one redis-server (``shared_state``, each its own
``shared_state_node``) and so the scenario's fleet limits; Postfix's own queue
managers have nothing to share and schedule each alone, which is the comparison
issue #23 asks for. The run is reported as one sender's: one maillog (the servers'
lines merged in time order), the qmgrs' CPU added up, every message's queue id.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from pyqmgr.output import open_new
from pyqmgr.testbed.instance import PostfixInstance

if TYPE_CHECKING:
    from pyqmgr.compare.plan import Arrival
    from pyqmgr.testbed.maillog import LogLine
    from pyqmgr.testbed.redis import RedisServer


class QmgrMeter(Protocol):
    """What is read of one server's qmgr (runner.py's QmgrMeter)."""

    def settle(self, timeout: float = 10.0) -> None: ...
    def sample(self) -> None: ...
    def record(self) -> dict[str, Any]: ...


class Submitter(Protocol):
    """What submits one server's share of the workload (runner.py's Submitter)."""

    lock: threading.Lock
    done: dict[int, tuple[str, float]]
    errors: list[str]

    def start(self) -> None: ...
    def finished(self) -> bool: ...
    def close(self) -> None: ...


def fleet_cf(pyqmgr_cf: dict[str, str] | None, redis: RedisServer | None,
             k: int) -> dict[str, str] | None:
    """Server ``k``'s pyqmgr.cf: the contender's, with the fleet's shared state."""
    if redis is None or pyqmgr_cf is None:
        return pyqmgr_cf
    return {**pyqmgr_cf, **redis.fleet_cf(f"server{k}")}


class Servers:
    """The instances, their submitters and their qmgr meters, used as one."""

    def __init__(self, pfs: list[PostfixInstance], redis: RedisServer | None) -> None:
        self.pfs = pfs
        self.redis = redis
        self.submitters: list[Submitter] = []
        self.meters: list[QmgrMeter] = []
        #: Shell words before each ``postfix start``: a DNS server's mount namespace
        #: when the workload routes by MX records (runner.py), else nothing.
        self.prefix = ""

    def start(self, meter: Callable[[PostfixInstance], QmgrMeter]) -> None:
        for pf in self.pfs:
            pf.start(prefix=self.prefix)
        for pf in self.pfs:
            m = meter(pf)
            m.settle()
            self.meters.append(m)

    def submit(self, submitter: Callable[[int, list[Arrival], float], Submitter],
               arrivals: list[Arrival], t0: float) -> None:
        n = len(self.pfs)
        self.submitters = [submitter(pf.smtpd_port, arrivals[k::n], t0)
                           for k, pf in enumerate(self.pfs)]
        for s in self.submitters:
            s.start()

    def new_lines(self) -> list[LogLine]:
        return [ln for pf in self.pfs for ln in pf.maillog.refresh()]

    def sample(self) -> None:
        for m in self.meters:
            m.sample()

    def finished(self) -> bool:
        return all(s.finished() for s in self.submitters)

    @property
    def errors(self) -> list[str]:
        return [e for s in self.submitters for e in s.errors]

    def done(self) -> dict[int, tuple[str, float]]:
        out: dict[int, tuple[str, float]] = {}
        for s in self.submitters:
            with s.lock:
                out.update(s.done)
        return out

    def qmgr_record(self) -> dict[str, Any]:
        """The qmgrs' figures as one: CPU added up, the largest peak memory."""
        parts = [m.record() for m in self.meters]
        if len(parts) == 1:
            return parts[0]
        return {"cpu_s": round(sum(p["cpu_s"] for p in parts), 6),
                "vmhwm_kib": max(p["vmhwm_kib"] for p in parts),
                "pids": sorted(pid for p in parts for pid in p["pids"]),
                "samples": sum(p["samples"] for p in parts), "servers": len(parts)}

    def close_submitters(self) -> None:
        for s in self.submitters:
            s.close()
        self.submitters = []

    def stop(self) -> None:
        for pf in self.pfs:
            pf.stop()

    def keep_maillog(self, path: str) -> None:
        """One maillog for the run: each server's lines, merged in time order (the
        syslog time stamp, whole seconds; a server's own order kept within one)."""
        if len(self.pfs) == 1:
            pf = self.pfs[0]
            if os.path.exists(pf.maillog_path):
                with open(pf.maillog_path, "rb") as src, open_new(path, "wb") as dst:
                    dst.write(src.read())
            return
        lines: list[tuple[str, int, bytes]] = []
        for k, pf in enumerate(self.pfs):
            if not os.path.exists(pf.maillog_path):
                continue
            with open(pf.maillog_path, "rb") as f:
                lines += [(ln[:15].decode("ascii", "replace"), k, ln) for ln in f]
        lines.sort(key=lambda t: t[0])
        with open_new(path, "wb") as f:
            f.writelines(ln if ln.endswith(b"\n") else ln + b"\n" for _, _, ln in lines)

    def close(self, keep: bool) -> list[str]:
        """Stop everything; the instances' directories when kept, else removed."""
        kept = []
        try:
            for pf in self.pfs:
                if keep:
                    pf.stop()
                    kept.append(pf.root)
                else:
                    pf.close()
        finally:
            if self.redis is not None:
                self.redis.stop()
        return kept
