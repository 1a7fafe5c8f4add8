"""From maillog lines to a workload: what arrived, and how each destination behaved.

Per Postfix instance (host and syslog_name), each message's lines are gathered by
queue id until qmgr's ``removed`` (or the end of the log), then turned into:

* an arrival: when, its size, its sender (hashed), its recipients per destination
  (recipient domain). Postfix logs times in whole seconds but each delivery line's
  ``delay`` to two significant digits, so the arrival is placed where every line of
  the message agrees: within a second of its first line (smtpd's ``client=``,
  pickup's, or cleanup's) and within each line's time less its delay;
* per recipient, a script of its answers at RCPT (or DATA) time in order: ``d`` a
  4xx, ``b`` a 5xx, ``s`` accepted. The simulator's destination gives the nth try of
  that recipient the nth answer, so greylisting and full mailboxes come back as
  they were, whatever the schedule;
* per destination, what only the destination decides and the schedule does not:
  the time a recipient takes (sessions' lengths over their recipients), whether it
  refused sessions with 421 at greeting (a session limit: the most sessions it
  accepted at once, read from the accepted sessions' intervals), answered a rate
  reply (``4.7.28``: the most sessions it accepted in a second), or was down
  (connections refused or timed out before it first accepted one).

The log's own figures come out of the same pass: per destination the recipients
sent, deferred (each deferred line is one recipient's try) and bounced, and the
delivery delays of sent recipients, which the report holds the simulation against.
Messages queued before the log begins (no submission line) are replayed from their
first line but left out of the delay figures on both sides.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import random
from array import array
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from pyqmgr.postfix.maillog import Line, active, delay_quantum, delivery, queue_id
from pyqmgr.simulator.scenario import DEFAULT_SENDER_DOMAIN, TraceMessage, is_sender

T = TypeVar("T")

#: Latency samples kept per destination (a uniform reservoir).
RESERVOIR = 4096
#: Programs whose status lines are no delivery attempt at a remote site.
NOT_AGENTS = ("retry", "error", "qmgr", "bounce", "cleanup")
#: Lines that came from the remote server's answer to one recipient (or its message).
_RCPT_LEVEL = ("(in reply to RCPT TO command", "(in reply to end of DATA command")
_SUBMISSION = ("client=", "uid=", "message-id=", "resent-message-id=")
BULK = 20
#: Waits in the active queue shorter than this are taken for agent hand-off times.
HANDOFF_MAX = 1.0


@dataclass
class Observed:
    """One destination as the log shows it."""

    name: str
    transports: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    deferred: int = 0
    bounced: int = 0
    #: Delivery delays of sent recipients (messages that arrived within the log).
    delays: array = field(default_factory=lambda: array("d"))
    #: Seconds per recipient of accepted sessions (a reservoir sample).
    latencies: list[float] = field(default_factory=list)
    sessions_seen: int = 0
    #: Accepted sessions: starts and ends (seconds since the log's start).
    starts: array = field(default_factory=lambda: array("d"))
    ends: array = field(default_factory=lambda: array("d"))
    #: Refused sessions by kind: "session limit", "rate limit", "connection refused",
    #: "connection timed out", "other".
    refusals: Counter[str] = field(default_factory=Counter)
    refusal_times: list[float] = field(default_factory=list)
    refusal_seconds: dict[str, list[float]] = field(default_factory=dict)
    refusal_texts: Counter[str] = field(default_factory=Counter)
    #: Answers at RCPT/DATA: tries, 4xx and 5xx, and their texts.
    rcpt_tries: int = 0
    rcpt_4xx: int = 0
    rcpt_5xx: int = 0
    replies_4xx: Counter[str] = field(default_factory=Counter)
    replies_5xx: Counter[str] = field(default_factory=Counter)

    @property
    def transport(self) -> str:
        return self.transports.most_common(1)[0][0] if self.transports else "smtp"


@dataclass
class Derived:
    """One instance's workload and the log's figures."""

    instance: str
    #: Epoch seconds of the first arrival (the workload's time 0) and the log's end.
    origin: float = 0.0
    end: float = 0.0
    destinations: dict[str, Observed] = field(default_factory=dict)
    trace: list[TraceMessage] = field(default_factory=list)
    #: Messages by what became of them: "replayed", "queued before the log", "missing
    #: qmgr line", "never queued" (rejected or discarded before the queue manager).
    messages: Counter[str] = field(default_factory=Counter)
    #: Lines about messages that could not be read.
    lines: Counter[str] = field(default_factory=Counter)
    #: When retried mail came back from the deferred queue (the time stamps of
    #: qmgr's lines for it, a sample): the deferred-queue scans' times, whose phase
    #: the simulation keeps.
    rescans: list[float] = field(default_factory=list)
    #: Per transport: first tries' waits in the active queue (``delays`` b) under
    #: HANDOFF_MAX, a sample, each with its destination: the workload keeps those of
    #: destinations that never refused a session, whose b is the time from a message
    #: coming in to its delivery leaving; at a throttled destination b is mostly a
    #: wait for its window, and a retry's b a wait behind the mail its deferred-queue
    #: scan brought back at once: the simulation makes both itself.
    handoffs: dict[str, list[tuple[float, str]]] = field(default_factory=dict)


class _Msg:
    __slots__ = ("first", "submitted", "sender", "size", "queued", "lines")

    def __init__(self, first: float) -> None:
        self.first = first
        self.submitted = False
        self.sender: str | None = None
        self.size = 0
        self.queued = False
        #: (time, pid, service, program, to, delay, c, d, status, detail, a, b)
        self.lines: list[tuple[float, int, str, str, str, float, float, float, str, str,
                               float, float]] = []


def refusal_kind(detail: str) -> str:
    if "refused to talk to me" in detail:
        if "4.7.28" in detail or "rate" in detail.lower():
            return "rate limit"
        return "session limit"
    if "Connection refused" in detail:
        return "connection refused"
    if "Connection timed out" in detail or "timed out while receiving the initial" in detail:
        return "connection timed out"
    return "other"


class Deriver:
    """Feed it lines (any instances, in order); ``finish`` gives each instance's."""

    def __init__(self, hash_addresses: bool = True, key: bytes | None = None,
                 seed: int = 1) -> None:
        self.hash = hash_addresses
        self.key = key if key is not None else os.urandom(16)
        self.instances: dict[str, Derived] = {}
        self._pending: dict[str, dict[str, _Msg]] = {}
        self._rng = random.Random(seed)
        self._handoffs_seen: Counter[str] = Counter()

    # -- lines ------------------------------------------------------------------------

    def feed(self, lines: Iterable[Line]) -> None:
        for line in lines:
            text = line.text
            head = queue_id(text)
            if head is None:
                continue
            qid, rest = head
            inst = f"{line.host}/{line.instance}"
            pending = self._pending.get(inst)
            if pending is None:
                pending = self._pending[inst] = {}
                self.instances[inst] = Derived(inst)
            msg = pending.get(qid)
            if rest.startswith("to=<"):
                d = delivery(text)
                if d is None:
                    self.instances[inst].lines["delivery lines cut short or malformed"] += 1
                    continue
                if msg is None:
                    msg = pending[qid] = _Msg(line.time)
                msg.lines.append((line.time, line.pid, line.service, line.program, d.to,
                                  d.delay, d.c, d.d, d.status, d.detail, d.a, d.b))
            elif line.program == "qmgr":
                if rest == "removed":
                    if msg is not None:
                        self._finish(inst, qid, pending.pop(qid))
                    continue
                a = active(text)
                if a is None:
                    if rest.startswith("from=<") and "(queue active" not in rest and \
                            "status=" not in rest:
                        self.instances[inst].lines["qmgr lines cut short or malformed"] += 1
                    continue
                if msg is None:
                    msg = pending[qid] = _Msg(line.time)
                if not msg.queued:
                    msg.queued, msg.sender, msg.size = True, a[1], a[2]
                elif len(self.instances[inst].rescans) < RESERVOIR:
                    # Back in the active queue: a deferred-queue scan has just run.
                    self.instances[inst].rescans.append(line.time)
            elif rest.startswith(_SUBMISSION) and line.program in (
                    "smtpd", "pickup", "cleanup", "qmqpd", "postsuper"):
                if msg is None:
                    msg = pending[qid] = _Msg(line.time)
                msg.submitted = True

    # -- one message --------------------------------------------------------------------

    def _finish(self, inst: str, qid: str, msg: _Msg) -> None:
        derived = self.instances[inst]
        if not msg.queued:
            derived.messages["missing qmgr line" if msg.lines else "never queued"] += 1
            return
        # Where the arrival can be: within a second of the first line, and for each
        # delivery line between its time less its delay (each up to its resolution).
        lo, hi = msg.first - 1.0, msg.first + 1.0
        if not msg.submitted:
            lo, hi = msg.first, msg.first + 1.0
        for line in msg.lines:
            t, delay = line[0], line[5]
            q = delay_quantum(delay)
            lo = max(lo, t - delay - q)
            hi = min(hi, t + 1.0 - delay + q)
        arrival = (lo + hi) / 2 if lo <= hi else msg.first + 0.5
        if not msg.submitted:
            arrival = msg.first  # queued before the log: it enters at its first line
        derived.messages["replayed" if msg.submitted else "queued before the log"] += 1
        rcpts: dict[str, list[tuple[str, tuple[int, int]]]] = {}
        by_rcpt: dict[str, str] = {}
        sessions: dict[tuple[int, int], list[tuple[float, float, str]]] = {}
        tried: set[str] = set()
        for _t, pid, service, program, to, delay, c, d, status, detail, _a, b in sorted(
                msg.lines):
            domain = to.rpartition("@")[2].lower() or "localhost"
            obs = derived.destinations.get(domain)
            if obs is None:
                obs = derived.destinations[domain] = Observed(domain)
            end = arrival + delay
            if status == "sent":
                obs.sent += 1
                if msg.submitted:
                    obs.delays.append(delay)
            elif status == "deferred":
                obs.deferred += 1
            elif status in ("bounced", "expired"):
                obs.bounced += 1
            agent = program not in NOT_AGENTS and service not in NOT_AGENTS
            if not agent:
                by_rcpt.setdefault(to, domain)
                continue
            obs.transports[service] += 1
            if b < HANDOFF_MAX and to not in tried:
                self._handoffs_seen[service] += 1
                _sample(derived.handoffs.setdefault(service, []), (b, domain),
                        self._handoffs_seen[service], self._rng)
            tried.add(to)
            script = rcpts.setdefault(to, [])
            by_rcpt[to] = domain
            rcpt_level = status == "sent" or any(mark in detail for mark in _RCPT_LEVEL)
            if rcpt_level:
                code = "s" if status == "sent" else "d" if status == "deferred" else "b"
                start = end - c - d
                key = (pid, round(start * 10))
                script.append((code, key))
                obs.rcpt_tries += 1
                reply = detail.partition(" said: ")[2].split(" (in reply to")[0]
                if code == "d":
                    obs.rcpt_4xx += 1
                    obs.replies_4xx[reply] += 1
                elif code == "b":
                    obs.rcpt_5xx += 1
                    obs.replies_5xx[reply] += 1
                sessions.setdefault(key, []).append((start, end, domain))
            elif status != "sent":
                kind = refusal_kind(detail)
                obs.refusals[kind] += 1
                obs.refusal_times.append(end - c - d)
                obs.refusal_seconds.setdefault(kind, []).append(c + d)
                said = detail.split(": ", 1)[-1]
                obs.refusal_texts[said[:120]] += 1
        per_of: dict[tuple[int, int], float] = {}
        for key, lines in sessions.items():
            start = min(s for s, _, _ in lines)
            end = max(e for _, e, _ in lines)
            obs = derived.destinations[lines[0][2]]
            obs.starts.append(start)
            obs.ends.append(end)
            obs.sessions_seen += 1
            per = per_of[key] = max(end - start, 0.0) / len(lines)
            _sample(obs.latencies, per, obs.sessions_seen, self._rng)
        counts: Counter[tuple[str, str]] = Counter()
        for to, domain in by_rcpt.items():
            # Each try: its answer and the seconds its session took per recipient, so
            # that the replay's sessions last as the logged ones did. A recipient the
            # log never saw at RCPT has none, and the destination's shares decide.
            counts[(domain, "".join(f"{code}{per_of[key]:.3g}"
                                    for code, key in rcpts.get(to, [])))] += 1
        if not counts:
            derived.messages["replayed"] -= 1
            derived.messages["no delivery lines"] += 1
            return
        sender = msg.sender or ""
        nrcpt = sum(counts.values())
        klass = "bounce" if not sender else "bulk" if nrcpt >= BULK else "mail"
        recipients = tuple((dom, n, script) for (dom, script), n in counts.items())
        derived.trace.append(TraceMessage(arrival, max(msg.size, 1), klass,
                                          self._sender(sender), recipients,
                                          msg.submitted))

    def _sender(self, sender: str) -> str:
        if not sender:
            return f"mailer-daemon@{DEFAULT_SENDER_DOMAIN}"
        if not self.hash and is_sender(sender):
            return sender
        digest = hmac.new(self.key, sender.lower().encode(), hashlib.sha256).hexdigest()
        return f"h{digest[:16]}@{DEFAULT_SENDER_DOMAIN}"

    def finish(self) -> dict[str, Derived]:
        """Messages still in the queue at the log's end count as they stand."""
        for inst, pending in self._pending.items():
            for qid, msg in list(pending.items()):
                self._finish(inst, qid, msg)
            pending.clear()
        for derived in self.instances.values():
            derived.trace.sort(key=lambda m: m.at)
            if derived.trace:
                # A whole second of the clock: the simulation's whole seconds are then
                # the log's, as stock's retry times (whole seconds) need.
                derived.origin = float(math.floor(derived.trace[0].at))
        return self.instances


def _sample(kept: list[T], value: T, seen: int, rng: random.Random) -> None:
    """Reservoir sampling: ``kept`` stays a uniform sample of the ``seen`` values."""
    if len(kept) < RESERVOIR:
        kept.append(value)
    else:
        k = rng.randrange(seen)
        if k < RESERVOIR:
            kept[k] = value
