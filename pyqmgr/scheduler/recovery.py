"""Deferred-mail recovery's half in the core: which mail waits for which destination.

pyqmgr.cf's ``deferred_recovery_rate`` (the daemon's :mod:`pyqmgr.daemon.retry`) brings
deferred mail forward when the destination it waited for delivers again. The core
cannot see the deferred queue; it only knows, as it happens, that a recipient went to
the retry transport (or the defer log) because its destination or transport was dead,
that a delivery failed at the site, or that a reply was throttling, and later that the
destination delivered. These verbs note that as decisions (``waits``, ``recovered``)
and keep the watched destinations, at most :data:`RECOVERY_WATCH_LIMIT`; the daemon
keeps the queue ids. Off (``Core.recovery_watch`` None), none of it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyqmgr.scheduler.structures import Dsn

if TYPE_CHECKING:
    from pyqmgr.scheduler.message import Message
    from pyqmgr.scheduler.state import Core
    from pyqmgr.scheduler.structures import Queue

#: The prefix of a dead site's reason, as stock words it.
SITE_SUSPENDED = "delivery temporarily suspended: "
#: Destinations watched at most. Beyond this many dead or throttled at once, the
#: others' deferred mail simply waits for its retry time, as in stock: recovery is an
#: optimisation, never a duty.
RECOVERY_WATCH_LIMIT = 10_000


def why(dsn: Dsn, rule: str | None = None) -> str:
    """Why a destination is watched for recovery, as its log line will say."""
    text = f"{dsn.status} {dsn.reason.removeprefix(SITE_SUSPENDED)}"
    if len(text) > 200:
        text = text[:197] + "..."
    if rule is not None:
        return f'a throttling reply "{text}" matched {rule}'
    return f"it was dead ({text})"


def watch(core: Core, transport: str, name: str, why: str) -> None:
    watch = core.recovery_watch
    assert watch is not None
    if (transport, name) not in watch and len(watch) < RECOVERY_WATCH_LIMIT:
        watch[(transport, name)] = why


def wait(core: Core, message: Message, transport: str, name: str, why: str | None) -> None:
    """``message`` waits for destination (transport, name); ``why``: it is dead or
    throttled, so watch it too. A message's recipients come sorted by destination:
    only the first of a run is noted."""
    waits = core.out.waits
    last = waits[-1] if waits else None
    if last is None or last[0] is not message or last[1] != transport or last[2] != name:
        waits.append((message, transport, name))
    if why is not None:
        watch(core, transport, name, why)


def delivered_again(core: Core, queue: Queue) -> None:
    """A delivery succeeded: a watched destination is back, unless a throttling
    rule still holds it down (then its mail would only wait in core for the rate)."""
    if queue.shape is not None and queue.shape.rule is not None:
        return
    watch = core.recovery_watch
    assert watch is not None
    why = watch.pop((queue.transport.name, queue.name), None)
    if why is not None:
        core.out.recovered.append((queue.transport.name, queue.name, queue.nexthop, why))
