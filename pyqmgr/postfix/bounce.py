"""Requests to the bounce(8) daemon running as bounce, defer and trace.

qmgr never writes notices itself: at the end of a message it asks ``private/bounce`` to
flush the bounce log, ``private/defer`` to return expired mail or send a delay warning,
and ``private/trace`` to send a delivery report. Each is one request per connection;
failure of any kind is status -1, which leaves the message deferred so nothing is lost.

The records qmgr writes itself (a recipient deferred when even the retry transport is
dead, the double-bounce discard) go through :func:`append`; with a trace flag the
client, not the bounce daemon, also appends the record to ``private/trace``
(``trace_append()`` in Postfix's ``global/trace.c``, called by ``sent()``,
``defer_append()`` and ``bounce_append()``: the bounce daemon's append service ignores
the flags): :func:`trace_append` and :func:`trace_append_now` are that call.
"""

from __future__ import annotations

import socket

from pyqmgr.postfix.attr import (
    AttrError,
    AttrParser,
    AttrValue,
    check_announcement,
    encode,
    expect,
    to_int,
)
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
    return await _request(f"private/{service}", _append_attrs(
        flags, queue_id, orig_addr, address, offset, dsn_orcpt, dsn_notify, status, action,
        reason))


#: The relay of a record qmgr writes itself (``NO_RELAY_AGENT``): its trace record's
#: reason gets no "delivery via" prefix.
NO_RELAY = "none"


def trace_reason(relay: str, reason: str) -> str:
    """The reason as ``trace_append()`` records it: ``delivery via RELAY: `` first,
    unless the relay is ``none``."""
    return reason if relay == NO_RELAY else f"delivery via {relay}: {reason}"


async def trace_append(
    flags: int, queue_id: str, orig_addr: str, address: str, offset: int, dsn_orcpt: str,
    dsn_notify: int, relay: str, status: str, action: str, reason: str,
) -> int:
    """``trace_append()``: the record to ``private/trace``; 0, or -1 on any failure."""
    return await append("trace", flags, queue_id, orig_addr, address, offset, dsn_orcpt,
                        dsn_notify, status, action, trace_reason(relay, reason))


def append_now(
    service: str, flags: int, queue_id: str, orig_addr: str, address: str, offset: int,
    dsn_orcpt: str, dsn_notify: int, status: str, action: str, reason: str,
    timeout: float = 60.0,
) -> int:
    """:func:`append` in a blocking call, for code that cannot wait: stock's qmgr
    makes its appends synchronously (``sent()`` of the double-bounce discard, while it
    resolves a message's recipients, and the ``defer_append()`` when that fails). A
    rare call: the discard's, and only with a trace flag. For the trace service, the
    reason is :func:`trace_reason`'s. Bounded by ``timeout`` seconds (stock waits for
    ever); 0, or -1 on any failure."""
    attrs = _append_attrs(flags, queue_id, orig_addr, address, offset, dsn_orcpt,
                          dsn_notify, status, action, reason)
    parser = AttrParser()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(f"private/{service}")

            def read_list() -> list[tuple[str, str]]:
                while (got := parser.pop()) is None:
                    data = sock.recv(4096)
                    if not data:
                        raise EOFError("premature end-of-input")
                    parser.feed(data)
                return got

            check_announcement(read_list(), PROTOCOL)
            sock.sendall(encode(attrs))
            (status_text,) = expect(read_list(), ("status",), f"private/{service}")
            return to_int(status_text, "status")
    except (AttrError, EOFError, OSError):
        return -1


def _append_attrs(
    flags: int, queue_id: str, orig_addr: str, address: str, offset: int, dsn_orcpt: str,
    dsn_notify: int, status: str, action: str, reason: str,
) -> list[tuple[str, AttrValue]]:
    """A BOUNCE_CMD_APPEND request (``rcpt_print`` and ``dsn_print``'s attributes)."""
    return [
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


__all__ = ["NO_RELAY", "append", "append_now", "notify", "trace_append", "trace_reason"]
