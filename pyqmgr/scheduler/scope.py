"""A delivery's scopes beyond its destination, reached by one road (issue #44).

Stock counts a delivery in its destination queue and its transport. pyqmgr adds
scopes that several destinations share: a provider's site (:mod:`.site`), a tenant at
a destination or at a site (:mod:`.tenant_cap`), a cold source's warm-up counts
(:func:`.source.source_kinds`, issue #46).
Each counts the deliveries in it, and each may close when full and open when one
ends. Before this module each had its own hook in :mod:`.entry` and :mod:`.deliver`,
with its own ``None`` check and ordering comment; now a scope kind is one
:class:`~.structures.ScopeKind` (its verbs, kept beside its structure), a queue carries the kinds
it belongs to (:attr:`~.structures.Queue.chain`: its site's, set when it joins one)
and a transport the kinds every delivery of it passes (:attr:`~.structures.Transport.chain`:
the tenant caps'), and the entry verbs walk the chain.

The walk's order is the chain's, and its phases are the ones every scope needs:

* :func:`scopes_started` when an agent takes the delivery (a site may fill), and
  :func:`scopes_unselected` when it never left after all;
* :func:`scopes_ended` when the delivery ends or its entry goes (counted down,
  staged work released), before the destination may go idle and be discarded;
* the kinds that asked for it then settle (:func:`scopes_settle`), after the
  destination's own state is synced: a full scope with room again opens.

A scope has one name wherever it is named: a destination its queue's name, a site
``structures.SITE_SCOPE`` and its name (``site google``: tenant caps' counts, the
fleet's units in Redis and on its channels, explain's text), a tenant at one of them
the tenant and that name. A queue name never holds a space, so no destination is
ever taken for a site. The control commands' target grammar writes the same site
``site:google`` (:mod:`.suspension`), parsed into that name; the metrics label it
``site="google"``. The fleet's Redis keys are made from the unit name by one function
(``fleet.shared.Shared.key``: ``site-sessions:smtp:google`` beside a destination's
``sessions:smtp:example.com``): a storage layout that running fleets share, kept as it
is so that a rolling upgrade never counts a site's sessions under two keys.

With nothing configured both chains are the empty tuple, and a walk is a loop over
nothing: stock's drain pays nothing for them (``bench drain``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyqmgr.scheduler.structures import ScopeKind

if TYPE_CHECKING:
    from pyqmgr.scheduler.state import Core
    from pyqmgr.scheduler.structures import Entry

__all__ = ["ScopeKind", "nothing", "nothing_to_settle", "scopes_ended", "scopes_settle",
           "scopes_started", "scopes_unselected"]


def scopes_started(core: Core, entry: Entry) -> None:
    for kind in entry.queue.chain:
        kind.started(core, entry)
    for kind in entry.queue.transport.chain:
        kind.started(core, entry)


def scopes_unselected(core: Core, entry: Entry) -> list[ScopeKind]:
    """Count a delivery that never left out of every scope; the kinds to settle."""
    settle: list[ScopeKind] = []
    for kind in entry.queue.chain:
        if kind.unselected(core, entry):
            settle.append(kind)
    for kind in entry.queue.transport.chain:
        if kind.unselected(core, entry):
            settle.append(kind)
    return settle


def scopes_ended(core: Core, entry: Entry, busy: bool) -> list[ScopeKind]:
    """Count the entry out of every scope; the kinds that must settle afterwards."""
    settle: list[ScopeKind] = []
    for kind in entry.queue.chain:
        if kind.ended(core, entry, busy):
            settle.append(kind)
    for kind in entry.queue.transport.chain:
        if kind.ended(core, entry, busy):
            settle.append(kind)
    return settle


def scopes_settle(core: Core, entry: Entry, kinds: list[ScopeKind]) -> None:
    for kind in kinds:
        kind.settle(core, entry)


def nothing(core: Core, entry: Entry) -> None:
    """For a kind with nothing to do at a step (its ``started``, its ``settle``)."""


def nothing_to_settle(core: Core, entry: Entry) -> bool:
    """For a kind that counts nothing at a step (its ``unselected``)."""
    return False
