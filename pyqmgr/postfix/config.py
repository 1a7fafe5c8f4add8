"""qmgr's view of its configuration, computed the way a Postfix daemon computes it.

A daemon does not see what ``postconf -x`` shows. It starts from main.cf plus its
own ``-o`` overrides; every parameter read looks the name up, expands ``$name``
references against that dictionary *as it is at that moment*, and, when the name is
absent, writes the built-in default into the dictionary. So ``$name`` expands only to
names that are in main.cf, were given with ``-o``, or were registered by an earlier
read; anything else is empty. Reading the tables in stock's order (the globals of
``mail_params_init()``, then qmgr's int, str, bool and time tables) is therefore part
of the semantics, not an implementation detail: it decides which configurations make
stock qmgr exit. Transport-specific values are read later, the first time a
transport is used, and fall back to the runtime ``default_*`` values.

Every ``ConfigError`` carries the text stock logs after ``fatal: ``, and the
``warnings`` stock would have logged before dying, so the daemon can log both.
No Postfix program is run here: the built-in defaults are Debian 3.7.11's.
"""

from __future__ import annotations

import grp
import ipaddress
import os
import pwd
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pyqmgr.postfix.expand import (
    C_SPACE,
    INT_MAX,
    INT_MIN,
    ConversionFatal,
    MacroError,
    compat_level_from_string,
    expand,
    is_alnum,
    is_digit,
    malformed_level,
    strtol,
)
from pyqmgr.postfix.parameters import STARTUP, TRANSPORT
from pyqmgr.postfix.version import DEFAULT as DEFAULT_VERSION
from pyqmgr.postfix.version import PostfixVersion

#: The dictionary name stock uses in ``macro processing error`` messages.
CONFIG_DICT = "mail_dict"
#: ``CHARS_COMMA_SP``: how Postfix splits lists such as defer_transports.
COMMA_SP = ", \t\r\n"
MAIN_CF = "main.cf"


class ConfigError(Exception):
    """A configuration stock qmgr refuses.

    ``str(err)`` is the text stock logs after ``fatal: ``; ``warnings`` are the
    ``warning: `` texts stock logs on the way there, in order (for example the
    ``overriding earlier entry`` lines of main.cf, or the syntax complaint that
    precedes ``macro processing error``).
    """

    def __init__(self, message: str, warnings: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.warnings = list(warnings)


# -- main.cf: logical lines and name = value ------------------------------------------------


def split_nameval(text: str) -> tuple[str, str]:
    """``split_nameval()``: the name ends at whitespace or ``=``; both ends trimmed.

    Used for main.cf lines and for ``-o name=value``; raises ValueError with stock's
    reason (``missing attribute name`` or ``missing '=' after attribute name``).
    """
    n = len(text)
    np = 0
    while np < n and text[np] in C_SPACE:
        np += 1
    if np == n or text[np] == "=":
        raise ValueError("missing attribute name")
    ep = np
    while ep < n and text[ep] not in C_SPACE and text[ep] != "=":
        ep += 1
    cp = ep
    while cp < n and text[cp] in C_SPACE:
        cp += 1
    if cp == n or text[cp] != "=":
        raise ValueError("missing '=' after attribute name")
    return text[np:ep], text[cp + 1:].strip(C_SPACE)


def option_nameval(optarg: str) -> tuple[str, str]:
    """A ``-o`` argument as the server skeleton splits it, with its fatal text."""
    try:
        return split_nameval(optarg)
    except ValueError as exc:
        raise ConfigError(f'invalid "-o {optarg}" option value: {exc}') from None


def logical_lines(text: str, path: str, warnings: list[str]) -> list[tuple[int, str]]:
    """``readllines()``: (first line number, logical line) pairs.

    Comment and blank lines are dropped without ending a logical line; a line that
    starts with whitespace is glued on as is (no separator, its indentation kept); a
    logical line that itself starts with whitespace is discarded with a warning.
    """
    physical = text.split("\n")
    if physical and physical[-1] == "":
        physical.pop()
    result: list[tuple[int, str]] = []
    idx = 0
    lineno = 0
    count = len(physical)
    while idx < count:
        buf = ""
        first = 0
        while idx < count:
            line = physical[idx]
            idx += 1
            lineno += 1
            content = line.lstrip(C_SPACE)
            if content and content[0] != "#":
                if not buf:
                    first = lineno
                buf += line
            if idx >= count:
                break
            if buf:
                nxt = physical[idx][:1] or "\n"
                if nxt != "#" and nxt not in C_SPACE:
                    break
        if not buf:
            continue
        if buf[0] in C_SPACE:
            more = "..." if len(buf) > 30 else ""
            warnings.append(
                f'{path}: logical line must not start with whitespace: "{buf[:30]}{more}"')
            continue
        result.append((first, buf))
    return result


def parse_main_cf(text: str, path: str = "/etc/postfix/main.cf",
                  initial: dict[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """main.cf as ``dict_load_fp()`` loads it: raw values and the warnings logged.

    ``initial`` is what the dictionary already holds (a daemon has set
    config_directory and process_name before it reads main.cf); a main.cf entry that
    changes one of those is reported like any duplicate, as stock does.
    """
    values = dict(initial or {})
    warnings: list[str] = []
    for lineno, line in logical_lines(text, path, warnings):
        try:
            name, value = split_nameval(line)
        except ValueError as exc:
            raise ConfigError(f'{path}, line {lineno}: {exc}: "{line}"', warnings) from None
        old = values.get(name)
        if old is not None and old != value:
            warnings.append(f"{path}, line {lineno}: overriding earlier entry: {name}={old}")
        values[name] = value
    return values, warnings


def split_list(value: str) -> list[str]:
    """A Postfix list (``argv_split(value, CHARS_COMMA_SP)``)."""
    words: list[str] = []
    word: list[str] = []
    for ch in value:
        if ch in COMMA_SP:
            if word:
                words.append("".join(word))
                word = []
        else:
            word.append(ch)
    if word:
        words.append("".join(word))
    return words


# -- typed conversions ---------------------------------------------------------------------

_UNIT_SECONDS = {"w": 604800, "d": 86400, "h": 3600, "m": 60}


def conv_time(value: str, default_unit: str) -> int | None:
    """``conv_time()``: seconds, or None where stock reports a bad value or unit.

    strtol() reads the number (so leading whitespace and ``+`` pass), and only the
    single character after the digits is looked at: ``1m30s`` is 60 and ``10sxyz``
    is 10. Units are lower-case only; a value without unit takes the default unit.
    """
    number, end, erange = strtol(value, 0)
    if not value or erange or not INT_MIN <= number <= INT_MAX or number < 0:
        return None
    unit = value[end] if end < len(value) else default_unit
    if unit == "s":
        return number
    scale = _UNIT_SECONDS.get(unit)
    if scale is None or number >= INT_MAX // scale:
        return None
    return number * scale


def _int_value(name: str, value: str, *, long: bool = False) -> int:
    number, end, erange = strtol(value, 0)
    if not value or end != len(value) or erange or (
            not long and not INT_MIN <= number <= INT_MAX):
        raise ValueError(f"bad numerical configuration: {name} = {value}")
    return number


def _check_int(name: str, value: int, lo: int, hi: int) -> None:
    # Stock skips a bound that is 0: "min 0" permits negative numbers.
    if lo and value < lo:
        raise ValueError(f"invalid {name} parameter value {value} < {lo}")
    if hi and value > hi:
        raise ValueError(f"invalid {name} parameter value {value} > {hi}")


def _check_time(name: str, value: int, lo: int, hi: int) -> None:
    if lo and value < lo:
        raise ValueError(f"invalid {name}: {value} (min {lo})")
    if hi and value > hi:
        raise ValueError(f"invalid {name}: {value} (max {hi})")


def _bool_value(name: str, value: str) -> bool:
    if value.lower() == "yes" and value.isascii():
        return True
    if value.lower() == "no" and value.isascii():
        return False
    raise ValueError(f"bad boolean configuration: {name} = {value}")


def _check_str(name: str, value: str, lo: int, hi: int) -> None:
    length = len(value.encode("utf-8", "surrogateescape"))
    if lo and length < lo:
        raise ValueError(f"bad string length {length} < {lo}: {name} = {value}")
    if hi and length > hi:
        raise ValueError(f"bad string length {length} > {hi}: {name} = {value}")


# -- the tables, in stock's order (global/mail_params.c, qmgr/qmgr.c) -------------------------

#: (kind, name, default, min, max): a row of :data:`pyqmgr.postfix.parameters.STARTUP`
#: without its step.
_Spec = tuple[str, str, str, int, int]


def _step(step: str) -> list[_Spec]:
    """The rows one step of the start-up reads, in their order."""
    return [row[1:] for row in STARTUP if row[0] == step]


_COMPAT = _step("compat")
_FIRST = _step("first")
_HOSTNAMES = _step("hostname")
_OTHER = _step("other")
_QMGR = _step("qmgr")

#: Every parameter the daemon reads at start-up, in the order it reads them.
STARTUP_PARAMETERS: tuple[str, ...] = tuple(
    spec[1] for spec in (*_COMPAT, *_FIRST, *_HOSTNAMES, *_OTHER)
) + ("mynetworks", "process_id") + tuple(spec[1] for spec in _QMGR)

_SYSLOG_FACILITIES = frozenset({
    "auth", "authpriv", "cron", "daemon", "ftp", "kern", "lpr", "mail", "news", "syslog",
    "user", "uucp", *(f"local{n}" for n in range(8)),
})


@dataclass(frozen=True)
class TransportConfig:
    """One transport's settings as ``qmgr_transport_create()`` derives them.

    The feedback values stay strings: the scheduler parses them (and logs stock's
    "ignoring malformed or unreasonable feedback" warning under ``*_name``).
    ``delivery_slot_discount`` is the configured percentage (stock keeps 100 - it).
    """

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
    positive_feedback: str
    positive_feedback_name: str
    negative_feedback: str
    negative_feedback_name: str
    failed_cohort_limit: int


class _Dictionary:
    """A daemon's parameter dictionary and the ``get_mail_conf_*()`` reads on it.

    The dictionary holds raw text; a read expands it against the dictionary as it is
    at that moment and registers the default of an absent name (see the module
    docstring). :class:`QmgrConfig` is the start-up that drives these reads.
    """

    _values: dict[str, str]
    #: The ``warning: `` texts stock would have logged so far, in order.
    warnings: list[str]
    #: (name, value) of every write into the dictionary after main.cf was loaded,
    #: in order: the registrations of defaults and the derived values.
    updates: list[tuple[str, str]]

    def lookup(self, name: str) -> str | None:
        """The raw value in the dictionary now, or None if the name is not there."""
        return self._values.get(name)

    def get(self, name: str) -> str:
        """The expanded value of ``name`` as the daemon would see it now; empty if absent.

        Names that qmgr never reads are visible only if main.cf or ``-o`` set them.
        """
        raw = self._values.get(name)
        if raw is None:
            return ""
        mark = len(self.warnings)
        try:
            return self._eval(raw)
        except ValueError as exc:
            taken = self.warnings[mark:]
            del self.warnings[mark:]
            raise ConfigError(str(exc), taken) from None

    def _update(self, name: str, value: str) -> None:
        self._values[name] = value
        self.updates.append((name, value))

    def _eval(self, text: str) -> str:
        try:
            return expand(text, self._values.get)
        except MacroError as exc:
            self.warnings.extend(exc.warnings)
            raise ValueError(f"dictionary {CONFIG_DICT}: macro processing error") from None

    def _lookup_eval(self, name: str) -> str | None:
        raw = self._values.get(name)
        return None if raw is None else self._eval(raw)

    # -- the get_mail_conf_*() family ----------------------------------------------------

    def _read(self, spec: _Spec, default_fn: Callable[[], str] | None = None) -> object:
        """Read one table row and set the attribute of its name to the typed value."""
        kind, name, default, lo, hi = spec
        value: object
        if kind in ("str", "fn"):
            value = self._read_str(name, default, lo, hi, default_fn)
        elif kind in ("int", "long"):
            value = self._read_int(name, default, lo, hi, long=kind == "long")
        elif kind == "bool":
            text = self._lookup_eval(name)
            if text is None:
                self._update(name, default)
                text = default
            value = _bool_value(name, text)
        elif kind == "nbool":
            # The default is an expression (compatibility level), stored unexpanded.
            if name not in self._values:
                self._update(name, default)
            value = _bool_value(name, self._lookup_eval(name) or "")
        elif kind == "time":
            unit = next((c for c in self._eval(default) if c.isascii() and c.isalpha()), "s")
            value = self._read_time(name, default, unit, lo, hi)
        else:  # pragma: no cover - table typo
            raise AssertionError(kind)
        setattr(self, name, value)
        return value

    def _read_str(self, name: str, default: str, lo: int, hi: int,
                  default_fn: Callable[[], str] | None = None) -> str:
        """``get_mail_conf_str()``: an absent name registers its default, expanded.

        ``default_fn`` (stock's function defaults) is called only when the name is
        absent: its checks must not run, or fail, for a value main.cf gives.
        """
        text = self._lookup_eval(name)
        if text is None:
            text = self._eval(default_fn() if default_fn else default)
            self._update(name, text)
        _check_str(name, text, lo, hi)
        return text

    def _read_int(self, name: str, default: str | int, lo: int, hi: int, *,
                  long: bool = False) -> int:
        """``get_mail_conf_int()`` (or ``_long``): an absent name registers the default."""
        text = self._lookup_eval(name)
        if text is None:
            number = int(default)
            self._update(name, str(number))
        else:
            number = _int_value(name, text, long=long)
        _check_int(name, number, lo, hi)
        return number

    def _read_time(self, name: str, default: str, unit: str, lo: int, hi: int) -> int:
        """``get_mail_conf_time()``: seconds; ``unit`` applies to a number without one."""
        if name not in self._values:
            self._update(name, default)
        text = self._lookup_eval(name) or ""
        seconds = conv_time(text, unit)
        if seconds is None:
            raise ValueError(f"parameter {name}: bad time value or unit: {text}")
        _check_time(name, seconds, lo, hi)
        return seconds


class QmgrConfig(_Dictionary):
    """Every parameter stock qmgr reads, typed, plus transport settings on demand.

    Attributes carry the parameter's name and hold the converted value: ``int`` for
    int and time parameters (times in seconds), ``bool`` for booleans, ``str`` for
    strings, except ``defer_transports`` and ``hash_queue_names`` which are lists.
    They are stock's runtime variables after ``qmgr_post_init()``: the recipient
    limit and bounce lifetime adjustments, ``ipc_timeout`` = qmgr_ipc_timeout, and
    ``max_use`` = ``max_idle`` = 0. ``get()`` still shows the configured text.
    """

    # Globals from mail_params_init() (a selection; every table entry is set).
    compatibility_level: str
    syslog_facility: str
    maillog_file: str
    maillog_file_prefixes: str
    postlog_service_name: str
    smtputf8_enable: bool
    myhostname: str
    mydomain: str
    syslog_name: str
    mail_owner: str
    setgid_group: str
    default_privs: str
    inet_protocols: str
    inet_interfaces: str
    mynetworks_style: str
    default_verp_delimiters: str
    verp_delimiter_filter: str
    mydestination: str
    myorigin: str
    relayhost: str
    daemon_directory: str
    queue_directory: str
    data_directory: str
    double_bounce_sender: str
    hash_queue_names: list[str]
    recipient_delimiter: str
    relay_domains: str
    fast_flush_domains: str
    bounce_service_name: str
    defer_service_name: str
    trace_service_name: str
    flush_service_name: str
    rewrite_service_name: str
    queue_service_name: str
    error_service_name: str
    address_verify_service_name: str
    info_log_address_format: str
    default_process_limit: int
    dont_remove: int
    hash_queue_depth: int
    delay_logging_resolution_limit: int
    soft_bounce: bool
    owner_request_special: bool
    helpful_warnings: bool
    ipc_timeout: int
    ipc_idle: int
    ipc_ttl: int
    max_idle: int
    max_use: int
    daemon_timeout: int
    in_flow_delay: int
    mynetworks: str
    # qmgr's own tables.
    qmgr_message_active_limit: int
    qmgr_message_recipient_limit: int
    qmgr_message_recipient_minimum: int
    default_recipient_limit: int
    default_extra_recipient_limit: int
    default_recipient_refill_limit: int
    default_delivery_slot_cost: int
    default_delivery_slot_loan: int
    default_delivery_slot_discount: int
    default_minimum_delivery_slots: int
    initial_destination_concurrency: int
    default_destination_concurrency_limit: int
    default_destination_recipient_limit: int
    local_destination_recipient_limit: int
    local_destination_concurrency_limit: int
    default_destination_concurrency_failed_cohort_limit: int
    address_verify_pending_request_limit: int
    defer_transports: list[str]
    default_destination_concurrency_positive_feedback: str
    default_destination_concurrency_negative_feedback: str
    default_filter_nexthop: str
    disable_verp_bounces: bool
    destination_concurrency_feedback_debug: bool
    confirm_delay_cleared: bool
    queue_run_delay: int
    minimal_backoff_time: int
    maximal_backoff_time: int
    maximal_queue_lifetime: int
    bounce_queue_lifetime: int
    transport_retry_time: int
    qmgr_clog_warn_time: int
    default_recipient_refill_delay: int
    default_transport_rate_delay: int
    default_destination_rate_delay: int
    qmgr_daemon_timeout: int
    qmgr_ipc_timeout: int

    def __init__(self, main_cf: str, overrides: Sequence[tuple[str, str]] = (), *,
                 config_dir: str = "/etc/postfix", process_name: str = "qmgr",
                 service_name: str | None = None, check_accounts: bool = False,
                 hostname: str | None = None) -> None:
        """Replay a daemon's start-up on the text of main.cf.

        The steps are those of ``trigger_server_main()``: process_name and
        config_directory enter the dictionary first, then main.cf, then each ``-o``
        in order, then service_name; then the tables are read. ``check_accounts``
        adds stock's checks that mail_owner, default_privs and setgid_group exist
        and are distinct (they depend on the host's accounts). ``hostname`` replaces
        gethostname() for the myhostname default.
        """
        self.config_dir = config_dir
        self.process_name = process_name
        self.service_name = service_name if service_name is not None else process_name
        self.warnings = []
        self.updates = []
        self._values: dict[str, str] = {}
        self._transports: dict[str, TransportConfig] = {}
        self._hostname = hostname
        self._warnings_mark = 0
        #: The installed release, which the daemon asks Postfix at start-up
        #: (:func:`pyqmgr.postfix.version.installed`); main.cf cannot say it.
        self.postfix_version: PostfixVersion = DEFAULT_VERSION

        path = os.path.join(config_dir, MAIN_CF)
        initial = {"process_name": process_name, "config_directory": config_dir}
        values, warnings = parse_main_cf(main_cf, path, initial)
        self.warnings.extend(warnings)
        self._values = values
        for name, value in overrides:
            self._update(name, value)
        self._update("service_name", self.service_name)
        try:
            self._mail_params_init(check_accounts)
            for spec in _QMGR:
                self._read(spec)
            self._post_init()
        except ValueError as exc:
            raise ConfigError(str(exc), self.warnings) from None
        except ConversionFatal as exc:
            raise ConfigError(str(exc), self.warnings) from None

    @classmethod
    def load(cls, config_dir: str, overrides: Sequence[tuple[str, str]] = (), *,
             process_name: str = "qmgr", service_name: str | None = None,
             check_accounts: bool = True) -> QmgrConfig:
        """Read ``config_dir/main.cf`` as the daemon does at start-up."""
        path = os.path.join(config_dir, MAIN_CF)
        try:
            with open(path, "rb") as f:
                text = f.read().decode("utf-8", "surrogateescape")
        except OSError as exc:
            raise ConfigError(f"open {path}: {exc.strerror}") from None
        return cls(text, overrides, config_dir=config_dir, process_name=process_name,
                   service_name=service_name, check_accounts=check_accounts)

    @classmethod
    def from_text(cls, main_cf: str, overrides: Sequence[tuple[str, str]] = (),
                  config_dir: str = "/etc/postfix", *, process_name: str = "qmgr",
                  service_name: str | None = None, check_accounts: bool = False,
                  hostname: str | None = None) -> QmgrConfig:
        """The same from a string, for the simulator and tests (no account checks)."""
        return cls(main_cf, overrides, config_dir=config_dir, process_name=process_name,
                   service_name=service_name, check_accounts=check_accounts,
                   hostname=hostname)

    # -- mail_params_init() --------------------------------------------------------------

    def _main_cf_path(self) -> str:
        return f"{self.config_dir}/{MAIN_CF}"

    def _mail_params_init(self, check_accounts: bool) -> None:
        level = str(self._read(_COMPAT[0]))
        if compat_level_from_string(level) is None:
            raise ValueError(malformed_level(level))
        for spec in _FIRST:
            self._read(spec)
        facility = self.syslog_facility
        if facility not in _SYSLOG_FACILITIES:
            raise ValueError(f"file {self._main_cf_path()}: parameter syslog_facility: "
                             f"unrecognized value: {facility}")
        self._read(_HOSTNAMES[0], self._default_myhostname)
        self._read(_HOSTNAMES[1], self._default_mydomain)
        for name, value in (("myhostname", self.myhostname), ("mydomain", self.mydomain)):
            complaint = hostname_problem(value)
            if complaint is not None:
                self.warnings.append(f"valid_hostname: {complaint}")
                raise ValueError(f"file {self._main_cf_path()}: parameter {name}: "
                                 f"bad parameter value: {value}")
        for spec in _OTHER:
            self._read(spec)
            if spec[1] == "info_log_address_format":
                # The end of the string table: Debian reads myorigin's file here.
                self._myorigin_from_file()
        if check_accounts:
            _check_accounts(self)
        self._read(("fn", "mynetworks", "", 0, 0), self._default_mynetworks)
        self._update("process_id", str(os.getpid()))
        myhostname = self.myhostname
        if myhostname.casefold() == self.relayhost.casefold():
            raise ValueError("myhostname and relayhost parameter settings must not be "
                             f"identical: {myhostname}")
        myorigin = self.myorigin
        if any(c in COMMA_SP for c in myorigin):
            raise ValueError("myorigin parameter setting must not contain multiple "
                             f"values: {myorigin}")
        problem = _verp_problem(self.default_verp_delimiters, self.verp_delimiter_filter)
        if problem:
            raise ValueError(f"file {self._main_cf_path()}: parameters "
                             f"default_verp_delimiters and verp_delimiter_filter: {problem}")

    def _default_myhostname(self) -> str:
        name = self._hostname if self._hostname is not None else socket.gethostname()
        complaint = hostname_problem(name)
        if complaint is not None:
            self.warnings.append(f"valid_hostname: {complaint}")
            raise ValueError("unable to use my own hostname")
        if "." not in name:
            domain = self._lookup_eval("mydomain")
            name = f"{name}.{domain if domain is not None else 'localdomain'}"
        return name

    def _default_mydomain(self) -> str:
        host = self.myhostname
        return host.partition(".")[2] if "." in host else "localdomain"

    def _myorigin_from_file(self) -> None:
        """Debian builds with MYORIGIN_FROM_FILE: ``myorigin = /etc/mailname`` works."""
        path = self.myorigin
        if not path.startswith("/"):
            return
        try:
            with open(path, "rb") as f:
                first = f.readline().decode("utf-8", "surrogateescape")
        except OSError as exc:
            raise ValueError(f"{path}: cannot open file: {exc.strerror}") from None
        origin = first.rstrip("\n").strip(C_SPACE)
        if not origin:
            raise ValueError(f"myorigin file {path} is empty")
        self.myorigin = origin

    def _default_mynetworks(self) -> str:
        return mynetworks_default(self.mynetworks_style, self.inet_protocols,
                                  self.inet_interfaces)

    # -- qmgr_post_init() ----------------------------------------------------------------

    def _post_init(self) -> None:
        if self.process_name == "nqmgr":
            self.warnings += [
                f"please update the {self.config_dir}/master.cf file; the new queue manager",
                "(old name: nqmgr) has become the standard queue manager (new name: qmgr)",
                "support for the name old name (nqmgr) will be removed from Postfix",
            ]
        if self.qmgr_message_recipient_limit < self.qmgr_message_active_limit:
            self.warnings.append(
                "qmgr_message_recipient_limit is smaller than qmgr_message_active_limit"
                " - adjusting qmgr_message_recipient_limit")
            self.qmgr_message_recipient_limit = self.qmgr_message_active_limit
        if self.bounce_queue_lifetime > self.maximal_queue_lifetime:
            self.warnings.append(
                "bounce_queue_lifetime is larger than maximal_queue_lifetime"
                " - adjusting bounce_queue_lifetime")
            self.bounce_queue_lifetime = self.maximal_queue_lifetime
        # Stock's runtime variables change too; the dictionary keeps the configured text.
        self.ipc_timeout = self.qmgr_ipc_timeout
        self.max_use = 0
        self.max_idle = 0
        # Lists as the daemon consumes them (stock keeps the strings and splits on use).
        self.defer_transports = split_list(self.__dict__["defer_transports"])
        self.hash_queue_names = split_list(self.__dict__["hash_queue_names"])

    # -- transports ----------------------------------------------------------------------

    def transport(self, name: str) -> TransportConfig:
        """``qmgr_transport_create()``'s settings for transport ``name``, computed once.

        Each value is ``<name><suffix>`` if that is in the dictionary, else the
        runtime value of the ``default_*`` parameter (registered under the
        transport-specific name, as stock does). There is no third level: ``relay``
        does not fall back to ``smtp``. ``local`` finds the
        local_destination_{concurrency,recipient}_limit values qmgr registered.
        A bad value raises ConfigError now, as it is fatal in stock at first use.
        """
        cached = self._transports.get(name)
        if cached is not None:
            return cached
        self._warnings_mark = len(self.warnings)
        try:
            config = _create_transport(self, name)
        except ValueError as exc:
            raise ConfigError(str(exc), self._take_warnings()) from None
        except ConversionFatal as exc:
            raise ConfigError(str(exc), self._take_warnings()) from None
        self._transports[name] = config
        return config

    def _take_warnings(self) -> list[str]:
        # Warnings raised during a lazy lookup belong to that lookup's error only.
        taken = self.warnings[self._warnings_mark:]
        del self.warnings[self._warnings_mark:]
        return taken


#: The TransportConfig field of each number whose field is not its suffix.
_TRANSPORT_FIELDS = {"_destination_concurrency_failed_cohort_limit": "failed_cohort_limit"}


def _create_transport(cfg: QmgrConfig, transport: str) -> TransportConfig:
    """``qmgr_transport_create()``'s reads for one transport (see QmgrConfig.transport)."""
    numbers, texts = _transport_values(cfg, transport)
    positive = texts["_destination_concurrency_positive_feedback"]
    negative = texts["_destination_concurrency_negative_feedback"]
    fields: dict[str, Any] = {_TRANSPORT_FIELDS.get(suffix, suffix[1:]): number
                              for suffix, number in numbers.items()}
    return TransportConfig(
        name=transport, positive_feedback=positive[0], positive_feedback_name=positive[1],
        negative_feedback=negative[0], negative_feedback_name=negative[1], **fields)


def _transport_values(cfg: QmgrConfig, transport: str
                      ) -> tuple[dict[str, int], dict[str, tuple[str, str]]]:
    """The transport's numbers and (text, name to log) strings, keyed by suffix."""
    numbers: dict[str, int] = {}
    texts: dict[str, tuple[str, str]] = {}
    for suffix, default_attr, kind, lo, hi in TRANSPORT:
        name = transport + suffix
        default = getattr(cfg, default_attr)
        if kind == "int":
            numbers[suffix] = cfg._read_int(name, default, lo, hi)
        elif kind == "time":
            numbers[suffix] = cfg._read_time(name, f"{default}s", "s", lo, hi)
        else:
            # The default is the runtime string, expanded once more when registered;
            # stock names the transport's parameter only if the result differs.
            text = cfg._read_str(name, default, lo, hi)
            texts[suffix] = (text, name if text != default else default_attr)
        if suffix == "_destination_rate_delay":
            # Stock makes these two adjustments right after reading the delays.
            if numbers[suffix] > 0:
                numbers["_destination_concurrency_limit"] = 1
            limit = numbers["_destination_concurrency_limit"]
            if limit != 0 and limit < numbers["_initial_destination_concurrency"]:
                numbers["_initial_destination_concurrency"] = limit
    return numbers, texts


def _check_accounts(cfg: QmgrConfig) -> None:
    """Stock's checks that mail_owner, default_privs and setgid_group exist and differ."""
    where = f"file {cfg._main_cf_path()}: parameter"
    ids: dict[str, tuple[int, int]] = {}
    for param in ("default_privs", "mail_owner"):
        user = str(getattr(cfg, param))
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            raise ValueError(f"{where} {param}: unknown user name value: {user}") from None
        if entry.pw_uid == 0:
            raise ValueError(f"{where} {param}: user {user} has privileged user ID")
        if entry.pw_gid == 0:
            raise ValueError(f"{where} {param}: user {user} has privileged group ID")
        if param == "mail_owner":
            try:
                same = pwd.getpwuid(entry.pw_uid).pw_name
            except KeyError:
                same = user
            if same != user:
                raise ValueError(
                    f"{where} {param}: user {user} has same user ID as {same}")
        ids[param] = (entry.pw_uid, entry.pw_gid)
    group = cfg.setgid_group
    try:
        sgid = grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"{where} setgid_group: unknown group name: {group}") from None
    if sgid == 0:
        raise ValueError(f"{where} setgid_group: group {group} has privileged group ID")
    try:
        same_group = grp.getgrgid(sgid).gr_name
    except KeyError:
        same_group = group
    if same_group != group:
        raise ValueError(
            f"{where} setgid_group: group {group} has same group ID as {same_group}")
    privs = cfg.default_privs
    owner = cfg.mail_owner
    where = f"file {cfg._main_cf_path()}: parameters"
    if privs == owner:
        raise ValueError(f"{where} default_privs and mail_owner specify the same user "
                         f"{privs}")
    (d_uid, d_gid), (o_uid, o_gid) = ids["default_privs"], ids["mail_owner"]
    # Stock's order: (left ID, right ID, parameters, who, which ID).
    users = f"users {privs} and {owner}"
    for left, right, params, who, which in (
            (d_uid, o_uid, "default_privs and mail_owner", users, "user"),
            (d_gid, o_gid, "default_privs and mail_owner", users, "group"),
            (d_gid, sgid, "default_privs and setgid_group", f"user {privs} and group {group}",
             "group"),
            (o_gid, sgid, "mail_owner and setgid_group", f"user {owner} and group {group}",
             "group")):
        if left == right:
            raise ValueError(f"{where} {params}: {who} have the same {which} ID: {right}")


# -- helpers for mail_params_init()'s checks -----------------------------------------------


def oqmgr_fudge_factor(cfg: QmgrConfig) -> int:
    """oqmgr's ``qmgr_fudge_factor`` (10..100, default 100), read only for oqmgr.

    Stock qmgr never reads it, so it is looked up here, after qmgr's own tables, and
    only when a policy needs it: reading it among qmgr's tables would register its
    default in the dictionary and change what ``$qmgr_fudge_factor`` expands to.
    """
    text = cfg.get("qmgr_fudge_factor")
    if not text:
        return 100
    try:
        value = _int_value("qmgr_fudge_factor", text)
        _check_int("qmgr_fudge_factor", value, 10, 100)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return value


def hostname_problem(name: str) -> str | None:
    """``valid_hostname()``'s complaint about ``name``, or None if it is fine."""
    if not name:
        return "empty hostname"
    label_length = 0
    non_numeric = False
    for i, ch in enumerate(name):
        if is_alnum(ch) or ch == "_":
            label_length += 1
            if label_length > 63:
                return f"hostname label too long: {name[:100]}"
            if not is_digit(ch):
                non_numeric = True
        elif ch == ".":
            if label_length == 0 or i + 1 == len(name):
                return f"misplaced delimiter: {name[:100]}"
            label_length = 0
        elif ch == "-":
            non_numeric = True
            label_length += 1
            if label_length == 1 or i + 1 == len(name) or name[i + 1] == ".":
                return f"misplaced hyphen: {name[:100]}"
        else:
            code = ch.encode("utf-8", "surrogateescape")[0]
            return f"invalid character {code}(decimal): {name[:100]}"
    if not non_numeric:
        return f"numeric hostname: {name[:100]}"
    length = len(name.encode("utf-8", "surrogateescape"))
    if length > 255:
        return f"bad length {length} for {name[:100]}..."
    return None


def _verp_problem(delims: str, allowed: str) -> str | None:
    if len(delims) != 2:
        return "bad VERP delimiter character count"
    if delims[0] not in allowed:
        return "bad first VERP delimiter character"
    if delims[1] not in allowed:
        return "bad second VERP delimiter character"
    return None


# -- the mynetworks default ----------------------------------------------------------------


def mynetworks_default(style: str, protocols: str, interfaces: str) -> str:
    """``mynetworks()``: one pattern per local interface address, by mynetworks_style.

    Approximation: inet_interfaces other than ``all`` keeps the local interfaces
    whose address is listed literally (or all loopback ones for ``loopback-only``);
    stock also resolves host names there.
    """
    styles = [w.lower() for w in split_list(style)]
    if len(styles) != 1 or styles[0] not in ("class", "subnet", "host"):
        raise ValueError(f"bad mynetworks_style value: {style}; specify exactly one value")
    from pyqmgr.postfix.inet_addr_local import local_interfaces

    families = _families(protocols)
    wanted = [w.lower() for w in split_list(interfaces)]
    patterns: list[str] = []
    for family in families:
        for addr, mask in local_interfaces(family):
            if "all" not in wanted and not _interface_wanted(addr, wanted):
                continue
            patterns.append(_network_pattern(addr, mask, styles[0]))
    unique = list(dict.fromkeys(patterns))
    return "".join(p + " " for p in unique)


def _families(protocols: str) -> list[int]:
    words = {w.lower() for w in split_list(protocols)}
    families: list[int] = []
    if words & {"all", "ipv4"}:
        families.append(socket.AF_INET)
    if words & {"all", "ipv6"} and socket.has_ipv6:
        families.append(socket.AF_INET6)
    return families


def _interface_wanted(addr: ipaddress.IPv4Address | ipaddress.IPv6Address,
                      wanted: list[str]) -> bool:
    for word in wanted:
        if word == "loopback-only" and addr.is_loopback:
            return True
        try:
            if ipaddress.ip_address(word.strip("[]")) == addr:
                return True
        except ValueError:
            continue
    return False


def _network_pattern(addr: ipaddress.IPv4Address | ipaddress.IPv6Address,
                     mask: ipaddress.IPv4Address | ipaddress.IPv6Address, style: str) -> str:
    bits: int = addr.max_prefixlen
    prefix: int
    if style == "host":
        prefix = bits
    elif style == "class" and addr.version == 4:
        first = int(addr) >> 24
        prefix = 8 if first < 128 else 16 if first < 192 else 24 if first < 224 else 4
    else:
        prefix = bin(int(mask)).count("1")
    network = ipaddress.ip_network(f"{addr}/{prefix}", strict=False).network_address
    return f"{network}/{prefix}" if addr.version == 4 else f"[{network}]/{prefix}"
