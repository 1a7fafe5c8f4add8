"""The qmgr daemon that master(8) starts; ``main`` is the launcher's entry point.

What lives where (no module here imports one that imports it back; each part declares,
as a Protocol, what it needs of the daemon):

- ``startup``: the trigger-server start-up order (``main``), settings read before the
  privilege drop and chroot; ``policies``: pyqmgr.cf's policies, shaping and retry
  settings, settled then;
- ``qmgr``: ``Qmgr``, the event loop: scans, feeding, agent dispatch, and ``apply``, the
  one place the core's decisions are acted on;
- ``active``: the active queue (a message in, its recipients routed, its file finished);
  ``delivery``: one delivery agent connection; ``request``: the delivery request;
- ``retry``: deferred mail's retry jitter and recovery; ``delegation``: asking a delivery
  policy service; ``fleet``, a package: asking the fleet's shared state in Redis
  (leases, rates) before a delivery, its shared throttling, operator suspensions,
  roster and metrics; ``suspensions``: the operators' controls and their state file;
  ``control``: the control socket;
- ``metrics``, ``metrics_exporter``, ``metrics_http``: counts and the Prometheus
  exporter (imported only when on).
"""

from __future__ import annotations


def main(argv: list[str]) -> int:
    """Run as the qmgr service. Imports happen here, before any privilege drop."""
    from pyqmgr.daemon.startup import main as startup_main

    return startup_main(argv)
