"""Scenario (workload) files: messages, destinations, transports and main.cf, in TOML.

One format for both ``pyqmgr simulate`` (the scheduler core on a virtual clock) and
``pyqmgr compare`` (the same workload on real Postfix, with a sink SMTP server playing
each destination). Keys only one of them uses are accepted by both and say so below.
A key the format does not know is an error, so a typo is not silently a default.

```toml
title = "what the experiment shows"
seed = 1                   # random numbers: latencies, 4xx/5xx draws, sizes
duration = 3600            # simulate: stop the clock here at the latest (seconds)
date = 2026-12-01          # simulate: the UTC date (or date-time) the clock's 0 stands
                           # for: warm-up plans count a source's age and their windows
                           # from it (default: the newest cold source's first day)

[main_cf]                  # any main.cf parameter, as text, read with stock's rules
smtp_destination_concurrency_limit = "20"

[scheduler]
feedback_rounding = "stock" # simulate: "stock" (Postfix 3.7, as the daemon) or
                           # "pseudocode" (the seed's November 2007 rules)
policy = "nqmgr"           # scheduler_policy: nqmgr, oqmgr, finch, zmailer, module:PATH

[pyqmgr_cf]                # any pyqmgr.cf parameter, as text (transport forms too)
smtp_finch_scale_max_concurrency = "10"
smtp_destination_rate = "5/1s"   # shaping; a response_rules path is relative to this file
source_pools = "bulk"      # source pools (docs/sources.md): each member a [transports.NAME];
bulk_sources = "src1 src2 src3"  # a table or plan path is relative to this file

[transports.smtp]
process_limit = 100        # master.cf maxproc of the service (compare: other names
                           # become copies of the smtp service)
handoff = 0.0              # simulate: seconds from a message entering the active queue
                           # to the scheduler offering its deliveries (by the transport
                           # of its first recipient; a busy machine): a number or a
                           # dist table; replay reads it off first tries' delays= b

[destinations."example.com"]
transport = "smtp"
latency = 1.0              # seconds per recipient (the sink waits before its RCPT
                           # reply): a number, or a table:
                           # {dist = "uniform", low = 0.5, high = 1.5}
                           # {dist = "exponential", mean = 1}
server_limit = 5           # sessions the server allows at once (0: no limit)
overload = "421"           # beyond the limit: "421" (answered at once); or a listen
                           # queue where connections wait for a server process, and beyond
                           # it "connect-timeout" (dropped SYNs: the connect times out) or
                           # "greeting-timeout" (connected, never greeted: it times out)
                           # (compare plays "421" only)
backlog = 5                # listen queue length (default: server_limit; -1 unbounded)
reject_time = 0.0          # how long a 421 answer takes
timeout = 30               # the client's connect or greeting timeout (compare: sets
                           # smtp_connect_timeout and smtp_helo_timeout, scaled)
dead = false               # true: no server at all, every connection is refused;
                           # "timeout": a host that never answers, every connect times
                           # out after `timeout` (a dead MX that swallows SYNs)
dead_until = 0             # no server until this time, then a working one (0: always up)
dead_until_low = 0         # if set (below dead_until): each run draws the time the
                           # server comes up between the two
rate_limit = 0             # sessions a second the server takes; beyond, it answers
rate_reply = "421 4.7.28 ..."  # this (a provider's rate limiting) at reject_time
rcpt_4xx = 0.0             # share of recipients answered rcpt_4xx_reply at RCPT
rcpt_4xx_reply = "450 4.2.0 mailbox busy, try again later"
rcpt_5xx = 0.0             # share of recipients answered rcpt_5xx_reply (they bounce)
rcpt_5xx_reply = "550 5.1.1 no such user"

[destinations."example.com".sources.src1]   # the server's rules for mail from one
day_limit = 150            # source (a pool member, docs/sources.md), counted per server
                           # (MX host) and source: recipients a UTC day; a session
                           # that starts beyond them gets day_reply (compare: the
                           # sink's quota for the source's address, judged at RCPT)
day_reply = "421 4.7.28 ..."  # (default: Gmail's text for a new IP's volume)
rate_limit = 0             # simulate: sessions a second from this source; beyond,
rate_reply = "421 4.7.28 ..."  # rate_reply

[deferred]                 # simulate: the deferred queue (off: deferred recipients are
retry = true               # only counted). Deferred recipients come back: a retry time
                           # of stock's backoff (main_cf minimal/maximal_backoff_time,
                           # from the arrival), a deferred-queue scan every
                           # queue_run_delay, and pyqmgr_cf's deferred_retry_jitter and
                           # deferred_recovery_rate. (compare: real Postfix retries)
scan_phase = 0             # the scans run at this offset plus multiples of
                           # queue_run_delay (a replayed log's scan times)

arrivals = "arrivals.csv"  # (top level) more messages, one a line, as pyqmgr replay
                           # writes them: at,size,class,sender,recipients,measured with
                           # recipients "DOMAIN[*COUNT][=SCRIPT] ..." (SCRIPT: the
                           # recipients' RCPT answers try by try, d 4xx, b 5xx, s 2xx,
                           # D and B the whole delivery failed (4xx: the site is
                           # throttled; 5xx: bounced), each with the try's seconds if
                           # known: d1.5s2.1), then optionally born,follows,gap (mail
                           # older than its arrival; a content filter's re-injection)

[fleet]                    # N servers sharing their limits, as pyqmgr.cf's shared_state
servers = 3                # does (default 1: no fleet): each its own scheduler, the
                           # messages dealt to them in turn, pyqmgr_cf's
                           # fleet_destination_concurrency_limit, fleet_destination_rate
                           # and fleet_throttling shared; reported as one sender.
                           # (compare: N Postfix servers a contender, pyqmgr's sharing
                           # one redis-server.) Not with [deferred] or [delegation] yet.

[compare]                  # pyqmgr compare only
time_scale = 0.1           # default --time-scale: arrival times, latencies, timeouts,
                           # rates and dead_until are multiplied by it (rates divided)
timeout = 300              # default --timeout: wall seconds a run may take at most
contenders = ["stock", "pyqmgr:nqmgr"]  # default --with list
[compare.main_cf]          # main.cf for the real runs only, not scaled, over [main_cf]
minimal_backoff_time = "2s"  # (e.g. short backoffs so that deferred mail comes back
queue_run_delay = "1s"       #  within the run)
[compare.content_filter]   # all mail through a content filter, as amavis is set up
latency = 0.2              # (FILTER_README's advanced filter): the filter holds each
process_limit = 10         # message this long (a number or a dist table), then
                           # re-injects it into a second smtpd and answers "250 ...
                           # queued as ID"; process_limit is the filter transport's
                           # maxproc. Real runs only: simulate does not model it.

[delegation]               # a delivery policy service, asked before each delivery
rate = {"example.com" = "3/10s"}   # per destination, as postfwd's rate(): at most N
                           # deliveries in a window of T that opens at the first one
reply = "450 4.7.1 too many deliveries"   # what a request beyond the rate gets
function = "module:/abs/path.py:decide"   # or your own: decide(request, now) -> action,
                           # request being the policy attributes pyqmgr sends (a dict)
defer_delay = 60           # delivery_policy_defer_delay (seconds)
reject = "defer"           # delivery_policy_reject: defer or bounce
latency = 0.0              # seconds the service takes to answer

[[messages]]
at = 0                     # arrival time
count = 1                  # this many such messages ...
every = 0                  # ... this many seconds apart, or a dist table: with
                           # {dist = "exponential", mean = 0.5} they arrive as
                           # independent senders' mail does (Poisson), drawn from
                           # the seed alike in simulate and compare
recipients = 2000          # recipients each, all to ...
destination = "example.com"
# or recipients spread over destinations (then no `destination`):
# recipients = {"a.example" = 3, "b.example" = 2}
name = "big"               # simulate: queue ids are name0, name1, ...
class = "bulk"             # the message class the compare report groups latency by
                           # (default: the name without trailing punctuation, or "mail")
sender = "news@lists.example"  # compare: the envelope sender (default CLASS@senders.test)
size = 2000                # compare: message size in bytes, a number or a dist table
# dist tables: fixed {value}, uniform {low, high}, exponential {mean}, or empirical
# {values = [...]}: 2 to 1001 quantiles in increasing order (replay writes them)
```
"""

from __future__ import annotations

import calendar
import dataclasses
import datetime
import math
import os
import random
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pyqmgr.output import open_new
from pyqmgr.scheduler.feedback import ROUNDINGS
from pyqmgr.scheduler.shaping import ShapingError, parse_rate

OVERLOADS = ("421", "connect-timeout", "greeting-timeout")
DEAD_MODES = ("refused", "timeout")
DISTS = ("fixed", "uniform", "exponential", "empirical")
#: A message class: it becomes part of recipient addresses in compare runs.
_CLASS = re.compile(r"^[A-Za-z0-9_]{1,40}$")
_SENDER = re.compile(r"^[A-Za-z0-9._+=-]{1,64}@[A-Za-z0-9.-]{1,200}$")
_DOMAIN = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,250}[A-Za-z0-9])?$")
DEFAULT_SENDER_DOMAIN = "senders.test.example"
DEFAULT_SIZE = 600

Key = tuple[str | int, ...]


@dataclass
class Delegation:
    """The scenario's delivery policy service: a rate per destination, or a function."""

    rates: dict[str, tuple[int, float]] = field(default_factory=dict)
    reply: str = "450 4.7.1 too many deliveries"
    #: ``decide(request: dict, now: float) -> str`` (an action), or None.
    function: Callable[[dict[str, object], float], str] | None = None
    defer_delay: float = 60.0
    reject: str = "defer"
    latency: float = 0.0


def _delegation(data: dict[str, Any], base_dir: str) -> Delegation:
    where = "delegation"
    d = Delegation(reply=str(data.get("reply", Delegation.reply)),
                   defer_delay=float(data.get("defer_delay", 60)),
                   reject=str(data.get("reject", "defer")),
                   latency=float(data.get("latency", 0)))
    if d.reject not in ("defer", "bounce"):
        raise ScenarioError(f"{where}.reject must be defer or bounce")
    if not 1 <= d.defer_delay <= 86400:
        raise ScenarioError(f"{where}.defer_delay must be 1 to 86400 seconds")
    rates = data.get("rate", {})
    if not isinstance(rates, dict):
        raise ScenarioError(f"{where}.rate must be a table: destination = \"N/PERIOD\"")
    for dest, text in rates.items():
        try:
            rate = parse_rate(str(text), f"{where}.rate.{dest}")
        except ShapingError as exc:
            raise ScenarioError(str(exc)) from None
        if rate is None or not float(rate.count).is_integer():
            raise ScenarioError(f"{where}.rate.{dest}: a whole number of deliveries per "
                                "period, e.g. 3/10s")
        d.rates[str(dest)] = (int(rate.count), rate.period)
    spec = data.get("function")
    if spec is not None:
        d.function = _load_function(str(spec), base_dir, where)
    return d


def _load_function(spec: str, base_dir: str, where: str) -> Callable[..., str]:
    """``module:PATH:NAME`` (PATH relative to the scenario file) or ``package.module:NAME``."""
    import importlib
    import importlib.util

    text = spec.removeprefix("module:")
    path, sep, name = text.rpartition(":")
    if not sep or not name:
        raise ScenarioError(f"{where}.function: write module:PATH:NAME or package.module:NAME")
    try:
        if spec.startswith("module:"):
            full = path if os.path.isabs(path) else os.path.join(base_dir, path)
            loaded = importlib.util.spec_from_file_location("pyqmgr_sim_delegation", full)
            if loaded is None or loaded.loader is None:
                raise ImportError(f"cannot load {full}")
            module = importlib.util.module_from_spec(loaded)
            loaded.loader.exec_module(module)
        else:
            module = importlib.import_module(path)
        func = getattr(module, name)
    except Exception as exc:  # noqa: BLE001 - a scenario's mistake, said as such
        raise ScenarioError(f"{where}.function {spec!r}: {type(exc).__name__}: {exc}") \
            from None
    if not callable(func):
        raise ScenarioError(f"{where}.function {spec!r} is not callable")
    return func  # type: ignore[no-any-return]


class ScenarioError(ValueError):
    """A scenario file that cannot be run; the text says which setting and why.

    ``key`` is the setting's path in the file (``("destinations", "a.example",
    "latency")``); :func:`load` turns it into the line it is on.
    """

    def __init__(self, text: str, key: Key = (), line: int | None = None) -> None:
        super().__init__(text)
        self.key = key
        self.line = line


@dataclass(frozen=True)
class Latency:
    """A distribution of seconds (or of bytes, for message sizes)."""

    dist: str = "fixed"
    value: float = 0.0
    low: float = 0.0
    high: float = 0.0
    mean: float = 0.0
    #: "empirical": sorted quantiles of observed values (a replayed log's), drawn by
    #: interpolating between neighbours.
    values: tuple[float, ...] = ()

    def scaled(self, factor: float) -> Latency:
        return Latency(self.dist, self.value * factor, self.low * factor,
                       self.high * factor, self.mean * factor,
                       tuple(v * factor for v in self.values))

    def average(self) -> float:
        if self.dist == "uniform":
            return (self.low + self.high) / 2
        if self.dist == "exponential":
            return self.mean
        if self.dist == "empirical":
            return sum(self.values) / len(self.values) if self.values else 0.0
        return self.value

    def draw(self, rng: random.Random) -> float:
        """One value; the simulator and compare's sinks draw alike from one seed."""
        if self.dist == "uniform":
            return rng.uniform(self.low, self.high)
        if self.dist == "exponential":
            return rng.expovariate(1.0 / self.mean) if self.mean > 0 else 0.0
        if self.dist == "empirical":
            values = self.values
            pos = rng.random() * (len(values) - 1)
            i = int(pos)
            if i + 1 >= len(values):
                return values[-1]
            return values[i] + (values[i + 1] - values[i]) * (pos - i)
        return self.value


#: What a provider answers a source past its day's limit (Gmail's text for a new IP).
DAY_REPLY = ("421 4.7.28 Our system has detected an unusual rate of unsolicited mail "
             "originating from your IP address; try again later")


@dataclass(frozen=True)
class SourceRule:
    """A destination's server's rules for mail from one source (a sending address),
    counted per server (MX host) and source: a provider keeps reputation per IP."""

    #: Sessions a second from this source (0: no limit); beyond, ``rate_reply``.
    rate_limit: float = 0.0
    rate_reply: str = ("421 4.7.28 Our system has detected an unusual rate of mail "
                       "from your IP address; try again later")
    #: Recipients a UTC day from this source (0: no limit); a session that starts
    #: once they are taken is answered ``day_reply``.
    day_limit: int = 0
    day_reply: str = DAY_REPLY


@dataclass(frozen=True)
class Destination:
    name: str
    transport: str = "smtp"
    latency: Latency = Latency()
    server_limit: int = 0
    overload: str = "421"
    timeout: float = 30.0
    dead: bool = False
    #: Connections the server's listen queue holds beyond its limit (-1: no bound).
    backlog: int = 0
    #: How long a 421 answer takes (connect, greeting, disconnect).
    reject_time: float = 0.0
    #: Sessions a second the server accepts (0: no limit); beyond, ``rate_reply``.
    rate_limit: float = 0.0
    rate_reply: str = ("421 4.7.28 Our system has detected an unusual rate of mail "
                       "from your IP address; try again later")
    #: No server before this time (0: none of that); ``dead`` is dead for ever.
    dead_until: float = 0.0
    #: How a dead host fails: "refused" at once, or "timeout" after ``timeout``.
    dead_mode: str = "refused"
    #: Shares of recipients answered a 4xx or a 5xx at RCPT, and those replies.
    rcpt_4xx: float = 0.0
    rcpt_4xx_reply: str = "450 4.2.0 mailbox busy, try again later"
    rcpt_5xx: float = 0.0
    rcpt_5xx_reply: str = "550 5.1.1 no such user"
    #: Whether the file set ``timeout`` (compare turns it into smtp timeouts).
    timeout_set: bool = False
    #: The earliest the server may have come up, where that is before ``dead_until``
    #: (a replayed log: its last refused connection): each run draws its time
    #: between the two (0: exactly at dead_until).
    dead_until_low: float = 0.0
    #: The host its MX record names (issue #33): destinations naming one host share
    #: its server, and with sites on its site (pyqmgr/simulator/sites.py). Empty: a
    #: server of its own.
    mx: str = ""
    #: The server's rules for one source (issue #46): [destinations.NAME.sources.SRC].
    sources: Mapping[str, SourceRule] = field(default_factory=dict, hash=False)

    @property
    def host(self) -> str:
        """The host smtp(8) names in a reply's text: its MX host, else itself."""
        return self.mx or self.name

    def drawn(self, rng: random.Random) -> Destination:
        """This destination with its coming-up time drawn (see dead_until_low)."""
        if 0 < self.dead_until_low < self.dead_until:
            return dataclasses.replace(
                self, dead_until=rng.uniform(self.dead_until_low, self.dead_until),
                dead_until_low=0.0)
        return self

    def is_dead(self, now: float) -> bool:
        return self.dead or now < self.dead_until


@dataclass(frozen=True)
class MessageSpec:
    at: float
    count: int
    every: float
    recipients: int
    destination: str
    name: str = ""
    #: (destination, recipients) of each message; one pair unless spread.
    spread: tuple[tuple[str, int], ...] = ()
    #: The report's message class, the envelope sender and the size (compare).
    klass: str = "mail"
    sender: str = ""
    size: Latency = Latency("fixed", DEFAULT_SIZE)
    #: The gaps between arrivals when ``every`` is a distribution (an exponential one
    #: makes Poisson arrivals, as independent senders do); fixed: ``every`` apart.
    gaps: Latency | None = None

    def destinations(self) -> tuple[tuple[str, int], ...]:
        return self.spread or ((self.destination, self.recipients),)

    def times(self, seed: object, index: int) -> Iterator[float]:
        """The arrival times, the same in simulate and in every compare run.

        Drawn gaps come from their own stream, keyed by the scenario's seed and the
        spec's place in the file, so that nothing else drawn moves them.
        """
        if self.gaps is None:
            for k in range(self.count):
                yield self.at + k * self.every
            return
        rng = random.Random(f"arrivals {seed} {index}")
        at = self.at
        for _ in range(self.count):
            yield at
            at += self.gaps.draw(rng)


class TraceMessage(NamedTuple):
    """One message of an arrivals file (a replayed log's): it arrives once, at ``at``."""

    at: float
    size: int
    klass: str
    sender: str
    #: (destination, recipients, script): those recipients answer their tries at RCPT
    #: as the script says, try by try: ``d`` a 4xx, ``b`` a 5xx, ``s`` accepted, each
    #: optionally followed by the seconds the try's session took per recipient
    #: (``d1.5s2.1``), and accepted past its end. An empty script leaves it to the
    #: destination's shares and latency.
    recipients: tuple[tuple[str, int, str], ...]
    #: False for mail queued before the log began: its delay is not the log's to
    #: compare, so the delay figures leave it out.
    measured: bool = True
    #: When the message really arrived, if before ``at`` (seconds, may be below 0):
    #: mail queued before the log began, or waiting before the active queue took it
    #: (``delays=`` a). Delays and stock's backoff count from it; None: ``at``.
    born: float | None = None
    #: The index (in the trace) of the message whose delivery to a content filter
    #: re-injected this one; it then arrives ``gap`` seconds after that message is
    #: done, not at ``at``. -1: it arrives by itself.
    follows: int = -1
    gap: float = 0.0


@dataclass
class CompareSettings:
    """``[compare]``: what only ``pyqmgr compare`` reads."""

    time_scale: float = 1.0
    timeout: float = 300.0
    contenders: list[str] = field(default_factory=list)
    main_cf: dict[str, str] = field(default_factory=dict)
    #: ``[compare.content_filter]``: every message goes through a re-injecting
    #: content filter first (None: no filter).
    content_filter: ContentFilter | None = None


@dataclass(frozen=True)
class ContentFilter:
    """A content filter on the real runs: how long it holds a message, how many
    messages the filter transport hands it at once."""

    latency: Latency
    process_limit: int = 10


@dataclass
class Scenario:
    seed: int = 1
    duration: float = 86400.0
    main_cf: dict[str, str] = field(default_factory=dict)
    process_limits: dict[str, int] = field(default_factory=dict)
    destinations: dict[str, Destination] = field(default_factory=dict)
    messages: list[MessageSpec] = field(default_factory=list)
    title: str = ""
    feedback_rounding: str = "stock"
    #: pyqmgr.cf parameters; ``[scheduler] policy`` is its ``scheduler_policy``.
    pyqmgr_cf: dict[str, str] = field(default_factory=dict)
    #: The scenario file's directory: relative response_rules paths start there.
    base_dir: str = "."
    #: Model the deferred queue: deferred recipients are tried again ([deferred] retry).
    retry_deferred: bool = False
    #: The deferred-queue scans run at this offset (seconds) plus multiples of
    #: queue_run_delay ([deferred] scan_phase).
    scan_phase: float = 0.0
    compare: CompareSettings = field(default_factory=CompareSettings)
    #: The file it came from ("" when built from a dict).
    path: str = ""
    #: A delivery policy service to ask before each delivery (None: none).
    delegation: Delegation | None = None
    #: Per transport: the time from a message entering the active queue to the
    #: scheduler offering its deliveries, for messages whose first recipient goes by
    #: it ([transports.NAME] handoff; none: at once).
    handoffs: dict[str, Latency] = field(default_factory=dict)
    #: Messages of the ``arrivals`` file, in time order.
    trace: list[TraceMessage] = field(default_factory=list)
    #: Servers of one fleet sharing their limits ([fleet] servers; 1: no fleet).
    fleet_servers: int = 1
    #: The Unix time the virtual clock's 0 stands for (``date``: warm-up plans count
    #: a source's age and their windows in UTC days from it); None: not given.
    date: float | None = None


# -- typed reads that name the key ----------------------------------------------------

_TOP = {"title", "seed", "duration", "main_cf", "scheduler", "pyqmgr_cf", "transports",
        "destinations", "deferred", "messages", "compare", "delegation", "arrivals",
        "fleet", "date"}
_FLEET = {"servers"}
#: The most servers a fleet simulation runs.
MAX_FLEET_SERVERS = 64
_SCHEDULER = {"feedback_rounding", "policy"}
_TRANSPORT = {"process_limit", "handoff"}
_DESTINATION = {"transport", "latency", "server_limit", "overload", "backlog",
                "reject_time", "timeout", "dead", "dead_until", "dead_until_low",
                "rate_limit", "rate_reply", "rcpt_4xx", "rcpt_4xx_reply", "rcpt_5xx",
                "rcpt_5xx_reply", "mx", "sources"}
_SOURCE_RULE = {"rate_limit", "rate_reply", "day_limit", "day_reply"}
_MESSAGE = {"at", "count", "every", "recipients", "destination", "name", "class",
            "sender", "size"}
_DEFERRED = {"retry", "scan_phase"}
_COMPARE = {"time_scale", "timeout", "contenders", "main_cf", "content_filter"}
_CONTENT_FILTER = {"latency", "process_limit"}
_DIST_KEYS = {"fixed": {"dist", "value"}, "uniform": {"dist", "low", "high"},
              "exponential": {"dist", "mean"}, "empirical": {"dist", "values"}}
#: Quantiles an empirical distribution may have at most.
MAX_VALUES = 1001


def is_domain(name: str) -> bool:
    """A destination name the format takes: a domain with a dot (no ``localhost``)."""
    return bool(_DOMAIN.match(name)) and "." in name


def is_sender(address: str) -> bool:
    """An envelope sender the format takes (compare submits it as it stands)."""
    return bool(_SENDER.match(address))


def _table(data: dict[str, Any], name: str, key: Key) -> dict[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ScenarioError(f"{_dotted(key + (name,))} must be a table", key + (name,))
    return value


def _dotted(key: Key) -> str:
    out = ""
    for part in key:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            text = part if re.fullmatch(r"[A-Za-z0-9_-]+", part) else f'"{part}"'
            out += ("." if out else "") + text
    return out or "(top level)"


def _known(table: dict[str, Any], allowed: set[str], key: Key) -> None:
    for name in table:
        if name not in allowed:
            raise ScenarioError(
                f"{_dotted(key + (name,))}: unknown key {name!r} (known here: "
                f"{', '.join(sorted(allowed))})", key + (name,))


def _number(table: dict[str, Any], name: str, key: Key, default: float,
            low: float | None = None, high: float | None = None,
            integer: bool = False) -> Any:
    where = key + (name,)
    value = table.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or (
            integer and not isinstance(value, int)) or (
            isinstance(value, float) and not math.isfinite(value)):
        kind = "a whole number" if integer else "a number"
        raise ScenarioError(f"{_dotted(where)} must be {kind}, not {value!r}", where)
    if low is not None and value < low:
        raise ScenarioError(f"{_dotted(where)} must be at least {low:g}, not {value!r}",
                            where)
    if high is not None and value > high:
        raise ScenarioError(f"{_dotted(where)} must be at most {high:g}, not {value!r}",
                            where)
    return int(value) if integer else float(value)


def _string(table: dict[str, Any], name: str, key: Key, default: str) -> str:
    value = table.get(name, default)
    if not isinstance(value, str):
        raise ScenarioError(f"{_dotted(key + (name,))} must be a string, not {value!r}",
                            key + (name,))
    return value


def _settings(table: dict[str, Any], key: Key) -> dict[str, str]:
    """A main.cf or pyqmgr.cf table: values as text (numbers are accepted)."""
    out = {}
    for name, value in table.items():
        if isinstance(value, dict | list) or isinstance(value, bool):
            raise ScenarioError(f"{_dotted(key + (name,))} must be text such as \"10\", "
                                f"as in main.cf, not {value!r}", key + (name,))
        out[str(name)] = str(value)
    return out


def _dist(value: Any, key: Key, what: str = "latency") -> Latency:
    if isinstance(value, bool) or not isinstance(value, int | float | dict):
        raise ScenarioError(f"{_dotted(key)}: {what} must be a number or a table such as "
                            '{dist = "uniform", low = 0.5, high = 1.5}', key)
    if not isinstance(value, dict):
        if value < 0 or not math.isfinite(value):
            raise ScenarioError(f"{_dotted(key)}: {what} must be 0 or more", key)
        return Latency("fixed", float(value))
    dist = value.get("dist", "fixed")
    if dist not in DISTS:
        raise ScenarioError(f"{_dotted(key)}: unknown {what} distribution {dist!r} (known: "
                            f"{', '.join(DISTS)})", key + ("dist",))
    _known(value, _DIST_KEYS[dist], key)
    for name in _DIST_KEYS[dist] - {"dist"}:
        if name not in value:
            raise ScenarioError(f"{_dotted(key)}: a {dist} {what} needs {name}", key)
    if dist == "fixed":
        return Latency("fixed", _number(value, "value", key, 0, low=0))
    if dist == "empirical":
        values = value["values"]
        if not isinstance(values, list) or not 2 <= len(values) <= MAX_VALUES:
            raise ScenarioError(f"{_dotted(key)}: an empirical {what} needs values = [...], "
                                f"2 to {MAX_VALUES} numbers (its quantiles)", key + ("values",))
        nums = [_number({"v": v}, "v", key + ("values",), 0, low=0) for v in values]
        if nums != sorted(nums):
            raise ScenarioError(f"{_dotted(key)}: the values of an empirical {what} are its "
                                "quantiles: in increasing order", key + ("values",))
        return Latency("empirical", values=tuple(nums))
    if dist == "uniform":
        low = _number(value, "low", key, 0, low=0)
        high = _number(value, "high", key, 0, low=low)
        return Latency("uniform", low=low, high=high)
    return Latency("exponential", mean=_number(value, "mean", key, 0, low=0))


# -- the parser -----------------------------------------------------------------------


def parse(data: dict[str, Any], base_dir: str = ".") -> Scenario:
    """A scenario from a parsed TOML document; ScenarioError names the bad key."""
    _known(data, _TOP, ())
    sc = Scenario(seed=_number(data, "seed", (), 1, integer=True),
                  duration=_number(data, "duration", (), 86400, low=0),
                  title=_string(data, "title", (), ""))
    sc.main_cf = _settings(_table(data, "main_cf", ()), ("main_cf",))
    scheduler = _table(data, "scheduler", ())
    _known(scheduler, _SCHEDULER, ("scheduler",))
    rounding = _string(scheduler, "feedback_rounding", ("scheduler",), "stock")
    if rounding not in ROUNDINGS:
        raise ScenarioError(
            f"scheduler.feedback_rounding must be one of {', '.join(ROUNDINGS)}",
            ("scheduler", "feedback_rounding"))
    sc.feedback_rounding = rounding
    sc.pyqmgr_cf = _settings(_table(data, "pyqmgr_cf", ()), ("pyqmgr_cf",))
    if "policy" in scheduler:
        sc.pyqmgr_cf["scheduler_policy"] = _string(scheduler, "policy", ("scheduler",), "")
    for name, t in _table(data, "transports", ()).items():
        key: Key = ("transports", name)
        if not isinstance(t, dict):
            raise ScenarioError(f"{_dotted(key)} must be a table", key)
        _known(t, _TRANSPORT, key)
        if "process_limit" in t:
            sc.process_limits[name] = _number(t, "process_limit", key, 100, low=1,
                                              integer=True)
        if "handoff" in t:
            sc.handoffs[name] = _dist(t["handoff"], key + ("handoff",), "handoff")
    for name, d in _table(data, "destinations", ()).items():
        sc.destinations[name] = _destination(name, d)
    messages = data.get("messages", [])
    if not isinstance(messages, list):
        raise ScenarioError("messages must be an array of tables: [[messages]]",
                            ("messages",))
    for i, m in enumerate(messages):
        sc.messages.append(_message(i, m, sc))
    if "arrivals" in data:
        path = _string(data, "arrivals", (), "")
        full = path if os.path.isabs(path) else os.path.join(base_dir, path)
        sc.trace = read_arrivals(full, sc)
    if not sc.messages and not sc.trace:
        raise ScenarioError("no [[messages]] and no arrivals file")
    deferred = _table(data, "deferred", ())
    _known(deferred, _DEFERRED, ("deferred",))
    retry = deferred.get("retry", False)
    if not isinstance(retry, bool):
        raise ScenarioError("deferred.retry must be true or false", ("deferred", "retry"))
    sc.retry_deferred = retry
    sc.scan_phase = _number(deferred, "scan_phase", ("deferred",), 0, low=0)
    sc.compare = _compare(_table(data, "compare", ()))
    fleet = _table(data, "fleet", ())
    _known(fleet, _FLEET, ("fleet",))
    sc.fleet_servers = int(_number(fleet, "servers", ("fleet",), 1, low=1,
                                   high=MAX_FLEET_SERVERS, integer=True))
    if "date" in data:
        sc.date = _date(data["date"])
    if "delegation" in data:
        delegation = data["delegation"]
        if not isinstance(delegation, dict):
            raise ScenarioError("delegation must be a table", ("delegation",))
        sc.delegation = _delegation(delegation, base_dir)
    return sc


def _date(value: Any) -> float:
    """``date``: a TOML date or date-time (UTC unless it has an offset), or the same
    as a string."""
    if isinstance(value, str):
        try:
            value = datetime.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            value = None
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.UTC)
        return value.timestamp()
    if isinstance(value, datetime.date):
        return float(calendar.timegm(value.timetuple()))
    raise ScenarioError("date must be a date or a date and time in UTC, such as 2026-12-01 "
                        "or 2026-12-01T06:00:00Z", ("date",))


def _destination(name: str, d: Any) -> Destination:
    key: Key = ("destinations", name)
    if not isinstance(d, dict):
        raise ScenarioError(f"{_dotted(key)} must be a table", key)
    _known(d, _DESTINATION, key)
    if not is_domain(name):
        raise ScenarioError(f"{_dotted(key)}: {name!r} is not a domain name such as "
                            "example.com", key)
    overload = _string(d, "overload", key, "421")
    if overload not in OVERLOADS:
        raise ScenarioError(f"{_dotted(key)}: overload must be one of {', '.join(OVERLOADS)}",
                            key + ("overload",))
    limit = _number(d, "server_limit", key, 0, low=0, integer=True)
    default_backlog = {"421": 0, "connect-timeout": limit, "greeting-timeout": limit}
    dead_value = d.get("dead", False)
    if dead_value is True or dead_value is False:
        dead, dead_mode = bool(dead_value), "refused"
    elif dead_value == "timeout":
        dead, dead_mode = True, "timeout"
    else:
        raise ScenarioError(f"{_dotted(key + ('dead',))} must be true, false or \"timeout\", "
                            f"not {dead_value!r}", key + ("dead",))
    shares = {}
    for share in ("rcpt_4xx", "rcpt_5xx"):
        shares[share] = _number(d, share, key, 0, low=0, high=1)
    if shares["rcpt_4xx"] + shares["rcpt_5xx"] > 1:
        raise ScenarioError(f"{_dotted(key)}: rcpt_4xx + rcpt_5xx is more than 1", key +
                            ("rcpt_5xx",))
    replies = {}
    for reply, first in (("rate_reply", "4"), ("rcpt_4xx_reply", "4"),
                         ("rcpt_5xx_reply", "5")):
        text = _string(d, reply, key, getattr(Destination, reply))
        if not re.match(rf"^{first}\d\d [^\r\n]*$", text):
            raise ScenarioError(f"{_dotted(key + (reply,))} must be an SMTP reply starting "
                                f"with a {first}xx code, such as "
                                f"{getattr(Destination, reply)!r}", key + (reply,))
        replies[reply] = text
    transport = _string(d, "transport", key, "smtp")
    if not re.fullmatch(r"[a-z][a-z0-9_-]{0,30}", transport):
        raise ScenarioError(f"{_dotted(key + ('transport',))}: {transport!r} is not a "
                            "master.cf service name", key + ("transport",))
    dead_until = _number(d, "dead_until", key, 0, low=0)
    dead_until_low = _number(d, "dead_until_low", key, 0, low=0)
    if dead_until_low and dead_until_low >= dead_until:
        raise ScenarioError(f"{_dotted(key + ('dead_until_low',))} must be below "
                            f"dead_until ({dead_until:g})", key + ("dead_until_low",))
    return Destination(
        name, transport, _dist(d.get("latency", 0), key + ("latency",)),
        limit, overload, _number(d, "timeout", key, 30, low=0), dead,
        _number(d, "backlog", key, default_backlog[overload], low=-1, integer=True),
        _number(d, "reject_time", key, 0, low=0), _number(d, "rate_limit", key, 0, low=0),
        replies["rate_reply"], dead_until, dead_mode,
        shares["rcpt_4xx"], replies["rcpt_4xx_reply"], shares["rcpt_5xx"],
        replies["rcpt_5xx_reply"], "timeout" in d, dead_until_low,
        _string(d, "mx", key, "").strip().rstrip(".").lower(),
        _source_rules(_table(d, "sources", key), key + ("sources",)))


def _source_rules(table: dict[str, Any], key: Key) -> dict[str, SourceRule]:
    """``[destinations.NAME.sources.SRC]``: the server's rules for one source."""
    out = {}
    for source, rule in table.items():
        where = key + (source,)
        if not isinstance(rule, dict):
            raise ScenarioError(f"{_dotted(where)} must be a table", where)
        _known(rule, _SOURCE_RULE, where)
        replies = {}
        for reply in ("rate_reply", "day_reply"):
            text = _string(rule, reply, where, getattr(SourceRule, reply))
            if not re.match(r"^4\d\d [^\r\n]*$", text):
                raise ScenarioError(f"{_dotted(where + (reply,))} must be an SMTP reply "
                                    "starting with a 4xx code, such as "
                                    f"{getattr(SourceRule, reply)!r}", where + (reply,))
            replies[reply] = text
        out[source] = SourceRule(_number(rule, "rate_limit", where, 0, low=0),
                                 replies["rate_reply"],
                                 _number(rule, "day_limit", where, 0, low=0, integer=True),
                                 replies["day_reply"])
    return out


def _message(i: int, m: Any, sc: Scenario) -> MessageSpec:
    key: Key = ("messages", i)
    if not isinstance(m, dict):
        raise ScenarioError(f"{_dotted(key)} must be a table", key)
    _known(m, _MESSAGE, key)
    rcpts = m.get("recipients", 1)
    spread: tuple[tuple[str, int], ...] = ()
    if isinstance(rcpts, dict):
        if "destination" in m:
            raise ScenarioError(f"{_dotted(key)}: recipients spread over destinations "
                                "(a table) and destination: give one of them",
                                key + ("destination",))
        pairs = []
        for dest in rcpts:
            if dest not in sc.destinations:
                raise ScenarioError(f"{_dotted(key)}: unknown destination {dest!r} in "
                                    "recipients", key + ("recipients", dest))
            pairs.append((dest, _number(rcpts, dest, key + ("recipients",), 1, low=1,
                                        integer=True)))
        if not pairs:
            raise ScenarioError(f"{_dotted(key)}: recipients is an empty table",
                                key + ("recipients",))
        spread = tuple(pairs)
        dest, total = pairs[0][0], sum(n for _, n in pairs)
    else:
        total = _number(m, "recipients", key, 1, low=1, integer=True)
        dest = _string(m, "destination", key, "")
        if dest not in sc.destinations:
            raise ScenarioError(f"messages[{i}]: unknown destination {dest!r}",
                                key + ("destination",))
    name = _string(m, "name", key, "")
    default_class = re.sub(r"[^A-Za-z0-9_]+$", "", name) or "mail"
    klass = _string(m, "class", key, default_class)
    if not _CLASS.match(klass):
        raise ScenarioError(f"{_dotted(key)}: class {klass!r} must be letters, digits and _ "
                            "(it becomes part of recipient addresses); name one with "
                            "class = ...", key + (("class",) if "class" in m else ("name",)))
    sender = _string(m, "sender", key, f"{klass}@{DEFAULT_SENDER_DOMAIN}")
    if not _SENDER.match(sender) or sender.rpartition("@")[2] in sc.destinations:
        raise ScenarioError(f"{_dotted(key + ('sender',))}: {sender!r} is not an address "
                            "of a domain other than the destinations'", key + ("sender",))
    size = _dist(m.get("size", DEFAULT_SIZE), key + ("size",), "size")
    gaps = _dist(m.get("every", 0), key + ("every",), "every (seconds between arrivals)")
    return MessageSpec(_number(m, "at", key, 0, low=0),
                       _number(m, "count", key, 1, low=1, integer=True),
                       gaps.average(), total, dest, name, spread, klass, sender, size,
                       None if gaps.dist == "fixed" else gaps)


def _compare(c: dict[str, Any]) -> CompareSettings:
    key: Key = ("compare",)
    _known(c, _COMPARE, key)
    scale = _number(c, "time_scale", key, 1.0)
    if not 0 < scale <= 100:
        raise ScenarioError("compare.time_scale must be more than 0 and at most 100",
                            key + ("time_scale",))
    contenders = c.get("contenders", [])
    if not isinstance(contenders, list) or not all(isinstance(x, str) for x in contenders):
        raise ScenarioError("compare.contenders must be a list of strings such as "
                            '["stock", "pyqmgr:finch"]', key + ("contenders",))
    content_filter = None
    if "content_filter" in c:
        f = _table(c, "content_filter", key)
        fkey = key + ("content_filter",)
        _known(f, _CONTENT_FILTER, fkey)
        content_filter = ContentFilter(
            _dist(f.get("latency", 0.0), fkey + ("latency",), "latency"),
            int(_number(f, "process_limit", fkey, 10, low=1, high=1000, integer=True)))
    return CompareSettings(scale, _number(c, "timeout", key, 300, low=1), list(contenders),
                           _settings(_table(c, "main_cf", key), key + ("main_cf",)),
                           content_filter)


# -- arrivals files: one message a line -------------------------------------------------

ARRIVALS_HEADER = ("# pyqmgr arrivals: at,size,class,sender,recipients,measured"
                   "[,born[,follows,gap]]")
#: An arrivals line is at most this long (a message to thousands of domains fits).
MAX_ARRIVAL_LINE = 1 << 20
_ITEM = re.compile(r"^(?P<dest>[^*=\s]+)(?:\*(?P<n>\d{1,7}))?"
                   r"(?:=(?P<script>(?:[dbsDB](?:\d{1,6}(?:\.\d{1,6})?(?:e-?\d\d)?)?){1,1000}))?$")
_TOKEN = re.compile(r"([dbsDB])(\d{1,6}(?:\.\d{1,6})?(?:e-?\d\d)?)?")


def parse_script(script: str) -> tuple[tuple[str, float | None], ...]:
    """A recipient's script as (answer, seconds or None) per try: ``d1.5s2`` is a 4xx
    after 1.5 s, then accepted after 2 s. ``D`` and ``B`` are tries that failed as a
    whole delivery, not at RCPT: ``D`` a temporary failure of the site (a lost
    connection, a timeout, a TLS or DNS failure: stock throttles the destination),
    ``B`` a permanent one (``5.4.4`` host not found, a 5xx greeting, error(8))."""
    return tuple((code, float(secs) if secs else None)
                 for code, secs in _TOKEN.findall(script))


def read_arrivals(path: str, sc: Scenario) -> list[TraceMessage]:
    """An arrivals file (``pyqmgr replay`` writes them): CSV, one message a line.

    ``at,size,class,sender,recipients,measured``: seconds, bytes, the message class,
    the envelope sender, recipients as space-separated ``DOMAIN[*COUNT][=SCRIPT]``
    (a destination of the scenario, how many, their RCPT answers try by try), and 1
    or 0; optionally then ``born`` (when it really arrived, if before ``at``; empty:
    ``at``), ``follows`` (the data line, from 0, of the message whose content filter
    re-injected it; -1: none) and ``gap`` (seconds after that one is done). Lines
    starting with ``#`` are comments. Errors name the file and line.
    """
    out: list[TraceMessage] = []
    classes: dict[str, str] = {}
    try:
        f = open(path, encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise ScenarioError(f"arrivals: {path}: {exc.strerror}", ("arrivals",)) from None
    last = 0.0
    with f:
        n = 0
        try:
            for raw in f:
                n += 1
                if len(raw) > MAX_ARRIVAL_LINE:
                    raise ValueError(f"longer than {MAX_ARRIVAL_LINE} bytes")
                line = raw.strip()
                if not line or line.startswith("#"):
                    continue
                fields = line.split(",")
                if len(fields) not in (5, 6, 7, 9):
                    raise ValueError("want at,size,class,sender,recipients[,measured"
                                     "[,born[,follows,gap]]]")
                at, size = float(fields[0]), int(fields[1])
                if not math.isfinite(at) or at < 0 or size < 1:
                    raise ValueError("at must be 0 or more and size 1 or more")
                if at < last:
                    raise ValueError(f"at {at:g} is before the line above's {last:g}: "
                                     "lines are in time order")
                last = at
                klass = classes.setdefault(fields[2], fields[2])
                if not _CLASS.match(klass):
                    raise ValueError(f"class {klass!r}: letters, digits and _")
                if not _SENDER.match(fields[3]):
                    raise ValueError(f"sender {fields[3]!r} is not an address")
                rcpts = []
                for item in fields[4].split():
                    m = _ITEM.match(item)
                    if m is None:
                        raise ValueError(f"recipients item {item[:60]!r}: write "
                                         "DOMAIN[*COUNT][=SCRIPT] (script: d, b, s, D, B, "
                                         "each with optional seconds)")
                    if m["dest"] not in sc.destinations:
                        raise ValueError(f"unknown destination {m['dest']!r}")
                    count = int(m["n"] or 1)
                    if count < 1:
                        raise ValueError("a recipient count is 1 or more")
                    rcpts.append((m["dest"], count, m["script"] or ""))
                if not rcpts:
                    raise ValueError("no recipients")
                measured = len(fields) < 6 or fields[5].strip() != "0"
                born = float(fields[6]) if len(fields) > 6 and fields[6].strip() else None
                if born is not None and (not math.isfinite(born) or born > at):
                    raise ValueError(f"born {born:g} must be a number at or before at")
                follows, gap = -1, 0.0
                if len(fields) > 7:
                    follows, gap = int(fields[7]), float(fields[8])
                    if follows >= len(out) or follows < -1:
                        raise ValueError(f"follows {follows}: a data line above, or -1")
                    if not math.isfinite(gap) or gap < 0:
                        raise ValueError("gap must be 0 or more")
                out.append(TraceMessage(at, size, klass, fields[3], tuple(rcpts), measured,
                                        born, follows, gap))
        except UnicodeDecodeError:
            raise ScenarioError(f"arrivals: {path}, line {n + 1}: not UTF-8 text",
                                ("arrivals",)) from None
        except ValueError as exc:
            raise ScenarioError(f"arrivals: {path}, line {n}: {exc}", ("arrivals",)) from None
    return out


def write_arrivals(path: str, trace: Sequence[TraceMessage]) -> None:
    with open_new(path, encoding="utf-8") as f:
        f.write(ARRIVALS_HEADER + "\n")
        for m in trace:
            items = " ".join(dest + (f"*{n}" if n != 1 else "") + (f"={s}" if s else "")
                             for dest, n, s in m.recipients)
            extra = ""
            if m.born is not None or m.follows >= 0:
                extra = "," + ("" if m.born is None else f"{m.born:.3f}")
                if m.follows >= 0:
                    extra += f",{m.follows},{m.gap:.3f}"
            f.write(f"{m.at:.3f},{m.size},{m.klass},{m.sender},{items},"
                    f"{1 if m.measured else 0}{extra}\n")


# -- files, and where in them -----------------------------------------------------------

_TOML_POS = re.compile(r"\(at line (\d+), column (\d+)\)$")
_HEADER = re.compile(r"^\s*(\[\[?)\s*(.*?)\s*\]\]?\s*(#.*)?$")
_KEYLINE = re.compile(r"^\s*((?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*')"
                      r"(?:\s*\.\s*(?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*'))*)\s*=")


def _split_key(text: str) -> list[str]:
    parts = re.findall(r"\"([^\"]*)\"|'([^']*)'|([A-Za-z0-9_-]+)", text)
    return [a or b or c for a, b, c in parts]


def locate(text: str, key: Sequence[str | int]) -> int | None:
    """The 1-based line of ``key`` in a TOML text, or of its nearest enclosing table.

    A small scanner rather than a TOML parser: tables, arrays of tables (counted, so
    ``("messages", 2, "count")`` finds the third ``[[messages]]``'s line) and ``key =``
    lines; a key inside an inline table gives the line of the key that holds it.
    """
    want = list(key)
    best: tuple[int, int] | None = None  # (matched length, line)
    current: list[str | int] = []
    arrays: dict[tuple[str, ...], int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        h = _HEADER.match(line)
        path: list[str | int] | None = None
        if h and not _KEYLINE.match(line):
            names = _split_key(h.group(2))
            if h.group(1) == "[[":
                count = arrays.get(tuple(names), -1) + 1
                arrays[tuple(names)] = count
                current = [*names, count]
            else:
                current = list(names)
            path = list(current)
        else:
            k = _KEYLINE.match(line)
            if k:
                path = current + _split_key(k.group(1))
        if path is None:
            continue
        if path == want[:len(path)] and (best is None or len(path) > best[0]):
            best = (len(path), n)
    return best[1] if best else None


def load(path: str) -> Scenario:
    """Read a file; every error says the file and, where it is known, the line."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ScenarioError(f"{path}: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
        data = tomllib.loads(text)
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"{path}: not UTF-8 text ({exc.reason} at byte "
                            f"{exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        msg = str(exc)
        m = _TOML_POS.search(msg)
        if m:
            raise ScenarioError(f"{path}, line {m.group(1)}: {msg[:m.start()].strip()} "
                                f"(column {m.group(2)}): not valid TOML",
                                line=int(m.group(1))) from None
        raise ScenarioError(f"{path}: {msg}: not valid TOML") from None
    try:
        sc = parse(data, os.path.dirname(os.path.abspath(path)))
    except ScenarioError as exc:
        at = locate(text, exc.key) if exc.key else None
        where = f"{path}, line {at}" if at else path
        raise ScenarioError(f"{where}: {exc}", exc.key, at) from None
    sc.base_dir = os.path.dirname(os.path.abspath(path))
    sc.path = os.path.abspath(path)
    return sc
