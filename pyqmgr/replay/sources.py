"""Source pools in a replayed maillog (issue #46 item 4: replay A/Bs a warm-up plan).

A relay that sends from several addresses runs one smtp service per address, and
its maillog names each delivery's service when master.cf gives it a syslog_name
(``-o syslog_name=postfix/out11`` logs ``postfix/out11/smtp[123]``). Given the
relay's pool settings (pyqmgr.cf's ``source_pools``, ``<pool>_sources``, the plan and
the start dates, from ``--config-dir`` or ``-o``), the replay reads what each
provider did to each source, per server (the ``relay=`` host, as ``--sites`` groups
them): how many recipients it took from the source in a UTC day before it answered a
rate refusal (``421 4.7.28``, or any reply the shipped categories call
``rate_limited``), which becomes the scenario's
``[destinations.X.sources.SRC] day_limit`` and ``day_reply``. A source the provider
refused now and then while it took more of its sessions afterwards met a rate, not a
day's volume: its ``rate_limit`` is the most sessions a second the source had
accepted there.

Those refusals belong to the source, not to the recipient: a recipient refused from
the cold address would have been taken from a warm one. So they leave the
recipients' scripts and the destination's shares of 4xx answers, and the server's
rule for that source plays them in the simulation, for whichever source each
contender's plan picks. The pool members become the workload's ``[transports.X]``,
the destinations go back to the pool's transport (trivial-rewrite's ``smtp``), the
settings go to ``[pyqmgr_cf]`` and the workload's ``date`` is the log's first
second, so that the plan's day in the simulation is the day the log was written.

What is kept while reading is a few numbers per recipient of a pool member (its
session's start), never a line. Without pool settings nothing here runs and the
replay is as it was.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from array import array
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pyqmgr.pyqmgr_cf import PyqmgrCf
from pyqmgr.scheduler.source import DAY
from pyqmgr.settings.sources import MAPS, MEMBERS_SUFFIX, PLAN, POOLS, START, TRANSPORTS, pool_names
from pyqmgr.simulator.classes import absolute_spec
from pyqmgr.simulator.scenario import SourceRule

if TYPE_CHECKING:
    from pyqmgr.events.categories import Categorizer
    from pyqmgr.simulator.scenario import Scenario

#: pyqmgr.cf parameters the pools need, beyond ``<pool>_sources`` and
#: ``<source>_source_warmup_start``: the map's classes and tenants, and sites.
POOL_KEYS = (POOLS, MAPS, TRANSPORTS, PLAN, "site_grouping", "message_classes",
             "message_class_maps", "message_class_key", "default_message_class",
             "tenant_key")
#: Accepted sessions after a day's first refusal, as a share of what the source had
#: sent that day, under which the provider's rule is a day's volume (the sessions
#: that began before the refusal and finished after it are counted as taken).
AFTER_SHARE = 0.02
#: The log's resolution: a session placed up to this much after the first refusal
#: may have begun before it (whole-second time stamps; a message retried later is
#: placed within its first line's second, not to the hundredth).
RESOLUTION = 1.0
#: Reply texts whose category is remembered (a log has few distinct refusals).
TEXTS_KEPT = 1024
_CODE = re.compile(r"\b(4\d\d)[ -]([^\r\n]{1,300})")


def is_pool_setting(name: str) -> bool:
    """A pyqmgr.cf parameter the replay takes for the pools (``-o`` sends it there)."""
    return name in POOL_KEYS or name.endswith(MEMBERS_SUFFIX) or name.endswith("_" + START)


def pool_settings(values: Mapping[str, str], base: str) -> dict[str, str]:
    """The pools' settings among pyqmgr.cf's ``values``, the plan and tables made
    absolute from ``base`` (the configuration directory); {} when no pool is set."""
    out = {k: v for k, v in values.items() if is_pool_setting(k)}
    if not out.get(POOLS, "").strip():
        return {}
    plan = out.get(PLAN, "").strip()
    if plan and plan.lower() != "none" and not os.path.isabs(plan):
        out[PLAN] = os.path.normpath(os.path.join(base, plan))
    for name in [k for k in out if k.endswith("_maps")]:
        out[name] = ", ".join(absolute_spec(spec.strip(), base)
                              for spec in out[name].split(",") if spec.strip())
    return out


def members(cf: Mapping[str, str]) -> dict[str, str]:
    """Each pool member (a master.cf service) and its pool, in the pools' order."""
    out: dict[str, str] = {}
    for pool in pool_names(PyqmgrCf("pyqmgr_cf", True, dict(cf))):
        for word in (cf.get(pool + MEMBERS_SUFFIX) or "").replace(",", " ").split():
            out.setdefault(word.partition(":")[0], pool)
    return out


def cold(cf: Mapping[str, str]) -> list[str]:
    """The members with a warm-up start date (the plan's sources)."""
    return [m for m in members(cf)
            if (cf.get(f"{m}_{START}") or "").strip().lower() not in ("", "none")]


@dataclass
class Seen:
    """One source at one destination as the log shows it (epoch seconds)."""

    #: Session starts of the recipients it took, and of its accepted sessions.
    took: array = field(default_factory=lambda: array("d"))
    sessions: array = field(default_factory=lambda: array("d"))
    #: Session starts of the tries refused with a rate reply, and the replies.
    refused: array = field(default_factory=lambda: array("d"))
    replies: Counter[str] = field(default_factory=Counter)
    #: Other deferred and bounced tries.
    deferred: int = 0
    bounced: int = 0

    def add(self, other: Seen) -> None:
        self.took.extend(other.took)
        self.sessions.extend(other.sessions)
        self.refused.extend(other.refused)
        self.replies.update(other.replies)
        self.deferred += other.deferred
        self.bounced += other.bounced


class SourceLog:
    """While the log is read: per (source, recipient domain), what the pool members'
    tries met."""

    def __init__(self, pool_members: frozenset[str]) -> None:
        self.members = pool_members
        self.seen: dict[tuple[str, str], Seen] = {}
        self._categories: Categorizer | None = None
        self._rated: dict[str, bool] = {}

    def rate_reply(self, dsn: str, said: str) -> bool:
        """Whether a reply refuses the sender's rate or volume (4.7.28 and the like)."""
        if dsn == "4.7.28" or "4.7.28" in said:
            return True
        known = self._rated.get(said)
        if known is None:
            if self._categories is None:
                from pyqmgr.events.categories import load
                self._categories = load()
            known = self._categories.category(dsn, said) == "rate_limited"
            if len(self._rated) < TEXTS_KEPT:
                self._rated[said] = known
        return known

    def tried(self, source: str, domain: str, code: str, detail: str, dsn: str,
              start: float, new_session: bool, greeting_rate: bool) -> bool:
        """One try of a pool member (``code`` as the recipient's script has it, C a
        refused session); True: a rate refusal, which the source's rule plays
        rather than the recipient's script."""
        seen = self.seen.get((source, domain))
        if seen is None:
            seen = self.seen[(source, domain)] = Seen()
        if code == "s":
            seen.took.append(start)
            if new_session:
                seen.sessions.append(start)
            return False
        said = (detail.partition(" said: ")[2] or detail.partition("refused to talk to me: ")[2]
                ).split(" (in reply to")[0]
        if greeting_rate or (code == "d" and self.rate_reply(dsn, said)):
            seen.refused.append(start)
            m = _CODE.search(said)
            seen.replies[f"{m[1]} {m[2]}" if m else said[:300]] += 1
            return True
        if code in ("d", "D", "C"):
            seen.deferred += 1
        else:
            seen.bounced += 1
        return False


@dataclass
class Rule:
    """What one server did to one source, read off the log."""

    source: str
    server: str
    rule: SourceRule | None
    notes: list[str]


def by_server(log: SourceLog, server_of: Callable[[str], str]) -> dict[tuple[str, str], Seen]:
    """The log's tries per (source, server), ``server_of`` naming a domain's."""
    out: dict[tuple[str, str], Seen] = {}
    for (source, domain), seen in sorted(log.seen.items()):
        out.setdefault((source, server_of(domain)), Seen()).add(seen)
    return out


def rule_of(source: str, server: str, seen: Seen, origin: float,
            rate_of: Callable[[Sequence[float]], float]) -> Rule:
    """The server's rule for the source: a day's volume if, on every day it refused
    the source, it took (almost) nothing the source began after the first refusal;
    else a rate of sessions; None when it refused nothing."""
    if not seen.refused:
        return Rule(source, server, None, [])
    reply = seen.replies.most_common(1)[0][0]
    if not re.match(r"^4\d\d [^\r\n]*$", reply):
        reply = SourceRule.day_reply
    days: dict[int, tuple[int, int]] = {}
    for day in sorted({math.floor(t / DAY) for t in seen.refused}):
        first = min(t for t in seen.refused if math.floor(t / DAY) == day)
        same = [t for t in seen.took if math.floor(t / DAY) == day]
        cut = first + RESOLUTION
        days[day] = (sum(1 for t in same if t <= cut), sum(1 for t in same if t > cut))
    refusals = len(seen.refused)
    if all(after <= max(1, AFTER_SHARE * took) for took, after in days.values()):
        limit = min(took for took, _ in days.values())
        notes = [f"{source} at {server}: took {limit} recipients in the day, then refused "
                 f"{refusals} tries ({_short(reply)}): day_limit {limit}"]
        if len(days) > 1:
            notes.append("per day: " + ", ".join(
                f"{_day(d)} {took}" for d, (took, _) in sorted(days.items())))
        first_day = min(days)
        if math.floor(origin / DAY) == first_day and origin % DAY > 0:
            notes.append(f"counted from the log's start ({_day(first_day)} "
                         f"{_clock(origin)} UTC): what it sent earlier that day is not in it")
        return Rule(source, server, SourceRule(day_limit=max(1, limit), day_reply=reply),
                    notes)
    rate = rate_of(seen.sessions) if seen.sessions else 1.0
    return Rule(source, server, SourceRule(rate_limit=rate, rate_reply=reply),
                [f"{source} at {server}: refused {refusals} tries ({_short(reply)}) between "
                 f"sessions it accepted: a rate, {rate:g} sessions a second at most"])


def _short(reply: str, width: int = 60) -> str:
    return reply if len(reply) <= width else reply[:width].rpartition(" ")[0] + " ..."


def _day(day: int) -> str:
    return _iso(day * DAY)[:10]


def _clock(when: float) -> str:
    return _iso(when)[11:19]


def _iso(when: float) -> str:
    import datetime
    return datetime.datetime.fromtimestamp(when, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S")


def apply(sc: Scenario, cf: Mapping[str, str], rules: Sequence[Rule],
          origin: float) -> None:
    """The pools into the scenario: their settings, the date of the log's first
    second, each destination that a pool member served back on the pool's transport
    and the servers' rules for each source on the destinations they serve."""
    pool = members(cf)
    transport = ((cf.get(TRANSPORTS) or "smtp").replace(",", " ").split() or ["smtp"])[0]
    sc.pyqmgr_cf = dict(cf)
    sc.date = origin
    by_server = {(r.source, r.server): r.rule for r in rules if r.rule is not None}
    for name, dest in list(sc.destinations.items()):
        change: dict[str, Any] = {}
        if dest.transport in pool:
            change["transport"] = transport
        server = dest.mx or name
        found = {s: rule for (s, host), rule in by_server.items() if host == server}
        if found:
            change["sources"] = found
        if change:
            sc.destinations[name] = dataclasses.replace(dest, **change)


def without_pools(sc: Scenario) -> Scenario:
    """The scenario as Postfix's own queue managers run it: no pools, so no rules
    for a source (trivial-rewrite's transport leaves from the default address)."""
    return dataclasses.replace(
        sc, pyqmgr_cf={}, date=None,
        destinations={n: dataclasses.replace(d, sources={}) for n, d in
                      sc.destinations.items()})


# -- the report ---------------------------------------------------------------------------


def log_rows(per: Mapping[tuple[str, str], Seen]) -> list[dict[str, Any]]:
    """Per source and server, the log's recipients sent, refused (a rate reply) and
    deferred or bounced otherwise."""
    return [{"source": s, "server": server, "sent": len(seen.took),
             "refused": len(seen.refused), "deferred": seen.deferred,
             "bounced": seen.bounced}
            for (s, server), seen in sorted(per.items())]


def sim_rows(docs: Sequence[dict[str, Any]], server_of: Callable[[str], str]
             ) -> list[dict[str, Any]]:
    """The same per source and server from simulated runs' ``sources`` (their mean):
    sent, refused by the server's rule for the source, deferred otherwise, held."""
    sums: dict[tuple[str, str], Counter[str]] = {}
    for doc in docs:
        for r in doc["per_source_site"]:
            row = sums.setdefault((r["source"], server_of(r["site"])), Counter())
            for key in ("sent", "deferred", "held", "bounced"):
                row[key] += r[key]
        for f in doc["refused"]:
            sums.setdefault((f["source"], f["server"]), Counter())["refused"] += \
                f["recipients"]
    k = max(1, len(docs))
    out = []
    for (s, server), c in sorted(sums.items()):
        out.append({"source": s, "server": server, "sent": round(c["sent"] / k),
                    "refused": round(c["refused"] / k),
                    "deferred": round(max(0, c["deferred"] - c["refused"]) / k),
                    "held": round(c["held"] / k), "bounced": round(c["bounced"] / k)})
    return out


def text_lines(doc: dict[str, Any], rows: int) -> list[str]:
    """The report's source table: per source and server, the log's recipients sent
    and refused next to each contender's, the cold sources first."""
    figures = doc["figures"]
    labels = list(figures)
    keys: list[tuple[str, str]] = sorted({(r["source"], r["server"]) for label in labels
                                          for r in figures[label]})
    coldset = set(doc["cold"])
    keys.sort(key=lambda k: (k[0] not in coldset, k))
    shown = keys[:rows] if rows else keys
    width = max([14] + [len(f"{s} {h}") for s, h in shown])
    out = ["", "sources (per server: recipients sent, refused with a rate reply; "
               "* a cold source):"]
    head = f"{'source server':<{width + 2}}"
    for label in labels:
        head += f" | {label[:20]:>20}"
    out.append(head)
    index = {label: {(r["source"], r["server"]): r for r in figures[label]}
             for label in labels}
    for key in shown:
        mark = "*" if key[0] in coldset else " "
        line = f"{mark} {key[0] + ' ' + key[1]:<{width}}"
        for label in labels:
            r = index[label].get(key)
            line += " | " + (f"{r['sent']:>9} {r['refused']:>10}" if r is not None
                             else f"{'-':>20}")
        out.append(line)
    if len(shown) < len(keys):
        out.append(f"... and {len(keys) - len(shown)} more (--all or --json)")
    for rule in doc["rules"]:
        out.append("  " + "; ".join(rule["notes"]))
    for label in labels:
        if not figures[label]:
            out.append(f"  {label}: no pools (Postfix's own queue manager): its mail "
                       "leaves by trivial-rewrite's transport, from the default address")
    return out


def read_pools(config_dir: str | None, settings: Sequence[str]
               ) -> tuple[dict[str, str], list[str]]:
    """The logged relay's pools: ``config_dir``'s pyqmgr.cf, then each ``-o`` that
    names a pool setting (relative paths from here); and the other ``-o`` settings,
    main.cf's. ValueError: a pyqmgr.cf that cannot be read, with its path."""
    from pyqmgr.postfix.config import split_nameval
    from pyqmgr.pyqmgr_cf import PyqmgrCfError, load

    values: dict[str, str] = {}
    if config_dir is not None:
        try:
            cf = load(config_dir)
        except PyqmgrCfError as exc:
            raise ValueError(str(exc)) from None
        values = pool_settings(cf.values, config_dir)
    rest = []
    given: dict[str, str] = {}
    for text in settings:
        try:
            name, value = split_nameval(text)
        except ValueError:
            rest.append(text)  # main.cf's reader says what is wrong with it
            continue
        if is_pool_setting(name):
            given[name] = value
        else:
            rest.append(text)
    if given:
        values = pool_settings({**values, **given}, os.getcwd())
    return values, rest
