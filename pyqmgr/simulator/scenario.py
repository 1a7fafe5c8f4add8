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
dead_until = 0             # no server until this time, then a working one (0: always up)
rate_limit = 0             # deliveries a second the server takes; beyond, it answers
rate_reply = "421 4.7.28 ..."  # this (a provider's rate limiting) at reject_time

[deferred]                 # the deferred queue (off: deferred recipients are only counted)
retry = true               # deferred recipients come back: a retry time of stock's backoff
                           # (main_cf minimal/maximal_backoff_time, from the arrival), a
                           # deferred-queue scan every queue_run_delay, and pyqmgr_cf's
                           # deferred_retry_jitter and deferred_recovery_rate

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
from dataclasses import dataclass, field
from typing import Any

from pyqmgr.scheduler.feedback import ROUNDINGS

OVERLOADS = ("421", "connect-timeout", "greeting-timeout")


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
    #: No server before this time (0: none of that); ``dead`` is dead for ever.
    dead_until: float = 0.0

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


def parse(data: dict[str, Any]) -> Scenario:
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
            str(d.get("rate_reply", Destination.rate_reply)), float(d.get("dead_until", 0)))
    for i, m in enumerate(data.get("messages", [])):
        dest = str(m.get("destination", ""))
        if dest not in sc.destinations:
            raise ScenarioError(f"messages[{i}]: unknown destination {dest!r}")
        sc.messages.append(MessageSpec(float(m.get("at", 0)), int(m.get("count", 1)),
                                       float(m.get("every", 0)), int(m.get("recipients", 1)),
                                       dest, str(m.get("name", ""))))
    if not sc.messages:
        raise ScenarioError("no [[messages]]")
    retry = data.get("deferred", {}).get("retry", False)
    if not isinstance(retry, bool):
        raise ScenarioError("deferred.retry must be true or false")
    sc.retry_deferred = retry
    return sc


def load(path: str) -> Scenario:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ScenarioError(f"{path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{path}: {exc}") from None
    sc = parse(data)
    sc.base_dir = os.path.dirname(os.path.abspath(path))
    return sc
