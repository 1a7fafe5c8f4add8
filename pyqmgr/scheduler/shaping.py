"""Traffic shaping stock Postfix cannot do: a rate with concurrency, graded backoff.

Two things admins ask for year after year, both off unless pyqmgr.cf turns them on:

* **A rate per destination together with the concurrency window.** Postfix's
  ``destination_rate_delay`` pauses a destination after every delivery, which forces
  its concurrency to 1. ``<transport>_destination_rate = N/PERIOD`` instead spaces the
  *starts* of deliveries (GCRA: one start every PERIOD/N, with
  ``<transport>_destination_rate_burst`` starts allowed back to back), while the 2.5
  window still decides how many run at once. A destination that may not start one now
  is *gated* until it may; its mail stays in core and no agent is asked for it.
* **Response-driven adaptation, graded.** ``<transport>_response_rules`` names a file
  of reply patterns, each with what to do when an agent's hop-level reply matches
  (a provider's throttling reply: Gmail's ``421 4.7.28``, Yahoo's ``[TS01]``, an
  anvil-style ``421 ... too many connections``). A matching reply is *throttling*, not
  failure: it never counts toward the failed cohorts that declare a destination dead
  (a burst of 421s must not kill a live site), and stock's negative feedback is
  replaced by the rule's action: cap the window at a fraction of the deliveries in
  flight, scale the rate down, or gate the destination for a while, each with a
  floor. After ``quiet`` seconds without another match the cap and the rate step back
  up; ``ttl`` after the last match the reduction is gone.

The rules file uses the syntax of a Postfix ``regexp:`` table: ``/pattern/flags``
then the action, ``#`` comments, continuation lines starting with white space. The
pattern is matched against ``"STATUS TEXT"`` of the agent's hop DSN, for example
``4.7.0 host mx.example[192.0.2.1] refused to talk to me: 421 4.7.0 Error: too many
connections from 192.0.2.9``. Patterns are case-insensitive unless the flags say
``i`` (as in Postfix, where ``i`` toggles the default). Actions::

    throttle [window=FACTOR] [window_floor=N] [rate=FACTOR] [rate_floor=N/PERIOD]
             [suspend=DURATION] [after=K/DURATION] [quiet=DURATION] [step=N]
             [ttl=DURATION] [suspend_tenant=DURATION]
    failure                   # stock behaviour: negative feedback and cohorts

The first matching rule wins. Everything here is data and arithmetic on values the
core passes in (``now``); nothing reads a clock or a file: a rules file is read by
:func:`pyqmgr.settings.scheduling.load_rules`, at start-up, and handed in parsed.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

#: Time units of durations and rate periods, as Postfix writes them (plus ms).
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)?(ms|s|m|h|d|w)?$")

#: A rate's largest count and shortest period: beyond these it is a typo, not a rate.
MAX_RATE_COUNT = 1_000_000
MIN_PERIOD = 0.001


class ShapingError(ValueError):
    """A bad shaping setting or rule; the text says what and where."""


def parse_duration(text: str, what: str, default_unit: str = "s") -> float:
    """``90s``, ``15m``, ``2h``, ``500ms``; a bare number is in ``default_unit``."""
    m = _DURATION_RE.match(text.strip().lower())
    if not text.strip() or m is None or (m.group(1) is None):
        raise ShapingError(f"{what}: bad duration {text!r} (examples: 500ms, 30s, 10m, 1h)")
    value = float(m.group(1)) * _UNITS[m.group(2) or default_unit]
    if value <= 0:
        raise ShapingError(f"{what}: a duration must be more than 0")
    return value


@dataclass(frozen=True)
class Rate:
    """N delivery starts per PERIOD seconds."""

    count: float
    period: float

    @property
    def interval(self) -> float:
        return self.period / self.count

    def __str__(self) -> str:
        period = f"{self.period:g}s"
        for unit in ("w", "d", "h", "m", "s", "ms"):
            size = _UNITS[unit]
            if self.period >= size and (self.period / size).is_integer():
                n = int(self.period / size)
                period = unit if n == 1 else f"{n}{unit}"
                break
        return f"{self.count:g}/{period}"


def parse_rate(text: str, what: str) -> Rate | None:
    """``N/PERIOD`` (``10/1s``, ``1/200ms``, ``600/h``); ``0`` or empty: no rate."""
    text = text.strip()
    if text in ("", "0"):
        return None
    count, sep, period = text.partition("/")
    if not sep:
        raise ShapingError(f"{what}: bad rate {text!r}: write N/PERIOD, e.g. 10/1s or 1/200ms")
    try:
        n = float(count)
    except ValueError:
        raise ShapingError(f"{what}: bad rate {text!r}: {count!r} is not a number") from None
    if not 0 < n <= MAX_RATE_COUNT:
        raise ShapingError(f"{what}: bad rate {text!r}: the count must be more than 0 and "
                           f"at most {MAX_RATE_COUNT}")
    seconds = parse_duration(period if period[:1].isdigit() else f"1{period}", what)
    if seconds < MIN_PERIOD:
        raise ShapingError(f"{what}: bad rate {text!r}: the period must be at least 1ms")
    return Rate(n, seconds)


# -- rules ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One line of a rules file: a reply pattern and what a match does."""

    pattern: re.Pattern[str]
    where: str
    throttle: bool = True
    window: float | None = None
    window_floor: int = 1
    rate: float | None = None
    rate_floor: Rate | None = None
    suspend: float | None = None
    #: Hold the replying delivery's tenant (issue #34) at the destination's site, or
    #: the destination, this long: its mail only, everyone else's flows.
    suspend_tenant: float | None = None
    after: tuple[int, float] | None = None
    #: A background share of throttling replies to live with (0.05: 5%): act only
    #: when more of the deliveries done in the ``after`` period (1 minute without
    #: it) were answered so. A server's session limit races with sessions it has
    #: not seen closed yet; a few such replies at the limit are noise, not a signal.
    tolerate: float = 0.0
    quiet: float = 60.0
    step: int = 1
    ttl: float = 3600.0

    def describe(self) -> str:
        """The action as the maillog and explain show it."""
        if not self.throttle:
            return "failure"
        parts = []
        if self.window is not None:
            parts.append(f"window x{self.window:g} (floor {self.window_floor})")
        if self.rate is not None:
            floor = f", floor {self.rate_floor}" if self.rate_floor else ""
            parts.append(f"rate x{self.rate:g}{floor}")
        if self.suspend is not None:
            parts.append(f"suspend {self.suspend:g}s")
        if self.suspend_tenant is not None:
            parts.append(f"suspend its tenant {self.suspend_tenant:g}s")
        return "throttle: " + (", ".join(parts) or "no failed cohort")


_RULE_RE = re.compile(r"/((?:[^/\\]|\\.)*)/([a-zA-Z]*)\s*(.*)$")


def parse_rule(line: str, where: str) -> Rule:
    """One rule: ``/pattern/flags action name=value...``."""
    m = _RULE_RE.match(line.strip())
    if m is None:
        raise ShapingError(f"{where}: expected /pattern/ then an action")
    source, flags, action = m.groups()
    re_flags = re.IGNORECASE
    for flag in flags:
        if flag == "i":
            re_flags ^= re.IGNORECASE
        elif flag not in "mx":
            raise ShapingError(f"{where}: unknown pattern flag {flag!r}")
    try:
        pattern = re.compile(source, re_flags)
    except re.error as exc:
        raise ShapingError(f"{where}: bad pattern: {exc}") from None
    words = action.split()
    if not words:
        raise ShapingError(f"{where}: no action after the pattern")
    kind, args = words[0].lower(), words[1:]
    if kind == "failure":
        if args:
            raise ShapingError(f"{where}: failure takes no arguments")
        return Rule(pattern, where, throttle=False)
    if kind != "throttle":
        raise ShapingError(f"{where}: unknown action {words[0]!r} (throttle or failure)")
    kw: dict[str, object] = {}
    for arg in args:
        name, sep, value = arg.partition("=")
        name = name.lower()
        if not sep or not value:
            raise ShapingError(f"{where}: expected name=value, not {arg!r}")
        what = f"{where}: {name}"
        if name in ("window", "rate"):
            try:
                factor = float(value)
            except ValueError:
                raise ShapingError(f"{what}: {value!r} is not a number") from None
            if not 0 < factor < 1:
                raise ShapingError(f"{what}: a factor between 0 and 1, e.g. 0.8")
            kw[name] = factor
        elif name == "window_floor":
            if not value.isdigit() or int(value) < 1:
                raise ShapingError(f"{what}: a whole number, 1 or more")
            kw[name] = int(value)
        elif name == "step":
            if not value.isdigit() or int(value) < 1:
                raise ShapingError(f"{what}: a whole number, 1 or more")
            kw[name] = int(value)
        elif name == "rate_floor":
            kw[name] = parse_rate(value, what)
        elif name in ("suspend", "quiet", "ttl", "suspend_tenant"):
            kw[name] = parse_duration(value, what)
        elif name == "tolerate":
            text = value[:-1] if value.endswith("%") else value
            try:
                share = float(text) / (100 if value.endswith("%") else 1)
            except ValueError:
                raise ShapingError(f"{what}: a share such as 5% or 0.05") from None
            if not 0 <= share < 1:
                raise ShapingError(f"{what}: a share from 0 to under 100%")
            kw[name] = share
        elif name == "after":
            k, sep, period = value.partition("/")
            if not sep or not k.isdigit() or int(k) < 1:
                raise ShapingError(f"{what}: write K/DURATION, e.g. 3/1m")
            kw[name] = (int(k), parse_duration(period, what))
        else:
            raise ShapingError(f"{where}: unknown parameter {name!r}")
    return Rule(pattern, where, **kw)  # type: ignore[arg-type]


def parse_rules(text: str, path: str) -> list[Rule]:
    """A whole rules file; ShapingError names the file and line of the first mistake."""
    rules: list[Rule] = []
    logical: list[tuple[int, str]] = []
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        if raw[:1].isspace() and logical:
            first, body = logical[-1]
            logical[-1] = (first, body + " " + raw.strip())
        else:
            logical.append((n, raw.strip()))
    for n, line in logical:
        rules.append(parse_rule(line, f"{path}, line {n}"))
    return rules


# -- one transport's shaping, and one destination's state -------------------------------


@dataclass(frozen=True)
class Shaping:
    """A transport's shaping settings (None of it set: the transport has no Shaping)."""

    rate: Rate | None = None
    burst: int = 1
    rules: tuple[Rule, ...] = ()
    #: Setting names, for explain and the logs.
    rate_setting: str = "destination_rate"
    rules_setting: str = "response_rules"

    def match(self, status: str, text: str) -> Rule | None:
        subject = f"{status} {text}"
        for rule in self.rules:
            if rule.pattern.search(subject):
                return rule
        return None


@dataclass
class Gate:
    """Why a live destination starts no delivery now, and until when (scheduler clock).

    ``kind`` is what explain names: ``rate`` (the GCRA spacing), ``backoff`` (a
    rule's suspend), ``policy service`` (a delegated DEFER) or ``suspended`` (an
    operator; see :class:`.suspension.Suspension`, which has the same members).
    """

    kind: str
    until: float
    setting: str
    text: str


@dataclass
class Shape:
    """One destination's shaping state. Outlives its queue while it matters.

    The core discards idle queues; a rate's spacing and a learned cap must survive
    that (else a destination that empties between messages would get each one at
    once), so the transport keeps shapes by queue name until they are neutral.
    """

    #: GCRA's theoretical arrival time of the next start.
    tat: float = 0.0
    #: A gate of the rate or of a rule, or None.
    gate: Gate | None = None
    #: The window cap a rule set (0: none), and the rate factor (1.0: none).
    cap: int = 0
    rate_factor: float = 1.0
    #: The rule in force, the time of its last match and of its last reduction, and
    #: when to step up next.
    rule: Rule | None = None
    last_match: float = -math.inf
    last_cut: float = -math.inf
    next_step: float = math.inf
    #: Match times for a rule's ``after=K/PERIOD`` trigger.
    matches: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    #: Recent start times, to learn a rate to scale when none is configured.
    starts: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    #: Recent delivery ends, whatever the outcome (a rule's ``tolerate`` share).
    dones: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    #: The rate learnt at the first rate reduction (starts per second).
    learnt_rate: float = 0.0

    def neutral(self, now: float) -> bool:
        return self.gate is None and self.rule is None and self.tat <= now


def effective_interval(shaping: Shaping, shape: Shape) -> float:
    """Seconds between starts now (0: no spacing)."""
    if shape.rate_factor < 1.0:
        base = shaping.rate.interval if shaping.rate else (
            1.0 / shape.learnt_rate if shape.learnt_rate > 0 else 0.0)
        if base <= 0:
            return 0.0
        interval = base / shape.rate_factor
        rule = shape.rule
        if rule is not None and rule.rate_floor is not None:
            interval = min(interval, rule.rate_floor.interval)
        return interval
    return shaping.rate.interval if shaping.rate else 0.0


def take_start(shaping: Shaping, shape: Shape, now: float) -> float | None:
    """A delivery starts now: advance GCRA; the time the next may start, if later."""
    if shaping.rules:
        shape.starts.append(now)
    interval = effective_interval(shaping, shape)
    if interval <= 0:
        return None
    tat = max(shape.tat, now) + interval
    shape.tat = tat
    next_ok = tat - (shaping.burst - 1) * interval
    return next_ok if next_ok > now else None


def observed_rate(shape: Shape, now: float, horizon: float = 30.0) -> float:
    """Starts per second lately: those in the last ``horizon`` seconds over their span.

    The span runs to ``now`` and is at least a second, so that a burst of starts at
    one instant (a fresh destination's initial concurrency) reads as that many a
    second, not as thousands.
    """
    recent = [t for t in shape.starts if t >= now - horizon]
    if not recent:
        return 0.0
    return len(recent) / max(1.0, now - recent[0])


def recovery_step(shape: Shape, rule: Rule, now: float, limit: int) -> bool:
    """A quiet interval passed with no throttling reply: the TTL since the last match
    ends the reduction, else one step goes back (the cap up by ``rule.step``, gone at
    ``limit``; the rate factor divided by ``rule.rate``). True while some reduction
    remains, its next step due at ``now + rule.quiet``; a destination's and a site's
    recovery (:mod:`.gates`, :mod:`.site`) are this one."""
    if now - shape.last_match >= rule.ttl:
        shape.cap, shape.rate_factor, shape.learnt_rate = 0, 1.0, 0.0
    else:
        if shape.cap:
            shape.cap += rule.step
            if limit and shape.cap >= limit:
                shape.cap = 0
        if rule.rate is not None and shape.rate_factor < 1.0:
            shape.rate_factor = min(1.0, shape.rate_factor / rule.rate)
    if not shape.cap and shape.rate_factor >= 1.0:
        shape.rule = None
        return False
    shape.next_step = now + rule.quiet
    return True


def recovery_text(shape: Shape, rule: Rule, what: str) -> str:
    """The log's words for a reduction still in force after a step (``what``: the
    cap's owner, "window" or "site")."""
    return (f"quiet for {rule.quiet:g}s: "
            + (f"{what} cap {shape.cap}" if shape.cap else f"no {what} cap")
            + (f", rate x{shape.rate_factor:.3g}" if shape.rate_factor < 1 else ""))


def triggered(rule: Rule, shape: Shape, now: float) -> bool:
    """Record a match; True when the rule's trigger fires.

    At once by default; with ``after=K/PERIOD`` at the K-th match within PERIOD; with
    ``tolerate=SHARE`` only while matches are more than that share of the
    deliveries done in the period.
    """
    shape.matches.append(now)
    k, period = rule.after if rule.after is not None else (1, 60.0)
    matches = sum(1 for t in shape.matches if t > now - period)
    if matches < k:
        return False
    if rule.tolerate > 0:
        done = sum(1 for t in shape.dones if t > now - period)
        return matches > rule.tolerate * max(done, 1)
    return True


# -- from pyqmgr.cf -------------------------------------------------------------------

#: The parameters, each also in the ``<transport>_NAME`` form.
RATE = "destination_rate"
BURST = "destination_rate_burst"
RULES = "response_rules"
NAMES = (RATE, BURST, RULES)

#: setting(name, transport, default): pyqmgr.cf's value by Postfix's naming rule.
Setting = Callable[[str, str, str], str]


class ShapingTable:
    """Each transport's :class:`Shaping` from pyqmgr.cf, checked and read up front.

    Rules files are read when the table is built (``read_rules``: the daemon builds
    it at start-up, before the chroot), one read per distinct path, and every
    parameter in any of its forms is parsed then, so a mistake is a start-up error
    naming the parameter, not a surprise when mail for that transport first comes.
    """

    def __init__(self, values: dict[str, str], setting: Setting,
                 read_rules: Callable[[str], list[Rule]]) -> None:
        self.setting = setting
        self.rules: dict[str, tuple[Rule, ...]] = {}
        self.names = sorted(k for k in values if k.endswith(NAMES))
        for name in self.names:
            value = values[name]
            if name.endswith(RULES):
                path = value.strip()
                if path and path not in self.rules:
                    if not path.startswith("/"):
                        raise ShapingError(f"{name}: {path!r} is not an absolute path")
                    self.rules[path] = tuple(read_rules(path))
            elif name.endswith(BURST):
                _burst(value, name)
            else:
                parse_rate(value, name)

    @property
    def active(self) -> bool:
        """Is any shaping set at all? (None: the scheduler stays stock.)"""
        return bool(self.names)

    def shaping_for(self, transport: str) -> Shaping | None:
        rate = parse_rate(self.setting(RATE, transport, ""), f"{transport}_{RATE}")
        burst = _burst(self.setting(BURST, transport, "1"), f"{transport}_{BURST}")
        path = self.setting(RULES, transport, "").strip()
        rules = self.rules.get(path, ()) if path else ()
        if rate is None and not rules:
            return None
        return Shaping(rate, burst, rules)


def _burst(value: str, name: str) -> int:
    value = value.strip() or "1"
    if not value.isdigit() or not 1 <= int(value) <= 100_000:
        raise ShapingError(f"{name}: a whole number from 1 to 100000, not {value!r}")
    return int(value)
