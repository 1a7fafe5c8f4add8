"""A transport: one master.cf delivery service and its queues (``qmgr_transport.c``).

Holds the transport's parameters (looked up by the configuration layer with stock's
``<transport>_*`` then ``default_*`` rule, see :class:`TransportParams`), its parsed
feedback, its destination queues by name, which of them could take a delivery now
(the allocation test), and its scheduling policy (:mod:`.policy`), which keeps its own
per-transport state (nqmgr's job lists, oqmgr's round-robin list, ...). A transport
whose agent cannot be reached is "dead" for ``transport_retry_time``; while dead, its
mail goes to the retry transport.

The structure is declared in :mod:`.structures`, beside the structures it names; this
module is where code asks for it by this name.
"""

from __future__ import annotations

from pyqmgr.scheduler.structures import MAX_PENDING, Transport, TransportParams

__all__ = ["MAX_PENDING", "Transport", "TransportParams"]
