"""Requests to the bounce(8) daemon running as bounce, defer and trace.

qmgr never writes notices itself: at the end of a message it asks ``private/bounce`` to
flush the bounce log, ``private/defer`` to return expired mail or send a delay warning,
and ``private/trace`` to send a delivery report. Each is one request per connection;
failure of any kind is status -1, which leaves the message deferred so nothing is lost.
"""

from __future__ import annotations

from pyqmgr.postfix.attr import AttrError, AttrValue, encode, expect, to_int
from pyqmgr.postfix.mail_connect import AttrConnection, PrematureDisconnect, ServiceUnavailable

PROTOCOL = "delivery_status_protocol"

BOUNCE_CMD_APPEND = 0
BOUNCE_CMD_FLUSH = 1
BOUNCE_CMD_WARN = 2
BOUNCE_CMD_VERP = 3
BOUNCE_CMD_ONE = 4
BOUNCE_CMD_TRACE = 5

BOUNCE_FLAG_KEEP = 0
BOUNCE_FLAG_CLEAN = 1
BOUNCE_FLAG_DELRCPT = 2

#: Hard-coded in Postfix's asynchronous bounce client.
ABOUNCE_TIMEOUT = 1000.0


async def _request(path: str, attrs: list[tuple[str, AttrValue]]) -> int:
    try:
        conn = await AttrConnection.open(path, PROTOCOL, ABOUNCE_TIMEOUT)
    except ServiceUnavailable:
        return -1
    try:
        conn.write(encode(attrs))
        (status,) = expect(await conn.read_list(ABOUNCE_TIMEOUT), ("status",), path)
        return to_int(status, "status")
    except (AttrError, PrematureDisconnect, TimeoutError, OSError):
        return -1
    finally:
        conn.close()


async def notify(
    service: str, command: int, flags: int, queue_id: str, encoding: str, sendopts: int,
    sender: str, envelope_id: str, ret_flags: int, verp_delims: str | None = None,
    attribute: str = "smtputf8",
) -> int:
    """A FLUSH, WARN, TRACE or VERP request for the whole message; returns its status.

    ``attribute`` names the option bits as the installed release's bounce and defer
    servers read them (``smtputf8`` up to 3.9, ``sendopts`` from 3.10): a bounce server
    of the other dialect logs "malformed request" and the notice is not sent.
    """
    attrs: list[tuple[str, AttrValue]] = [
        ("nrequest", command),
        ("flags", flags),
        ("queue_name", "active"),
        ("queue_id", queue_id),
        ("encoding", encoding),
        (attribute, sendopts),
        ("sender", sender),
        ("envelope_id", envelope_id),
        ("ret_flags", ret_flags),
    ]
    if verp_delims is not None:
        attrs.append(("verp_delimiters", verp_delims))
    return await _request(f"private/{service}", attrs)


async def append(
    service: str, flags: int, queue_id: str, orig_addr: str, address: str, offset: int,
    dsn_orcpt: str, dsn_notify: int, status: str, action: str, reason: str,
) -> int:
    """Append one recipient record to a bounce/defer/trace log (``defer_append``)."""
    attrs: list[tuple[str, AttrValue]] = [
        ("nrequest", BOUNCE_CMD_APPEND),
        ("flags", flags),
        ("queue_id", queue_id),
        ("original_recipient", orig_addr),
        ("recipient", address),
        ("offset", offset),
        ("dsn_orig_rcpt", dsn_orcpt),
        ("notify_flags", dsn_notify),
        ("status", status),
        ("diag_type", ""),
        ("diag_text", ""),
        ("mta_type", ""),
        ("mta_mname", ""),
        ("action", action),
        ("reason", reason),
    ]
    return await _request(f"private/{service}", attrs)


__all__ = ["append", "notify"]
