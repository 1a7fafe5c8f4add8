"""Source pools on real Postfix (issue #46): ``pyqmgr compare`` of a warm-up plan.

A workload whose ``[pyqmgr_cf]`` sets ``source_pools`` runs as the simulator plays it
(:mod:`pyqmgr.simulator.sources`), with real addresses: each pool member, in the
order the pools name them, becomes an smtp service of master.cf bound to its own
loopback address, 127.0.0.21, .22 and so on (``-o smtp_bind_address=``: Linux
answers the whole of 127/8 on ``lo``), so that each MX host's sink tells the sources
apart by the client address of a session. A destination's rule for one source
(``[destinations.X.sources.SRC] day_limit``) becomes its sink's quota for that
address: past that many messages from it, its recipients are answered ``day_reply``
at RCPT, as a provider answers a new address past its day's volume.

The plan's file is copied into the instance's configuration directory (pyqmgr reads
it as root, and judges it as it judges pyqmgr.cf), and each cold source's first day
is moved so that the real today is the day of its plan the workload's ``date`` is:
a source on day 0 in the simulation is on day 0 in the run. A run that crosses
midnight UTC starts the next day's window, as the daemon would. The stock contender
has the same master.cf services and never uses them: its mail leaves from 127.0.0.1.
"""

from __future__ import annotations

import calendar
import datetime
import math
import os
import shutil
import tempfile
import time
from typing import TYPE_CHECKING, Any

from pyqmgr.pyqmgr_cf import PyqmgrCf
from pyqmgr.scheduler.source import DAY
from pyqmgr.settings.sources import MEMBERS_SUFFIX, PLAN, START, parse_start, pool_names
from pyqmgr.simulator.classes import absolute_spec
from pyqmgr.simulator.scenario import ScenarioError

if TYPE_CHECKING:
    from pyqmgr.simulator.scenario import Destination, Scenario

#: The first source's address is 127.0.0.FIRST.
FIRST = 21
#: The plan's name in the instance's configuration directory.
PLAN_FILE = "pyqmgr-warmup"


def source_addresses(sc: Scenario) -> dict[str, str]:
    """Each pool member's loopback address, in the order the pools name them."""
    cf = sc.pyqmgr_cf
    members: list[str] = []
    for pool in pool_names(PyqmgrCf("pyqmgr_cf", True, dict(cf))):
        for word in (cf.get(pool + MEMBERS_SUFFIX) or "").replace(",", " ").split():
            member = word.partition(":")[0]
            if member not in members:
                members.append(member)
    if FIRST + len(members) > 255:
        raise ScenarioError(f"{len(members)} pool members: compare binds each to an "
                            f"address from 127.0.0.{FIRST}, at most {255 - FIRST}")
    return {m: f"127.0.0.{FIRST + i}" for i, m in enumerate(members)}


def master_cf_line(name: str, limit: int, address: str | None) -> str:
    """A transport's master.cf line: an smtp service, bound to its address if a
    source, and then logging under its own name (``postfix/src1/smtp``), as an admin's
    pool does, so that ``pyqmgr replay`` of the run's maillog tells the sources apart."""
    line = f"{name} unix - - n - {limit or '-'} smtp"
    return line + (f" -o smtp_bind_address={address} -o syslog_name=postfix/{name}"
                   if address else "")


def quotas(dest: Destination, addresses: dict[str, str]) -> dict[str, tuple[int, str]]:
    """The sink's quotas per client address for a destination's source rules."""
    return {addresses[s]: (rule.day_limit, rule.day_reply)
            for s, rule in dest.sources.items() if rule.day_limit > 0 and s in addresses}


def real_cf(cf: dict[str, str], sc: Scenario, now: float | None = None) -> dict[str, str]:
    """The contender's pyqmgr.cf with each cold source's first day moved, so that
    today is the day of its plan the workload's ``date`` is; table paths absolute."""
    out = dict(cf)
    starts = {name[:-len(START) - 1]: value for name, value in cf.items()
              if name.endswith("_" + START) and value.strip().lower() not in ("", "none")}
    parsed = {}
    for source, text in starts.items():
        try:
            parsed[source] = parse_start(text)
        except ValueError:
            continue  # the contender's start refuses it, with the parameter named
    epoch = sc.date if sc.date is not None else max(parsed.values(), default=0.0)
    today = calendar.timegm(time.gmtime(time.time() if now is None else now)[:3] + (0, 0, 0))
    for source, start in parsed.items():
        age = math.floor((epoch - start) / DAY)
        out[f"{source}_{START}"] = datetime.datetime.fromtimestamp(
            today - age * DAY, datetime.UTC).strftime("%Y-%m-%d")
    if out.get("source_pool_maps"):
        out["source_pool_maps"] = ", ".join(
            absolute_spec(spec.strip(), sc.base_dir)
            for spec in out["source_pool_maps"].split(",") if spec.strip())
    return out


def plan_root(cf: dict[str, str], sc: Scenario, base: str) -> tuple[str | None,
                                                                   dict[str, str]]:
    """A new instance's root (under ``base``) with the plan in its configuration
    directory (root's, 0644: pyqmgr judges a file outside that directory as it
    judges pyqmgr.cf, and /tmp's sticky bit would fail it), and the pyqmgr.cf that
    names it there; (None, cf) when the settings name no plan."""
    plan = (cf.get(PLAN) or "").strip()
    if not plan or plan.lower() == "none":
        return None, cf
    source = plan if os.path.isabs(plan) else os.path.join(sc.base_dir, plan)
    root = tempfile.mkdtemp(prefix="pyqmgr-tb-", dir=base)
    try:
        os.makedirs(os.path.join(root, "etc"))
        target = os.path.join(root, "etc", PLAN_FILE)
        shutil.copyfile(source, target)
        os.chmod(target, 0o644)
    except OSError as exc:
        shutil.rmtree(root, ignore_errors=True)
        raise ScenarioError(f"pyqmgr_cf.{PLAN}: {source}: {exc.strerror or exc}") from None
    return root, {**cf, PLAN: target}


def record(addresses: dict[str, str], sinks: dict[str, Any]) -> dict[str, Any]:
    """What each MX host's (or destination's) sink saw per source: messages
    accepted, sessions served and recipients over its quota; ``(default)`` is
    127.0.0.1, where stock's mail (and mail no pool takes) leaves from."""
    names = {a: s for s, a in addresses.items()}
    out: dict[str, dict[str, dict[str, int]]] = {}
    for host, st in sinks.items():
        clients = (set(st.messages_by_client) | set(st.sessions_by_client)
                   | set(st.over_quota_by_client))
        for client in sorted(clients):
            source = names.get(client, "(default)" if client == "127.0.0.1" else client)
            out.setdefault(source, {})[host] = {
                "messages": st.messages_by_client[client],
                "sessions": st.sessions_by_client[client],
                "over_quota": st.over_quota_by_client[client]}
    return {"addresses": addresses, "by_source": out}


def markdown_lines(report: dict[str, Any]) -> list[str]:
    """The report's "Sources" section: per contender, source and server, what the
    sink counted from that source's address."""
    rows = []
    for label, run in report["runs"].items():
        src = run.get("sources")
        if not src:
            continue
        for source, hosts in sorted(src["by_source"].items()):
            address = src["addresses"].get(source, "127.0.0.1")
            for host, n in sorted(hosts.items()):
                rows.append(f"| {label} | {source} ({address}) | {host} | {n['messages']} | "
                            f"{n['sessions']} | {n['over_quota']} |")
    if not rows:
        return []
    return ["", "## Sources (each sink's count per source address)", "",
            "| contender | source | server | messages | sessions | refused over quota |",
            "|---|---|---|---|---|---|", *rows]
