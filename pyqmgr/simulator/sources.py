"""Source pools and warm-up plans in the simulator (issue #46): a plan tried first.

A scenario sets pools as pyqmgr.cf does (``[pyqmgr_cf] source_pools``,
``<pool>_sources``, ``source_pool_maps``, ``source_warmup_plan``: a path relative to
the scenario file, ``<source>_source_warmup_start``), read by the daemon's own
:func:`pyqmgr.settings.sources.source_settings`; each member is a
``[transports.NAME]`` of the scenario (its master.cf service). As its recipients are
read, each is routed as the daemon routes it, by the same
:class:`~pyqmgr.scheduler.source_route.SourceRouter`: the pool of its message's class
or tenant, :meth:`SourceBook.choose <pyqmgr.scheduler.source.SourceBook.choose>` with
the destination's site as the core knows it then (a domain not looked up yet has none
and goes warm, as in the daemon), and the reservation's life through the core's scope
chain. The wall clock a plan counts in is the scenario's ``date`` plus the virtual
clock, so a run gives the same counts every time.

The remote side: ``[destinations.NAME.sources.SRC]`` gives a server rules for one
source (:class:`~pyqmgr.simulator.scenario.SourceRule`), counted per server (MX host)
and source as a provider keeps reputation per sending address: ``day_limit``
recipients a UTC day, beyond which a session gets ``421 4.7.28``, and a rate of
sessions. Enough to A/B a plan: a steep one earns the 421s a gentle one does not.

What it reports (:func:`summary_lines`, and ``sources`` in ``--json``): recipients
per source and site, sent, deferred after a try, held without one (the source at that
site throttled or dead: the retry transport) and bounced; each window's counts of the
cold sources against their allowance; what waited or went warm for want of a site;
what each provider refused.
"""

from __future__ import annotations

import datetime
import math
import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pyqmgr.pyqmgr_cf import PyqmgrCf, PyqmgrCfError
from pyqmgr.scheduler.core import ERROR, RETRY, Route
from pyqmgr.scheduler.source import DAY
from pyqmgr.scheduler.source_route import SourceRouter
from pyqmgr.settings.sources import MAPS, PLAN, SourceSettings, source_settings
from pyqmgr.simulator.classes import absolute_spec
from pyqmgr.simulator.remote import server_of
from pyqmgr.simulator.scenario import ScenarioError

if TYPE_CHECKING:
    from pyqmgr.postfix.config import QmgrConfig
    from pyqmgr.scheduler.core import Scheduler
    from pyqmgr.scheduler.entry import Entry
    from pyqmgr.scheduler.message import Message
    from pyqmgr.settings.classes import Classifier
    from pyqmgr.simulator.remote import Remote
    from pyqmgr.simulator.scenario import Destination, Scenario

#: The report's name for recipients no source took (they waited: overflow wait).
NO_SOURCE = "(none)"


class Host(Protocol):
    """What the pools need of the engine: its clock and its servers."""

    @property
    def now(self) -> float: ...

    @property
    def remote(self) -> Remote: ...


def scenario_sources(sc: Scenario, section: str, sched: Scheduler, cfg: QmgrConfig,
                     classes: Classifier | None, host: Host) -> SimSources | None:
    """The scenario's pools, routing on ``sched``, their servers' rules on the
    host's; None when it sets none. Bad settings: ScenarioError, named as
    ``pyqmgr_cf.NAME``."""
    values = dict(sc.pyqmgr_cf)
    if values.get(PLAN, "").strip() and values[PLAN].strip().lower() != "none":
        plan = values[PLAN].strip()
        values[PLAN] = os.path.normpath(os.path.join(sc.base_dir, plan))
    if MAPS in values:
        values[MAPS] = ", ".join(absolute_spec(spec.strip(), sc.base_dir)
                                 for spec in values[MAPS].split(",") if spec.strip())
    commands = {d.transport: "smtp" for d in sc.destinations.values()}
    commands.update({t: "smtp" for t in sc.process_limits})
    try:
        settings = source_settings(PyqmgrCf(section, True, values), commands)
    except PyqmgrCfError as exc:
        text = str(exc).replace(": parameter ", ".", 1)
        if "is not a unix service in master.cf" in text:
            text += " (a scenario names its services as [transports.NAME])"
        raise ScenarioError(text) from None
    ruled = sorted({(d.name, s) for d in sc.destinations.values() for s in d.sources})
    if settings is None:
        if ruled:
            raise ScenarioError(f"destinations.{ruled[0][0]}.sources: rules for a source "
                                f"need {section}.source_pools", ("destinations", ruled[0][0]))
        return None
    members = {m for pool in settings.pools.values() for m, _ in pool}
    for name, source in ruled:
        if source not in members:
            raise ScenarioError(f"destinations.{name}.sources.{source}: not a member of a "
                                "pool (source_pools)", ("destinations", name, "sources", source))
    if sc.fleet_servers > 1:
        raise ScenarioError("source pools are not simulated with [fleet] servers yet",
                            ("fleet",))
    epoch = sc.date if sc.date is not None else max(settings.starts.values(), default=0.0)
    sources = SimSources(settings, sched, cfg, classes, epoch, lambda: host.now)
    host.remote.provider = sources.provider
    return sources


@dataclass
class Row:
    """Recipients of one source at one site, by how their try ended."""

    sent: int = 0
    deferred: int = 0
    held: int = 0
    bounced: int = 0


@dataclass
class ProviderRules:
    """The destinations' servers' rules per source (``[destinations.N.sources.S]``)."""

    epoch: float
    #: (server, source) -> session starts in the last second.
    starts: dict[tuple[str, str], deque[float]] = field(default_factory=dict)
    #: (server, source) -> (UTC day, recipients taken that day).
    days: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    #: (source, server, reply) -> [sessions, recipients] refused.
    refused: dict[tuple[str, str, str], list[int]] = field(default_factory=dict)

    def refusal(self, dest: Destination, source: str, recipients: int,
                now: float) -> str | None:
        """The reply a session from ``source`` gets at ``dest``'s server now, None:
        served (and counted)."""
        rule = dest.sources.get(source)
        if rule is None:
            return None
        key = (server_of(dest), source)
        text = None
        if rule.rate_limit > 0:
            starts = self.starts.setdefault(key, deque())
            while starts and starts[0] <= now - 1.0:
                starts.popleft()
            if len(starts) >= rule.rate_limit:
                text = rule.rate_reply
            else:
                starts.append(now)
        if text is None and rule.day_limit > 0:
            day = math.floor((self.epoch + now) / DAY)
            was, taken = self.days.get(key, (day, 0))
            taken = taken if was == day else 0
            if taken >= rule.day_limit:
                text = rule.day_reply
            else:
                self.days[key] = (day, taken + recipients)
        if text is not None:
            counts = self.refused.setdefault((source, key[0], text), [0, 0])
            counts[0] += 1
            counts[1] += recipients
        return text


class SimSources:
    """The pools' choice as a scenario's recipients are read, and what it gave."""

    def __init__(self, settings: SourceSettings, sched: Scheduler, cfg: QmgrConfig,
                 classes: Classifier | None, epoch: float,
                 clock: Callable[[], float]) -> None:
        self.epoch = epoch
        self.clock = clock
        self.cfg = cfg
        self.sched = sched
        self.router = SourceRouter(settings.book(), settings,
                                   list(classes.classes) if classes else None, sched,
                                   lambda: epoch + clock(), lambda: None)
        self.book = self.router.book
        self.provider = ProviderRules(epoch)
        #: (source, site) -> recipients by how they ended.
        self.rows: dict[tuple[str, str], Row] = {}
        #: Each ended window's cold counts: (its first second, [(source, site, n)]).
        self.history: list[tuple[float, list[tuple[str, str, int]]]] = []
        #: The source each routed recipient went to, until its try ends.
        self.chosen: dict[int, str] = {}

    def route(self, message: Message, batch: Sequence[Route]) -> list[Route]:
        """The batch's recipients routed as the daemon routes them after
        trivial-rewrite, sorted by transport and queue as the core wants them. The
        message's own routes keep trivial-rewrite's transport: a retry is routed
        afresh."""
        self._roll()
        out = []
        for r in batch:
            transport, nexthop = self.router.route(message, r.recipient, r.transport,
                                                   r.nexthop)
            if transport == r.transport:
                out.append(r)
                continue
            if transport != RETRY:
                self.chosen[id(r.recipient)] = transport
            queue = nexthop
            if (transport != RETRY
                    and self.cfg.transport(transport).destination_recipient_limit == 1):
                queue = r.recipient.address
            out.append(Route(transport, queue, nexthop, r.recipient))
        out.sort(key=lambda r: (r.transport, r.queue_name))
        return out

    def _roll(self) -> None:
        """Keep a window's cold counts before the book starts the next one."""
        plan = self.book.plan
        if plan is None or self.book.window < 0:
            return
        if int((self.epoch + self.clock()) // plan.window) != self.book.window:
            self.history.append(self._window_counts())

    def _window_counts(self) -> tuple[float, list[tuple[str, str, int]]]:
        assert self.book.plan is not None
        return (self.book.window * self.book.plan.window,
                sorted((s, site, n) for (s, site), n in self.book.counts.items()))

    def site_of(self, dest: str) -> str:
        """The site a destination's deliveries are reported at: as the core knows it."""
        table = self.sched.sites
        if table is not None:
            pin = table.pinned.get(dest)
            known = table.known.get(dest)
            if pin is not None or known is not None:
                return pin or known[0]  # type: ignore[index]
        return dest

    def finished(self, entry: Entry, dest: str, outcome: str,
                 replies: list[str] | None) -> None:
        """A try ended: its recipients counted at their source and site."""
        name = entry.queue.transport.name
        site = self.site_of(dest)
        for i, r in enumerate(entry.recipients):
            source = self.chosen.pop(id(r), NO_SOURCE if name in (RETRY, ERROR) else name)
            row = self.rows.setdefault((source, site), Row())
            if name == RETRY:
                row.held += 1
            elif name == ERROR or outcome == "bounced":
                row.bounced += 1
            elif outcome != "sent":
                row.deferred += 1
            elif replies is None or replies[i] == "2xx":
                row.sent += 1
            elif replies[i] == "4xx":
                row.deferred += 1
            else:
                row.bounced += 1

    def summary(self) -> dict[str, Any]:
        """What the report shows, as ``--json``'s ``sources``."""
        book = self.book
        now = self.epoch + self.clock()
        windows = [*self.history, self._window_counts()] if book.window >= 0 else []
        status = book.status(now) if book.window >= 0 else book.status(self.epoch)
        return {
            "date": _iso(self.epoch),
            "window": book.plan.window_name if book.plan is not None else None,
            "pools": status["pools"],
            "per_source_site": [{"source": s, "site": site, "sent": r.sent,
                                 "deferred": r.deferred, "held": r.held,
                                 "bounced": r.bounced}
                                for (s, site), r in sorted(self.rows.items())],
            "cold_counts": [{"window": _iso(start), "source": s, "site": site,
                             "counted": n, "allowance": book.allowance(s, start),
                             "age_days": book.age_days(s, start)}
                            for start, counts in windows for s, site, n in counts],
            "waited": book.waited, "unknown_site": book.unknown_site,
            "refused": [{"source": s, "server": server, "reply": reply,
                         "sessions": n[0], "recipients": n[1]}
                        for (s, server, reply), n in sorted(self.provider.refused.items())],
        }


def _iso(when: float) -> str:
    return datetime.datetime.fromtimestamp(when, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _member(m: dict[str, Any], window: str | None) -> str:
    """A pool member as ``pyqmgr status`` names it, at the run's end."""
    if m["age_days"] is None:
        return str(m["source"])
    if m["allowance"] is None:
        return f"{m['source']} (warm by its plan, day {m['age_days']})"
    return f"{m['source']} (cold, day {m['age_days']}, {m['allowance']} a site this {window})"


def summary_lines(doc: dict[str, Any]) -> list[str]:
    """The report's source part: the pools, each source and site's recipients, the
    cold sources' counts against their allowance, what waited, what was refused."""
    out = []
    for name, members in doc["pools"].items():
        out.append(f"source pool {name}: " + ", ".join(_member(m, doc["window"])
                                                       for m in members))
    rows = doc["per_source_site"]
    width = max([6] + [len(r["source"]) for r in rows])
    swidth = max([4] + [len(r["site"]) for r in rows])
    out.append(f"{'source':<{width}} {'site':<{swidth}} {'sent':>8} {'deferred':>8} "
               f"{'held':>8} {'bounced':>8}")
    for r in rows:
        out.append(f"{r['source']:<{width}} {r['site']:<{swidth}} {r['sent']:>8} "
                   f"{r['deferred']:>8} {r['held']:>8} {r['bounced']:>8}")
    for c in doc["cold_counts"]:
        allowance = "no limit" if c["allowance"] is None else f"{c['allowance']}"
        out.append(f"warm-up {c['window']}: {c['source']} at {c['site']} counted "
                   f"{c['counted']} of {allowance} (day {c['age_days']})")
    out.append(f"sources: {doc['waited']} recipients waited (no source could take them), "
               f"{doc['unknown_site']} went warm before their site was known")
    for f in doc["refused"]:
        out.append(f"refused: {f['source']} at {f['server']}: {f['sessions']} sessions, "
                   f"{f['recipients']} recipients: {f['reply']}")
    return out
