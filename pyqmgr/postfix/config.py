"""qmgr's view of main.cf and its ``-o`` overrides, computed as a Postfix daemon does.

A daemon does not see what ``postconf -x`` shows: it starts from main.cf plus its own
``-o`` overrides, and a ``$name`` reference expands only to names that are in that
dictionary or were registered by an earlier read (reads register their built-in default).
Tables are read in stock's order (globals, then qmgr's int, str, bool and time tables),
so a reference to a parameter read later expands to nothing, exactly as in stock qmgr.
Transport-specific values (``<transport>_destination_concurrency_limit`` ...) are read
lazily the first time a transport is used, falling back to the runtime ``default_*``.
Errors carry the text stock logs after ``fatal: ``.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass


class ConfigError(Exception):
    """A value stock would refuse; the text is what stock logs after ``fatal: ``."""


# -- main.cf reading ----------------------------------------------------------------------


def parse_main_cf(text: str) -> tuple[dict[str, str], list[str]]:
    """Read main.cf's logical lines; returns raw values and warnings (duplicates)."""
    values: dict[str, str] = {}
    warnings: list[str] = []
    logical: list[str] = []

    def flush() -> None:
        if not logical:
            return
        line = "".join(logical).strip()
        logical.clear()
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not name or any(c.isspace() for c in name):
            raise ConfigError(f"missing '=' after attribute name: \"{line}\"")
        if name in values:
            warnings.append(f"overriding earlier entry: {name}={values[name]}")
        values[name] = value.strip()

    for raw in text.split("\n"):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if raw[0] in " \t":
            if logical:
                logical.append(raw.rstrip("\r"))
            continue
        flush()
        logical.append(raw.rstrip("\r"))
    flush()
    return values, warnings


# -- $ expansion -------------------------------------------------------------------------

_NAME = re.compile(r"[A-Za-z0-9_]+")


def _find_close(text: str, i: int, open_ch: str, close_ch: str) -> int:
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_ch:
            depth += 1
        elif text[j] == close_ch:
            depth -= 1
            if depth == 0:
                return j
    raise ConfigError(f"unbalanced {open_ch} in value: {text}")


def _strip_braces(text: str) -> str:
    t = text.strip()
    if t.startswith("{") and t.endswith("}"):
        return t[1:-1]
    return text


class Dictionary:
    """Raw parameter values and the expansion engine that reads them."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def expand(self, text: str, depth: int = 0) -> str:
        if depth > 100:
            raise ConfigError(f"unreasonable macro call nesting: \"{text}\"")
        if "$" not in text:
            return text
        out: list[str] = []
        i = 0
        n = len(text)
        while i < n:
            ch = text[i]
            if ch != "$":
                out.append(ch)
                i += 1
                continue
            if i + 1 >= n:
                raise ConfigError(f"truncated macro reference: \"{text}\"")
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt in "{(":
                close = _find_close(text, i + 1, nxt, "}" if nxt == "{" else ")")
                out.append(self._braced(text[i + 2:close], depth))
                i = close + 1
                continue
            m = _NAME.match(text, i + 1)
            if m is None:
                raise ConfigError(f"bad macro name syntax: \"{text}\"")
            out.append(self._value(m.group(0), depth))
            i = m.end()
        return "".join(out)

    def _value(self, name: str, depth: int) -> str:
        raw = self.values.get(name)
        return "" if raw is None else self.expand(raw, depth + 1)

    def _braced(self, inner: str, depth: int) -> str:
        body = inner.strip()
        m = _NAME.match(body)
        if m is None:
            # Relational expressions (${{a} == {b}...}) only occur in Postfix's own
            # defaults, which this module precomputes; refuse them in main.cf.
            raise ConfigError(f"unsupported macro expression: ${{{inner}}}")
        name = m.group(0)
        rest = body[m.end():].lstrip()
        if not rest:
            return self._value(name, depth)
        value = self._value(name, depth)
        if rest[0] == "?":
            rest = rest[1:]
            true_text, false_text = rest, None
            stripped = rest.strip()
            if stripped.startswith("{"):
                close = _find_close(stripped, 0, "{", "}")
                true_text = stripped[1:close]
                after = stripped[close + 1:].strip()
                if after.startswith(":"):
                    false_text = _strip_braces(after[1:].strip())
            if value:
                return self.expand(true_text, depth + 1)
            return self.expand(false_text, depth + 1) if false_text is not None else ""
        if rest[0] == ":":
            return "" if value else self.expand(_strip_braces(rest[1:].lstrip()), depth + 1)
        raise ConfigError(f"bad macro syntax: ${{{inner}}}")


# -- conversions ---------------------------------------------------------------------------


def to_int(name: str, value: str, lo: int = 0, hi: int = 0) -> int:
    if not re.fullmatch(r"[+-]?\d+", value.strip()) or value != value.strip():
        raise ConfigError(f"bad numerical configuration: {name} = {value}")
    number = int(value)
    if not -(2**31) <= number < 2**31:
        raise ConfigError(f"bad numerical configuration: {name} = {value}")
    if number < lo:
        raise ConfigError(f"invalid {name} parameter value {number} < {lo}")
    if hi and number > hi:
        raise ConfigError(f"invalid {name} parameter value {number} > {hi}")
    return number


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def to_time(name: str, value: str, default: str, lo: int = 0, hi: int = 0) -> int:
    """Seconds; the default unit is the first letter of the parameter's default value."""
    m = re.match(r"(\d+)(.?)", value)
    if m is None or not value:
        raise ConfigError(f"bad time value or unit: {name} = {value}")
    unit = m.group(2) or re.sub(r"[^a-z]", "", default)[:1] or "s"
    if unit not in _UNITS:
        raise ConfigError(f"bad time value or unit: {name} = {value}")
    seconds = int(m.group(1)) * _UNITS[unit]
    if seconds < lo:
        raise ConfigError(f"invalid {name}: {value} (min {lo})")
    if hi and seconds > hi:
        raise ConfigError(f"invalid {name}: {value} (max {hi})")
    return seconds


def to_bool(name: str, value: str) -> bool:
    if value.lower() == "yes":
        return True
    if value.lower() == "no":
        return False
    raise ConfigError(f"bad boolean configuration: {name} = {value}")


def split_list(value: str) -> list[str]:
    return [w for w in re.split(r"[\s,]+", value) if w]


# -- the tables, in stock's order ----------------------------------------------------------

# (name, default) of global parameters qmgr needs, read in mail_params_init order.
_GLOBAL_STR = [
    ("compatibility_level", "0"),
    ("config_directory", "/etc/postfix"),
    ("queue_directory", "/var/spool/postfix"),
    ("daemon_directory", "/usr/lib/postfix/sbin"),
    ("mail_owner", "postfix"),
    ("syslog_name", "postfix"),
    ("syslog_facility", "mail"),
    ("maillog_file", ""),
    ("maillog_file_prefixes", "/var, /dev/stdout"),
    ("postlog_service_name", "postlog"),
    ("myhostname", ""),  # computed below
    ("mydomain", ""),  # computed below
    ("myorigin", "$myhostname"),
    ("double_bounce_sender", "double-bounce"),
    ("recipient_delimiter", ""),
    ("hash_queue_names", "deferred, defer"),
    ("rewrite_service_name", "rewrite"),
    ("bounce_service_name", "bounce"),
    ("defer_service_name", "defer"),
    ("trace_service_name", "trace"),
    ("flush_service_name", "flush"),
    ("queue_service_name", "qmgr"),
    ("relay_domains", ""),
    ("fast_flush_domains", "$relay_domains"),
]
_GLOBAL_INT = [
    ("default_process_limit", "100", 1, 0),
    ("hash_queue_depth", "1", 1, 0),
    ("delay_logging_resolution_limit", "2", 0, 6),
]
_GLOBAL_BOOL = [
    ("owner_request_special", "yes"),
    ("smtputf8_enable", "yes"),  # compatibility_level >= 1; see _computed_defaults
    ("helpful_warnings", "yes"),
    ("soft_bounce", "no"),
    ("dont_remove", "no"),
]
_GLOBAL_TIME = [
    ("in_flow_delay", "1s", 0, 10),
    ("daemon_timeout", "18000s", 1, 0),
    ("ipc_timeout", "3600s", 1, 0),
    ("ipc_idle", "5s", 1, 0),
    ("ipc_ttl", "1000s", 1, 0),
]
# qmgr's own tables (qmgr.c), int -> str -> bool -> time.
_QMGR_INT = [
    ("qmgr_message_active_limit", "20000", 1, 0),
    ("qmgr_message_recipient_limit", "20000", 1, 0),
    ("qmgr_message_recipient_minimum", "10", 1, 0),
    ("initial_destination_concurrency", "5", 1, 0),
    ("default_destination_concurrency_limit", "20", 0, 0),
    ("default_destination_recipient_limit", "50", 0, 0),
    ("default_recipient_limit", "20000", 0, 0),
    ("default_extra_recipient_limit", "1000", 0, 0),
    ("default_recipient_refill_limit", "100", 1, 0),
    ("default_delivery_slot_cost", "5", 0, 0),
    ("default_delivery_slot_loan", "3", 0, 0),
    ("default_delivery_slot_discount", "50", 0, 100),
    ("default_minimum_delivery_slots", "3", 0, 0),
    ("local_destination_concurrency_limit", "2", 0, 0),
    ("local_destination_recipient_limit", "1", 0, 0),
    ("default_destination_concurrency_failed_cohort_limit", "1", 0, 0),
    ("address_verify_pending_request_limit", "5000", 1, 0),
]
_QMGR_STR = [
    ("defer_transports", "", 0),
    ("default_destination_concurrency_positive_feedback", "1", 1),
    ("default_destination_concurrency_negative_feedback", "1", 1),
    ("default_filter_nexthop", "", 0),
]
_QMGR_BOOL = [
    ("disable_verp_bounces", "no"),
    ("destination_concurrency_feedback_debug", "no"),
    ("confirm_delay_cleared", "no"),
]
_QMGR_TIME = [
    ("queue_run_delay", "300s", 1, 0),
    ("minimal_backoff_time", "300s", 1, 0),
    ("maximal_backoff_time", "4000s", 1, 0),
    ("maximal_queue_lifetime", "5d", 0, 8640000),
    ("bounce_queue_lifetime", "5d", 0, 8640000),
    ("transport_retry_time", "60s", 1, 0),
    ("qmgr_clog_warn_time", "300s", 0, 0),
    ("default_recipient_refill_delay", "5s", 1, 0),
    ("default_transport_rate_delay", "0s", 0, 0),
    ("default_destination_rate_delay", "0s", 0, 0),
    ("qmgr_daemon_timeout", "1000s", 1, 0),
    ("qmgr_ipc_timeout", "60s", 1, 0),
]

# Transport suffixes: (suffix, global default name, kind, lo, hi).
_TRANSPORT_PARAMS = [
    ("_destination_concurrency_limit", "default_destination_concurrency_limit", "int", 0, 0),
    ("_destination_recipient_limit", "default_destination_recipient_limit", "int", 0, 0),
    ("_initial_destination_concurrency", "initial_destination_concurrency", "int", 1, 0),
    ("_transport_rate_delay", "default_transport_rate_delay", "time", 0, 0),
    ("_destination_rate_delay", "default_destination_rate_delay", "time", 0, 0),
    ("_delivery_slot_cost", "default_delivery_slot_cost", "int", 0, 0),
    ("_delivery_slot_loan", "default_delivery_slot_loan", "int", 0, 0),
    ("_delivery_slot_discount", "default_delivery_slot_discount", "int", 0, 100),
    ("_minimum_delivery_slots", "default_minimum_delivery_slots", "int", 0, 0),
    ("_recipient_limit", "default_recipient_limit", "int", 0, 0),
    ("_extra_recipient_limit", "default_extra_recipient_limit", "int", 0, 0),
    ("_recipient_refill_limit", "default_recipient_refill_limit", "int", 1, 0),
    ("_recipient_refill_delay", "default_recipient_refill_delay", "time", 1, 0),
    ("_destination_concurrency_failed_cohort_limit",
     "default_destination_concurrency_failed_cohort_limit", "int", 0, 0),
]


@dataclass(frozen=True)
class TransportConfig:
    name: str
    destination_concurrency_limit: int
    destination_recipient_limit: int
    initial_destination_concurrency: int
    transport_rate_delay: int
    destination_rate_delay: int
    delivery_slot_cost: int
    delivery_slot_loan: int
    delivery_slot_discount: int
    minimum_delivery_slots: int
    recipient_limit: int
    extra_recipient_limit: int
    recipient_refill_limit: int
    recipient_refill_delay: int
    failed_cohort_limit: int
    positive_feedback: str
    positive_feedback_name: str
    negative_feedback: str
    negative_feedback_name: str


def _system_hostname() -> str:
    name = socket.gethostname()
    if "." not in name:
        try:
            fqdn = socket.getfqdn(name)
        except OSError:
            fqdn = name
        if "." in fqdn:
            name = fqdn
    return name


class QmgrConfig:
    """Every parameter qmgr reads, typed, plus lazily computed transport settings."""

    def __init__(self, values: dict[str, str], overrides: Sequence[tuple[str, str]] = (),
                 config_dir: str = "/etc/postfix", warnings: list[str] | None = None) -> None:
        self.warnings: list[str] = list(warnings or [])
        merged = dict(values)
        for name, value in overrides:
            merged[name] = value
        merged.setdefault("config_directory", config_dir)
        self.dict = Dictionary(merged)
        self._transports: dict[str, TransportConfig] = {}
        self._read_tables()

    @classmethod
    def load(cls, config_dir: str, overrides: Sequence[tuple[str, str]] = ()) -> QmgrConfig:
        path = os.path.join(config_dir, "main.cf")
        try:
            with open(path, encoding="utf-8", errors="surrogateescape") as f:
                text = f.read()
        except OSError as exc:
            raise ConfigError(f"open {path}: {exc.strerror}") from exc
        values, warnings = parse_main_cf(text)
        return cls(values, overrides, config_dir, warnings)

    @classmethod
    def from_text(cls, main_cf: str, overrides: Sequence[tuple[str, str]] = (),
                  config_dir: str = "/etc/postfix") -> QmgrConfig:
        values, warnings = parse_main_cf(main_cf)
        return cls(values, overrides, config_dir, warnings)

    # Registered-names lookups: absent names get their default written in first.
    def _raw(self, name: str, default: str) -> str:
        values = self.dict.values
        if name not in values:
            values[name] = default
        return self.dict.expand(values[name])

    def get(self, name: str) -> str:
        return self.dict.expand(self.dict.values.get(name, ""))

    def _str(self, name: str, default: str, min_len: int = 0) -> str:
        value = self._raw(name, default)
        if len(value) < min_len:
            raise ConfigError(f"bad parameter value: {name} = {value}")
        setattr(self, name, value)
        return value

    def _int(self, name: str, default: str, lo: int, hi: int) -> int:
        value = to_int(name, self._raw(name, default), lo, hi)
        setattr(self, name, value)
        return value

    def _bool(self, name: str, default: str) -> bool:
        value = to_bool(name, self._raw(name, default))
        setattr(self, name, value)
        return value

    def _time(self, name: str, default: str, lo: int, hi: int) -> int:
        value = to_time(name, self._raw(name, default), default, lo, hi)
        setattr(self, name, value)
        return value

    def _read_tables(self) -> None:
        hostname = _system_hostname()
        for name, default in _GLOBAL_STR:
            if name == "myhostname":
                default = hostname
            elif name == "mydomain":
                default = hostname.partition(".")[2] or "localdomain"
            self._str(name, default)
        compat = self.compatibility_level  # type: ignore[attr-defined]
        for name, default, lo, hi in _GLOBAL_INT:
            self._int(name, default, lo, hi)
        for name, default in _GLOBAL_BOOL:
            if name == "smtputf8_enable" and _compat_below_1(compat):
                default = "no"
            self._bool(name, default)
        for name, default, lo, hi in _GLOBAL_TIME:
            self._time(name, default, lo, hi)
        for name, default, lo, hi in _QMGR_INT:
            self._int(name, default, lo, hi)
        for name, default, min_len in _QMGR_STR:
            self._str(name, default, min_len)
        for name, default in _QMGR_BOOL:
            self._bool(name, default)
        for name, default, lo, hi in _QMGR_TIME:
            self._time(name, default, lo, hi)
        # Lists are kept split, as the daemon uses them.
        self.defer_transports = split_list(self.defer_transports)  # type: ignore
        self.hash_queue_names = [n.lower() for n in split_list(self.hash_queue_names)]  # type: ignore
        self._post_init()

    def _post_init(self) -> None:
        """Stock's qmgr_post_init adjustments, with its warning texts."""
        if self.qmgr_message_recipient_limit < self.qmgr_message_active_limit:  # type: ignore
            self.warnings.append(
                "qmgr_message_recipient_limit is smaller than qmgr_message_active_limit"
                " - adjusting qmgr_message_recipient_limit")
            self.qmgr_message_recipient_limit = self.qmgr_message_active_limit  # type: ignore
        if self.bounce_queue_lifetime > self.maximal_queue_lifetime:  # type: ignore
            self.warnings.append(
                "bounce_queue_lifetime is larger than maximal_queue_lifetime"
                " - adjusting bounce_queue_lifetime")
            self.bounce_queue_lifetime = self.maximal_queue_lifetime  # type: ignore

    # -- transports ---------------------------------------------------------------------

    def transport(self, name: str) -> TransportConfig:
        cached = self._transports.get(name)
        if cached is not None:
            return cached
        values: dict[str, int] = {}
        for suffix, default_name, kind, lo, hi in _TRANSPORT_PARAMS:
            param = name + suffix
            if param in self.dict.values:
                raw = self.dict.expand(self.dict.values[param])
                values[suffix] = (to_int(param, raw, lo, hi) if kind == "int"
                                  else to_time(param, raw, "s", lo, hi))
            else:
                values[suffix] = getattr(self, default_name)
                self.dict.values[param] = str(values[suffix])
        limit = values["_destination_concurrency_limit"]
        if values["_destination_rate_delay"] > 0:
            limit = 1
        initial = values["_initial_destination_concurrency"]
        if limit and limit < initial:
            initial = limit
        feedback = {}
        for direction in ("positive", "negative"):
            default_name = f"default_destination_concurrency_{direction}_feedback"
            param = f"{name}_destination_concurrency_{direction}_feedback"
            default_value = getattr(self, default_name)
            value = self._raw(param, default_value) if param in self.dict.values else default_value
            if not value:
                raise ConfigError(f"bad parameter value: {param} = {value}")
            feedback[direction] = (value, param if value != default_value else default_name)
        cfg = TransportConfig(
            name=name,
            destination_concurrency_limit=limit,
            destination_recipient_limit=values["_destination_recipient_limit"],
            initial_destination_concurrency=initial,
            transport_rate_delay=values["_transport_rate_delay"],
            destination_rate_delay=values["_destination_rate_delay"],
            delivery_slot_cost=values["_delivery_slot_cost"],
            delivery_slot_loan=values["_delivery_slot_loan"],
            delivery_slot_discount=values["_delivery_slot_discount"],
            minimum_delivery_slots=values["_minimum_delivery_slots"],
            recipient_limit=values["_recipient_limit"],
            extra_recipient_limit=values["_extra_recipient_limit"],
            recipient_refill_limit=values["_recipient_refill_limit"],
            recipient_refill_delay=values["_recipient_refill_delay"],
            failed_cohort_limit=values["_destination_concurrency_failed_cohort_limit"],
            positive_feedback=feedback["positive"][0],
            positive_feedback_name=feedback["positive"][1],
            negative_feedback=feedback["negative"][0],
            negative_feedback_name=feedback["negative"][1],
        )
        self._transports[name] = cfg
        return cfg


def _compat_below_1(level: str) -> bool:
    try:
        return float(level.split(".")[0] or "0") < 1
    except ValueError:
        return True
