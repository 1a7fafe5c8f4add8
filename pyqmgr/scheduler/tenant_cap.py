"""A tenant's cap at a destination: ``tenant_concurrency_limit`` (issue #34).

One tenant's flood can take every session a destination gives the relay, and its
throttling then falls on everyone. ``tenant_concurrency_limit = N`` (per transport by
Postfix's naming rule: ``smtp_tenant_concurrency_limit``) lets each tenant have at
most N entries (deliveries under way or waiting for an agent) at one destination; its
further mail for there waits in a staging queue of the transport ``pyqmgr-held``
(named ``+TENANT TRANSPORT:QUEUE``, beside the suspended tenants' queues of
:mod:`.tenant_hold`), and each of its entries there that ends brings one back, oldest
first: O(1) a delivery. The destination's window, and every other tenant's mail,
are untouched; a tenant's share of a destination is its own cap, not a slice of the
window.

A destination that dies while a tenant's mail is staged for it sends that mail to
the retry transport with its own, as new mail would be; a tenant suspended there
(:mod:`.tenant_hold`) takes its staged mail with it, and what comes back is capped
again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pyqmgr.scheduler.held import HELD, held_queue_for
from pyqmgr.scheduler.structures import ERROR, RETRY, TenantCaps

if TYPE_CHECKING:
    from pyqmgr.scheduler.message import Message
    from pyqmgr.scheduler.state import Core
    from pyqmgr.scheduler.structures import Queue

PARAM = "tenant_concurrency_limit"


def caps_for(setting: Callable[[str, str, str], str], transport: str) -> TenantCaps | None:
    """The transport's cap from pyqmgr.cf (``setting``: the scheduler's; a bad value
    is a start-up error, daemon/classes.py, and never gets here)."""
    if transport in (RETRY, ERROR, HELD):
        return None
    text = setting(PARAM, transport, "0").strip()
    limit = int(text) if text.isdigit() else 0
    return TenantCaps(limit) if limit > 0 else None


def capped_queue(core: Core, message: Message, queue: Queue) -> Queue:
    """Where a new entry of the message's tenant for ``queue`` goes: ``queue`` while
    the tenant has fewer than the cap there, else its staging queue."""
    caps = queue.transport.tenant_caps
    if caps is None or not message.tenant:
        return queue
    if caps.counts.get((message.tenant, queue.name), 0) < caps.limit:
        return queue
    return held_queue_for(core, message.tenant, queue, staged=True)


def made(queue: Queue, message: Message) -> None:
    """A new entry of the message's tenant landed in ``queue``: count it."""
    caps = queue.transport.tenant_caps
    if caps is not None and message.tenant:
        key = (message.tenant, queue.name)
        caps.counts[key] = caps.counts.get(key, 0) + 1
