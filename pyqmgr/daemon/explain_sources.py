"""What ``pyqmgr explain TRANSPORT:DESTINATION`` says of a source (issue #46).

A source is an smtp service of master.cf in a pool (docs/sources.md): why its mail
to a destination is what it is (its share of the pool, or a cold source's count at
the site against its allowance this window) is not the destination's state in core,
so it is said beside it, and also when nothing of that source's is in core now (the
question then is most often "why does src1 send nothing to Google?").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pyqmgr.scheduler.policy import reason
from pyqmgr.scheduler.site import site_domain
from pyqmgr.scheduler.source import OVERFLOW_WAIT

if TYPE_CHECKING:
    from pyqmgr.scheduler.source import SourceBook


def source_reasons(book: SourceBook, target: str, reply: dict[str, object], now: float,
                   site_of: Callable[[str], str | None]) -> dict[str, object]:
    """``reply`` with the reason of ``target``'s source, when its transport is a pool
    member; a reply that found nothing in core becomes the destination's, with it.
    ``site_of``: the site a next hop's count is kept at, as routing names it."""
    transport, sep, nexthop = target.partition(":")
    if not sep or not nexthop or transport not in book.members:
        return reply
    listed = reply.get("destinations")
    found = [d for d in listed if isinstance(d, dict)] if isinstance(listed, list) else []
    site = site_of(nexthop) or next((str(d["site"]) for d in found if d.get("site")),
                                    None) or site_domain(nexthop) or nexthop.lower()
    said = _source_reason(book, transport, site, now)
    if reply.get("kind") == "unknown":
        return {"target": target, "kind": "destination", "destinations": [],
                "reasons": [said, reason("nothing in core", "",
                                         f"no mail of {transport} for {nexthop} is in the "
                                         "active queue now")]}
    reasons = reply.get("reasons")
    if isinstance(reasons, list):
        reasons.append(said)
    return reply


def _source_reason(book: SourceBook, source: str, site: str, now: float) -> dict[str, object]:
    book.roll(now)
    pools = [p for p in book.pools.values() if source in p.members]
    shares = ", ".join(
        f"pool {p.name} (weight {p.weights[p.members.index(source)]} of {sum(p.weights)})"
        for p in pools)
    allowance = book.allowance(source, now)
    if allowance is None:
        return reason("source", "source_pools",
                      f"{source} is a warm source of {shares}: it takes its weight's share "
                      "of the pool's mail")
    plan = book.plan
    assert plan is not None
    counted = book.counts.get((source, site), 0)
    beyond = ("waits (overflow wait)" if plan.overflow == OVERFLOW_WAIT
              else "goes to its warm sources")
    state = "its allowance is used up" if counted >= allowance else "it takes its share"
    return reason("warm-up", "source_warmup_plan",
                  f"{source} is a cold source of {shares}, day {book.age_days(source, now)} "
                  f"of its plan: {counted} of its {allowance} recipients at site {site} "
                  f"this {plan.window_name} counted, so {state}; beyond the allowance its "
                  f"share of the pool's mail {beyond}",
                  site=site, counted=counted, allowance=allowance)


__all__ = ["source_reasons"]
