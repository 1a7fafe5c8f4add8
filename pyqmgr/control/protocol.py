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

* reading the scheduler's state: ``status`` (no arguments) and ``explain``
  (``target``: a destination or a queue id);
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
class CommandSpec:
    """A command's kind and its arguments: name -> (accepted types, required)."""

    kind: str
    args: dict[str, tuple[tuple[type, ...], bool]] = field(default_factory=dict)


#: Every command the daemon knows. JSON numbers arrive as int or float; bool is a
#: subclass of int in Python, so it is excluded explicitly where numbers are wanted.
COMMANDS: dict[str, CommandSpec] = {
    "status": CommandSpec(READ),
    "explain": CommandSpec(READ, {"target": ((str,), True)}),
    "jobs": CommandSpec(READ, {"transport": ((str,), True),
                               "limit": ((int, float), False)}),
    "suspend": CommandSpec(CONTROL, {"target": ((str,), True), "reason": ((str,), False),
                                     "ttl": ((int, float), True)}),
    "resume": CommandSpec(CONTROL, {"target": ((str,), True)}),
    "retry": CommandSpec(CONTROL, {"target": ((str,), True)}),
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
        types, _required = allowed
        if isinstance(value, bool) or not isinstance(value, types):
            want = " or ".join(dict.fromkeys(_TYPE_NAMES[t] for t in types))
            raise ProtocolError(f"command {command}: argument {name} must be {want}, "
                                f"not {_json_type(value)}")
        args[name] = value
    for name, (_types, required) in spec.args.items():
        if required and name not in args:
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
