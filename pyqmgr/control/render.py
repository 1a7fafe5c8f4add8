"""Readable text for the control channel's replies (``pyqmgr status``, ``pyqmgr explain``).

Kept apart from the CLI so that it can be tested on canned replies. It reads the
members it knows and tolerates missing ones (a newer daemon may add or drop members;
``--json`` shows everything as sent).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence

from pyqmgr.durations import ago, duration, until

#: ``pyqmgr status --sort`` keys: how destinations are ordered (busiest first for all
#: but name, so the ones an admin asks about come on top).
SORTS: dict[str, Callable[[dict[str, object]], tuple[object, ...]]] = {
    "name": lambda d: (str(d.get("name", "")), str(d.get("transport", ""))),
    "window": lambda d: (-_num(d.get("window")), str(d.get("name", ""))),
    "busy": lambda d: (-_num(d.get("in_flight")), str(d.get("name", ""))),
    "queued": lambda d: (-_num(d.get("queued_recipients")), -_num(d.get("queued_entries")),
                         str(d.get("name", ""))),
}


def _num(value: object) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _seconds(value: object) -> str:
    """A duration of a reply (seconds, a number) in human units: 9m58s."""
    return duration(value) if isinstance(value, int | float) else "-"


def clock(wall: object) -> str:
    """A time of a reply (seconds since the epoch) on this machine's clock."""
    if not isinstance(wall, int | float) or not math.isfinite(wall):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall))


def _state(item: dict[str, object]) -> str:
    """Suspended, dead (with why and when it is tried again), rate-delayed, or nothing."""
    held = item.get("suspended")
    if isinstance(held, dict):
        return f"suspended by {_fmt(held.get('by'))} (ends in {_seconds(held.get('ends_in'))})"
    if item.get("dead"):
        text = "dead"
        if item.get("reason"):
            text += f": {item['reason']}"
        if item.get("retry_in") is not None:
            text += f" (retry in {_seconds(item['retry_in'])})"
        return text
    gate = item.get("gate")
    if isinstance(gate, dict) and gate.get("kind") == "policy service":
        return f"held back by the policy service (opens in {_seconds(gate.get('opens_in'))})"
    if item.get("rate_delayed_for") is not None:
        return f"rate delay (next in {_seconds(item['rate_delayed_for'])})"
    if item.get("rate_lock"):
        return "rate delay"
    parts = []
    gate = item.get("gate")
    if isinstance(gate, dict):
        # Shaping's gates: a rate's spacing, a backoff rule, a policy service's DEFER.
        parts.append(f"{_fmt(gate.get('kind'))} (opens in {_seconds(gate.get('opens_in'))})")
    if item.get("cap"):
        parts.append(f"window capped at {_fmt(item['cap'])} (throttling)")
    return ", ".join(parts)


def _table(header: Sequence[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    out = []
    for row in [list(header), *rows]:
        cells = [c.ljust(w) for c, w in zip(row, widths, strict=True)]
        out.append("  ".join(cells).rstrip())
    return out


def _dicts(value: object) -> list[dict[str, object]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _memory_line(memory: dict[str, object]) -> str:
    """The qmgr's own resident size, its peak, and the warning limit if one is set."""
    def mib(key: str) -> str:
        value = memory.get(key)
        return f"{value / 2**20:.1f} MiB" if isinstance(value, int) else "?"

    limit = (f", warning over {mib('warning_limit')} (memory_warning_limit)"
             if memory.get("warning_limit") else "")
    return f"qmgr memory: {mib('resident_bytes')} resident, peak {mib('peak_bytes')}{limit}"


def _lookup_lines(lookups: dict[str, object]) -> list[str]:
    """The sites' MX lookups: how many, and where they run (issue #44's helper)."""
    failed = lookups.get("failed")
    failures = (", ".join(f"{why} {n}" for why, n in sorted(failed.items()))
                if isinstance(failed, dict) and failed else "none failed")
    line = (f"MX lookups: {_fmt(lookups.get('answered'))} answered, "
            f"{_fmt(lookups.get('lookups_running'))} running, "
            f"{_fmt(lookups.get('lookups_waiting'))} waiting; {failures}")
    helper = lookups.get("helper")
    if isinstance(helper, dict):
        line += (f"; lookup helper pid {_fmt(helper.get('pid'))}: "
                 + (f"gone ({_fmt(helper.get('gone'))}), lookups in qmgr"
                    if helper.get("gone") else
                    f"{_fmt(helper.get('in_flight'))} in flight"))
    return [line, ""]


def _sources_lines(sources: object) -> list[str]:
    """Source pools (issue #46): each pool's members, a cold one's age and allowance,
    and the window's counts per source and site."""
    if not isinstance(sources, dict):
        return []
    window = _fmt(sources.get("window") or "day")
    lines = []
    pools = sources.get("pools")
    for name, members in (pools.items() if isinstance(pools, dict) else ()):
        said = []
        for m in _dicts(members):
            text = _fmt(m.get("source")) + (f":{m['weight']}" if m.get("weight") != 1 else "")
            if m.get("allowance") is not None:
                text += (f" (cold, day {_fmt(m.get('age_days'))}, {_fmt(m.get('allowance'))} "
                         f"a site this {window})")
            said.append(text)
        lines.append(f"source pool {name}: {', '.join(said)}")
    lines.append(f"sources: {_fmt(sources.get('waited'))} recipients waited, "
                 f"{_fmt(sources.get('unknown_site'))} went warm before their site was known"
                 + (f"; counts kept in {sources['state_file']}"
                    if sources.get("state_file") else ""))
    if sources.get("shared"):
        lines.append(_shared_warmup_line(sources))
    counts = _dicts(sources.get("counts"))
    if counts:
        fleet = {(f.get("source"), f.get("site")): f.get("counted")
                 for f in _dicts(sources.get("fleet_counts"))}
        held = {(f.get("source"), f.get("site")): f.get("credits")
                for f in _dicts(sources.get("credits"))}
        shared = bool(sources.get("shared"))
        lines += _table(["SOURCE", "SITE", f"COUNTED THIS {window.upper()}", "LEFT"]
                        + (["FLEET", "CREDITS"] if shared else []),
                        [[_fmt(c.get("source")), _fmt(c.get("site")), _fmt(c.get("counted")),
                          _fmt(c.get("left"))]
                         + ([_fmt(fleet.get((c.get("source"), c.get("site")), "-")),
                             _fmt(held.get((c.get("source"), c.get("site")), 0))]
                            if shared else []) for c in counts])
    return [*lines, ""]


def _shared_warmup_line(sources: dict[str, object]) -> str:
    """A fleet's warm-up (issue #46): the counts are the fleet's, the credits held."""
    line = (f"warm-up counts: the fleet's (shared_state), {_fmt(sources.get('credits_held'))}"
            f" credits held here; {_fmt(sources.get('credits_asked'))} asked, "
            f"{_fmt(sources.get('credits_granted'))} granted")
    if sources.get("fleet_unavailable"):
        line += ("; Redis not answering: " + (
            "counting here alone" if sources.get("away") else "taking no more credits")
            + f" (shared_state_failure = {_fmt(sources.get('fleet_failure'))}), "
            f"{_fmt(sources.get('owed'))} owed to the fleet's count")
    return line


def _classes_lines(reply: dict[str, object]) -> list[str]:
    """Classes' room in the active queue, and whose sender-written keys count."""
    lines: list[str] = []
    keys = reply.get("sender_keys")
    if isinstance(keys, dict):
        lines.append(f"sender-written keys count for: {_fmt(keys.get('trusted_clients'))}; "
                     f"{_fmt(keys.get('untrusted_messages'))} messages from other "
                     "clients took the default class and tenant")
        lines.append("")
    unlisted = reply.get("unlisted_tenants")
    if isinstance(unlisted, dict):
        lines.append(f"unlisted tenants in the active queue: "
                     f"{_fmt(unlisted.get('in_active_queue'))} of "
                     f"{_fmt(unlisted.get('limit'))}; "
                     f"{_fmt(unlisted.get('folded_messages'))} messages made tenant _other")
        lines.append("")
    classes = reply.get("classes")
    if isinstance(classes, dict):
        lines += _table(["CLASS", "ACTIVE", "ROOM"],
                        [[_fmt(c.get("name")), _fmt(c.get("active")), _fmt(c.get("cap"))]
                         for c in _dicts(classes.get("classes"))])
        lines.append(f"incoming/ {_fmt(classes.get('incoming'))}: "
                     f"{_fmt(classes.get('files_read'))} files read, "
                     f"{_fmt(classes.get('fed_past_the_scan'))} fed past the scan, "
                     f"{_fmt(classes.get('waiting_for_room'))} waiting for room")
        lines.append("")
    return lines


def status_lines(reply: dict[str, object], sort: str = "name") -> list[str]:
    """Two tables: transports, then destinations in ``sort`` order."""
    transports = _dicts(reply.get("transports"))
    destinations = sorted(_dicts(reply.get("destinations")), key=SORTS[sort])
    lines = [f"active queue: {_fmt(reply.get('messages'))} messages, "
             f"{_fmt(reply.get('recipients'))} recipients in core"]
    memory = reply.get("memory")
    if isinstance(memory, dict):
        lines.append(_memory_line(memory))
    lines.append("")
    rows = [[_fmt(t.get("name")), _fmt(t.get("policy")),
             f"{_fmt(t.get('agents_busy'))}/{_fmt(t.get('process_limit'))}",
             _fmt(t.get("agents_pending")), _fmt(t.get("destinations")),
             _fmt(t.get("queued_entries")), _fmt(t.get("queued_recipients")), _state(t)]
            for t in transports]
    lines += _table(["TRANSPORT", "POLICY", "BUSY/LIMIT", "PENDING", "DESTS", "QUEUED",
                     "RCPTS", "STATE"], rows)
    lines.append("")
    asking = [t for t in transports if isinstance(t.get("delivery_policy"), dict)]
    if asking:
        rows = []
        for t in asking:
            p = t["delivery_policy"]
            assert isinstance(p, dict)
            rows.append([_fmt(t.get("name")), _fmt(p.get("service"))]
                        + [_fmt(p.get(k)) for k in ("asked", "deliver", "defer", "hold",
                                                    "reject", "unknown", "errors",
                                                    "connections")])
        lines += _table(["TRANSPORT", "POLICY SERVICE", "ASKED", "DELIVER", "DEFER", "HOLD",
                         "REJECT", "UNKNOWN", "ERRORS", "CONNECTIONS"], rows)
        lines.append("")
    held = _dicts(reply.get("suspensions"))
    if held:
        lines += _table(["SUSPENDED", "BY", "ENDS IN", "REASON"],
                        [[_fmt(h.get("target")), _fmt(h.get("by")),
                          _seconds(h.get("ends_in")), _fmt(h.get("reason") or "-")]
                         for h in held])
        lines.append("")
    retry = reply.get("deferred_retry")
    if isinstance(retry, dict):
        lines += _retry_lines(retry)
        lines.append("")
    fleet = reply.get("fleet")
    if isinstance(fleet, dict):
        lines += _fleet_lines(fleet)
        lines.append("")
    lines += _classes_lines(reply)
    lookups = reply.get("site_lookups")
    if isinstance(lookups, dict):
        lines += _lookup_lines(lookups)
    lines += _sources_lines(reply.get("sources"))
    lines += _events_lines(reply.get("delivery_events"))
    sites = _dicts(reply.get("sites"))
    if sites:
        lines += _table(["SITE", "TRANSPORT", "DESTS", "IN FLIGHT/LIMIT", "STATE", "RULE"],
                        [[_fmt(x.get("name")), _fmt(x.get("transport")),
                          _fmt(x.get("destinations")),
                          f"{_fmt(x.get('in_flight'))}/{_fmt(x.get('bound') or '-')}",
                          _fmt(x.get("state")), _fmt(x.get("rule") or "-")] for x in sites])
        lines.append("")
    if not destinations:
        lines.append("no destinations in core")
        return lines
    rows = [[_fmt(d.get("name")), _fmt(d.get("transport")),
             f"{_fmt(d.get('window'))}/{_fmt(d.get('limit'))}", _fmt(d.get("in_flight")),
             _fmt(d.get("queued_entries")), _fmt(d.get("queued_recipients")),
             _fmt(d.get("success")), _fmt(d.get("failure")), _fmt(d.get("fail_cohorts")),
             _state(d)]
            for d in destinations]
    lines += _table(["DESTINATION", "TRANSPORT", "WINDOW/LIMIT", "IN FLIGHT", "QUEUED",
                     "RCPTS", "SUCCESS", "FAILURE", "COHORTS", "STATE"], rows)
    return lines


def _events_lines(events: object) -> list[str]:
    """Delivery events (issue #46): what was read from trace logs, written to the
    file, and streamed to Redis."""
    if not isinstance(events, dict):
        return []
    read, wrote = events.get("reading"), events.get("writing")
    read = read if isinstance(read, dict) else {}
    wrote = wrote if isinstance(wrote, dict) else {}
    lines = [f"delivery events: {_fmt(read.get('events'))} read ("
             f"{_fmt(read.get('repeated'))} again after a restart, "
             f"{_fmt(read.get('bad_records'))} bad records, "
             f"{_fmt(read.get('read_errors'))} read errors), "
             f"{_fmt(wrote.get('written'))} written ({_fmt(wrote.get('queued'))} waiting, "
             f"{_fmt(wrote.get('held_back'))} held back, {_fmt(wrote.get('failures'))} "
             f"failures, {_fmt(wrote.get('rotations'))} rotations)"]
    if wrote.get("last_error"):
        lines.append(f"  events file: {_fmt(wrote.get('last_error'))}")
    stream = events.get("stream")
    if isinstance(stream, dict):
        lines.append(f"  stream {_fmt(stream.get('key'))}: {_fmt(stream.get('sent'))} sent, "
                     f"{_fmt(stream.get('pending'))} waiting, {_fmt(stream.get('dropped'))} "
                     f"dropped, {_fmt(stream.get('failures'))} failures"
                     + (f" (last: {_fmt(stream.get('last_error'))})"
                        if stream.get("last_error") else ""))
    lines.append("")
    return lines


def _fleet_lines(fleet: dict[str, object]) -> list[str]:
    """The fleet's shared state: this node, Redis, and each destination's share."""
    state = "unavailable" if fleet.get("unavailable") else (
        "connected" if fleet.get("connected") else "not connected")
    lines = [f"fleet: node {_fmt(fleet.get('node'))}, shared state "
             f"{_fmt(fleet.get('shared_state'))} ({state}, on failure "
             f"{_fmt(fleet.get('failure'))}); asked {_fmt(fleet.get('asked'))}, admitted "
             f"{_fmt(fleet.get('admitted'))}, sessions full {_fmt(fleet.get('sessions_full'))}"
             f", rate waits {_fmt(fleet.get('rate_wait'))}, errors {_fmt(fleet.get('errors'))}"
             f"; throttling told {_fmt(fleet.get('throttling_told'))}, heard "
             f"{_fmt(fleet.get('throttling_heard'))}, refused "
             f"{_fmt(fleet.get('throttling_refused'))}"]
    if fleet.get("servers") is not None:
        lines.append(f"fleet roster: {_fmt(fleet.get('servers'))} servers, "
                     f"{_fmt(fleet.get('differences'))} settings differ (pyqmgr status "
                     f"--fleet), lease time in force "
                     f"{_seconds(fleet.get('lease_time_in_force'))}, "
                     f"{_fmt(fleet.get('waits_capped'))} waits capped")
    rows = [[_fmt(d.get("queue")), _fmt(d.get("transport")), _fmt(d.get("text"))]
            for d in _dicts(fleet.get("destinations"))]
    if rows:
        lines += _table(["FLEET DESTINATION", "TRANSPORT", "SHARE"], rows)
    return lines


def _limits_text(limits: object) -> str:
    """A server's published limits in a few words: ``default: 5 sessions; smtp: 10/s
    burst 2`` (default: the bare ``fleet_*`` parameters, for every other transport)."""
    parts = []
    for transport, kinds in limits.items() if isinstance(limits, dict) else ():
        for kind, lim in kinds.items() if isinstance(kinds, dict) else ():
            if not isinstance(lim, dict):
                continue
            words = []
            if lim.get("sessions"):
                words.append(f"{_fmt(lim['sessions'])} sessions")
            if lim.get("rate"):
                words.append(f"{_fmt(lim['rate'])} burst {_fmt(lim.get('burst'))}")
            if words:
                name = "default" if transport == "*" else transport
                where = name if kind == "destination" else f"{name} sites"
                parts.append(f"{where}: {', '.join(words)}")
    return "; ".join(parts) or "none"


def _ago(value: object) -> str:
    return ago(value) if isinstance(value, int | float) else "never"


def fleet_roster_lines(reply: dict[str, object]) -> list[str]:
    """``pyqmgr status --fleet``: every server in the roster, then each one's
    destinations, then the settings in which they differ."""
    servers = _dicts(reply.get("servers"))
    lines = [f"fleet: {len(servers)} servers in the roster of "
             f"{_fmt(reply.get('shared_state'))}, read by {_fmt(reply.get('node'))}; lease "
             f"time in force {_seconds(reply.get('lease_time_in_force'))}"]
    if not reply.get("read"):
        lines.append(f"Redis did not answer ({_fmt(reply.get('error'))}): this server's own "
                     "record only")
    lines.append("")
    rows = []
    for srv in servers:
        units = _dicts(srv.get("units"))
        rows.append([_fmt(srv.get("node")) + (" *" if srv.get("this") else ""),
                     _fmt(srv.get("instance")), _fmt(srv.get("pid")), _fmt(srv.get("version")),
                     _fmt(srv.get("layout")), _fmt(srv.get("mode")), _fmt(srv.get("errors")),
                     _ago(srv.get("last_sync_age")), _ago(srv.get("age")),
                     str(sum(int(_num(u.get("leases"))) for u in units)),
                     str(sum(int(_num(u.get("waiting"))) for u in units)),
                     _limits_text(srv.get("limits"))])
    lines += _table(["SERVER", "INSTANCE", "PID", "VERSION", "LAYOUT", "MODE", "ERRORS",
                     "LAST SYNC", "PUBLISHED", "LEASES", "WAITING", "LIMITS"], rows)
    rows = [[_fmt(srv.get("node")), _fmt(u.get("transport")), _fmt(u.get("unit")),
             _fmt(u.get("leases")), _fmt(u.get("waiting")),
             f"{_fmt(u.get('fleet_sessions'))} of {_fmt(u.get('limit'))}"
             if u.get("limit") else "-", _fmt(u.get("mode"))]
            for srv in servers for u in _dicts(srv.get("units"))]
    lines.append("")
    if rows:
        lines += _table(["SERVER", "TRANSPORT", "DESTINATION", "LEASES", "WAITING",
                         "FLEET SESSIONS", "MODE"], rows)
    else:
        lines.append("no server holds or waits for a fleet session")
    more = [s for s in servers if _num(s.get("units_total")) > len(_dicts(s.get("units")))]
    for srv in more:
        lines.append(f"  {_fmt(srv.get('node'))}: the busiest {len(_dicts(srv.get('units')))} "
                     f"of {_fmt(srv.get('units_total'))} destinations shown")
    differences = _dicts(reply.get("differences"))
    if differences:
        lines.append("")
        lines += _table(["DIFFERS", "SETTING", "THEIRS", "THIS NODE", "OBEYED"],
                        [[_fmt(d.get("node")), _fmt(d.get("setting")), _fmt(d.get("theirs")),
                          _fmt(d.get("ours")), _fmt(d.get("obeyed") or "-")]
                         for d in differences])
    for skipped in _dicts(reply.get("skipped")):
        lines.append(f"skipped the record of {_fmt(skipped.get('server'))}: "
                     f"{_fmt(skipped.get('why'))}")
    return lines


def _retry_lines(retry: dict[str, object]) -> list[str]:
    """pyqmgr.cf's deferred retry: jitter and recovery, with any recovery under way."""
    parts = []
    if retry.get("jitter"):
        parts.append(f"jitter {_fmt(retry['jitter'])} ({_fmt(retry.get('jittered'))} "
                     "retry times jittered)")
    if retry.get("recovery_rate"):
        parts.append(f"recovery at {_fmt(retry['recovery_rate'])}: "
                     f"{_fmt(retry.get('remembered'))} deferred messages remembered for "
                     f"{_fmt(retry.get('remembered_destinations'))} destinations (limit "
                     f"{_fmt(retry.get('remembered_limit'))}), "
                     f"{_fmt(retry.get('recoveries'))} recoveries brought "
                     f"{_fmt(retry.get('brought_forward'))} forward")
    lines = ["deferred retry: " + "; ".join(parts or ["off"])]
    runs = _dicts(retry.get("recovering"))
    if runs:
        lines += _table(["RECOVERING", "TRANSPORT", "BROUGHT FORWARD", "GONE", "LEFT",
                         "FOR", "AFTER"],
                        [[_fmt(r.get("destination")), _fmt(r.get("transport")),
                          f"{_fmt(r.get('brought_forward'))}/{_fmt(r.get('total'))}",
                          _fmt(r.get("gone")), _fmt(r.get("left")), _seconds(r.get("for")),
                          _fmt(r.get("why"))] for r in runs])
    return lines


def _reason_lines(reasons: list[dict[str, object]]) -> list[str]:
    lines = []
    for r in reasons:
        constraint = _fmt(r.get("constraint"))
        setting = r.get("setting")
        where = f" [{r['destination']}]" if r.get("destination") else ""
        lines.append(f"  {constraint}{where}: {_fmt(r.get('text'))}")
        if setting:
            lines.append(f"      setting: {setting}")
    return lines


def _when(wall: object, relative: str) -> str:
    """A time of the reply as the local clock says it, and how far from now."""
    return f"{clock(wall)} ({relative})" if isinstance(wall, int | float) else relative


def _queued_facts(reply: dict[str, object]) -> list[str]:
    """The envelope's times: arrival, next try or hold, when it is returned."""
    sender = reply.get("sender")
    lines = []
    if reply.get("arrival_time") is not None:
        lines.append(f"  from <{_fmt(sender) if sender else ''}>, arrived "
                     + _when(reply["arrival_time"], ago(_number(reply.get("arrived_ago")))))
    next_in = _number(reply.get("next_try_in"))
    if reply.get("queue") == "deferred" or (next_in is not None and next_in > 1):
        lines.append("  next try after " + _when(reply.get("next_try_time"), until(next_in)))
    if reply.get("held_since") is not None:
        lines.append("  on hold since "
                     + _when(reply["held_since"], ago(_number(reply.get("held_for")))))
    expires_in = _number(reply.get("expires_in"))
    if expires_in is not None:
        setting = _fmt(reply.get("lifetime_setting"))
        lines.append(f"  returned to the sender if not delivered by "
                     f"{_when(reply.get('expires_time'), f'{until(expires_in)}, {setting}')}"
                     if expires_in > 0 else
                     f"  past its {setting}: returned to the sender at its next "
                     "delivery attempt")
    return lines


def _recipient_lines(reply: dict[str, object]) -> list[str]:
    rows = _dicts(reply.get("recipients"))
    pending = reply.get("recipients_pending")
    more = " and more in the file" if reply.get("recipients_more") else ""
    shown = (f", the first {len(rows)} shown"
             if isinstance(pending, int) and pending > len(rows) else "")
    lines = [f"  recipients: {_fmt(pending)} to deliver{more}{shown}"]
    for r in rows:
        route = (f" ({_fmt(r.get('transport'))}:{_fmt(r.get('nexthop'))})"
                 if r.get("transport") else "")
        why = (f": {_fmt(r.get('status'))} {_fmt(r.get('reason'))}" if r.get("reason")
               else ": no reason logged" if reply.get("queue") == "deferred" else "")
        lines.append(f"    {_fmt(r.get('address'))}{route}{why}")
    if reply.get("routing"):
        lines.append(f"    (destinations not looked up: {_fmt(reply['routing'])})")
    return lines


def _queued_lines(reply: dict[str, object]) -> list[str]:
    """A message outside the active queue: where it is, its times, each recipient's
    last reason, then what its destinations' state in core says."""
    lines = [f"{_fmt(reply.get('target'))}: message in the {_fmt(reply.get('queue'))} "
             "queue (not in core)"]
    lines += _queued_facts(reply)
    reasons = _dicts(reply.get("reasons"))
    lines += _reason_lines(reasons[:1])
    if "recipients" in reply:
        lines += _recipient_lines(reply)
    lines += _reason_lines(reasons[1:])
    for d in _dicts(reply.get("destinations")):
        if not d.get("in_core"):
            lines.append(f"  destination {_fmt(d.get('nexthop'))} ({_fmt(d.get('transport'))}"
                         "): not in core (no mail for it in the active queue now)")
    log = reply.get("defer_log")
    if isinstance(log, dict) and log.get("error"):
        lines.append(f"  defer log {_fmt(log.get('path'))}: {_fmt(log['error'])}")
    elif isinstance(log, dict) and _num(log.get("read")) < _num(log.get("size")):
        lines.append(f"  defer log {_fmt(log.get('path'))}: the first {_fmt(log.get('read'))} "
                     f"of {_fmt(log.get('size'))} bytes read")
    warnings = reply.get("warnings")
    for text in warnings if isinstance(warnings, list) else ():
        lines.append(f"  warning: {text}")
    return lines


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(
        value, bool) else None


def explain_lines(reply: dict[str, object]) -> list[str]:
    """What the target is, then one line per reason with its constraint and setting."""
    target = _fmt(reply.get("target"))
    kind = reply.get("kind")
    if kind == "message" and reply.get("in_core") is False:
        return _queued_lines(reply)
    if kind == "destination":
        head = f"{target}: destination"
        dests = _dicts(reply.get("destinations"))
        if dests:
            head += " (" + "; ".join(
                f"{_fmt(d.get('transport'))}: window {_fmt(d.get('window'))}/"
                f"{_fmt(d.get('limit'))}, {_fmt(d.get('in_flight'))} in flight, "
                f"{_fmt(d.get('queued_entries'))} queued" for d in dests) + ")"
    elif kind == "message":
        head = (f"{target}: message in the active queue "
                f"({_fmt(reply.get('queued_entries'))} entries queued, "
                f"{_fmt(reply.get('in_flight'))} in flight)")
    else:
        head = f"{target}: not in core, nor in the queue"
    return [head, *_reason_lines(_dicts(reply.get("reasons")))]


def control_lines(command: str, reply: dict[str, object]) -> list[str]:
    """What a control did, in a line or two (suspend, resume, retry)."""
    target = _fmt(reply.get("target"))
    if command == "suspend":
        ttl = reply.get("ttl")
        lines = [f"suspended {target} for {_seconds(ttl)}"
                 + (" (replacing its earlier suspension)" if reply.get("replaced") else "")]
        in_core = reply.get("in_core")
        if isinstance(in_core, list) and in_core:
            lines.append(f"  held now: {', '.join(str(q) for q in in_core)}")
        else:
            lines.append("  nothing for it in core now; mail that comes is held")
        if reply.get("saved") is False:
            lines.append("  warning: not saved; it ends if qmgr restarts (see the maillog)")
        return lines
    if command == "resume":
        return [f"resumed {target}"]
    revived = reply.get("revived")
    if isinstance(revived, list) and revived:
        return [f"revived {', '.join(str(r) for r in revived)}",
                "  mail already deferred waits for its retry time; 'postqueue -f' or "
                "'postqueue -s SITE' sends it now"]
    return [f"{target}: nothing dead in core"]


# -- pyqmgr jobs -----------------------------------------------------------------------

#: Members of a jobs reply that are not the policy's own transport-level state.
_JOBS_FRAME = ("ok", "transport", "policy", "kind", "order", "total", "broken", "settings")


def _cell(value: object) -> str:
    if isinstance(value, list):
        return ",".join(_cell(v) for v in value) or "-"
    if isinstance(value, dict):
        return " ".join(f"{k}={_cell(v)}" for k, v in value.items())
    return _fmt(value)


def jobs_lines(reply: dict[str, object]) -> list[str]:
    """A heading (the transport, its policy, settings and state), then the list.

    nqmgr's jobs get their own table (slots, loan, stack); any other policy's list,
    a user's own included, is shown column by column as its items come.
    """
    kind = str(reply.get("kind") or "items")
    items = _dicts(reply.get(kind))
    total = reply.get("total")
    head = (f"transport {_fmt(reply.get('transport'))} ({_fmt(reply.get('policy'))}): "
            f"{_fmt(total if total is not None else len(items))} {kind}")
    if isinstance(total, int) and total > len(items):
        head += f", the first {len(items)} shown"
    lines = [head]
    if reply.get("broken"):
        lines.append("the policy failed and is not asked: the transport's destinations "
                     "as the core holds them")
    settings = reply.get("settings")
    if isinstance(settings, dict) and settings:
        lines.append("settings: " + ", ".join(f"{k} = {_cell(v)}" for k, v in settings.items()))
    state = {k: v for k, v in reply.items() if k not in _JOBS_FRAME and k != kind}
    if kind == "jobs" and reply.get("policy") == "nqmgr":
        return lines + _nqmgr_jobs(reply, items)
    if state:
        lines.append("state: " + ", ".join(f"{k} {_cell(v)}" for k, v in state.items()))
    if reply.get("order"):
        lines.append(f"order: {reply['order']}")
    lines.append("")
    if not items:
        lines.append(f"no {kind}")
        return lines
    header = list(items[0])
    rows = [[_cell(item.get(k)) for k in header] for item in items]
    return lines + _table([h.upper().replace("_", " ") for h in header], rows)


def _nqmgr_jobs(reply: dict[str, object], jobs: list[dict[str, object]]) -> list[str]:
    lines = []
    state = [f"current job {_fmt(reply.get('current_job'))}"]
    if reply.get("preemption") is False:
        state.append("preemption off (delivery_slot_cost below 2)")
    state.append(f"first job still reading recipients {_fmt(reply.get('next_unread'))}")
    state.append(f"spare recipient slots {_fmt(reply.get('spare_recipient_slots'))}")
    lines.append("; ".join(state))
    stacks = reply.get("stacks")
    if isinstance(stacks, list) and stacks:
        for chain in stacks:
            if isinstance(chain, list):
                lines.append("preemption stack, preempted first: "
                             + " <- ".join(_fmt(q) for q in chain))
    else:
        lines.append("preemption stack: empty (no job is preempted)")
    lines.append("")
    if not jobs:
        lines.append("no jobs")
        return lines
    rows = []
    for j in jobs:
        flags = [name for name, on in (
            ("current", j.get("current")), ("blocker", j.get("blocker")),
            ("preempted", bool(j.get("preempted_by")) and not j.get("current")),
            ("reading", j.get("reading"))) if on]
        dests = _dicts(j.get("destinations"))
        where = ", ".join(f"{_fmt(d.get('destination'))} {_fmt(d.get('todo'))}+"
                          f"{_fmt(d.get('in_flight'))}" for d in dests[:3])
        if len(dests) > 3:
            where += f", +{len(dests) - 3} more"
        rows.append([
            ">" if j.get("current") else "", _fmt(j.get("queue_id")),
            _fmt(j.get("stack_level")), _fmt(j.get("preempts")),
            f"{_fmt(j.get('slots_used'))}/{_fmt(j.get('slots_available'))}",
            _fmt(j.get("loan")), _fmt(j.get("preempt_for")),
            f"{_fmt(j.get('entries_selected'))}/{_fmt(j.get('entries_read'))}/"
            f"{_fmt(j.get('entries_max'))}",
            f"{_fmt(j.get('recipients'))}/{_fmt(j.get('recipient_limit'))}",
            _fmt(j.get("recipients_unread")), _seconds(j.get("age")),
            ",".join(flags) or "-", where or "-"])
        if "round" in j:  # classes and tenants (issue #34)
            rows[-1][2:2] = [_fmt(j.get("class")), _fmt(j.get("tenant") or "-"),
                             _fmt(j.get("round"))]
    segmented = any("round" in j for j in jobs)
    return lines + _table(["", "JOB", *(["CLASS", "TENANT", "ROUND"] if segmented else []),
                           "LEVEL", "PREEMPTS", "SLOTS USED/AVAIL", "LOAN",
                           "PREEMPT<=", "ENTRIES SEL/READ/MAX", "RCPTS/LIMIT", "UNREAD",
                           "AGE", "STATE", "DESTINATIONS TODO+OUT"], rows)


# -- any command -------------------------------------------------------------------------


def reply_lines(command: str, reply: dict[str, object],
                view: dict[str, object] | None = None) -> list[str]:
    """The text ``pyqmgr COMMAND`` prints for a successful reply.

    ``view`` holds the subcommand's own options (``CommandSpec.view``: status's sort).
    A command with no text of its own here yet is shown as its JSON, so that a new
    command works from the CLI as soon as it is in ``COMMANDS``.
    """
    view = view or {}
    if command == "status" and "servers" in reply:
        return fleet_roster_lines(reply)
    if command == "status":
        return status_lines(reply, str(view.get("sort", "name")))
    if command == "explain":
        return explain_lines(reply)
    if command == "jobs":
        return jobs_lines(reply)
    if command in ("suspend", "resume", "retry"):
        return control_lines(command, reply)
    return json.dumps(reply, indent=2).splitlines()
