"""A deterministic simulator: the scheduler core on a virtual clock.

The same :class:`pyqmgr.scheduler.core.Scheduler` the daemon uses makes every decision;
the simulator plays everything else: messages arriving, delivery processes with
master.cf process limits, and destinations with latency, server session limits that
answer 421, congestion timeouts, or no server at all. Scenario files are TOML
(:mod:`.scenario`), the run is :mod:`.engine` (its messages arriving
:mod:`.arrivals`, the destinations' servers :mod:`.remote`, what it produced
:mod:`.result`), a fleet of servers sharing limits :mod:`.fleet`, the printed report
:mod:`.report`.
"""

from pyqmgr.simulator.engine import Result, simulate
from pyqmgr.simulator.scenario import Scenario, load

__all__ = ["Result", "Scenario", "load", "simulate"]
