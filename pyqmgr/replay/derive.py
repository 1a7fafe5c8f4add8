"""From maillog lines to a workload: what arrived, and how each destination behaved.

Per Postfix instance (host and syslog_name), each message's lines are gathered by
queue id until qmgr's ``removed`` (or the end of the log), then turned into:

* an arrival: when, its size, its sender (hashed), its recipients per destination
  (recipient domain). Postfix logs times in whole seconds but each delivery line's
  ``delay`` to two significant digits, so the arrival is placed where every line of
  the message agrees: within a second of its first line (smtpd's ``client=``,
  pickup's, or cleanup's) and within each line's time less its delay. The message
  enters the simulation's active queue ``delays=`` a later, the wait before qmgr took
  it that the log shows (cleanup, the incoming queue), and its delays count from
  the arrival;
* mail queued before the log began (no submission line) arrives where its delivery
  lines put it (their time less ``delay``) and enters at its first qmgr line, or at
  the log's start when it was already in the active queue then; its delays count;
* per recipient, a script of its tries in order: at RCPT (or MAIL FROM, DATA, end of
  DATA) ``d`` a 4xx, ``b`` a 5xx, ``s`` accepted; a try that failed as a whole
  (connect or greeting outside a server's limits, a lost connection, a timeout in
  the conversation, TLS, DNS: ``4.4.3`` deferred, ``5.4.4`` bounced, error(8)) ``D``
  for a 4xx and ``B`` for a 5xx; a refused session (a 421 at greeting, a connection
  refused or timed out) ``C``, which the workload leaves to the destination's model
  (its session or rate limit, its down time) where it has one and makes a ``D``
  where it has none. The simulator gives the nth try of that recipient
  the nth answer, so greylisting, full mailboxes and flaky links come back as they
  were, whatever the schedule;
* content filters: a delivery whose reply says ``queued as ID`` where ID is a message
  of the same instance (amavis re-injecting through a second smtpd) is a hop to the
  filter, a destination of its own named after the relay (``[127.0.0.1]:10024``); the
  re-injected message follows it (it arrives as the filter's delivery is done) and
  its delays are end to end, from the first message's arrival;
* per destination, what only the destination decides and the schedule does not:
  the time a recipient takes (sessions' lengths over their recipients), whether it
  refused sessions with 421 at greeting (a session limit: the most sessions it
  accepted at once, read from the accepted sessions' intervals), answered a rate
  reply (``4.7.28``: the most sessions it accepted in a second), or was down
  (connections refused or timed out before it first accepted one).

A log with a long silence (``GAP``: a server switched off, or two logs days apart) is
cut there, each stretch replayed on its own, with a warning: mail does not wait
through a gap in the simulation as it did not in the log.

The log's own figures come out of the same pass: per destination the recipients
sent, deferred (each deferred line is one recipient's try) and bounced, and the
delivery delays of sent recipients, which the report holds the simulation against.
Every line that is not used is counted by kind (``Derived.unused``).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import random
import re
from array import array
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pyqmgr.postfix.mail_queue import queue_id_usec
from pyqmgr.postfix.maillog import (
    QUEUED_AS,
    Line,
    active,
    delay_quantum,
    delivery,
    queue_id,
)
from pyqmgr.replay.sites import Relays
from pyqmgr.replay.sources import SourceLog
from pyqmgr.simulator.scenario import DEFAULT_SENDER_DOMAIN, TraceMessage, is_sender

T = TypeVar("T")

#: Latency samples kept per destination (a uniform reservoir).
RESERVOIR = 4096
#: Programs whose status lines are no delivery attempt at a remote site.
NOT_AGENTS = ("retry", "error", "qmgr", "bounce", "cleanup")
#: Agents that speak SMTP or LMTP to a server: their failures outside a reply to a
#: command are failures of the session (stock throttles the site on a 4xx one).
SESSION_AGENTS = ("smtp", "lmtp")
#: Replies to one recipient or to the message: the recipient's own answer, no
#: failure of the site.
_RCPT_LEVEL = ("(in reply to RCPT TO command", "(in reply to end of DATA command",
               "(in reply to MAIL FROM command", "(in reply to DATA command")
_SUBMISSION = ("client=", "uid=", "message-id=", "resent-message-id=")
BULK = 20
#: Senders whose trace name is kept once computed (a log of one-off senders, VERP's,
#: would otherwise keep one for every message).
SENDERS_KEPT = 65536
#: Waits in the active queue shorter than this are taken for agent hand-off times.
HANDOFF_MAX = 1.0
#: A silence this long (seconds) cuts the log into stretches replayed apart.
GAP = 6 * 3600.0
_RELAY = re.compile(r"^(?P<name>[^\[\s]*)\[(?P<addr>[^\]]*)\](?::(?P<port>\d+))?$")


@dataclass
class Observed:
    """One destination as the log shows it."""

    name: str
    transports: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    deferred: int = 0
    bounced: int = 0
    #: Delivery delays of sent recipients (from their message's arrival).
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
    #: Tries that failed as a whole and are replayed as the log had them, by kind
    #: (``failure_kind``).
    failures: Counter[str] = field(default_factory=Counter)
    #: qmgr's own deferrals of a site it holds dead ("delivery temporarily
    #: suspended: connect to ...: Connection refused"), by what killed it, and when:
    #: a destination dead before the log began shows only these.
    suspended: Counter[str] = field(default_factory=Counter)
    suspended_times: list[float] = field(default_factory=list)
    #: Answers at RCPT/DATA: tries, 4xx and 5xx, and their texts.
    rcpt_tries: int = 0
    rcpt_4xx: int = 0
    rcpt_5xx: int = 0
    replies_4xx: Counter[str] = field(default_factory=Counter)
    replies_5xx: Counter[str] = field(default_factory=Counter)
    #: A content filter (a relay that re-injects into the same instance).
    content_filter: bool = False

    @property
    def transport(self) -> str:
        return self.transports.most_common(1)[0][0] if self.transports else "smtp"


@dataclass
class Derived:
    """One instance's workload (or one stretch of it) and the log's figures."""

    instance: str
    #: Epoch seconds of the first arrival (the workload's time 0) and the log's end.
    origin: float = 0.0
    end: float = 0.0
    destinations: dict[str, Observed] = field(default_factory=dict)
    trace: list[TraceMessage] = field(default_factory=list)
    #: Messages by what became of them: "replayed" (all in the trace), and of those
    #: "queued before the log", "in the active queue as the log began", "missing
    #: qmgr line", "re-injected by a content filter"; not replayed: "never queued"
    #: (rejected or discarded before the queue manager), "no delivery lines".
    messages: Counter[str] = field(default_factory=Counter)
    #: Lines about messages that could not be read.
    lines: Counter[str] = field(default_factory=Counter)
    #: Postfix lines read and deliberately not used, by kind, and how many lines of
    #: the instance were read in all: the report says how much was not modelled.
    unused: Counter[str] = field(default_factory=Counter)
    read: int = 0
    #: Warnings for the report (gaps in time), and what was fitted instance-wide.
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Ages of messages qmgr returned to sender as expired, and whether each was a
    #: bounce (null sender): where maximal/bounce_queue_lifetime lie.
    expiry_ages: list[tuple[float, bool]] = field(default_factory=list)
    #: When retried mail came back from the deferred queue (the time stamps of
    #: qmgr's lines for it, a sample): the deferred-queue scans' times, whose phase
    #: the simulation keeps.
    rescans: list[float] = field(default_factory=list)
    #: Retries seen whole (a sample): each message's age at its round's last line
    #: when it had a deferral (its ``delay=``), and the seconds from that line to its
    #: coming back. qmgr sets the retry time then, to the age bounded by
    #: minimal_backoff_time and maximal_backoff_time, and a deferred-queue scan (every
    #: queue_run_delay) brings it back: :mod:`.timing` holds them against the
    #: configuration replayed under.
    retries: list[tuple[float, float]] = field(default_factory=list)
    #: Per transport: first tries' waits in the active queue (``delays`` b) under
    #: HANDOFF_MAX, a sample, each with its destination: the workload keeps those of
    #: destinations that never refused a session, whose b is the time from a message
    #: coming in to its delivery leaving; at a throttled destination b is mostly a
    #: wait for its window, and a retry's b a wait behind the mail its deferred-queue
    #: scan brought back at once: the simulation makes both itself.
    handoffs: dict[str, list[tuple[float, str]]] = field(default_factory=dict)
    #: Trace messages' queue ids and content-filter parents, to link them at the end.
    qids: list[str] = field(default_factory=list)
    parents: dict[str, str] = field(default_factory=dict)
    #: The servers each destination's relay= fields named (``replay --sites``); None
    #: unless asked for, so that a replay without it reads and writes as before.
    relays: Relays | None = None
    #: What each pool member's tries met (``replay`` given the relay's pools);
    #: None otherwise, so that a replay without pools reads as before.
    sources: SourceLog | None = None
    #: The pools' part of the report, once the workload is built (``--json``'s
    #: ``sources``): the pools, the cold sources, the rules read and the log's rows.
    source_report: dict[str, Any] | None = None


#: A delivery line as kept: (time, pid, service, program, to, delay, c, d, status,
#: detail, a, b, dsn, destination or "" for the recipient's domain).
_DLine = tuple[float, int, str, str, str, float, float, float, str, str, float, float, str,
               str]


class _Msg:
    __slots__ = ("first", "submitted", "sender", "size", "queued", "lines", "first_qmgr",
                 "root_born", "parent", "filter_end", "children", "expired_at",
                 "deferred_at", "deferred_age")

    def __init__(self, first: float) -> None:
        self.first = first
        self.submitted = False
        self.sender: str | None = None
        self.size = 0
        self.queued = False
        self.first_qmgr: float | None = None
        #: Re-injected by a content filter: the first message's arrival and queue id.
        self.root_born: float | None = None
        self.parent = ""
        self.filter_end = 0.0
        #: Messages its content filter re-injected: (queue id, the hop's delay).
        self.children: list[tuple[str, float]] = []
        #: When qmgr returned it to sender as too old ("status=expired").
        self.expired_at: float | None = None
        #: The last line of a round with a deferral (when, the message's age then):
        #: where its retry time was set; None once it came back.
        self.deferred_at: float | None = None
        self.deferred_age = 0.0
        self.lines: list[_DLine] = []


class _Stretch:
    """One instance's state while reading: its messages in the queue and its clock."""

    __slots__ = ("pending", "start", "last", "number", "host", "instance", "derived")

    def __init__(self, start: float, number: int) -> None:
        self.pending: dict[str, _Msg] = {}
        self.start = start
        self.last = start
        self.number = number
        self.host = ""
        self.instance = ""
        self.derived: Derived


class _Tries:
    """One message's tries while its lines are read: each recipient's script (its
    answers, with their session's key or seconds), its destination, the sessions
    that answered at RCPT or DATA (by agent pid and start) and the recipients tried."""

    __slots__ = ("rcpts", "by_rcpt", "sessions", "tried")

    def __init__(self) -> None:
        self.rcpts: dict[str, list[tuple[str, tuple[int, int] | float]]] = {}
        self.by_rcpt: dict[str, str] = {}
        self.sessions: dict[tuple[int, int], list[tuple[float, float, str]]] = {}
        self.tried: set[str] = set()


def _answered(obs: Observed, code: str, detail: str) -> None:
    """A recipient's answer at RCPT or DATA (``code`` s, d or b) into its destination's
    shares and reply texts."""
    obs.rcpt_tries += 1
    if code == "d":
        obs.rcpt_4xx += 1
        obs.replies_4xx[_said(detail)] += 1
    elif code == "b":
        obs.rcpt_5xx += 1
        obs.replies_5xx[_said(detail)] += 1


def _said(detail: str) -> str:
    return detail.partition(" said: ")[2].split(" (in reply to")[0]


def _refused(obs: Observed, detail: str, at: float, seconds: float) -> None:
    """A refused session (at greeting, or its connection) into its destination's."""
    kind = refusal_kind(detail)
    obs.refusals[kind] += 1
    obs.refusal_times.append(at)
    obs.refusal_seconds.setdefault(kind, []).append(seconds)
    said = detail.split(": ", 1)[-1]
    obs.refusal_texts[said[:120]] += 1


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


def failure_kind(detail: str, dsn: str) -> str:
    """What a try that failed as a whole ran into, for the report."""
    low = detail.lower()
    if "host or domain name not found" in low or "name service error" in low:
        return "DNS: not found" if dsn.startswith("5") else "DNS: temporary failure"
    if "lost connection" in low:
        return "lost connection"
    if "tls" in low or "certificate" in low or "handshake" in low:
        return "TLS"
    if "timed out" in low or "timeout" in low:
        return "timeout in the conversation"
    if "refused to talk to me" in low:
        return "refused at greeting"
    if "connection refused" in low or "no route to host" in low or "network is unreachable" \
            in low:
        return "connection failed"
    return "other failure"


def try_code(program: str, status: str, detail: str) -> str | None:
    """A try's letter in its recipient's script; None: the destination's model plays it
    (a session limit, a rate limit, a host down)."""
    if status == "sent":
        return "s"
    if status not in ("deferred", "bounced", "expired"):
        return None
    soft = status == "deferred"
    if any(mark in detail for mark in _RCPT_LEVEL) or (
            program not in SESSION_AGENTS and program not in ("error", "retry")):
        return "d" if soft else "b"
    if program in ("error", "retry"):
        if "delivery temporarily suspended" in detail:
            return None  # qmgr's own deferral of a dead site: the simulation makes it
        return "d" if soft else "B"
    if soft and refusal_kind(detail) != "other":
        return None
    return "D" if soft else "B"


def unused_kind(line: Line, rest: str | None) -> str:
    """The kind of a Postfix line the replay does not use, for the report's account."""
    text = line.text
    prog = line.program
    if text.startswith(("warning:", "fatal:", "panic:", "error:")):
        return f"{prog}: {text.split(':', 1)[0]}s"
    if text.startswith("NOQUEUE:"):
        return f"{prog}: rejected before queueing (NOQUEUE)"
    if rest is None:
        if text.startswith(("connect to ", "SSL_connect error")):
            # One MX host's failure within a try: the try's status line counts it.
            return f"{prog}: notes on one MX host within a try"
        if text.startswith(("connect from", "disconnect from", "lost connection after",
                            "timeout after", "too many errors after", "improper command")):
            return f"{prog}: SMTP sessions (no message)"
        if text.startswith("statistics:") or "statistics" in text[:40]:
            return f"{prog}: statistics"
        if "TLS connection established" in text or "Anonymous TLS" in text \
                or "Trusted TLS" in text or "Verified TLS" in text or "Untrusted TLS" in text:
            return f"{prog}: TLS connections"
        return f"{prog}: lines about no message"
    if rest.startswith("sender non-delivery notification") or rest.startswith(
            "sender delivery status notification") or rest.startswith("postmaster "):
        return f"{prog}: notices sent (the notice is a message of its own)"
    if rest.startswith(("reject:", "milter-reject:", "discard:", "hold:", "filter:",
                        "redirect:", "warning:", "info:", "replace:", "prepend:")):
        return f"{prog}: header/body checks and milters ({rest.split(':', 1)[0]})"
    if rest.startswith("to=<"):
        return f"{prog}: address verification and other statuses"
    if rest.startswith("host ") or rest.startswith("enabling PIX") or rest.startswith(
            "lost connection") or rest.startswith("conversation with"):
        return f"{prog}: notes on a delivery (logged beside its status line)"
    if rest.startswith(("from=<", "size=")):
        return f"{prog}: message lines of another form"
    return f"{prog}: other lines about a message"


def relay_nexthop(relayhost: str) -> str:
    """main.cf's relayhost as the replay's destination name: ``[host]:port`` (a host
    without brackets is looked up by MX, but is still one destination); "" when it is
    unset or not plain (``$name`` expansions, several hosts)."""
    value = relayhost.strip()
    if not value or "$" in value or "," in value or " " in value:
        return ""
    if value.startswith("["):
        return value
    host, _, port = value.partition(":")
    return f"[{host}]" + (f":{port}" if port else "")


def filter_name(relay: str) -> str:
    """A content filter's destination name: Postfix's nexthop form ``[addr]:port``."""
    m = _RELAY.match(relay)
    if m is None:
        return relay
    return f"[{m['addr']}]" + (f":{m['port']}" if m["port"] else "")


class Deriver:
    """Feed it lines (any instances, in order); ``finish`` gives each instance's."""

    def __init__(self, hash_addresses: bool = True, key: bytes | None = None,
                 seed: int = 1, gap: float = GAP, relayhost: str = "",
                 sites: bool = False, sources: frozenset[str] = frozenset()) -> None:
        self.hash = hash_addresses
        #: The pools' members (master.cf services): their tries are kept per source.
        self.sources = sources
        #: Count the servers relay= names per destination (``replay --sites``).
        self.sites = sites
        #: main.cf's relayhost, as a nexthop (``[host]:port``): the smtp transport's
        #: mail is one destination there, as stock queues it, not one per domain.
        self.relayhost = relayhost
        self.key = key if key is not None else os.urandom(16)
        self.gap = gap
        self.instances: dict[str, Derived] = {}
        self._stretches: dict[str, _Stretch] = {}
        self._last: _Stretch | None = None
        self._rng = random.Random(seed)
        self._handoffs_seen: Counter[str] = Counter()
        #: Senders as the trace names them (hashing each is most of its cost, and a
        #: day's mail comes from far fewer senders than messages).
        self._senders: dict[str, str] = {}

    # -- lines ------------------------------------------------------------------------

    def _stretch(self, line: Line) -> _Stretch:
        """The line's instance's current stretch, a new one after a gap. Every line
        comes through here: the common case (same instance, no gap) is kept short."""
        st = self._last
        if st is not None and line.host == st.host and line.instance == st.instance and \
                line.time - st.last <= self.gap:
            if line.time > st.last:
                st.last = line.time
            return st
        inst = f"{line.host}/{line.instance}"
        st = self._stretches.get(inst)
        if st is None:
            st = self._stretches[inst] = _Stretch(line.time, 1)
            st.host, st.instance = line.host, line.instance
            st.derived = self.instances[inst] = Derived(
                inst, relays=Relays() if self.sites else None,
                sources=SourceLog(self.sources) if self.sources else None)
        elif line.time - st.last > self.gap:
            # A silence: what was queued stays as it stands, and the log goes on as
            # another stretch (its queued mail is mail queued before it).
            self._close(st)
            old = st.derived
            number = st.number + 1
            key = f"{inst}#{number}"
            st = self._stretches[inst] = _Stretch(line.time, number)
            st.host, st.instance = line.host, line.instance
            new = st.derived = self.instances[key] = Derived(
                key, relays=Relays() if self.sites else None,
                sources=SourceLog(self.sources) if self.sources else None)
            hours = (line.time - old.end) / 3600
            warning = (f"no line for {hours:.1f} hours: the log is cut there and each "
                       "stretch replayed on its own")
            old.warnings.append(warning + f" (it goes on as {key})")
            new.warnings.append(warning + f" (it follows {old.instance})")
        if line.time > st.last:
            st.last = line.time
        self._last = st
        return st

    def feed(self, lines: Iterable[Line]) -> None:
        for line in lines:
            st = self._stretch(line)
            derived = st.derived
            derived.read += 1
            if line.time > derived.end:
                derived.end = line.time
            text = line.text
            head = queue_id(text)
            if head is None:
                derived.unused[unused_kind(line, None)] += 1
                continue
            qid, rest = head
            if qid.isalpha() and qid.islower():
                # "statistics: ...", "warning: ...": a word, not a queue id.
                derived.unused[unused_kind(line, None)] += 1
                continue
            pending = st.pending
            msg = pending.get(qid)
            if rest.startswith("to=<"):
                self._delivery(st, qid, line, rest, msg)
            elif line.program == "qmgr":
                if rest == "removed":
                    if msg is not None:
                        self._finish(st, qid, pending.pop(qid))
                    continue
                a = active(text)
                if a is None and rest.endswith("status=expired, returned to sender"):
                    if msg is None:
                        msg = pending[qid] = _Msg(line.time)
                    msg.expired_at = line.time
                    if msg.sender is None:
                        msg.sender = rest[6:rest.find(">")] if rest.startswith("from=<") else ""
                    continue
                if a is None:
                    if rest.startswith("from=<") and "(queue active" not in rest and \
                            "status=" not in rest:
                        derived.lines["qmgr lines cut short or malformed"] += 1
                    else:
                        derived.unused[unused_kind(line, rest)] += 1
                    continue
                if msg is None:
                    msg = pending[qid] = _Msg(line.time)
                if not msg.queued:
                    msg.queued, msg.sender, msg.size = True, a[1], a[2]
                    msg.first_qmgr = line.time
                else:
                    # Back in the active queue: a deferred-queue scan has just run.
                    if len(derived.rescans) < RESERVOIR:
                        derived.rescans.append(line.time)
                    if msg.deferred_at is not None:
                        if len(derived.retries) < RESERVOIR:
                            derived.retries.append((msg.deferred_age,
                                                    line.time - msg.deferred_at))
                        msg.deferred_at = None
            elif rest.startswith(_SUBMISSION) and line.program in (
                    "smtpd", "pickup", "cleanup", "qmqpd", "postsuper"):
                if msg is None:
                    msg = pending[qid] = _Msg(line.time)
                msg.submitted = True
            else:
                derived.unused[unused_kind(line, rest)] += 1

    def _delivery(self, st: _Stretch, qid: str, line: Line, rest: str,
                  msg: _Msg | None) -> None:
        """A delivery agent's status line (``to=<...>``): kept with its message."""
        derived = st.derived
        pending = st.pending
        text = line.text
        d = delivery(text)
        if d is None:
            derived.lines["delivery lines cut short or malformed"] += 1
            return
        if d.status not in ("sent", "deferred", "bounced", "expired"):
            derived.unused[unused_kind(line, rest)] += 1
            return
        if msg is None:
            msg = pending[qid] = _Msg(line.time)
        hop = ""
        if d.status == "sent":
            m = QUEUED_AS.search(d.detail)
            child = pending.get(m.group(1)) if m is not None else None
            if m is not None and child is not None and m.group(1) != qid:
                # Re-injected into this instance: a content filter's hop.
                hop = filter_name(d.relay)
                born = msg.root_born if msg.root_born is not None else \
                    line.time - d.delay
                child.root_born = born
                child.parent = qid
                child.filter_end = line.time
                msg.children.append((m.group(1), d.delay))
        relays = derived.relays
        if relays is not None and not hop and line.program in SESSION_AGENTS and \
                not (self.relayhost and line.service == "smtp"):
            # Counted as read, not kept with the line: a content filter's hop
            # and the relayhost's mail are bracketed next hops, never grouped.
            relays.seen(d.to.rpartition("@")[2].lower() or "localhost", d.relay,
                        d.detail)
        if d.status == "deferred" or msg.deferred_at is not None:
            # The round's later lines move its end (qmgr defers the message once
            # its last delivery of the round is done).
            msg.deferred_at, msg.deferred_age = line.time, d.delay
        msg.lines.append((line.time, line.pid, line.service, line.program, d.to,
                          d.delay, d.c, d.d, d.status, d.detail, d.a, d.b, d.dsn,
                          hop))

    # -- one message --------------------------------------------------------------------

    def _finish(self, st: _Stretch, qid: str, msg: _Msg) -> None:
        derived = st.derived
        if not msg.queued and not msg.lines:
            derived.messages["never queued"] += 1
            return
        lines = sorted(msg.lines)
        arrival, enter = _placed(msg, lines, st.start, queue_id_usec(qid))
        if msg.parent:
            # A content filter hands the copy back before it answers (amavis, a
            # pipe's sendmail alike): the copy arrived as the filter's hop ended, to
            # the hundredth where the hop's line has it, and waited its own delays=
            # a for the active queue. Its own whole-second lines place it only to
            # within a second either way, and a gap between two such estimates,
            # kept at 0 or more, put the copies of a real filter run 0.085 s after
            # the hop at the median and 0.35 s at p95: the replayed mail arrived
            # 0.2 s late at its destination (p50 1.27 s against the log's 1.05).
            arrival = msg.filter_end
            enter = arrival + (lines[0][10] if lines else 0.0)
        if arrival is not None:
            # Its re-injected messages, still queued: their first arrival and the
            # filter hop's end, to the hundredth where the hop's line has seconds.
            root = msg.root_born if msg.root_born is not None else arrival
            for cq, hop_delay in msg.children:
                child = st.pending.get(cq)
                if child is not None:
                    child.root_born = root
                    child.filter_end = arrival + hop_delay
        if msg.root_born is not None:
            born: float | None = min(msg.root_born, enter)
            derived.messages["re-injected by a content filter"] += 1
        else:
            born = arrival if arrival is not None and arrival < enter else None
        if not msg.submitted:
            derived.messages["queued before the log" if msg.first_qmgr is not None
                             else "in the active queue as the log began"] += 1
        elif not msg.queued:
            derived.messages["missing qmgr line"] += 1
        if msg.expired_at is not None:
            derived.messages["expired (returned to sender)"] += 1
            if arrival is not None and len(derived.expiry_ages) < RESERVOIR:
                derived.expiry_ages.append((msg.expired_at - arrival, not msg.sender))
        measured = arrival is not None
        # End to end: a re-injected message's delays count from the first arrival.
        shift = (arrival - msg.root_born) if (
            msg.root_born is not None and arrival is not None) else 0.0
        gap = max(0.0, enter - msg.filter_end) if msg.parent else 0.0
        self._lines(derived, qid, msg, lines, arrival if arrival is not None else enter,
                    measured, shift, TraceMessage(enter, max(msg.size, 1), "mail", "", (),
                                                  measured, born, -1, round(gap, 3)))

    def _lines(self, derived: Derived, qid: str, msg: _Msg, lines: list[_DLine],
               arrival: float, measured: bool, shift: float, head: TraceMessage) -> None:
        """The message's delivery lines into the log's figures, the destinations'
        behaviour and its recipients' scripts; the message into the trace."""
        tries = _Tries()
        for line in lines:
            self._line(derived, tries, line, arrival, measured, shift)
        # After every line: the handoffs' samples above and the sessions' below draw
        # from one generator, in this order.
        per_of = self._sessions(derived, tries.sessions)
        counts: dict[tuple[str, str], int] = {}
        rcpts = tries.rcpts
        for to, domain in tries.by_rcpt.items():
            # Each try: its answer and the seconds its session took per recipient, so
            # that the replay's sessions last as the logged ones did. A recipient the
            # log never saw at RCPT has none, and the destination's shares decide.
            key = (domain, "".join([
                f"{code}{(per_of[k] if isinstance(k, tuple) else k):.3g}"
                for code, k in rcpts.get(to, ())]))
            counts[key] = counts.get(key, 0) + 1
        if not counts:
            derived.messages["no delivery lines"] += 1
            return
        derived.messages["replayed"] += 1
        sender = msg.sender or ""
        nrcpt = sum(counts.values())
        klass = "bounce" if not sender else "bulk" if nrcpt >= BULK else "mail"
        recipients = tuple((dom, n, script) for (dom, script), n in counts.items())
        derived.trace.append(head._replace(klass=klass, sender=self._sender(sender),
                                           recipients=recipients))
        derived.qids.append(qid)
        if msg.parent:
            derived.parents[qid] = msg.parent

    def _line(self, derived: Derived, tries: _Tries, line: _DLine, arrival: float,
              measured: bool, shift: float) -> None:
        """One delivery line: the log's figures, its destination's behaviour, its
        recipient's script (in ``tries``)."""
        (_t, pid, service, program, to, delay, c, d, status, detail, _a, b, dsn,
         hop) = line
        domain = hop or to.rpartition("@")[2].lower() or "localhost"
        if self.relayhost and not hop and service == "smtp" and (
                program == "smtp" or "delivery temporarily suspended" in detail):
            domain = self.relayhost
        obs = derived.destinations.get(domain)
        if obs is None:
            obs = derived.destinations[domain] = Observed(domain)
            obs.content_filter = bool(hop)
        end = arrival + delay
        if status == "sent":
            obs.sent += 1
            if measured:
                obs.delays.append(delay + shift)
        elif status == "deferred":
            obs.deferred += 1
        else:
            obs.bounced += 1
        key_to = f"{to}\0{hop}" if hop else to
        code = try_code(program, status, detail)
        if program in NOT_AGENTS or service in NOT_AGENTS:
            tries.by_rcpt.setdefault(key_to, domain)
            if code is not None and program in ("error", "retry"):
                tries.rcpts.setdefault(key_to, []).append((code, 0.0))
            elif "delivery temporarily suspended: " in detail:
                obs.suspended[refusal_kind(detail.partition("suspended: ")[2])] += 1
                if len(obs.suspended_times) < RESERVOIR:
                    obs.suspended_times.append(end)
            return
        obs.transports[service] += 1
        if b < HANDOFF_MAX and to not in tries.tried:
            self._handoffs_seen[service] += 1
            _sample(derived.handoffs.setdefault(service, []), (b, domain),
                    self._handoffs_seen[service], self._rng)
        tries.tried.add(to)
        script = tries.rcpts.setdefault(key_to, [])
        tries.by_rcpt[key_to] = domain
        sources = derived.sources
        if sources is not None and service in sources.members and \
                program in SESSION_AGENTS and sources.tried(
                    service, domain, code or "C", detail, dsn, end - c - d,
                    (pid, round((end - c - d) * 10)) not in tries.sessions,
                    code is None and refusal_kind(detail) == "rate limit"):
            # A provider's refusal of this source: the server's rule for the source
            # plays it in the simulation, whichever source a plan picks then.
            return
        if code == "s" or code == "d" or code == "b":
            start = end - c - d
            key = (pid, round(start * 10))
            script.append((code, key))
            _answered(obs, code, detail)
            tries.sessions.setdefault(key, []).append((start, end, domain))
        elif code == "D" or code == "B":
            script.append((code, c + d))
            obs.failures[failure_kind(detail, dsn)] += 1
        else:
            # A refused session: the destination's model plays it (a limit, a down
            # time) where it has one, else the script does (``C``).
            script.append(("C", c + d))
            _refused(obs, detail, end - c - d, c + d)

    def _sessions(self, derived: Derived,
                  sessions: dict[tuple[int, int], list[tuple[float, float, str]]]
                  ) -> dict[tuple[int, int], float]:
        """The message's accepted sessions into their destinations' starts, ends and
        latencies; each session's seconds per recipient."""
        per_of: dict[tuple[int, int], float] = {}
        for key, group in sessions.items():
            start = min(s for s, _, _ in group)
            end = max(e for _, e, _ in group)
            obs = derived.destinations[group[0][2]]
            obs.starts.append(start)
            obs.ends.append(end)
            obs.sessions_seen += 1
            per = per_of[key] = max(end - start, 0.0) / len(group)
            _sample(obs.latencies, per, obs.sessions_seen, self._rng)
        return per_of

    def _sender(self, sender: str) -> str:
        known = self._senders.get(sender)
        if known is None:
            known = self._hashed(sender)
            if len(self._senders) < SENDERS_KEPT:
                self._senders[sender] = known
        return known

    def _hashed(self, sender: str) -> str:
        if not sender:
            return f"mailer-daemon@{DEFAULT_SENDER_DOMAIN}"
        if not self.hash and is_sender(sender):
            return sender
        digest = hmac.new(self.key, sender.lower().encode(), hashlib.sha256).hexdigest()
        return f"h{digest[:16]}@{DEFAULT_SENDER_DOMAIN}"

    def _close(self, st: _Stretch) -> None:
        """Messages still in the queue at a stretch's end count as they stand."""
        for qid, msg in list(st.pending.items()):
            self._finish(st, qid, msg)
        st.pending.clear()

    def finish(self) -> dict[str, Derived]:
        for st in self._stretches.values():
            self._close(st)
        for derived in self.instances.values():
            order = sorted(range(len(derived.trace)), key=lambda i: derived.trace[i].at)
            trace = [derived.trace[i] for i in order]
            qids = [derived.qids[i] for i in order]
            index = {q: i for i, q in enumerate(qids)}
            for i, q in enumerate(qids):
                parent = derived.parents.get(q)
                j = index.get(parent, -1) if parent is not None else -1
                if 0 <= j < i:
                    trace[i] = trace[i]._replace(follows=j)
            derived.trace, derived.qids = trace, qids
            derived.parents.clear()
            if derived.trace:
                # A whole second of the clock: the simulation's whole seconds are then
                # the log's, as stock's retry times (whole seconds) need.
                derived.origin = float(math.floor(derived.trace[0].at))
        return self.instances


def _within_second(lo: float, hi: float, usec: int | None) -> float:
    """The arrival in [lo, hi] whose fraction of a second the queue id gives (the one
    nearer the middle if two fit); the middle where the id tells nothing or nothing
    fits.

    The lines alone leave a second's doubt, and which of two sessions a second apart
    a 421 limiter counts is decided within it: three real runs of a limiter of 5 fed a
    third of its capacity refused 9, 11 and 12 sessions; replays of the run with 11
    placing each arrival in the middle of its second refused 7 to 10, placed by the
    queue id 9 to 11. On a real run the placed arrivals were the submissions' own
    times to 2 ms.
    """
    mid = (lo + hi) / 2
    if usec is None:
        return mid
    frac = usec / 1e6
    near = math.floor(mid) + frac
    fits = [x for x in (near - 1.0, near, near + 1.0) if lo <= x <= hi]
    return min(fits, key=lambda x: abs(x - mid)) if fits else mid


def _placed(msg: _Msg, lines: list[_DLine], start: float,
            usec: int | None = None) -> tuple[float | None, float]:
    """When the message arrived (None: the log cannot tell) and when it entered the
    active queue, from its lines and its queue id's microseconds; ``start`` is its
    stretch's first line."""
    # Where the arrival can be: for each delivery line between its time less its
    # delay (each up to its resolution), and within a second of the first line
    # when the log saw the message come in.
    lo, hi = -math.inf, math.inf
    if msg.submitted:
        lo, hi = msg.first - 1.0, msg.first + 1.0
    for line in lines:
        t, delay = line[0], line[5]
        q = delay_quantum(delay)
        lo = max(lo, t - delay - q)
        hi = min(hi, t + 1.0 - delay + q)
    if lo <= hi and math.isfinite(lo) and math.isfinite(hi):
        arrival: float | None = _within_second(lo, hi, usec)
    elif msg.submitted:
        arrival = msg.first + 0.5
    elif lines:
        arrival = min(x[0] - x[5] for x in lines)
    else:
        arrival = None  # queued before the log and never delivered in it
    # When it entered the active queue: ``delays=`` a after it arrived (the first
    # try's), the first qmgr line, or the log's start.
    if msg.submitted:
        assert arrival is not None
        enter = arrival + (lines[0][10] if lines else 0.0)
        if msg.first_qmgr is not None:
            enter = min(max(enter, msg.first_qmgr), msg.first_qmgr + 1.0)
    elif msg.first_qmgr is not None:
        enter = msg.first_qmgr
        if lines:
            t0, delay0, a0 = lines[0][0], lines[0][5], lines[0][10]
            guess = t0 - delay0 + a0
            if msg.first_qmgr <= guess <= msg.first_qmgr + 1.0:
                enter = guess
    else:
        # In the active queue as the log began: since then, or since its first
        # logged delivery started if that was earlier.
        enter = start
        if lines:
            enter = min(enter, lines[0][0] - lines[0][6] - lines[0][7])
    if arrival is not None and arrival > enter:
        arrival = enter
    return arrival, enter


def _sample(kept: list[T], value: T, seen: int, rng: random.Random) -> None:
    """Reservoir sampling: ``kept`` stays a uniform sample of the ``seen`` values."""
    if len(kept) < RESERVOIR:
        kept.append(value)
    else:
        k = rng.randrange(seen)
        if k < RESERVOIR:
            kept[k] = value
