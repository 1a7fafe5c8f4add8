"""Did the run test what it was run to test? What its maillog says did not happen.

A comparison's figures mean something only if the contender did what it was started
to do: a pyqmgr with ``site_grouping = mx`` whose every MX lookup failed counts each
domain as a site of its own, and its figures are those of a pyqmgr without sites (the
shipped sites comparison once showed pyqmgr deferring 85% against stock's 87.5%, and
its report did not say that no site was ever learnt: issue #43). So the report leads
with what a run's maillog shows did not take effect, each found in lines the daemon
or master(8) writes for exactly that:

* the qmgr's ``fatal:``/``panic:`` lines, and master's ``process .../qmgr pid N exit
  status S`` and ``bad command startup -- throttling`` (a daemon that died at start
  with no fatal line of its own: a missing library, once);
* sites: ``warning: sites: DOMAIN: MX lookup failed (WHY)``, one line per failed
  lookup, held against the domains the run routes by MX record (their next hop a
  domain, not ``[address]``): every one failed is "learnt no site";
* a fleet: ``warning: shared state ENDPOINT: WHY; holding .../delivering under this
  node's own limits`` (Redis unreachable: the limits were not shared meanwhile);
* delegation: ``warning: SERVICE: ERROR; ... by default_action = ACTION`` (the policy
  service did not answer: its default decided);
* classes: ``warning: classes: PARAMETER: ...: left out, its mail takes the defaults``
  (a class or tenant table that could not be read);
* the qmgr's warnings that name pyqmgr.cf (a parameter or table it does not act on).

Nothing is inferred from the figures: a feature that worked logs nothing here, and a
figure that merely looks like no feature is not reported as one. The fleet's and the
policy service's warnings come at most once a minute, so their counts are lower
bounds, and are said as "at least".
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from pyqmgr.postfix import maillog

_LOOKUP_FAILED = re.compile(r"^warning: sites: (?P<domain>\S+): MX lookup failed "
                            r"\((?P<why>.*)\); its own site for \S+$")
_EXITED = re.compile(r"^warning: process (?P<path>\S*qmgr) pid \d+ "
                     r"(?P<how>exit status \d+|killed by signal \d+)")
_THROTTLED = re.compile(r"^warning: (?P<path>\S*qmgr): bad command startup -- throttling")
_SHARED_STATE = re.compile(r"^warning: shared state (?P<endpoint>\S+): (?P<why>.*); "
                           r"(?:holding deliveries to shared destinations back|delivering "
                           r"under this node's own limits) \(")
_CLASS_TABLE = re.compile(r"^warning: classes: (?P<param>\S+): (?P<why>.*): left out, "
                          r"its mail takes the defaults")
_POLICY = re.compile(r"^warning: (?P<service>\S+): (?P<why>.*); (?:delivering|holding "
                     r"deliveries back) by default_action = (?P<action>\S+)")
#: The test bed's "postfix stop": what a qmgr does after it is no longer the run's.
_STOPPING = "stopping the Postfix mail system"
#: Texts quoted in a sentence are cut here.
QUOTE = 160


def _cut(text: str) -> str:
    return text if len(text) <= QUOTE else text[:QUOTE - 3] + "..."


def looked_up(record: dict[str, Any]) -> list[str]:
    """The destinations whose sites the daemon looks up in this run: those routed to a
    domain (``smtp:DOMAIN:PORT``, MX records found by DNS), not to ``[address]``."""
    out = []
    for dest, transport in (record.get("transports") or {}).items():
        _, _, hop = transport.partition(":")
        if hop and not hop.startswith("["):
            out.append(dest)
    return sorted(out)


def _on(pyqmgr_cf: dict[str, str], name: str, off: str = "") -> bool:
    return (pyqmgr_cf.get(name) or off).strip().lower() not in ("", off)


class _Lines:
    """The qmgr's and master's lines of one run, sorted into what the checks read."""

    def __init__(self, text: str) -> None:
        self.fatal: list[str] = []
        self.exits: list[str] = []
        self.throttled = 0
        self.lookups: list[tuple[str, str]] = []
        self.shared_state: list[tuple[str, str]] = []
        self.policy: list[tuple[str, str, str]] = []
        self.class_tables: list[tuple[str, str]] = []
        self.settings: list[str] = []
        for raw in text.splitlines():
            parts = maillog.split(raw)
            if parts is None:
                continue
            tag, _, line = parts
            program = tag.rpartition("/")[2]
            if program == "postfix-script" and line.startswith(_STOPPING):
                break
            if program == "master":
                self._master(line)
            elif program == "qmgr":
                self._qmgr(line)

    def _master(self, line: str) -> None:
        m = _EXITED.match(line)
        if m is not None:
            self.exits.append(m["how"])
        elif _THROTTLED.match(line):
            self.throttled += 1

    def _qmgr(self, line: str) -> None:
        if line.startswith(("fatal: ", "panic: ")):
            self.fatal.append(line)
            return
        if not line.startswith("warning: "):
            return
        if (m := _LOOKUP_FAILED.match(line)) is not None:
            self.lookups.append((m["domain"].lower(), m["why"]))
        elif (m := _SHARED_STATE.match(line)) is not None:
            self.shared_state.append((m["endpoint"], m["why"]))
        elif (m := _CLASS_TABLE.match(line)) is not None:
            self.class_tables.append((m["param"], m["why"]))
        elif (m := _POLICY.match(line)) is not None:
            self.policy.append((m["service"], m["why"], m["action"]))
        elif "pyqmgr.cf" in line:
            self.settings.append(line[len("warning: "):])


def _daemon(x: str, lines: _Lines) -> list[str]:
    out = []
    if lines.fatal:
        more = f" ({len(lines.fatal)} fatal lines)" if len(lines.fatal) > 1 else ""
        out.append(f"{x}'s qmgr stopped on a fatal error{more}: {_cut(lines.fatal[0])}")
    if lines.exits:
        n = len(lines.exits)
        text = (f"{x}'s qmgr exited {n} time{'s' if n > 1 else ''} while the run went on "
                f"(master: {lines.exits[0]})")
        if lines.throttled:
            text += ("; master throttled its restart (bad command startup): no mail moved "
                     "meanwhile")
        if not lines.fatal:
            text += "; no fatal line of the qmgr's says why"
        out.append(text)
    return out


def _sites(x: str, record: dict[str, Any], lines: _Lines) -> list[str]:
    if not lines.lookups:
        return []
    failed = Counter(domain for domain, _ in lines.lookups)
    routed = {d.lower() for d in looked_up(record)}
    asked = len(routed | set(failed))
    domain, why = lines.lookups[0]
    first = f"first: {domain}: {_cut(why)}"
    if len(failed) >= asked:
        return [f"{x} learnt no site: {len(failed)} of {asked} MX lookups failed ({first});"
                " the comparison does not show sites"]
    return [f"{x}'s MX lookups failed for {len(failed)} of {asked} domains ({first}): "
            "those domains were sites of their own, outside their site's limits"]


def not_in_effect(record: dict[str, Any], text: str) -> list[str]:
    """Sentences, each naming the contender, for what its run's maillog ``text`` shows
    did not take effect; empty when it shows nothing of the kind."""
    x = record.get("contender", "?")
    cf = record.get("pyqmgr_cf") or {}
    lines = _Lines(text)
    out = _daemon(x, lines)
    if _on(cf, "site_grouping", "none"):
        out += _sites(x, record, lines)
    if lines.shared_state:
        endpoint, why = lines.shared_state[0]
        n = len(lines.shared_state)
        out.append(f"{x}'s fleet lost its shared state {endpoint} (at least {n} "
                   f"warning{'s' if n > 1 else ''}; first: {_cut(why)}): its servers' "
                   "limits were not shared meanwhile")
    if lines.policy:
        service, why, action = lines.policy[0]
        out.append(f"{x}'s policy service {service} did not answer (at least "
                   f"{len(lines.policy)} warning{'s' if len(lines.policy) > 1 else ''}; "
                   f"first: {_cut(why)}): default_action = {action} decided instead")
    for param, why in lines.class_tables:
        out.append(f"{x}'s qmgr left a table of {param} out ({_cut(why)}): the mail it "
                   "names took the default class")
    if lines.settings:
        more = (f" (and {len(lines.settings) - 1} more)" if len(lines.settings) > 1 else "")
        out.append(f"{x}'s qmgr warned about its settings: {_cut(lines.settings[0])}{more}: "
                   "what it names did not take effect")
    return out
