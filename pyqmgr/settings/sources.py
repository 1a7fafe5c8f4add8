"""Source pools' settings (issue #46): pyqmgr.cf read into the core's SourceBook.

``source_pools`` names the pools, ``<pool>_sources`` each one's members (master.cf
smtp or lmtp services, each bound to its address with ``-o smtp_bind_address=``,
``src2:3`` for a weight), ``source_pool_maps`` maps a message's tenant or class to a
pool, and only recipients trivial-rewrite sends to a ``source_pool_transports``
transport (default smtp) move. ``source_warmup_plan`` is the warm-up plan's file and
``source_warmup_start`` (per source: ``src1_source_warmup_start``) a source's first
day; a source without one is warm. Everything is checked once, at start-up and by
``pyqmgr check``, a bad value a fatal line naming the parameter. With no
``source_pools`` nothing here is read: trivial-rewrite's transport stands.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Collection
from dataclasses import dataclass

from pyqmgr.postfix.lookup_table import LookupTableError, Table, open_table, table_specs
from pyqmgr.pyqmgr_cf import PyqmgrCf
from pyqmgr.scheduler.source import PlanError, Pool, SourceBook, WarmupPlan, parse_plan
from pyqmgr.site_names import ProviderTableError, read_table

POOLS = "source_pools"
#: A pool's members: ``<pool>_sources`` (a pool is no master.cf service, so this is
#: no transport form; pyqmgr_cf_names knows the names from source_pools).
MEMBERS_SUFFIX = "_sources"
MAPS = "source_pool_maps"
TRANSPORTS = "source_pool_transports"
PLAN = "source_warmup_plan"
START = "source_warmup_start"

#: master.cf commands a source may run: a delivery agent that binds an address.
SOURCE_COMMANDS = ("smtp", "lmtp")
#: Most members in one pool (a choice walks them all).
MAX_MEMBERS = 64
#: Largest weight of a member.
MAX_WEIGHT = 1000


@dataclass(frozen=True)
class SourceSettings:
    """pyqmgr.cf's source settings, checked."""

    #: Pool name -> ((member, weight), ...), in the file's order.
    pools: dict[str, tuple[tuple[str, int], ...]]
    #: source_pool_maps: tenant, then class -> pool.
    maps: list[Table]
    #: The transports whose recipients move to a pool's member.
    transports: frozenset[str]
    plan: WarmupPlan | None
    #: Each cold source's first day (Unix time of its UTC midnight).
    starts: dict[str, float]

    def book(self) -> SourceBook:
        return SourceBook({name: Pool(name, tuple(m for m, _ in members),
                                      tuple(w for _, w in members))
                           for name, members in self.pools.items()}, self.plan,
                          dict(self.starts))

    def pool_for(self, tenant: str, class_name: str) -> str | None:
        """The pool a message's tenant (first) or class maps to; None: none."""
        for key in (tenant, class_name):
            if not key:
                continue
            for table in self.maps:
                got = table.get(key)
                if got is not None:
                    return got.strip() if got.strip() in self.pools else None
        return None


def parse_start(text: str) -> float:
    """A source's first day (``YYYY-MM-DD``, UTC) as the Unix time of its midnight;
    ValueError when it is not a date."""
    parsed = time.strptime(text.strip(), "%Y-%m-%d")
    return float(calendar.timegm(parsed))


def pool_names(settings: PyqmgrCf) -> list[str]:
    return (settings.get(POOLS) or "").replace(",", " ").split()


def source_settings(settings: PyqmgrCf, commands: dict[str, str]) -> SourceSettings | None:
    """The settings checked, None when no pool is set. ``commands``: master.cf's unix
    services and the command each runs."""
    names = pool_names(settings)
    if not names:
        return None
    pools: dict[str, tuple[tuple[str, int], ...]] = {}
    member_of: dict[str, str] = {}
    for name in names:
        if name in pools:
            raise settings.error(POOLS, f'pool "{name}" is named twice')
        param = name + MEMBERS_SUFFIX
        members = _members(settings, param, (settings.get(param) or "").replace(",", " "),
                           commands)
        for member, _ in members:
            if member in member_of:
                raise settings.error(param, f'source "{member}" is in pool '
                                            f'"{member_of[member]}" already')
            member_of[member] = name
        pools[name] = members
    transports = frozenset((settings.get(TRANSPORTS) or "smtp").replace(",", " ").split())
    for t in sorted(transports):
        if t not in commands:
            raise settings.error(TRANSPORTS, f'master.cf has no unix service "{t}"')
        if t in member_of:
            raise settings.error(TRANSPORTS, f'"{t}" is a source of pool "{member_of[t]}": '
                                             "a source's mail never moves again")
    maps = _maps(settings, pools)
    plan = _plan(settings)
    starts: dict[str, float] = {}
    for member in member_of:
        text = (settings.get(START, member) or "").strip()
        if not text or text.lower() == "none":
            continue
        try:
            starts[member] = parse_start(text)
        except ValueError:
            raise settings.error(settings.which(START, member) or START,
                                 f'"{text}" is not a date (YYYY-MM-DD)') from None
    if starts and plan is None:
        raise settings.error(settings.which(START, next(iter(starts))) or START,
                             f"a start date needs a warm-up plan ({PLAN})")
    return SourceSettings(pools, maps, transports, plan, starts)


def _members(settings: PyqmgrCf, param: str, text: str,
             commands: dict[str, str]) -> tuple[tuple[str, int], ...]:
    out: list[tuple[str, int]] = []
    for word in text.split():
        member, _, weight_text = word.partition(":")
        weight = 1
        if weight_text:
            if not weight_text.isdigit() or not 1 <= int(weight_text) <= MAX_WEIGHT:
                raise settings.error(param, f'"{word}": the weight is a number from 1 to '
                                            f"{MAX_WEIGHT}")
            weight = int(weight_text)
        command = commands.get(member)
        if command is None:
            raise settings.error(param, f'"{member}" is not a unix service in master.cf')
        if command not in SOURCE_COMMANDS:
            raise settings.error(param, f'"{member}" runs {command}, not smtp or lmtp: a '
                                        "source is a delivery agent bound to an address")
        if any(m == member for m, _ in out):
            raise settings.error(param, f'"{member}" is listed twice')
        out.append((member, weight))
    if not out:
        raise settings.error(param if settings.which(param) else POOLS,
                             f'pool "{param[:-len(MEMBERS_SUFFIX)]}" has no members '
                             f"(set {param} = SERVICE ...)")
    if len(out) > MAX_MEMBERS:
        raise settings.error(param, f"more than {MAX_MEMBERS} members")
    return tuple(out)


def _maps(settings: PyqmgrCf, pools: Collection[str]) -> list[Table]:
    out: list[Table] = []
    for spec in table_specs(settings.get(MAPS) or ""):
        try:
            table = open_table(spec, files=settings.root_files())
        except LookupTableError as exc:
            raise settings.error(MAPS, str(exc)) from None
        for key, value in table.entries.items():
            if value.strip() not in pools:
                raise settings.error(MAPS, f'{spec}: "{key}" maps to "{value}", which is '
                                           f"not a pool of {POOLS}")
        out.append(table)
    if not out:
        raise settings.error(MAPS if settings.which(MAPS) else POOLS,
                             "no table maps a tenant or class to a pool (set "
                             f"{MAPS} = inline:{{ CLASS=POOL }})")
    return out


def _plan(settings: PyqmgrCf) -> WarmupPlan | None:
    path = (settings.get(PLAN) or "").strip()
    if not path or path.lower() == "none":
        return None
    try:
        return parse_plan(read_table(path, settings.root_files()), path)
    except (PlanError, ProviderTableError) as exc:
        raise settings.error(PLAN, str(exc)) from None
    except OSError as exc:
        raise settings.error(PLAN, f"{path}: {exc.strerror or exc}") from None
