"""How a server waits for the fleet's sessions: the same in the daemon and the simulator.

The daemon's fleet (:mod:`pyqmgr.daemon.fleet`) and the simulator's
(:mod:`pyqmgr.simulator.fleet`) hold a destination back under the same gate, ask again
after the same time, and give a spare session back after the same wait, so that a
simulated fleet answers what the real one would. Pure values: the simulator takes
them from here without loading the daemon.
"""

from __future__ import annotations

#: The gate explain shows for a destination the fleet holds back.
GATE_KIND = "fleet"
#: How long a destination whose fleet sessions are all in use waits before it asks
#: again unless handed a session sooner, as a share of the lease time (within
#: :data:`SESSION_RETRY_RANGE`): a session given back goes to the first process
#: waiting for it, so asking again only covers what nobody hands on: a dead node's
#: leases expiring (after the lease time), a lost message.
SESSION_RETRY_SHARE = 0.25
SESSION_RETRY_RANGE = (1.0, 15.0)
#: A session kept or handed for a next delivery that did not start within this long
#: goes back (and on to whoever waits).
SPARE_TIME = 1.0


def session_retry(lease_time: float) -> float:
    """Seconds a refused server waits before it asks the fleet again on its own."""
    lo, hi = SESSION_RETRY_RANGE
    return min(hi, max(lo, lease_time * SESSION_RETRY_SHARE))
