"""The delivery request qmgr sends to a delivery agent, and the agent's reply.

Wire format per client_protocols.md §3: one common list of exactly 23 attributes in
stock's order, then one list per recipient. The agent scans with ATTR_FLAG_STRICT, so a
missing, extra or reordered attribute makes it reject the whole request. Per-recipient
results never come back: the agent marks recipients done in the queue file and writes
the bounce/defer logs itself; qmgr only learns "all final" or "retry needed", plus an
optional hop-level DSN that says the whole next hop should be avoided.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pyqmgr.postfix.attr import AttrError, AttrList, AttrValue, encode, expect, to_int

PROTOCOL = "delivery_request_protocol"

DEL_REQ_FLAG_SUCCESS = 0x1
DEL_REQ_FLAG_BOUNCE = 0x2
DEL_REQ_FLAG_DEFLT = DEL_REQ_FLAG_SUCCESS | DEL_REQ_FLAG_BOUNCE
DEL_REQ_FLAG_MTA_VRFY = 0x100
DEL_REQ_FLAG_USR_VRFY = 0x200
DEL_REQ_FLAG_RECORD = 0x400
DEL_REQ_FLAG_CONN_LOAD = 0x800
DEL_REQ_FLAG_CONN_STORE = 0x1000
DEL_REQ_FLAG_REC_DLY_SENT = 0x2000
DEL_REQ_TRACE_FLAGS_MASK = (
    DEL_REQ_FLAG_MTA_VRFY | DEL_REQ_FLAG_USR_VRFY | DEL_REQ_FLAG_RECORD
    | DEL_REQ_FLAG_REC_DLY_SENT
)

DEL_STAT_FINAL = 0
DEL_STAT_DEFER = -1

#: struct msg_stats on x86-64 Linux: five struct timeval, an int, padding (88 bytes).
_MSG_STATS = struct.Struct("<10qi4x")

_REPLY_NAMES = ("status", "diag_type", "diag_text", "mta_type", "mta_mname", "action",
                "reason", "status")


def msg_stats(incoming: tuple[int, int], active: tuple[int, int]) -> bytes:
    """The ``time`` blob: arrival and activation times; the agent fills in the rest."""
    return _MSG_STATS.pack(incoming[0], incoming[1], active[0], active[1], 0, 0, 0, 0, 0, 0, 0)


class RequestRecipient(Protocol):
    """Any recipient object with these fields (the scheduler's, the queue file's)."""

    orig_addr: str
    address: str
    offset: int
    dsn_orcpt: str
    dsn_notify: int


@dataclass(eq=False, slots=True, kw_only=True)
class ClientAttributes:
    """Where a message came from, as cleanup recorded it and a delivery agent logs it.

    The queue file's ``A`` records (:class:`pyqmgr.postfix.queue_file.Message` reads
    them) go out unchanged in every delivery request (:class:`RequestMessage`): one
    list of fields for both ends. Keyword-only, so the subclasses keep their own
    positional fields first; no ``__eq__`` here, so each subclass keeps its own.
    """

    client_name: str = ""
    client_address: str = ""
    client_port: str = ""
    protocol_name: str = ""
    helo_name: str = ""
    sasl_method: str = ""
    sasl_username: str = ""
    sasl_sender: str = ""
    log_ident: str = ""
    rewrite_context: str = "local"


@dataclass(slots=True)
class RequestMessage(ClientAttributes):
    """Message-level fields of a request; the daemon builds one per active message."""

    queue_id: str
    data_offset: int
    cont_length: int
    encoding: str
    #: The queue file's option bits as qmgr passes them on (``smtputf8`` up to
    #: Postfix 3.9, ``sendopts`` from 3.10: :mod:`pyqmgr.postfix.version`).
    sendopts: int
    sender: str
    envelope_id: str
    ret_flags: int
    stats: bytes


# The request as two preformatted lists: about 70 attributes go out per delivery, so
# this is one of the daemon's hot paths. Byte for byte what the general encoder makes
# of the same lists (tests/unit/test_deliver_request.py holds it to that).
_HEAD_TEMPLATE = (b"flags\0%d\0queue_name\0active\0queue_id\0%b\0offset\0%d\0size\0%d\0"
         b"nexthop\0%b\0encoding\0%b\0@OPTIONS@\0%d\0sender\0%b\0envelope_id\0%b\0"
         b"ret_flags\0%d\0time\0%b\0log_client_name\0%b\0log_client_address\0%b\0"
         b"log_client_port\0%b\0log_protocol_name\0%b\0log_helo_name\0%b\0"
         b"sasl_method\0%b\0sasl_username\0%b\0sasl_sender\0%b\0log_ident\0%b\0"
         b"rewrite_context\0%b\0recipient_count\0%d\0\0")
#: One head per name of the option bits' attribute.
_HEADS = {name: _HEAD_TEMPLATE.replace(b"@OPTIONS@", name.encode())
          for name in ("smtputf8", "sendopts")}
_HEAD_NULS = 2 * 23 + 1
_RCPT = (b"original_recipient\0%b\0recipient\0%b\0offset\0%d\0dsn_orig_rcpt\0%b\0"
         b"notify_flags\0%d\0\0")
_RCPT_NULS = 2 * 5 + 1


def encode_request(
    flags: int, msg: RequestMessage, nexthop: str, sendopts: int, sender: str,
    recipients: Sequence[RequestRecipient], attribute: str = "smtputf8",
) -> bytes:
    """The request's bytes: the common list, then one list per recipient.

    A value the general encoder would refuse (a NUL inside) or print differently (a
    negative number, as unsigned) sends the request through that encoder instead, so
    the bytes and the errors are the same either way.
    """
    enc = "surrogateescape"
    head = _HEADS[attribute] % (
        flags, msg.queue_id.encode("utf-8", enc), msg.data_offset, msg.cont_length,
        nexthop.encode("utf-8", enc), msg.encoding.encode("utf-8", enc), sendopts,
        sender.encode("utf-8", enc), msg.envelope_id.encode("utf-8", enc), msg.ret_flags,
        base64.b64encode(msg.stats), msg.client_name.encode("utf-8", enc),
        msg.client_address.encode("utf-8", enc), msg.client_port.encode("utf-8", enc),
        msg.protocol_name.encode("utf-8", enc), msg.helo_name.encode("utf-8", enc),
        msg.sasl_method.encode("utf-8", enc), msg.sasl_username.encode("utf-8", enc),
        msg.sasl_sender.encode("utf-8", enc), msg.log_ident.encode("utf-8", enc),
        msg.rewrite_context.encode("utf-8", enc), len(recipients),
    )
    if (head.count(b"\0") != _HEAD_NULS
            or min(flags, msg.data_offset, msg.cont_length, sendopts, msg.ret_flags) < 0):
        return _encode_request_lists(flags, msg, nexthop, sendopts, sender, recipients,
                                         attribute)
    parts = [head]
    for r in recipients:
        offset = r.offset
        notify = r.dsn_notify
        part = _RCPT % (r.orig_addr.encode("utf-8", enc), r.address.encode("utf-8", enc),
                        offset, r.dsn_orcpt.encode("utf-8", enc), notify)
        if offset < 0 or notify < 0 or part.count(b"\0") != _RCPT_NULS:
            return _encode_request_lists(flags, msg, nexthop, sendopts, sender, recipients,
                                         attribute)
        parts.append(part)
    return b"".join(parts)


def _encode_request_lists(
    flags: int, msg: RequestMessage, nexthop: str, sendopts: int, sender: str,
    recipients: Sequence[RequestRecipient], attribute: str,
) -> bytes:
    """The same request through the general encoder (odd values, and their errors)."""
    common: list[tuple[str, AttrValue]] = [
        ("flags", flags),
        ("queue_name", "active"),
        ("queue_id", msg.queue_id),
        ("offset", msg.data_offset),
        ("size", msg.cont_length),
        ("nexthop", nexthop),
        ("encoding", msg.encoding),
        (attribute, sendopts),
        ("sender", sender),
        ("envelope_id", msg.envelope_id),
        ("ret_flags", msg.ret_flags),
        ("time", msg.stats),
        ("log_client_name", msg.client_name),
        ("log_client_address", msg.client_address),
        ("log_client_port", msg.client_port),
        ("log_protocol_name", msg.protocol_name),
        ("log_helo_name", msg.helo_name),
        ("sasl_method", msg.sasl_method),
        ("sasl_username", msg.sasl_username),
        ("sasl_sender", msg.sasl_sender),
        ("log_ident", msg.log_ident),
        ("rewrite_context", msg.rewrite_context),
        ("recipient_count", len(recipients)),
    ]
    parts = [encode(common)]
    for rcpt in recipients:
        parts.append(encode((
            ("original_recipient", rcpt.orig_addr),
            ("recipient", rcpt.address),
            ("offset", rcpt.offset),
            ("dsn_orig_rcpt", rcpt.dsn_orcpt),
            ("notify_flags", rcpt.dsn_notify),
        )))
    return b"".join(parts)


@dataclass(frozen=True, slots=True)
class HopStatus:
    """The hop-level DSN of a reply; ``status`` empty means "nothing wrong with the hop"."""

    status: str
    diag_type: str
    diag_text: str
    mta_type: str
    mta_mname: str
    action: str
    reason: str


@dataclass(frozen=True, slots=True)
class DeliveryReply:
    hop: HopStatus
    status: int


def decode_reply(attrs: AttrList) -> DeliveryReply:
    """Parse a final reply; AttrError means "malformed response" (a crash, to qmgr)."""
    values = expect(attrs, _REPLY_NAMES, "delivery status")
    return DeliveryReply(HopStatus(*values[:7]), to_int(values[7], "status"))


__all__ = [
    "AttrError", "DeliveryReply", "HopStatus", "PROTOCOL", "RequestMessage",
    "RequestRecipient", "decode_reply", "encode_request", "msg_stats",
]
