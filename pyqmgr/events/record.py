"""One delivery event: a recipient's outcome of one delivery attempt, as a JSON line.

An event is made from one record of the message's trace log (:mod:`pyqmgr.postfix.
trace_log`) and what the queue manager knows of the message and the delivery (its
sender and arrival, the request's transport and next hop, the site, class and tenant
it was scheduled in). Its fields are documented in docs/events.md; :data:`SCHEMA` is
raised when one changes meaning or goes, not when one is added.

Why the key looks the way it does: an event may be written twice (a qmgr killed
after the agent recorded an outcome and before the event was flushed reads the same
trace log again), and a consumer must be able to keep each once. The key is made only
of what a second reading finds again: the queue id, the message's arrival time (a
short queue id is reused once its inode is), the recipient's offset in the queue file
(its address when the record has none) and the record's ordinal among that
recipient's records in the trace log. Nothing of the reading (clock, process) is in it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from json.encoder import encode_basestring

from pyqmgr.postfix.bounce_log import LogEntry
from pyqmgr.postfix.trace_log import relay_and_reply

#: The events' schema version (the ``v`` field).
SCHEMA = 1

#: What ``action`` says becomes the event's ``status`` (the maillog's status= word).
STATUS_OF_ACTION = {"delivered": "sent", "relayed": "sent", "expanded": "sent",
                    "delayed": "deferred", "failed": "bounced"}


@dataclass(frozen=True, slots=True)
class Context:
    """What the queue manager adds to a trace record: the message and the delivery."""

    queue_id: str
    sender: str
    #: The message's arrival (seconds since the epoch, with microseconds).
    arrival: float
    transport: str = ""
    nexthop: str = ""
    site: str = ""
    message_class: str = ""
    tenant: str = ""


def recipient_part(entry: LogEntry) -> str:
    """The recipient's part of a key: its offset in the queue file, else a digest of
    its address (an entry without an offset: a corrupt record, or a very old log)."""
    if entry.offset > 0:
        return str(entry.offset)
    # Imported here: hashlib loads libcrypto, which the default daemon keeps out
    # (tests/unit/test_daemon_imports.py), and this is the rare road.
    import hashlib

    return "a" + hashlib.sha1(entry.recipient.encode("utf-8", "replace")).hexdigest()[:12]


def event_key(ctx: Context, entry: LogEntry, ordinal: int) -> str:
    """``QUEUEID.ARRIVAL_US.RCPT.ORDINAL``: the same record read again gives the same."""
    return f"{ctx.queue_id}.{round(ctx.arrival * 1e6):x}.{recipient_part(entry)}.{ordinal}"


def make_event(ctx: Context, entry: LogEntry, ordinal: int, ended: float,
               category: str = "") -> dict[str, object]:
    """The event of one trace record (``ordinal`` counts the recipient's records
    from 1: it is the attempt number while the message's trace log lives)."""
    relay, reply = relay_and_reply(entry.reason)
    action = entry.action
    return {
        "v": SCHEMA,
        "key": event_key(ctx, entry, ordinal),
        "queue_id": ctx.queue_id,
        "recipient": entry.recipient,
        "original_recipient": entry.original_recipient or entry.recipient,
        "sender": ctx.sender,
        "transport": ctx.transport,
        "source": ctx.transport,
        "nexthop": ctx.nexthop,
        "relay": relay,
        "remote_mta": entry.mta_mname,
        "site": ctx.site,
        "class": ctx.message_class,
        "tenant": ctx.tenant,
        "status": STATUS_OF_ACTION.get(action, action),
        "dsn": entry.status,
        "action": action,
        "reply": reply,
        "diagnostic": entry.diag_text,
        "category": category,
        "attempt": ordinal,
        "arrival": round(ctx.arrival, 6),
        "time": round(ended, 6),
    }


def encode(event: dict[str, object]) -> bytes:
    """One line of JSON, UTF-8, no spaces: what the file and the stream hold."""
    return json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode(
        "utf-8", "replace") + b"\n"


def _number(x: float) -> str:
    """A float as :func:`json.dumps` writes it."""
    return float.__repr__(x) if math.isfinite(x) else json.dumps(x)


class EventLine:
    """:func:`encode` of :func:`make_event`, byte for byte, for the records of one
    message's delivery: what the context gives (its queue id, sender, transport, next
    hop, site, class, tenant, arrival) is encoded once, so that each record costs the
    encoding of its own fields only. Why: this runs for every recipient of every
    delivery, and ``json.dumps`` of the 23 fields was a fifth of the events' cost on
    the queue manager (tests/unit/test_delivery_events.py compares the two)."""

    __slots__ = ("_key", "_head", "_middle", "_scope", "_tail")

    def __init__(self, ctx: Context) -> None:
        enc = encode_basestring
        transport = enc(ctx.transport)
        self._key = f"{ctx.queue_id}.{round(ctx.arrival * 1e6):x}."
        self._head = f',"queue_id":{enc(ctx.queue_id)},"recipient":'
        self._middle = (f',"sender":{enc(ctx.sender)},"transport":{transport},'
                        f'"source":{transport},"nexthop":{enc(ctx.nexthop)},"relay":')
        self._scope = (f',"site":{enc(ctx.site)},"class":{enc(ctx.message_class)},'
                       f'"tenant":{enc(ctx.tenant)},"status":')
        self._tail = f',"arrival":{_number(round(ctx.arrival, 6))},"time":'

    def line(self, entry: LogEntry, ordinal: int, ended: float, category: str = "") -> bytes:
        """The event line of one trace record (as ``encode(make_event(...))``)."""
        enc = encode_basestring
        relay, reply = relay_and_reply(entry.reason)
        action = entry.action
        key = f"{self._key}{recipient_part(entry)}.{ordinal}"
        return "".join((
            f'{{"v":{SCHEMA},"key":', enc(key), self._head, enc(entry.recipient),
            ',"original_recipient":', enc(entry.original_recipient or entry.recipient),
            self._middle, enc(relay), ',"remote_mta":', enc(entry.mta_mname), self._scope,
            enc(STATUS_OF_ACTION.get(action, action)), ',"dsn":', enc(entry.status),
            ',"action":', enc(action), ',"reply":', enc(reply), ',"diagnostic":',
            enc(entry.diag_text), ',"category":', enc(category), ',"attempt":',
            int.__repr__(ordinal), self._tail, _number(round(ended, 6)), "}\n",
        )).encode("utf-8", "replace")


def decode(line: bytes) -> dict[str, object]:
    """An event line back (tests and consumers); ValueError for anything else."""
    obj = json.loads(line)
    if not isinstance(obj, dict) or "key" not in obj:
        raise ValueError("not an event")
    return obj


__all__ = ["SCHEMA", "STATUS_OF_ACTION", "Context", "EventLine", "decode", "encode",
           "event_key", "make_event", "recipient_part"]
