"""Scenario files: messages, destinations, transports and main.cf, in TOML.

```toml
seed = 1
duration = 3600            # stop the clock here at the latest (seconds)

[main_cf]                  # any main.cf parameter, as text, read with stock's rules
smtp_destination_concurrency_limit = "20"

[scheduler]
feedback_rounding = "stock" # "stock" (Postfix 3.7, as the daemon) or "pseudocode" (the
                           # seed's November 2007 rules its tables were measured with)
policy = "nqmgr"           # scheduler_policy: nqmgr, oqmgr, finch, zmailer, module:PATH

[pyqmgr_cf]                # any pyqmgr.cf parameter, as text (transport forms too)
smtp_finch_scale_max_concurrency = "10"
smtp_destination_rate = "5/1s"   # shaping; a response_rules path is relative to this file

[transports.smtp]
process_limit = 100        # master.cf maxproc of the service

[destinations."example.com"]
transport = "smtp"
latency = 1.0              # seconds per recipient: a number, or a table:
                           # {dist = "uniform", low = 0.5, high = 1.5}
                           # {dist = "exponential", mean = 1}
server_limit = 5           # sessions the server allows at once (0: no limit)
overload = "421"           # beyond the limit: "421" (answered at once); or a listen
                           # queue where connections wait for a server process, and beyond
                           # it "connect-timeout" (dropped SYNs: the connect times out) or
                           # "greeting-timeout" (connected, never greeted: it times out)
backlog = 5                # listen queue length (default: server_limit; -1 unbounded)
reject_time = 0.0          # how long a 421 answer takes
timeout = 30               # the client's connect or greeting timeout
dead = false               # no server at all: every attempt fails at once
rate_limit = 0             # deliveries a second the server takes; beyond, it answers
rate_reply = "421 4.7.28 ..."  # this (a provider's rate limiting) at reject_time

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
every = 0                  # ... this many seconds apart
recipients = 2000          # recipients each, all to ...
destination = "example.com"
```
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pyqmgr.scheduler.feedback import ROUNDINGS
from pyqmgr.scheduler.shaping import ShapingError, parse_rate

OVERLOADS = ("421", "connect-timeout", "greeting-timeout")


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
    """A scenario file that cannot be run; the text says which setting and why."""


@dataclass(frozen=True)
class Latency:
    dist: str = "fixed"
    value: float = 0.0
    low: float = 0.0
    high: float = 0.0
    mean: float = 0.0


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


@dataclass(frozen=True)
class MessageSpec:
    at: float
    count: int
    every: float
    recipients: int
    destination: str
    name: str = ""


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
    #: A delivery policy service to ask before each delivery (None: none).
    delegation: Delegation | None = None


def _latency(value: Any, where: str) -> Latency:
    if isinstance(value, int | float):
        return Latency("fixed", float(value))
    if not isinstance(value, dict):
        raise ScenarioError(f"{where}: latency must be a number or a table")
    dist = value.get("dist", "fixed")
    if dist == "fixed":
        return Latency("fixed", float(value.get("value", 0)))
    if dist == "uniform":
        return Latency("uniform", low=float(value["low"]), high=float(value["high"]))
    if dist == "exponential":
        return Latency("exponential", mean=float(value["mean"]))
    raise ScenarioError(f"{where}: unknown latency distribution {dist!r}")


def parse(data: dict[str, Any], base_dir: str = ".") -> Scenario:
    sc = Scenario(seed=int(data.get("seed", 1)), duration=float(data.get("duration", 86400)),
                  title=str(data.get("title", "")))
    sc.main_cf = {str(k): str(v) for k, v in data.get("main_cf", {}).items()}
    rounding = str(data.get("scheduler", {}).get("feedback_rounding", "stock"))
    if rounding not in ROUNDINGS:
        raise ScenarioError(
            f"scheduler.feedback_rounding must be one of {', '.join(ROUNDINGS)}")
    sc.feedback_rounding = rounding
    sc.pyqmgr_cf = {str(k): str(v) for k, v in data.get("pyqmgr_cf", {}).items()}
    policy = data.get("scheduler", {}).get("policy")
    if policy is not None:
        sc.pyqmgr_cf["scheduler_policy"] = str(policy)
    for name, t in data.get("transports", {}).items():
        sc.process_limits[name] = int(t.get("process_limit", 100))
    for name, d in data.get("destinations", {}).items():
        where = f"destinations.{name}"
        overload = str(d.get("overload", "421"))
        if overload not in OVERLOADS:
            raise ScenarioError(f"{where}: overload must be one of {', '.join(OVERLOADS)}")
        limit = int(d.get("server_limit", 0))
        default_backlog = {"421": 0, "connect-timeout": limit, "greeting-timeout": limit}
        sc.destinations[name] = Destination(
            name, str(d.get("transport", "smtp")), _latency(d.get("latency", 0), where),
            limit, overload, float(d.get("timeout", 30)), bool(d.get("dead", False)),
            int(d.get("backlog", default_backlog[overload])),
            float(d.get("reject_time", 0)), float(d.get("rate_limit", 0)),
            str(d.get("rate_reply", Destination.rate_reply)))
    for i, m in enumerate(data.get("messages", [])):
        dest = str(m.get("destination", ""))
        if dest not in sc.destinations:
            raise ScenarioError(f"messages[{i}]: unknown destination {dest!r}")
        sc.messages.append(MessageSpec(float(m.get("at", 0)), int(m.get("count", 1)),
                                       float(m.get("every", 0)), int(m.get("recipients", 1)),
                                       dest, str(m.get("name", ""))))
    if not sc.messages:
        raise ScenarioError("no [[messages]]")
    if "delegation" in data:
        sc.delegation = _delegation(data["delegation"], base_dir)
    return sc


def load(path: str) -> Scenario:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ScenarioError(f"{path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{path}: {exc}") from None
    base_dir = os.path.dirname(os.path.abspath(path))
    sc = parse(data, base_dir)
    sc.base_dir = base_dir
    return sc
