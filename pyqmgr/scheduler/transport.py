"""A transport: one master.cf delivery service and its queues (``qmgr_transport.c``).

Holds the transport's parameters (looked up by the configuration layer with stock's
``<transport>_*`` then ``default_*`` rule, see :class:`TransportParams`), its parsed
feedback, its destination queues by name, which of them could take a delivery now
(the allocation test), and its scheduling policy (:mod:`.policy`), which keeps its own
per-transport state (nqmgr's job lists, oqmgr's round-robin list, ...). A transport
whose agent cannot be reached is "dead" for ``transport_retry_time``; while dead, its
mail goes to the retry transport.

The structure is declared in :mod:`.structures`, beside the structures it names; this
module is where code asks for it by this name, and has the allocation of agents.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyqmgr.scheduler.structures import MAX_PENDING, Transport, TransportParams

if TYPE_CHECKING:
    from pyqmgr.scheduler.state import Core

__all__ = ["MAX_PENDING", "Transport", "TransportParams", "transport_select"]


def transport_select(core: Core) -> str | None:
    """A transport that deserves one more agent connection, counted as pending.

    Stock's ``qmgr_transport_select``: round robin over live transports with fewer
    than two pending connections whose queues hold enough deliverable work.
    """
    node = core.transport_list.head
    while node is not None:
        t = node.item
        if t.wants_agent():
            core.transport_list.rotate(node)
            t.pending += 1
            if t.cfg.transport_rate_delay > 0:
                t.rate_lock = True
            return t.name
        node = node.next
    return None
