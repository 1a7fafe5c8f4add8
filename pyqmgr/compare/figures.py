"""The figures of one run, from its maillog and what the run recorded (``run.json``).

Every delivery figure comes from the maillog, the record an admin has too: the
agents' ``to=<...>, relay=..., delay=D, delays=a/b/c/d, dsn=..., status=...`` lines.
Postfix's ``delay`` is the time from the message's arrival to that line with 10 ms
resolution, and ``c`` and ``d`` are the agent's connection set-up and transmission,
so with the submission time of each queue id (``run.json``) every line has an end
(submission + delay) and every delivery attempt an interval (end - c - d to end), to
the hundredth of a second, where the maillog's own time stamps have whole seconds.

* latency: ``delay`` of each ``status=sent`` line, percentiles per message class
  (linear interpolation between closest ranks: numpy's default);
* time to drain: the last end of a ``sent`` or ``bounced`` line (None when the run
  did not drain within its timeout);
* per destination: recipients sent, bounced, deferral lines and the deferral rate
  (deferred lines / all lines: each line is one recipient's attempt), the deferred
  lines by the remote reply they quote (``421 4.7.28``...), and delivery attempts (lines of one
  request share agent pid, queue id and delays; lines of the retry and error
  transports and of qmgr are no attempt);
* the delivery order: the message of each ``sent`` line, in maillog order;
* from ``run.json``: the qmgr's CPU time and peak memory, and what each sink saw
  (sessions, 421 refusals, replies) as the remote side's own count: the 4xx replies
  provoked are the sink's (a 421 refusal is one reply, logged by Postfix once for each
  recipient of the delivery, and lines of two deliveries cannot always be told
  apart). Postfix prints ``delay`` with two significant digits, too coarse to place
  0.1 s deliveries in time, so the series over time come from the sink's clock: sessions open at the
  destination (its session timeline) and recipients accepted per second. A
  destination without a sink (a dead host) gets its attempts in flight from the
  maillog instead: there the connect timeout is long enough for its precision.
* what did not take effect (the qmgr fatal, MX lookups that failed...), from the
  maillog's own lines for it (:mod:`.evidence`);
* per MX host (destinations that name one share its sink): the host's sessions, 421
  and rate refusals, sessions open over time and their peak, from its sink
  (``mx_hosts``). A refusal comes before the session says whom it is for, so it is
  counted at the host, not at a destination; the destinations' own figures are
  those the sink tells apart by recipient (accepted, replies at RCPT) and their
  attempts in flight from the maillog.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from pyqmgr.compare.evidence import not_in_effect
from pyqmgr.compare.plan import parse_address
from pyqmgr.postfix import maillog
from pyqmgr.testbed.replies import RATE_LIMITED, TOO_MANY

#: A remote server's reply quoted in a delivery line's detail.
_REPLY = re.compile(r"(?:said|refused to talk to me): (?P<code>[2-5]\d\d)"
                    r"(?: (?P<ext>[2-5]\.\d{1,3}\.\d{1,3}))?")
#: Bins of the deliveries-per-second series: the first that gives at most this many.
MAX_BINS = 60
_BIN_WIDTHS = (0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
PERCENTILES = (50, 95, 99)
#: Lines from these programs are no delivery attempt at a remote host: qmgr's own, and
#: the retry and error transports' deferrals and bounces of a dead destination's mail.
NOT_AGENTS = ("retry", "error", "qmgr")
PER_RECIPIENT = "(in reply to RCPT TO command)"


@dataclass(frozen=True)
class DeliveryLine:
    program: str
    pid: int
    qid: str
    to: str
    relay: str
    delay: float
    delays: tuple[float, float, float, float]
    dsn: str
    status: str
    detail: str

    @property
    def reply(self) -> str | None:
        """The remote reply's code (and enhanced status): ``421 4.7.28``, or None."""
        m = _REPLY.search(self.detail)
        if m is None:
            return None
        return m["code"] + (f" {m['ext']}" if m["ext"] else "")


def parse_delivery(raw: str) -> DeliveryLine | None:
    """A delivery line of the run's maillog (read by :mod:`pyqmgr.postfix.maillog`)."""
    parts = maillog.split(raw)
    if parts is None:
        return None
    tag, pid, text = parts
    d = maillog.delivery(text)
    if d is None:
        return None
    return DeliveryLine(tag, pid, d.qid, d.to, d.relay, d.delay, (d.a, d.b, d.c, d.d),
                        d.dsn, d.status, d.detail)


def percentile(values: list[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def bin_width(span: float) -> float:
    for w in _BIN_WIDTHS:
        if span / w <= MAX_BINS:
            return float(w)
    return float(_BIN_WIDTHS[-1])


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def steps(intervals: list[tuple[float, float]]) -> list[tuple[float, int]]:
    """How many intervals are open after each start or end, ends first at a tie."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals],
                    key=lambda ev: (ev[0], ev[1]))
    out: list[tuple[float, int]] = []
    n = 0
    for t, delta in events:
        n += delta
        if out and out[-1][0] == t:
            out[-1] = (t, n)
        else:
            out.append((t, n))
    return out


def mean_open(points: list[tuple[float, int]]) -> float:
    """Time-weighted mean of a step series over the time it is above 0."""
    total = weight = 0.0
    for (t0, n), (t1, _) in zip(points, points[1:], strict=False):
        if n > 0:
            total += n * (t1 - t0)
            weight += t1 - t0
    return total / weight if weight else 0.0


def sink_replies(sink: dict[str, Any], cfg: dict[str, Any]) -> dict[str, int]:
    """The 4xx replies a sink gave, by code and enhanced status (``421 4.7.28``).

    The sink's own count, one per reply: a 421 refusal is one reply to one session,
    which Postfix logs once for each recipient of the delivery. Each kind of 4xx comes
    from one reply text of the destination's, so its code names it exactly.
    """
    out: dict[str, int] = Counter()

    def code(text: str) -> str:
        return " ".join(text.split()[:2])

    if sink.get("refused_421"):
        out[code(TOO_MANY)] += sink["refused_421"]
    if sink.get("refused_rate"):
        out[code(cfg.get("rate_reply", RATE_LIMITED))] += sink["refused_rate"]
    for c, n in sink.get("replies", {}).items():
        if c.startswith("4"):
            # The destination's reply with that code: its rcpt_4xx_reply, or a source's
            # day_reply (a 421 4.7.28 past its quota, compare/sources.py).
            texts = [cfg.get("rcpt_4xx_reply", c), *cfg.get("day_replies", [])]
            out[code(next((t for t in texts if t.split()[:1] == [c]), c))] += n
    return dict(sorted(out.items()))


def _through_filter(record: dict[str, Any], lines: list[DeliveryLine],
                    submitted: dict[str, float]) -> dict[str, float]:
    """Follow a content filter's hops: the figures are the mail's, end to end.

    A delivery to the filter (its port in run.json) is a hop, not the recipient's
    delivery: it is dropped from the lines' messages, and the copy it re-injected
    ("queued as ID") stands for the message, submitted when the original was, its
    delays counted from then. Returns, per copy, the seconds before it arrived.
    """
    port = (record.get("content_filter") or {}).get("port")
    if not port:
        return {}
    hop = f"]:{port}"
    since: dict[str, float] = {}
    for d in lines:
        if hop not in d.relay:
            continue
        m = maillog.QUEUED_AS.search(d.detail) if d.status == "sent" else None
        if m is not None and d.qid in submitted:
            since[m.group(1)] = since.get(d.qid, 0.0) + d.delay
            submitted[m.group(1)] = submitted[d.qid]
    for d in lines:
        if hop in d.relay:
            submitted.pop(d.qid, None)
    return since


def _new_destination() -> dict[str, Any]:
    """A destination's counts before its first delivery line."""
    return {"sent": 0, "bounced": 0, "deferred": 0, "deferred_by_reply": Counter(),
            "replies_5xx": Counter()}


def _expected(record: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    """The recipients the run submitted, by message class and by destination."""
    expected: dict[str, int] = Counter()
    per_dest_expected: dict[str, int] = Counter()
    for m in record["messages"]:
        for r in m["recipients"]:
            parsed = parse_address(r)
            if parsed is not None:
                expected[parsed[0]] += 1
                per_dest_expected[parsed[3]] += 1
    return expected, per_dest_expected


def _delivery_lines(record: dict[str, Any], text: str) -> tuple[
        list[DeliveryLine], dict[str, float], dict[str, float]]:
    """The delivery lines of the run's own recipients, each message's submission time
    (a content filter's copy standing for its original) and the copies' head start
    (see :func:`_through_filter`)."""
    submitted = {m["qid"]: m["submitted"] for m in record["messages"]
                 if m["qid"] and m["submitted"] is not None}
    parsed_lines = [d for raw in text.splitlines() if (d := parse_delivery(raw)) is not None]
    since = _through_filter(record, parsed_lines, submitted)
    lines = [d for d in parsed_lines if d.qid in submitted and parse_address(d.to) is not None]
    return lines, submitted, since


@dataclass
class _Tally:
    """What one pass over a run's delivery lines counts, for :func:`run_figures`."""

    #: Latencies of the sent lines, by message class.
    latency: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    #: Recipients finished (sent or bounced), by message class.
    final: dict[str, int] = field(default_factory=Counter)
    #: Per destination: :func:`_new_destination`'s counts.
    dests: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: One (destination, start, end) per delivery attempt, keyed by what its lines share.
    attempts: dict[tuple[Any, ...], tuple[str, float, float]] = field(default_factory=dict)
    #: The message of each sent line, in maillog order.
    order: list[int] = field(default_factory=list)
    last_final: float | None = None


def _tally(lines: list[DeliveryLine], submitted: dict[str, float],
           since: dict[str, float]) -> _Tally:
    tally = _Tally()
    for d in lines:
        klass, mid, _, domain = parse_address(d.to)  # type: ignore[misc]
        end = submitted[d.qid] + since.get(d.qid, 0.0) + d.delay
        fig = tally.dests.setdefault(domain, _new_destination())
        reply = d.reply
        if d.status == "sent":
            fig["sent"] += 1
            tally.latency[klass].append(d.delay + since.get(d.qid, 0.0))
            tally.order.append(mid)
        elif d.status == "bounced":
            fig["bounced"] += 1
            if reply and reply[0] == "5":
                fig["replies_5xx"][reply] += 1
        elif d.status == "deferred":
            fig["deferred"] += 1
            if reply and reply[0] == "4":
                fig["deferred_by_reply"][reply] += 1
        if d.status in ("sent", "bounced"):
            tally.final[klass] += 1
            last = tally.last_final
            tally.last_final = end if last is None else max(last, end)
        if d.program.rpartition("/")[2] not in NOT_AGENTS:
            key = (d.program, d.pid, d.qid, d.delay, d.delays)
            tally.attempts[key] = (domain, end - d.delays[2] - d.delays[3], end)
    return tally


def _destination_figures(record: dict[str, Any], tally: _Tally,
                         per_dest_expected: dict[str, int], span: float,
                         width: float) -> dict[str, dict[str, Any]]:
    """Each destination's counts, its sessions in flight and its deliveries per second."""
    nbins = max(1, math.ceil(span / width))
    intervals: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for domain, start, end in tally.attempts.values():
        intervals[domain].append((start, end))
    destinations = {}
    dest_cfg = record.get("destinations", {})
    for domain in sorted(set(per_dest_expected) | set(tally.dests)):
        fig = tally.dests.get(domain, _new_destination())
        tried = fig["sent"] + fig["bounced"] + fig["deferred"]
        sink = record.get("sinks", {}).get(domain, {})
        if sink.get("kind") == "sink":
            points = [(t, n) for t, n in sink.get("timeline", [])]
            source = "sink"
        else:
            points = steps(intervals.get(domain, []))
            source = "maillog"
        bins = [0] * nbins
        for t, n in sink.get("received", []):
            bins[min(nbins - 1, max(0, int(t // width)))] += n
        destinations[domain] = {
            "recipients": per_dest_expected.get(domain, 0),
            "sent": fig["sent"], "bounced": fig["bounced"], "deferred": fig["deferred"],
            "deferral_rate": _r(fig["deferred"] / tried if tried else 0.0),
            "deferred_by_reply": dict(sorted(fig["deferred_by_reply"].items())),
            "replies_5xx": dict(sorted(fig["replies_5xx"].items())),
            "replies_4xx": sink_replies(sink, dest_cfg.get(domain, {})),
            "attempts": len(intervals.get(domain, [])),
            "in_flight_peak": max((n for _, n in points), default=0),
            "in_flight_mean": _r(mean_open(points), 3),
            "in_flight": [[_r(t, 3), n] for t, n in points],
            "in_flight_source": source,
            "per_second": [round(c / width, 3) for c in bins],
            "sink": {k: v for k, v in sink.items() if k not in ("timeline", "received")},
        }
    return destinations


def _mx_host_figures(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each MX host's sink as a whole: what its destinations together met there."""
    out = {}
    dest_cfg = record.get("destinations", {})
    for host, sink in sorted(record.get("mx_hosts", {}).items()):
        domains = sink.get("domains", [])
        points = [(t, n) for t, n in sink.get("timeline", [])]
        out[host] = {
            "domains": domains,
            "kind": sink.get("kind"),
            "replies_4xx": sink_replies(sink, dest_cfg.get(domains[0], {}) if domains
                                        else {}),
            "in_flight_peak": max((n for _, n in points), default=0),
            "in_flight_mean": _r(mean_open(points), 3),
            "in_flight": [[_r(t, 3), n] for t, n in points],
            "sink": {k: v for k, v in sink.items()
                     if k not in ("timeline", "received", "domains")},
        }
    return out


def _class_figures(expected: dict[str, int], tally: _Tally) -> dict[str, dict[str, Any]]:
    """Latency percentiles and what is undelivered, per message class."""
    classes = {}
    for klass in sorted(expected):
        values = tally.latency.get(klass, [])
        classes[klass] = {
            "recipients": expected[klass], "sent": len(values),
            "undelivered": expected[klass] - tally.final.get(klass, 0),
            **{f"p{p}": _r(percentile(values, p)) for p in PERCENTILES},
            "max": _r(max(values)) if values else None,
        }
    return classes


def run_figures(record: dict[str, Any], maillog: str) -> dict[str, Any]:
    """Everything the report shows about one run."""
    expected, per_dest_expected = _expected(record)
    lines, submitted, since = _delivery_lines(record, maillog)
    tally = _tally(lines, submitted, since)
    last_final, final, order = tally.last_final, tally.final, tally.order
    span = max([record.get("elapsed") or 0.0, last_final or 0.0])
    width = bin_width(span)
    destinations = _destination_figures(record, tally, per_dest_expected, span, width)
    hosts = _mx_host_figures(record)
    classes = _class_figures(expected, tally)
    sent = sum(f["sent"] for f in destinations.values())
    bounced = sum(f["bounced"] for f in destinations.values())
    deferred = sum(f["deferred"] for f in destinations.values())
    tried = sent + bounced + deferred
    qmgr = record.get("qmgr", {})
    cpu = qmgr.get("cpu_s")
    return {
        "contender": record["contender"],
        "pyqmgr_cf": record.get("pyqmgr_cf"),
        "drained": bool(record.get("drained")),
        "error": record.get("error"),
        "elapsed": record.get("elapsed"),
        "drain_time": _r(last_final) if record.get("drained") else None,
        "last_final": _r(last_final),
        "recipients": sum(expected.values()),
        "sent": sent, "bounced": bounced, "deferred": deferred,
        "undelivered": sum(expected.values()) - sum(final.values()),
        "deferral_rate": _r(deferred / tried if tried else 0.0),
        # An MX host's refusals are counted at the host (its destinations' replies
        # at RCPT are theirs already).
        "replies_4xx": sum(sum(f["replies_4xx"].values()) for f in destinations.values())
        + sum(h["sink"].get("refused_421", 0) + h["sink"].get("refused_rate", 0)
              for h in hosts.values()),
        "deferred_by_reply": sum(sum(f["deferred_by_reply"].values())
                                 for f in destinations.values()),
        "classes": classes,
        "destinations": destinations,
        "mx_hosts": hosts,
        "bin_width": width,
        "order": order,
        "qmgr_cpu_s": cpu,
        "qmgr_cpu_us_per_recipient": _r(cpu * 1e6 / tried, 1) if cpu is not None and tried
        else None,
        "qmgr_vmhwm_mib": _r(qmgr.get("vmhwm_kib", 0) / 1024, 2) if qmgr else None,
        "submission_errors": len(record.get("submission_errors", [])),
        # What the maillog shows did not take effect (pyqmgr.compare.evidence).
        "not_in_effect": not_in_effect(record, maillog),
        # Each sink's count per source address (issue #46; compare/sources.py).
        "sources": record.get("sources"),
    }
