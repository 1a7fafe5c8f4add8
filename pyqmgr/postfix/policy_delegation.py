"""Postfix's policy delegation protocol (``SMTPD_POLICY_README``), asked before a delivery.

With ``delivery_policy_service`` set, pyqmgr asks an external policy server whether a
delivery may start now, so a site can put its own limits on outgoing mail (N deliveries
per T seconds to one destination, say) with the servers it already runs for smtpd, such
as postfwd. The protocol is Postfix's: the client sends ``name=value`` lines ended by an
empty line, the server answers ``action=...`` ended by an empty line, and the connection
stays open for the next request.

This module has two parts, in the house style of the other protocol modules:

* **sans-I/O**: :func:`encode_request`, :class:`DeliveryRequest` (the attributes),
  :class:`ReplyParser` (bytes in, a :class:`PolicyReply` out, or a
  :class:`PolicyProtocolError`), :func:`classify`/:func:`decide` (an action text in, a
  :class:`Decision` out) and :class:`WarnGate` (at most one warning a minute, with the
  clock passed in). None of these reads a clock or touches a socket.
* **asyncio client**: :func:`parse_endpoint` and :class:`PolicyClient`, a small pool of
  persistent connections. Every failure to get a usable answer (timeout, refused or
  closed connection, malformed reply) is one exception type, :class:`PolicyError`, which
  the caller turns into its default action: the scheduler never waits longer than the
  client's timeout and the event loop is never blocked.

The request
-----------

Real, unmodified policy servers answer only ``request=smtpd_access_policy`` (postfwd
silently ignores any other request type and never replies), so that is what is sent;
``protocol_state=DELIVERY``, a state smtpd never uses, lets a server shared with smtpd
tell the two apart (a postfwd rule with ``protocol_state==RCPT`` never matches a
delivery). :meth:`DeliveryRequest.attrs` lists every attribute in the order sent:

=========================  ===============================================================
``request``                ``smtpd_access_policy``
``protocol_state``         ``DELIVERY``
``protocol_name``          empty
``client_address``,        empty: there is no SMTP client. Sent anyway ("unavailable" in
``client_name``,           the README's words) because Perl servers such as postfwd log
``reverse_client_name``,   them and would warn about an undefined value on every request
``helo_name``
``sender``                 the envelope sender (empty for the null sender)
``recipient``              the first recipient of the delivery (all of a delivery's
                           recipients share its transport and nexthop), so rules keyed
                           by recipient or recipient domain work
``recipient_count``        the number of recipients in this delivery
``queue_id``               the queue file's id
``instance``               unique per request (the queue id and a sequence number):
                           each delivery is its own decision, so a server that keys
                           anything on the instance never merges two deliveries
``size``                   the message size in bytes
``policy_context``         the configured context string (smtpd's
                           ``smtpd_policy_service_policy_context``), often empty
``transport``              pyqmgr's own: the master.cf transport of the delivery
``nexthop``                pyqmgr's own: the nexthop (the destination the scheduler's
                           window belongs to)
``destination_window``     pyqmgr's own: the destination's concurrency window now
``destination_in_flight``  pyqmgr's own: deliveries to the destination under way now
``attempt``                pyqmgr's own: 1 for a message's first delivery attempt, then
                           one more for each time it was deferred
=========================  ===============================================================

Names must be non-empty and hold no ``=``, newline or NUL (a bad name is a programming
error: ``ValueError``). A value may hold no newline or NUL (the README's rule), and a
carriage return would end the line for servers that strip ``\\r\\n``: each of these
three characters is replaced by ``?`` (Postfix's own ``printable(..., '?')`` marker)
rather than refusing the request. Non-UTF-8 bytes in a value (an address read from a
queue file with ``surrogateescape``) go out unchanged, as Postfix sends them.

The reply
---------

The reply is ``name=value`` lines ended by an empty line; ``action`` must be among them
(the first one counts, as in Postfix, which skips extra attributes). Limits, each a
:class:`PolicyProtocolError` as soon as it is passed, so a server streaming garbage is
cut off at once instead of filling memory:

* :data:`MAX_LINE` = 8192 bytes a line (without its newline): ``4 * line_limit`` with
  Postfix's default ``line_limit`` of 2048, the bound ``attr_scan_plain.c`` has in its
  (disabled) length check; an action is one SMTP reply line, far shorter.
* :data:`MAX_ATTRS` = 1024 attributes: the most Postfix collects into one attribute
  table (``RECV_ATTR_HASH``).
* :data:`MAX_REPLY` = 65536 bytes in all: the two above allow 8 MiB, far more than a
  reply needs, per pooled connection.
* a line without ``=`` (or with an empty name), a NUL byte, or bytes that are not UTF-8
  (smtpd refuses a non-UTF-8 action too) is malformed. A ``\\r`` before the newline is
  tolerated and dropped.

A pyqmgr extension: a ``delay=TIME`` attribute in a DEFER reply names how long the
destination is held back, as a number of seconds or with a Postfix time unit
(``90``, ``90s``, ``5m``, ``2h``, ``1d``, ``1w``). It is bounded to
:data:`MIN_DELAY` (1 s) .. :data:`MAX_DELAY` (one day); a value outside is clamped and a
malformed one ignored, each with a note for the log. Servers that cannot send extra
attributes (postfwd prints ``action=`` only) leave the delay to
``delivery_policy_defer_delay``.

Actions
-------

The action grammar is access(5)'s, as smtpd's ``check_table_result()`` reads it: the
first word, case-insensitive, then optional text, where a DEFER, REJECT or numeric
reply may start its text with an RFC 3463 status (``4.7.1``). :func:`classify` sorts them
into a :class:`Verdict`:

* ``DELIVER``: ``DUNNO``, ``OK``, ``RELAY``, an all-numeric action (access(5): "probably
  OK"), and ``WARN``/``INFO``, which in smtpd only log their text and go on (the text
  comes back as a note to log).
* ``DEFER``: ``DEFER``, ``DEFER_IF_PERMIT``, ``DEFER_IF_REJECT`` (there is no later
  restriction to wait for in a delivery), ``4NN text``, and a bare ``4.X.X text``.
  Codes and texts default as in smtpd: 450 and 4.7.1 with ``Access denied`` (DEFER) or
  ``Service unavailable`` (DEFER_IF_*).
* ``HOLD``: ``HOLD`` (text defaults to ``triggers HOLD action``).
* ``REJECT``: ``REJECT`` (554 5.7.1 ``Access denied``), ``5NN text``, a bare
  ``5.X.X text``.
* ``UNKNOWN``: everything else, including the access(5) actions that make no sense for
  a delivery (``PREPEND``, ``FILTER``, ``REDIRECT``, ``BCC``, ``DISCARD``, ``HANGUP``,
  ``DELAY``), restriction names and an empty action. The caller warns and delivers:
  nothing a policy server says by mistake may lose or divert mail.

Two choices differ from smtpd on purpose. A bare ``450`` or ``554`` (no text) is
all-numeric and therefore OK in smtpd; here it defers or rejects, with a default text,
because a server that answers a 4xx/5xx code certainly did not mean "deliver". And a
bare enhanced status (``4.7.1 text``) is accepted as DEFER/REJECT where smtpd would
look it up as a restriction name. As in smtpd, the SMTP code wins over the enhanced
status's class (``450 5.7.1 x`` becomes 450 4.7.1, with a note).
"""

from __future__ import annotations

import asyncio
import enum
import os
import re
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pyqmgr.postfix.host_port import HostPortError, host_port
from pyqmgr.postfix.mail_connect import WakingProtocol

#: Longest reply line accepted, in bytes without the newline (see the module docstring).
MAX_LINE = 8192
#: Most attributes accepted in one reply.
MAX_ATTRS = 1024
#: Most bytes accepted for one reply, terminator included.
MAX_REPLY = 65536
#: Bounds of a ``delay=`` the server names, in seconds.
MIN_DELAY = 1.0
MAX_DELAY = 86400.0

REQUEST_TYPE = "smtpd_access_policy"
PROTOCOL_STATE = "DELIVERY"

#: smtpd's defaults for the codes of access(5) actions: ``access_map_defer_code``,
#: ``defer_code`` (DEFER_IF_*) and ``access_map_reject_code``.
DEFER_CODE = 450
REJECT_CODE = 554

AttrValue = str | int


# -- errors ----------------------------------------------------------------------------


class PolicyError(Exception):
    """No usable answer from the policy service; the caller applies its default action.

    ``reason`` says which kind of failure it was, for the log: one of :data:`TIMEOUT`,
    :data:`UNREACHABLE` (the connection could not be made), :data:`CLOSED` (the server
    closed or reset the connection before a complete reply) and :data:`MALFORMED`.
    """

    TIMEOUT = "timeout"
    UNREACHABLE = "unreachable"
    CLOSED = "closed"
    MALFORMED = "malformed"

    def __init__(self, reason: str, text: str) -> None:
        super().__init__(text)
        self.reason = reason
        self.text = text


class PolicyProtocolError(PolicyError):
    """The server's bytes are not a policy reply (raised by :class:`ReplyParser`)."""

    def __init__(self, text: str) -> None:
        super().__init__(PolicyError.MALFORMED, text)


# -- the request -----------------------------------------------------------------------

_UNSENDABLE = str.maketrans({"\n": "?", "\r": "?", "\0": "?"})


def clean_value(value: str) -> str:
    """A value that can be sent: newline, carriage return and NUL become ``?``."""
    return value.translate(_UNSENDABLE)


def check_name(name: str) -> None:
    """Refuse an attribute name the protocol cannot carry (a programming error)."""
    if not name or any(c in name for c in "=\n\r\0"):
        raise ValueError(f"bad policy attribute name {name!r}")


def encode_request(attrs: Iterable[tuple[str, AttrValue]]) -> bytes:
    """Encode one request: ``name=value`` lines in the order given, then an empty line.

    ``int`` values are printed in decimal and must not be negative (Postfix prints them
    unsigned); ``str`` values are cleaned with :func:`clean_value`.
    """
    out = bytearray()
    for name, value in attrs:
        check_name(name)
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise TypeError(f"policy attribute {name}: {type(value).__name__} value")
        if isinstance(value, int):
            if value < 0:
                raise ValueError(f"policy attribute {name}: negative value {value}")
            text = str(value)
        else:
            text = clean_value(value)
        out += name.encode("utf-8", "surrogateescape")
        out += b"="
        out += text.encode("utf-8", "surrogateescape")
        out += b"\n"
    out += b"\n"
    return bytes(out)


@dataclass(frozen=True, slots=True)
class DeliveryRequest:
    """What the scheduler knows about a delivery it is about to start.

    See the module docstring for what each attribute means on the wire.
    """

    queue_id: str
    sender: str
    recipient: str
    recipient_count: int
    size: int
    instance: str
    transport: str
    nexthop: str
    destination_window: int
    destination_in_flight: int
    attempt: int
    policy_context: str = ""

    def attrs(self) -> list[tuple[str, AttrValue]]:
        """The request's attributes in the order they are sent."""
        return [
            ("request", REQUEST_TYPE),
            ("protocol_state", PROTOCOL_STATE),
            ("protocol_name", ""),
            ("client_address", ""),
            ("client_name", ""),
            ("reverse_client_name", ""),
            ("helo_name", ""),
            ("sender", self.sender),
            ("recipient", self.recipient),
            ("recipient_count", self.recipient_count),
            ("queue_id", self.queue_id),
            ("instance", self.instance),
            ("size", self.size),
            ("policy_context", self.policy_context),
            ("transport", self.transport),
            ("nexthop", self.nexthop),
            ("destination_window", self.destination_window),
            ("destination_in_flight", self.destination_in_flight),
            ("attempt", self.attempt),
        ]

    def encode(self) -> bytes:
        return encode_request(self.attrs())


# -- the reply -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PolicyReply:
    """One parsed reply: its attributes in the order received (names may repeat)."""

    attrs: tuple[tuple[str, str], ...]

    def get(self, name: str) -> str | None:
        """The first value of ``name``, as Postfix's scanner takes it, or None."""
        for key, value in self.attrs:
            if key == name:
                return value
        return None

    @property
    def action(self) -> str:
        value = self.get("action")
        assert value is not None  # the parser refuses a reply without one
        return value


class ReplyParser:
    """Incremental parser for one reply: feed bytes as they arrive.

    :meth:`feed` returns None until the empty line that ends the reply has arrived,
    then the :class:`PolicyReply`; it raises :class:`PolicyProtocolError` as soon as the
    bytes break a rule or a limit (see the module docstring). Bytes after the end of the
    reply are kept in :attr:`trailing`: a server that sends more than one reply for one
    request is out of step, and its connection must not be used again.
    """

    __slots__ = ("_buf", "_attrs", "_consumed", "_done", "received")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._attrs: list[tuple[str, str]] = []
        self._consumed = 0
        self._done: PolicyReply | None = None
        #: Bytes fed so far, reply and trailing bytes together.
        self.received = 0

    @property
    def trailing(self) -> bytes:
        """Bytes received after the reply's end (empty before the end, normally)."""
        return bytes(self._buf) if self._done is not None else b""

    def feed(self, data: bytes) -> PolicyReply | None:
        self.received += len(data)
        buf = self._buf
        buf += data
        if self._done is not None:
            return self._done
        start = 0
        try:
            while True:
                end = buf.find(b"\n", start)
                if end < 0:
                    if len(buf) - start > MAX_LINE + 1:  # + 1: a "\r" may precede "\n"
                        raise PolicyProtocolError(
                            f"reply line longer than {MAX_LINE} bytes")
                    if self._consumed + len(buf) - start > MAX_REPLY:
                        raise PolicyProtocolError(f"reply longer than {MAX_REPLY} bytes")
                    return None
                line = bytes(buf[start:end])
                self._consumed += end + 1 - start
                start = end + 1
                if self._consumed > MAX_REPLY:
                    raise PolicyProtocolError(f"reply longer than {MAX_REPLY} bytes")
                if line.endswith(b"\r"):
                    line = line[:-1]
                if not line:
                    if self.get_action() is None:
                        raise PolicyProtocolError(
                            "reply without action attribute"
                            + ("" if self._attrs else " (empty reply)"))
                    self._done = PolicyReply(tuple(self._attrs))
                    return self._done
                self._attrs.append(self._parse_line(line))
                if len(self._attrs) > MAX_ATTRS:
                    raise PolicyProtocolError(f"more than {MAX_ATTRS} reply attributes")
        finally:
            del buf[:start]

    def get_action(self) -> str | None:
        for name, value in self._attrs:
            if name == "action":
                return value
        return None

    @staticmethod
    def _parse_line(line: bytes) -> tuple[str, str]:
        if len(line) > MAX_LINE:
            raise PolicyProtocolError(f"reply line longer than {MAX_LINE} bytes")
        if b"\0" in line:
            raise PolicyProtocolError("NUL byte in reply")
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            raise PolicyProtocolError(
                f"reply is not UTF-8: {_show(line)}") from None
        name, eq, value = text.partition("=")
        if not eq:
            raise PolicyProtocolError(f"reply line without '=': {_show(line)}")
        if not name:
            raise PolicyProtocolError(f"reply attribute without name: {_show(line)}")
        return name, value


def _show(line: bytes | str, limit: int = 60) -> str:
    """A bounded, printable rendering of a bad line for a message."""
    text = repr(line[:limit])
    text = text[2:-1] if isinstance(line, bytes) else text[1:-1]
    return text + ("..." if len(line) > limit else "")


# -- what the action means ---------------------------------------------------------------


class Verdict(enum.Enum):
    """What the scheduler does with a delivery after asking."""

    DELIVER = "deliver"
    DEFER = "defer"
    HOLD = "hold"
    REJECT = "reject"
    #: Not an action that means anything for a delivery: warn and deliver.
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Decision:
    """A classified reply.

    ``command`` is the action's first word as sent, ``text`` the rest (after the
    enhanced status, if any) or the default text, ``code``/``dsn`` the SMTP reply code
    and RFC 3463 status for DEFER and REJECT (None otherwise). ``delay`` is the bounded
    ``delay=`` of a DEFER reply, in seconds, or None. ``notes`` are things the caller
    should log as warnings (an unknown action, a clamped or malformed delay, a fixed
    status class) or, for WARN/INFO, the text the server asked to log.
    """

    verdict: Verdict
    action: str
    command: str
    code: int | None = None
    dsn: str | None = None
    text: str = ""
    delay: float | None = None
    notes: tuple[str, ...] = ()

    @property
    def reason(self) -> str:
        """``450 4.7.1 text`` for DEFER and REJECT, the text otherwise: for log lines."""
        if self.code is not None:
            return f"{self.code} {self.dsn} {self.text}"
        return self.text


_CODE = re.compile(r"[245][0-9][0-9]\Z")
_DSN = re.compile(r"([245])\.([0-9]{1,3})\.([0-9]{1,3})(?=\s|\Z)")
_DIGITS = re.compile(r"[0-9]+\Z")
_DELAY = re.compile(r"([0-9]{1,9})([smhdw]?)\Z")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
#: access(5) actions that a policy reply may carry but that mean nothing for a delivery.
_SMTPD_ONLY = frozenset(("PREPEND", "FILTER", "REDIRECT", "BCC", "DISCARD", "HANGUP",
                         "DELAY"))


def _split_dsn(text: str, default: str) -> tuple[str, str]:
    """``dsn_split()``: an optional leading RFC 3463 status, then free text."""
    text = text.lstrip()
    match = _DSN.match(text)
    if match is None:
        return default, text
    return match.group(0), text[match.end():].lstrip()


def _status(verdict: Verdict, action: str, command: str, code: int, rest: str,
            default_text: str) -> Decision:
    klass = str(code)[0]
    dsn, text = _split_dsn(rest, f"{klass}.7.1")
    notes: tuple[str, ...] = ()
    if dsn[0] != klass:
        # smtpd_check_reject(): "SMTP has the higher precedence since it came here first".
        fixed = klass + dsn[1:]
        notes = (f"policy reply {action!r}: status {dsn} does not match reply code "
                 f"{code}, using {fixed}",)
        dsn = fixed
    return Decision(verdict, action, command, code, dsn, text or default_text, notes=notes)


def classify(action: str) -> Decision:
    """Sort an ``action=`` value into a :class:`Decision` (see the module docstring)."""
    stripped = action.strip()
    words = stripped.split(None, 1)
    command = words[0] if words else ""
    rest = words[1].strip() if len(words) > 1 else ""
    word = command.upper()
    if word in ("DUNNO", "OK", "RELAY"):
        return Decision(Verdict.DELIVER, action, command, text=rest)
    if word in ("WARN", "INFO"):
        note = f"policy service {word}: {rest}" if rest else f"policy service {word}"
        return Decision(Verdict.DELIVER, action, command, text=rest, notes=(note,))
    if word == "DEFER":
        return _status(Verdict.DEFER, action, command, DEFER_CODE, rest, "Access denied")
    if word in ("DEFER_IF_PERMIT", "DEFER_IF_REJECT"):
        return _status(Verdict.DEFER, action, command, DEFER_CODE, rest,
                       "Service unavailable")
    if word == "REJECT":
        return _status(Verdict.REJECT, action, command, REJECT_CODE, rest,
                       "Access denied")
    if word == "HOLD":
        return Decision(Verdict.HOLD, action, command, text=rest or "triggers HOLD action")
    if _CODE.match(command) and command[0] in "45":
        verdict = Verdict.DEFER if command[0] == "4" else Verdict.REJECT
        return _status(verdict, action, command, int(command), rest,
                       "Service unavailable" if command[0] == "4" else "Access denied")
    if _DIGITS.match(command) and not rest:
        return Decision(Verdict.DELIVER, action, command)
    dsn_match = _DSN.match(stripped)
    if dsn_match is not None and dsn_match.group(1) in "45":
        code = DEFER_CODE if dsn_match.group(1) == "4" else REJECT_CODE
        verdict = Verdict.DEFER if code == DEFER_CODE else Verdict.REJECT
        return _status(verdict, action, command, code, stripped,
                       "Service unavailable" if code == DEFER_CODE else "Access denied")
    if word in _SMTPD_ONLY:
        why = f"{word} is an smtpd action that does not apply to a delivery"
    elif not stripped:
        why = "empty action"
    else:
        why = "unknown action"
    return Decision(Verdict.UNKNOWN, action, command, text=rest,
                    notes=(f"policy reply action={_show(action, 100)}: {why}; "
                           "treated as DUNNO",))


def parse_delay(value: str) -> tuple[float | None, str | None]:
    """A ``delay=`` value: (seconds bounded to MIN_DELAY..MAX_DELAY, note) or (None, note).

    Accepts a number of seconds or a number with one Postfix time unit (s, m, h, d, w).
    """
    match = _DELAY.match(value.strip())
    if match is None:
        return None, f"policy reply delay={_show(value, 40)}: not a time, ignored"
    seconds = float(int(match.group(1)) * _UNIT[match.group(2)])
    if seconds < MIN_DELAY:
        return MIN_DELAY, f"policy reply delay={value}: raised to {MIN_DELAY:g}s"
    if seconds > MAX_DELAY:
        return MAX_DELAY, f"policy reply delay={value}: lowered to {MAX_DELAY:g}s"
    return seconds, None


def decide(reply: PolicyReply) -> Decision:
    """:func:`classify` the reply's action and attach its bounded ``delay=`` (DEFER only)."""
    decision = classify(reply.action)
    raw = reply.get("delay")
    if raw is None or decision.verdict is not Verdict.DEFER:
        return decision
    delay, note = parse_delay(raw)
    notes = decision.notes + ((note,) if note else ())
    return Decision(decision.verdict, decision.action, decision.command, decision.code,
                    decision.dsn, decision.text, delay, notes)


class WarnGate:
    """At most one warning per ``interval`` seconds for one kind of trouble.

    A policy service that is down would otherwise add a warning to every delivery.
    The caller passes its clock (so this stays free of I/O and testable) and, when
    allowed, says how many warnings were held back since the last one.
    """

    __slots__ = ("interval", "burst", "_last", "_used", "held")

    def __init__(self, interval: float = 60.0, burst: int = 1) -> None:
        self.interval = interval
        #: Warnings let through in one interval (the first ``burst`` of it).
        self.burst = burst
        self._last: float | None = None
        self._used = 0
        #: Warnings held back since the last one let through.
        self.held = 0

    def allow(self, now: float) -> int | None:
        """None: stay quiet. An int: warn now; it is the count held back before this."""
        if self._last is not None and now - self._last < self.interval:
            if self._used < self.burst:
                self._used += 1
                return 0
            self.held += 1
            return None
        self._last, self._used = now, 1
        held, self.held = self.held, 0
        return held


# -- endpoints -----------------------------------------------------------------------------

#: Longest UNIX-domain socket path the kernel takes (sun_path less its NUL).
_SUN_PATH_MAX = 107


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the policy service listens: ``inet`` with host and port, or ``unix``."""

    kind: str
    host: str = ""
    port: int = 0
    path: str = ""

    def __str__(self) -> str:
        if self.kind == "unix":
            return f"unix:{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"inet:{host}:{self.port}"


def parse_endpoint(spec: str, base_dir: str | None = None) -> Endpoint:
    """Parse ``inet:host:port`` or ``unix:path``; raise ValueError saying what is wrong.

    An IPv6 host is written in brackets (``inet:[::1]:10040``); the port is a number
    or a service name from /etc/services (looked up here, once). A relative ``unix:``
    path is joined to ``base_dir`` when one is given; otherwise it stays relative and
    is resolved against the working directory at each connect, which in the daemon is
    the queue directory, chrooted or not, as Postfix resolves ``private/...``.
    """
    what = f"policy service {spec!r}"
    kind, colon, rest = spec.strip().partition(":")
    if not colon or kind not in ("inet", "unix"):
        raise ValueError(f"{what}: expected inet:host:port or unix:pathname")
    if kind == "unix":
        if not rest:
            raise ValueError(f"{what}: empty pathname")
        if "\0" in rest:
            raise ValueError(f"{what}: NUL in pathname")
        path = rest
        if base_dir is not None and not os.path.isabs(path):
            path = os.path.join(base_dir, path)
        if len(os.fsencode(path)) > _SUN_PATH_MAX:
            raise ValueError(f"{what}: pathname longer than {_SUN_PATH_MAX} bytes")
        return Endpoint("unix", path=path)
    try:
        host, port_text = host_port(rest)
    except HostPortError as exc:
        raise ValueError(f"{what}: " + {
            "bracket": "expected inet:[address]:port", "colon": "expected inet:host:port",
            "ipv6": "an IPv6 address must be in brackets", "host": "empty host"}[exc.kind]
        ) from None
    if not port_text:
        raise ValueError(f"{what}: empty port")
    if port_text.isdigit():
        port = int(port_text)
        if not 0 < port < 65536:
            raise ValueError(f"{what}: port {port} out of range")
    else:
        try:
            port = socket.getservbyname(port_text, "tcp")
        except OSError:
            raise ValueError(f"{what}: unknown service {port_text!r}") from None
    return Endpoint("inet", host=host, port=port)


# -- the asyncio client ----------------------------------------------------------------------


class _PolicyProtocol(WakingProtocol):
    """One connection: feeds the current request's parser, remembers EOF and strays."""

    __slots__ = ("parser", "reply", "error", "stray")

    def __init__(self) -> None:
        super().__init__()
        self.parser: ReplyParser | None = None
        self.reply: PolicyReply | None = None
        self.error: PolicyProtocolError | None = None
        #: Bytes arrived when no request was outstanding, or after a reply's end: the
        #: server is out of step (attr_clnt's "readable before we send" check).
        self.stray = False

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is None or self.reply is not None or self.error is not None:
            self.stray = True
            return
        try:
            reply = parser.feed(data)
        except PolicyProtocolError as exc:
            self.error = exc
        else:
            if reply is not None:
                self.reply = reply
                if parser.trailing:
                    self.stray = True
        self._wake()


class _Connection:
    __slots__ = ("proto", "opened", "used")

    def __init__(self, proto: _PolicyProtocol, now: float) -> None:
        self.proto = proto
        self.opened = now
        self.used = now

    def usable(self) -> bool:
        proto = self.proto
        return not (proto.closed or proto.stray or proto.transport is None
                    or proto.transport.is_closing())

    def close(self) -> None:
        transport = self.proto.transport
        if transport is not None:
            transport.close()


class _Stale(Exception):
    """A reused connection was found closed before any byte of a reply came back."""


@dataclass
class PolicyClientStats:
    """Counters, for tests and for ``pyqmgr status`` later."""

    requests: int = 0
    connections_opened: int = 0
    #: Requests sent over a connection that had served an earlier request.
    reused: int = 0
    #: Requests sent again on a fresh connection after a reused one turned out dead.
    retries: int = 0
    errors: int = 0


class PolicyClient:
    """Asks one policy service, over at most ``max_connections`` persistent connections.

    smtpd keeps one connection a process; the scheduler may have several deliveries
    waiting for an answer at once, so up to ``max_connections`` (default 4) are opened
    as needed and kept for reuse. A request waits for a free connection when all are
    busy. Connections are closed when unused for ``max_idle`` seconds or older than
    ``max_ttl`` (smtpd_policy_service_max_idle/max_ttl: 300 s and 1000 s), checked when
    one is taken and by :meth:`expire_idle`, which the daemon's periodic timer calls.

    ``timeout`` bounds one :meth:`ask` as a whole: waiting for a free connection,
    connecting, sending and reading the reply (smtpd's smtpd_policy_service_timeout
    bounds each read and write; one bound for the whole is what a scheduler needs).
    A connection that fails in any way is closed, never reused. When a connection
    taken from the pool turns out closed by the server (it restarted, or closed an
    idle connection) before any reply byte came back, the request is sent once more
    on a fresh connection, as attr_clnt retries; a timeout is never retried.
    """

    def __init__(
        self,
        endpoint: Endpoint | str,
        *,
        timeout: float = 10.0,
        max_idle: float = 300.0,
        max_ttl: float = 1000.0,
        max_connections: int = 4,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self.endpoint = endpoint if isinstance(endpoint, Endpoint) else parse_endpoint(endpoint)
        self.timeout = timeout
        self.max_idle = max_idle
        self.max_ttl = max_ttl
        self.max_connections = max_connections
        self._clock = clock
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()
        self._slots: asyncio.Semaphore | None = None
        self._closed = False
        self.stats = PolicyClientStats()

    # -- public ----------------------------------------------------------------------

    async def ask(self, request: DeliveryRequest | Sequence[tuple[str, AttrValue]]
                  ) -> Decision:
        """Send one request; return the classified decision or raise PolicyError."""
        if isinstance(request, DeliveryRequest):
            payload = request.encode()
        else:
            payload = encode_request(request)
        self.stats.requests += 1
        try:
            async with asyncio.timeout(self.timeout):
                reply = await self._request(payload)
        except TimeoutError:
            self.stats.errors += 1
            raise PolicyError(PolicyError.TIMEOUT,
                              f"{self._name()}: no reply within {self.timeout:g}s") from None
        except PolicyError:
            self.stats.errors += 1
            raise
        return decide(reply)

    def open_connections(self) -> int:
        """Connections open now, idle and busy."""
        return len(self._idle) + len(self._busy)

    def expire_idle(self) -> None:
        """Close pooled connections idle longer than max_idle or older than max_ttl."""
        now = self._clock()
        keep = []
        for conn in self._idle:
            if self._expired(conn, now) or not conn.usable():
                conn.close()
            else:
                keep.append(conn)
        self._idle = keep

    def close(self) -> None:
        """Close every connection; requests under way fail with PolicyError(closed)."""
        self._closed = True
        for conn in self._idle:
            conn.close()
        self._idle.clear()
        for conn in list(self._busy):
            conn.close()

    # -- internals ---------------------------------------------------------------------

    def _name(self) -> str:
        return f"policy service {self.endpoint}"

    def _expired(self, conn: _Connection, now: float) -> bool:
        return now - conn.used > self.max_idle or now - conn.opened > self.max_ttl

    def _take_idle(self) -> _Connection | None:
        now = self._clock()
        while self._idle:
            conn = self._idle.pop()  # most recently used first: least likely stale
            if conn.usable() and not self._expired(conn, now):
                return conn
            conn.close()
        return None

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        proto = _PolicyProtocol()
        endpoint = self.endpoint
        try:
            if endpoint.kind == "unix":
                await loop.create_unix_connection(lambda: proto, endpoint.path)
            else:
                await loop.create_connection(lambda: proto, endpoint.host, endpoint.port)
        except OSError as exc:
            # asyncio's own text for a refused connection is "Connect call failed
            # (addr)"; the errno's text is what an admin expects ("Connection refused").
            text = (os.strerror(exc.errno) if exc.errno else exc.strerror or str(exc)
                    or type(exc).__name__)
            raise PolicyError(PolicyError.UNREACHABLE,
                              f"{self._name()}: connect: {text}") from None
        self.stats.connections_opened += 1
        return _Connection(proto, self._clock())

    async def _request(self, payload: bytes) -> PolicyReply:
        if self._closed:
            raise PolicyError(PolicyError.CLOSED, f"{self._name()}: client closed")
        if self._slots is None:
            # Made here, inside the running loop, so a client built before the loop
            # (at configuration time) binds to the loop that uses it.
            self._slots = asyncio.Semaphore(self.max_connections)
        async with self._slots:
            for attempt in (1, 2):
                # The retry always takes a fresh connection: when one pooled connection
                # was found dead, the server probably restarted and closed them all.
                conn = self._take_idle() if attempt == 1 else None
                reused = conn is not None
                if conn is None:
                    conn = await self._open()
                self._busy.add(conn)
                try:
                    if reused:
                        self.stats.reused += 1
                    reply = await self._exchange(conn, payload)
                except _Stale:
                    conn.close()
                    if reused and attempt == 1 and not self._closed:
                        self.stats.retries += 1
                        continue
                    raise PolicyError(
                        PolicyError.CLOSED,
                        f"{self._name()}: connection closed before a reply") from None
                except BaseException:
                    conn.close()
                    raise
                finally:
                    self._busy.discard(conn)
                self._give_back(conn)
                return reply
        raise AssertionError("unreachable")

    async def _exchange(self, conn: _Connection, payload: bytes) -> PolicyReply:
        proto = conn.proto
        transport = proto.transport
        if transport is None or transport.is_closing() or proto.closed:
            raise _Stale()
        parser = ReplyParser()
        proto.parser = parser
        proto.reply = None
        transport.write(payload)
        loop = asyncio.get_running_loop()
        while True:
            if proto.reply is not None:
                return proto.reply
            if proto.error is not None:
                raise PolicyProtocolError(f"{self._name()}: {proto.error}")
            if proto.closed:
                if parser.received == 0:
                    raise _Stale()
                raise PolicyError(PolicyError.CLOSED,
                                  f"{self._name()}: connection closed in mid-reply")
            proto.waiter = loop.create_future()
            try:
                await proto.waiter
            finally:
                proto.waiter = None

    def _give_back(self, conn: _Connection) -> None:
        now = self._clock()
        conn.proto.parser = None
        conn.proto.reply = None
        if self._closed or not conn.usable() or now - conn.opened > self.max_ttl:
            conn.close()
            return
        conn.used = now
        self._idle.append(conn)


__all__ = [
    "MAX_ATTRS", "MAX_DELAY", "MAX_LINE", "MAX_REPLY", "MIN_DELAY", "Decision",
    "DeliveryRequest", "Endpoint", "PolicyClient", "PolicyClientStats", "PolicyError",
    "PolicyProtocolError", "PolicyReply", "ReplyParser", "Verdict", "WarnGate",
    "classify", "clean_value", "decide", "encode_request", "parse_delay",
    "parse_endpoint",
]
