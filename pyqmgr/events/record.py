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
from dataclasses import dataclass

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


def decode(line: bytes) -> dict[str, object]:
    """An event line back (tests and consumers); ValueError for anything else."""
    obj = json.loads(line)
    if not isinstance(obj, dict) or "key" not in obj:
        raise ValueError("not an event")
    return obj


__all__ = ["SCHEMA", "STATUS_OF_ACTION", "Context", "decode", "encode", "event_key",
           "make_event", "recipient_part"]
