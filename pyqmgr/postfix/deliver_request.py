"""The delivery request qmgr sends to a delivery agent, and the agent's reply.

Wire format per client_protocols.md §3: one common list of exactly 23 attributes in
stock's order, then one list per recipient. The agent scans with ATTR_FLAG_STRICT, so a
missing, extra or reordered attribute makes it reject the whole request. Per-recipient
results never come back: the agent marks recipients done in the queue file and writes
the bounce/defer logs itself; qmgr only learns "all final" or "retry needed", plus an
optional hop-level DSN that says the whole next hop should be avoided.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
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


@dataclass(slots=True)
class RequestMessage:
    """Message-level fields of a request; the daemon builds one per active message."""

    queue_id: str
    data_offset: int
    cont_length: int
    encoding: str
    smtputf8: int
    sender: str
    envelope_id: str
    ret_flags: int
    stats: bytes
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
    #: The message's fixed attributes, encoded on the first request and reused.
    wire: tuple[bytes, bytes, bytes] | None = field(default=None, repr=False, compare=False)


# Attributes that change per request go through these formats; the message's fixed
# ones are encoded once (``_message_wire``). A request is about 70 attributes, and
# qmgr sends one per delivery, so this is one of the daemon's hot paths.
_HEAD = (b"flags\0%d\0%bnexthop\0%b\0%bsmtputf8\0%d\0sender\0%b\0%b"
         b"recipient_count\0%d\0\0")
_HEAD_NULS = 2 * 23 + 1
_RCPT = (b"original_recipient\0%b\0recipient\0%b\0offset\0%d\0dsn_orig_rcpt\0%b\0"
         b"notify_flags\0%d\0\0")
_RCPT_NULS = 2 * 5 + 1


def _message_wire(msg: RequestMessage) -> tuple[bytes, bytes, bytes]:
    """The three runs of fixed attributes between the per-request ones, encoded."""
    first = encode((
        ("queue_name", "active"),
        ("queue_id", msg.queue_id),
        ("offset", msg.data_offset),
        ("size", msg.cont_length),
    ))[:-1]
    encoding = encode((("encoding", msg.encoding),))[:-1]
    rest = encode((
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
    ))[:-1]
    msg.wire = (first, encoding, rest)
    return msg.wire


def encode_request(
    flags: int, msg: RequestMessage, nexthop: str, smtputf8: int, sender: str,
    recipients: Sequence[RequestRecipient],
) -> bytes:
    """The request's bytes: the common list, then one list per recipient.

    Byte for byte what :func:`pyqmgr.postfix.attr.encode` makes of the same lists; a
    value it would refuse (a NUL inside, a negative number) takes that path, so the
    error is the same too.
    """
    first, encoding, rest = msg.wire or _message_wire(msg)
    head = _HEAD % (flags, first, nexthop.encode("utf-8", "surrogateescape"), encoding,
                    smtputf8, sender.encode("utf-8", "surrogateescape"), rest,
                    len(recipients))
    if flags < 0 or smtputf8 < 0 or head.count(b"\0") != _HEAD_NULS:
        return _encode_request_lists(flags, msg, nexthop, smtputf8, sender, recipients)
    parts = [head]
    for r in recipients:
        offset = r.offset
        notify = r.dsn_notify
        part = _RCPT % (r.orig_addr.encode("utf-8", "surrogateescape"),
                        r.address.encode("utf-8", "surrogateescape"), offset,
                        r.dsn_orcpt.encode("utf-8", "surrogateescape"), notify)
        if offset < 0 or notify < 0 or part.count(b"\0") != _RCPT_NULS:
            return _encode_request_lists(flags, msg, nexthop, smtputf8, sender, recipients)
        parts.append(part)
    return b"".join(parts)


def _encode_request_lists(
    flags: int, msg: RequestMessage, nexthop: str, smtputf8: int, sender: str,
    recipients: Sequence[RequestRecipient],
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
        ("smtputf8", smtputf8),
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
