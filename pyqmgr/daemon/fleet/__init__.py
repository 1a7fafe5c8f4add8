"""The daemon's side of a fleet of servers sharing their limits in Redis (#23, #31, #35).

Built only with ``shared_state`` in pyqmgr.cf; the pure halves every side shares (the
settings, the Redis client and scripts, the roster's records, the session timings the
simulator also uses) are in :mod:`pyqmgr.fleet`. Here, one module per concern:

- ``node``: :class:`Fleet`, this server's part: a fleet session and a rate slot asked
  of Redis before each delivery, given back (or handed on) after it, and what happens
  when Redis is slow or gone; what it needs of the daemon is :class:`FleetHost`;
- ``units``: each transport's fleet limits per destination and per site, read once;
- ``news``: dead destinations and throttling told to and heard from the other servers;
- ``suspensions``: this server's part of the fleet's operator suspensions table;
- ``roster``: the roster of servers: publish this one's record, read the others',
  obey the stricter settings where they differ;
- ``stats``: round trips, errors and the last good answer from Redis;
- ``metrics``: the fleet's Prometheus series (imported only with metrics on, by
  :mod:`pyqmgr.daemon.metrics_exporter`: importing this package does not load it).
"""

from __future__ import annotations

from pyqmgr.daemon.fleet.node import Fleet, FleetHost

__all__ = ["Fleet", "FleetHost"]
