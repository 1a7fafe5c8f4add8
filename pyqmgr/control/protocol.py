"""The control channel's request/reply format, without any I/O (in the manner of h11).

The daemon and the ``pyqmgr`` commands both use this module, so that the format is
written down once and the parser can be tested byte by byte without a socket.

Format (protocol version 1)
---------------------------

One request and one reply per connection, on ``$queue_directory/pyqmgr/control``:

* The **request** is ONE line: a JSON object, UTF-8, ended by ``"\\n"``, at most
  :data:`MAX_REQUEST` bytes (64 KiB) including the newline. The object has a
  ``"command"`` (a string) and the command's arguments as further members::

      {"command": "status"}
      {"command": "explain", "target": "example.com"}

  Bytes after the newline are ignored: the daemon answers the first request and closes.
* The **reply** is one line of JSON ended by ``"\\n"``; the daemon closes the connection
  after it. Success is ``{"ok": true, ...}`` with the command's result members; failure
  is ``{"ok": false, "error": "human-readable text", "code": "..."}`` where ``code`` is
  one of :data:`ERROR_CODES` (``denied``, ``bad_request``, ``too_long``, ``timeout``,
  ``busy``, ``not_implemented``, ``internal``, ``not_found``), for scripts to branch on.

Commands (:data:`COMMANDS`):

* reading the scheduler's state: ``status`` (optional ``fleet``: true for every
  server of the fleet, read from Redis's roster) and ``explain`` (``target``: a
  destination or a queue id);
* *controls* (root and mail_owner only): ``suspend`` (``target``, ``ttl`` in seconds,
  optional ``reason``), ``resume`` (``target``) and ``retry`` (``target``). A control
  target is ``DESTINATION`` (in every transport), ``TRANSPORT:DESTINATION``,
  ``TRANSPORT:`` or a bare master.cf service name (the whole transport); see
  :func:`pyqmgr.scheduler.suspension.parse_target`. ``resume`` of something not
  suspended fails with code ``not_found``.

Who may send which kind is the daemon's decision (:mod:`pyqmgr.daemon.control`), from
the peer's socket credentials, never from anything in the request.

``jobs`` (``transport``: a transport name as master.cf has it; ``limit``: optional,
a number, only the first that many items) is a read command too: the transport's
policy's work in the policy's own order, ``{"ok": true, "transport": ..., "policy":
..., "kind": "jobs", "order": "...", "total": N, "jobs": [...]}``, where ``kind``
names the member holding the list (nqmgr ``jobs``, oqmgr ``queues``, finch
``messages``, zmailer ``threads``; see each policy's ``jobs_report``). A transport
not in core is answered ``not_found``, a limit that is not a whole number of 0 or
more ``bad_request``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

#: Largest request, newline included. Requests are a command and a destination name:
#: 64 KiB is far beyond any real one and still small enough to buffer per client.
MAX_REQUEST = 64 * 1024

#: Largest reply a client reads; a status of 100,000 destinations is ~30 MB of JSON.
MAX_REPLY = 256 * 1024 * 1024

PROTOCOL_VERSION = 1

#: The two kinds of command: reading state, or changing the scheduler (controls).
READ = "read"
CONTROL = "control"

#: Error codes of failed replies.
ERROR_CODES = ("denied", "bad_request", "too_long", "timeout", "busy", "not_implemented",
               "internal", "not_found")


@dataclass(frozen=True)
class Arg:
    """One argument of a command: what the daemon accepts, and how ``pyqmgr`` takes it.

    ``types`` and ``required`` are the request's rule (:func:`validate`). The rest
    makes the ``pyqmgr`` subcommand's argument, so that a command is declared here once:
    ``positional`` (``TARGET``) or an option (``--ttl``), its ``help``, ``metavar``,
    ``choices`` and ``default``, and ``parse``, the name of the CLI's converter of the
    text typed (:data:`pyqmgr.cli.ARG_TYPES`; None: the text as it is). An optional
    argument left at its default is not sent: the daemon's own default applies.
    """

    types: tuple[type, ...] = (str,)
    required: bool = False
    help: str = ""
    positional: bool = False
    metavar: str | None = None
    default: object = None
    parse: str | None = None
    choices: tuple[str, ...] | None = None


@dataclass(frozen=True)
class CommandSpec:
    """A command: its kind, its arguments, and its ``pyqmgr`` subcommand's texts.

    ``help`` is its line in ``pyqmgr --help``, ``description`` the top of ``pyqmgr
    COMMAND --help``, ``reply_keys`` the reply's members that ``--json`` names, and
    ``view`` the subcommand's own options: they choose how the reply is shown (passed to
    :func:`pyqmgr.control.render.reply_lines`) and are never sent.
    """

    kind: str
    args: dict[str, Arg] = field(default_factory=dict)
    help: str = ""
    description: str = ""
    reply_keys: str = "ok"
    view: dict[str, Arg] = field(default_factory=dict)


#: How a control command's TARGET is written (:func:`pyqmgr.scheduler.suspension.parse_target`).
CONTROL_TARGET_HELP = (
    "DESTINATION (in every transport: a domain, or a nexthop such as [10.0.0.1]:25), "
    "TRANSPORT:DESTINATION (in that transport only), TRANSPORT: or a bare master.cf "
    "service name without a dot (the whole transport), site:NAME (every destination of "
    "a provider site, with site_grouping in pyqmgr.cf), TRANSPORT:site:NAME (that "
    "transport's site only: one source at one site, out11:site:google), tenant:NAME "
    "(one tenant's mail everywhere, with tenant_key in pyqmgr.cf) or "
    "tenant:NAME@TARGET (its mail to any of the above only)")

def _control(help: str, *, description: str, reply_keys: str, **more: Arg) -> CommandSpec:
    """A control command: a TARGET, named as every control names it, then ``more``."""
    target = Arg(required=True, positional=True, help=CONTROL_TARGET_HELP)
    return CommandSpec(CONTROL, {"target": target, **more}, help=help,
                       description=description, reply_keys=reply_keys)


#: Every command the daemon knows, and so every ``pyqmgr`` subcommand that asks it.
#: JSON numbers arrive as int or float; bool is a subclass of int in Python, so it is
#: excluded explicitly where numbers are wanted.
COMMANDS: dict[str, CommandSpec] = {
    "status": CommandSpec(
        READ,
        {"fleet": Arg((bool,), default=False,
                      help="every server of the fleet instead (pyqmgr.cf shared_state): "
                           "each one's leases, waiting deliveries and mode per "
                           "destination, its limits and its last sync, read from "
                           "Redis's roster")},
        help="show the running scheduler: transports and destinations (read-only)",
        description=(
            "Ask the running pyqmgr what its scheduler holds now. Per transport: the\n"
            "policy, agents busy and the process limit, agent connections pending,\n"
            "destinations, queued entries and recipients, dead or rate-delayed. Per\n"
            "destination: the concurrency window and its limit, deliveries in flight,\n"
            "queued entries and recipients, the success and failure accumulators and\n"
            "failed cohorts of the concurrency feedback, and whether it is dead (with\n"
            "the reason and when it is tried again) or rate-delayed. Only mail in the\n"
            "active queue is in core; 'postqueue -p' lists the rest.\n\n"
            "With --fleet, the fleet instead (shared_state in pyqmgr.cf): every server\n"
            "that published its record to Redis within three lease times, with its\n"
            "mode (normal, or local/hold while Redis fails it), its limits, its last\n"
            "good answer from Redis and, per destination or site, the fleet sessions\n"
            "it holds and its deliveries waiting; then the settings in which servers\n"
            "differ (each obeys the stricter)."),
        reply_keys="ok, messages, recipients, transports, destinations; with --fleet: "
                   "node, read, error, servers, differences, skipped",
        view={"sort": Arg(choices=("name", "window", "busy", "queued"), default="name",
                          help="order of the destinations: name (default), window "
                               "(largest first), busy (most in flight first), queued "
                               "(most recipients waiting first)")}),
    "explain": CommandSpec(
        READ,
        {"target": Arg(required=True, positional=True,
                       help="a destination as the scheduler names it (a domain, or the "
                            "nexthop such as [10.0.0.1]:25; see pyqmgr status) or a "
                            "queue id")},
        help="say why a destination or a message is not being delivered now",
        description=(
            "Ask the running pyqmgr why TARGET is not going out right now: each reason\n"
            "names the constraint (a full window, a dead destination, the transport's\n"
            "process limit, a rate delay, a blocker or preempted job, ...) and the\n"
            "setting behind it, so that shaping by configuration can be told from a\n"
            "slow remote side.\n\n"
            "A queue id of a message outside the active queue is answered from its\n"
            "queue file and defer log, which the daemon reads for you: in the deferred\n"
            "queue, each recipient's last reason, when it arrived, when it is tried\n"
            "next and when it is returned to the sender, and the state of its\n"
            "destinations in core; on hold, since when; in the incoming queue, that it\n"
            "waits to be read. Durations are in Postfix's units (9m58s), times on this\n"
            "machine's clock; --json gives seconds and Unix times."),
        reply_keys="ok, target, kind, reasons with constraint, setting and text; for a "
                   "message outside the active queue also queue, in_core, sender, "
                   "arrival_time, next_try_time, next_try_in, held_since, held_for, "
                   "expires_time, expires_in, recipients (address, status, reason, "
                   "transport, nexthop), destinations, defer_log, warnings"),
    "jobs": CommandSpec(
        READ,
        {"transport": Arg(required=True, positional=True,
                          help="a transport as master.cf names it (smtp, relay, ...; see "
                               "pyqmgr status)"),
         "limit": Arg((int, float), metavar="N", parse="count",
                      help="only the first N (the daemon builds the list in one go, "
                           "holding up deliveries meanwhile: 50-85 ms for 10,000 jobs, "
                           "2 ms for the first 50)")},
        help="show a transport's jobs in scheduling order: slots, loans, preemption stack "
             "(read-only)",
        description=(
            "Ask the running pyqmgr for TRANSPORT's work in the order its scheduling policy\n"
            "picks from. With nqmgr (stock's scheduler) that is the job list, one job per\n"
            "message, in scheduler order:\n\n"
            "  SLOTS USED/AVAIL  a job earns a delivery slot for each entry (delivery request)\n"
            "                    it delivers; when it has saved <transport>_delivery_slot_cost\n"
            "                    slots per entry another job needs, that job may preempt it.\n"
            "                    A preempting job starts with USED at minus the entries it is\n"
            "                    expected to deliver.\n"
            "  LOAN              <transport>_delivery_slot_loan (and _delivery_slot_discount)\n"
            "                    let preemption happen before the slots are saved; the\n"
            "                    preempted job is charged at once, so AVAIL goes negative: LOAN\n"
            "                    is that debt, earned back by its own deliveries.\n"
            "  PREEMPT<=         the most entries a job may need and still preempt this one\n"
            "                    now (0: not now; needs AVAIL above 0 and the job to be at\n"
            "                    least <transport>_minimum_delivery_slots x cost entries).\n"
            "  LEVEL, PREEMPTS   the preemption stack: a preempting job sits one level above\n"
            "                    the job it preempted, and stands right before it in the list;\n"
            "                    'preemption stack' lines show each chain, preempted first.\n"
            "  ENTRIES SEL/READ/MAX  entries selected for delivery, read into core, and at\n"
            "                    most in all (read plus recipients still in the queue file).\n"
            "  RCPTS/LIMIT, UNREAD  recipients in core and the recipient slots the job may\n"
            "                    fill (<transport>_recipient_limit), and those not yet read.\n"
            "  STATE             current (selection starts here, marked >), blocker (every\n"
            "                    destination it has mail for is at its window: skipped),\n"
            "                    preempted, reading (recipients left in the file).\n"
            "  CLASS, TENANT, ROUND  with message_classes or tenant_key (pyqmgr.cf): the\n"
            "                    job's class and tenant, and its tenant's turn: the list\n"
            "                    holds each class in turn, its tenants' jobs in rounds.\n\n"
            "oqmgr shows its round-robin list of destinations, finch its messages first come\n"
            "first served with the workers each holds, zmailer its threads (one per\n"
            "destination) in the order free agents go to them; a policy of one's own shows\n"
            "what its jobs_report() returns (by default its destinations). Only the active\n"
            "queue is in core."),
        reply_keys="ok, transport, policy, kind, order, total, and the list named by kind: "
                   "jobs, queues, messages or threads"),
    "suspend": _control(
        "hold a destination's or a transport's mail in the queue for a while",
        reason=Arg(default="", help="why, for the maillog and 'pyqmgr status' (at most "
                                    "200 characters)"),
        fleet=Arg((bool,), default=False,
                  help="on every server of the fleet (pyqmgr.cf shared_state): each one "
                       "holds the mail within a second and says who and why in its "
                       "maillog"),
        ttl=Arg((int, float), True, metavar="DURATION", default=3600.0, parse="duration",
                help="how long: 90s, 15m, 2h, 1d, 1w (a bare number is seconds; at most 30 "
                     "days; default 1h)"),
        description=(
            "Stop starting deliveries to TARGET until the TTL runs out or 'pyqmgr resume'.\n"
            "Its mail stays queued: what is in the active queue stays there, new mail for\n"
            "it waits there too, and nothing is deferred or bounced on the suspension's\n"
            "account. Deliveries already under way finish. When the suspension ends, the\n"
            "mail goes out at once with the concurrency window the destination had.\n"
            "Suspending the same TARGET again replaces its reason and TTL. A tenant's\n"
            "suspension (tenant:acme@site:yahoo) holds only that tenant's mail there;\n"
            "the rest of the mail to the same place keeps flowing."),
        reply_keys="ok, target, in_core, ttl, until, replaced, saved"),
    "resume": _control(
        "end a suspension now",
        fleet=Arg((bool,), default=False,
                  help="end it on every server of the fleet (a suspension made with "
                       "--fleet)"),
        description=("End the suspension of TARGET, named as it was suspended ('pyqmgr\n"
                     "status' lists them); its mail goes out at once."),
        reply_keys="ok, target, saved"),
    "retry": _control(
        "revive a dead destination (or transport) now",
        description=(
            "Forget that TARGET is dead (after failed_cohort_limit failed cohorts, for\n"
            "minimal_backoff_time), so the next mail for it is tried at once, as\n"
            "'postqueue -f' does for every destination. Mail the dead destination already\n"
            "sent to the deferred queue keeps its retry time; 'postqueue -f' or\n"
            "'postqueue -s SITE' sends it now."),
        reply_keys="ok, target, revived"),
}


class ProtocolError(Exception):
    """A request or reply that breaks the format; ``code`` is one of :data:`ERROR_CODES`."""

    def __init__(self, text: str, code: str = "bad_request") -> None:
        super().__init__(text)
        self.code = code


@dataclass(frozen=True)
class Request:
    """A well-formed request: its command, the command's kind and its arguments."""

    command: str
    kind: str
    args: dict[str, object]

    def as_dict(self) -> dict[str, object]:
        """The request as the handler sees it: ``{"command": ..., **args}``."""
        return {"command": self.command, **self.args}


def validate(obj: object) -> Request:
    """Check a decoded request against :data:`COMMANDS`; raise ProtocolError if bad."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"request is not a JSON object but {_json_type(obj)}")
    command = obj.get("command")
    if command is None:
        raise ProtocolError('request has no "command"')
    if not isinstance(command, str):
        raise ProtocolError(f'"command" must be a string, not {_json_type(command)}')
    spec = COMMANDS.get(command)
    if spec is None:
        known = ", ".join(sorted(COMMANDS))
        raise ProtocolError(f"unknown command {_quoted(command)} (known: {known})")
    args: dict[str, object] = {}
    for name, value in obj.items():
        if name == "command":
            continue
        allowed = spec.args.get(name)
        if allowed is None:
            raise ProtocolError(f"command {command}: unknown argument {_quoted(name)}")
        types = allowed.types
        if isinstance(value, bool) != (bool in types) or not isinstance(value, types):
            want = " or ".join(dict.fromkeys(_TYPE_NAMES[t] for t in types))
            raise ProtocolError(f"command {command}: argument {name} must be {want}, "
                                f"not {_json_type(value)}")
        args[name] = value
    for name, arg in spec.args.items():
        if arg.required and name not in args:
            raise ProtocolError(f"command {command}: missing argument {name}")
    return Request(command, spec.kind, args)


class RequestParser:
    """Fed the bytes a client sends; yields one :class:`Request` or a ProtocolError.

    ``feed`` returns None while the line is incomplete, then the request (or raises
    ProtocolError) once; later calls return None (the connection's one request is
    known). Nothing past :data:`MAX_REQUEST` bytes is ever buffered: a line that
    would be longer is refused as soon as that many bytes have come without a newline.
    """

    def __init__(self, limit: int = MAX_REQUEST) -> None:
        self.limit = limit
        self._buf = bytearray()
        self.done = False

    @property
    def pending(self) -> int:
        """Bytes received of an unfinished request (a client that stops half-way)."""
        return len(self._buf)

    def feed(self, data: bytes) -> Request | None:
        if self.done:
            return None
        end = data.find(b"\n")
        room = self.limit - len(self._buf)
        if end < 0:
            # A full buffer without a newline can only become too long: refuse now.
            if len(data) >= room:
                self.done = True
                raise ProtocolError(f"request longer than {self.limit} bytes", "too_long")
            self._buf += data
            return None
        if end + 1 > room:
            self.done = True
            raise ProtocolError(f"request longer than {self.limit} bytes", "too_long")
        self._buf += data[:end]
        self.done = True
        return parse_line(bytes(self._buf))

    def eof(self) -> None:
        """The client closed its side: raise ProtocolError unless a request was read."""
        if not self.done:
            self.done = True
            if self._buf:
                raise ProtocolError("request not ended by a newline")
            raise ProtocolError("connection closed without a request")


def parse_line(line: bytes) -> Request:
    """A request line without its newline -> Request, or ProtocolError."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("request is not UTF-8") from None
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise ProtocolError(f"request is not JSON: {exc}") from None
    return validate(obj)


def encode_request(command: str, **args: object) -> bytes:
    """One request line; checked like the daemon checks it, so mistakes show here."""
    obj = {"command": command, **args}
    validate(obj)
    line = json.dumps(obj, separators=(",", ":")).encode() + b"\n"
    if len(line) > MAX_REQUEST:
        raise ProtocolError(f"request longer than {MAX_REQUEST} bytes", "too_long")
    return line


def ok_reply(result: dict[str, object]) -> bytes:
    """A success line: ``{"ok": true, ...result}``."""
    return _line({"ok": True, **result})


def error_reply(text: str, code: str) -> bytes:
    """A failure line: ``{"ok": false, "error": text, "code": code}``."""
    return _line({"ok": False, "error": text, "code": code})


def decode_reply(data: bytes) -> dict[str, object]:
    """The client's side: a reply (without or with its newline) -> its object.

    Raises ProtocolError for anything that is not a JSON object with a boolean "ok"
    (a failure must also carry an "error" text).
    """
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"reply is not JSON: {exc}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("ok"), bool):
        raise ProtocolError('reply is not a JSON object with a boolean "ok"')
    if not obj["ok"] and not isinstance(obj.get("error"), str):
        raise ProtocolError('failed reply without an "error" text')
    return obj


def _line(obj: dict[str, object]) -> bytes:
    # ensure_ascii keeps the reply 7-bit whatever names a queue holds.
    return json.dumps(obj, separators=(",", ":")).encode("ascii") + b"\n"


_TYPE_NAMES: dict[type, str] = {str: "a string", int: "a number", float: "a number",
                                bool: "a boolean", list: "an array", dict: "an object"}


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    for t in (bool, str, int, float, list, dict):
        if isinstance(value, t):
            return _TYPE_NAMES[t]
    return type(value).__name__


def _quoted(text: str) -> str:
    """A client's string in an error text: quoted and cut short (it is also logged)."""
    return json.dumps(text[:64] + ("..." if len(text) > 64 else ""))
