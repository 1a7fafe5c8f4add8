"""What qmgr reads from a queue file, and the few bytes it writes back.

The read loop follows stock's ``qmgr_message_read`` (queue_files_lifecycle.md §3.2):
records are read in logical order (following ``p`` pointers into the heap after ``E``),
the content is skipped with one seek, recipients are read in batches with a resume
offset, and every malformation produces stock's warning text. The caller logs the
warnings and, when ``ok`` is false, moves the file to ``corrupt/``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pyqmgr.postfix.record import RecordError, encode_record, read_record

# The scheduler core's recipient is exactly what a queue file's R record carries; the
# reader builds it directly so the daemon never copies recipients between layers.
from pyqmgr.scheduler.message import Recipient

READ_FLAG_MIXED_RCPT_OTHER = 1 << 0
READ_FLAG_USER = 0x1F
READ_FLAG_SEEN_ALL_NON_RCPT = 1 << 16

DEL_REQ_FLAG_RECORD = 0x400
DEL_REQ_TRACE_FLAGS_MASK = 0x100 | 0x200 | 0x400 | 0x2000
DSN_NOTIFY_MASK = 0xF
DSN_RET_MASK = 0x3

_ENVELOPE_TYPES = frozenset(b"MCTcFILSDRO/WVA>K<ion" + b"EDRO/PreAFIL>Kon")
_EXTRA_TYPE = frozenset(b"X")
_ATTR_MAP = {
    "dsn_orig_rcpt": ord("o"),
    "notify_flags": ord("n"),
    "envelope_id": ord("i"),
    "ret_flags": ord("<"),
    "create_time": ord("c"),
}
_LOG_ATTRS = {
    "log_client_name": "client_name",
    "log_client_address": "client_address",
    "log_client_port": "client_port",
    "log_protocol_name": "protocol_name",
    "log_helo_name": "helo_name",
}
_LEGACY_ATTRS = {
    "client_name": "client_name",
    "client_address": "client_address",
    "client_port": "client_port",
    "protocol_name": "protocol_name",
    "helo_name": "helo_name",
}
_SINGLE_ATTRS = ("sasl_method", "sasl_username", "sasl_sender", "log_ident", "rewrite_context")
_MAX_REVERSE_JUMPS = 10000




@dataclass
class Message:
    """Envelope state of one queue file; persists across recipient batches."""

    queue_id: str
    data_offset: int = 0
    data_size: int = 0
    cont_length: int = 0
    rcpt_count: int = 0
    rcpt_unread: int = 0
    rflags: int = READ_FLAG_MIXED_RCPT_OTHER
    smtputf8: int = 0
    arrival_time: tuple[int, int] = (0, 0)
    create_time: int = 0
    sender: str | None = None
    warn_time: int = 0
    warn_offset: int = 0
    verp_delims: str = ""
    filter: str | None = None
    redirect: str | None = None
    inspector: str | None = None
    envelope_id: str = ""
    ret_flags: int = 0
    encoding: str = ""
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
    trace_flags: int = 0
    trace_offset: int = 0
    rcpt_offset: int = 0
    seen_log_attrs: bool = False
    seen_single: set[str] = field(default_factory=set)


@dataclass
class Batch:
    recipients: list[Recipient]
    warnings: list[str]
    ok: bool
    #: The sender record was read in this call: time for the "(queue active)" line.
    sender_seen_now: bool = False


def _text(payload: bytes) -> str:
    return payload.decode("utf-8", "surrogateescape")


def _parse_long(text: str) -> int | None:
    """``atol``-style: optional spaces and sign, digits; None when no digits at all."""
    s = text.lstrip()
    sign = 1
    if s[:1] in "+-" and s:
        sign = -1 if s[0] == "-" else 1
        s = s[1:]
    digits = ""
    for ch in s:
        if not ch.isdigit():
            break
        digits += ch
    return sign * int(digits) if digits else None


def read_batch(data: bytes, msg: Message, limit: int) -> Batch:
    """Read the next recipient batch of ``data`` (the whole file) into ``msg``.

    The first call reads the envelope and up to ``limit`` recipients; later calls
    resume at ``msg.rcpt_offset``. Never raises on bad input: ``ok`` is False and the
    warnings say why.
    """
    qid = msg.queue_id
    path = f"active/{qid}"
    warnings: list[str] = []
    recipients: list[Recipient] = []
    save_offset = msg.rcpt_offset
    save_unread = msg.rcpt_unread
    sender_seen_now = False
    pos = 0
    if msg.rcpt_offset:
        pos = msg.rcpt_offset
        msg.rcpt_offset = 0
    orig: str | None = None
    orcpt: str | None = None
    notify = 0
    failed = False
    reverse_jumps = 0

    while True:
        cur = pos
        allowed = _ENVELOPE_TYPES
        if cur == msg.data_offset and cur > 0:
            pos += msg.data_size
            cur = pos
            allowed = _EXTRA_TYPE
        try:
            rtype, payload, pos = read_record(data, pos, path)
        except EOFError:
            warnings.append(f"{qid}: message rejected: missing end record")
            failed = True
            break
        except RecordError as exc:
            warnings.append(str(exc))
            warnings.append(f"{qid}: message rejected: missing end record")
            failed = True
            break
        if rtype == 0x70:  # 'p'
            target = _parse_long(_text(payload))
            if target is None or target < 0:
                warnings.append(f"{path}: malformed pointer record value: {_text(payload)}")
                failed = True
                break
            if target:
                if target < pos:
                    reverse_jumps += 1
                    if reverse_jumps > _MAX_REVERSE_JUMPS:
                        warnings.append(f"{path}: too many reverse jump records")
                        failed = True
                        break
                pos = target
            continue
        if rtype not in allowed:
            warnings.append(f"Unexpected record type '{chr(rtype)}' at offset {cur}")
            failed = True
            break
        if rtype == 0x45:  # 'E'
            msg.rflags |= READ_FLAG_SEEN_ALL_NON_RCPT
            break
        text = _text(payload)
        if rtype == 0x41:  # 'A'
            name, sep, value = text.partition("=")
            if not sep or not name.strip():
                warnings.append(f"{qid}: bad attribute record: missing '=' after attribute "
                                f"name: {text[:200]}")
                failed = True
                break
            name = name.strip()
            mapped = _ATTR_MAP.get(name)
            if mapped is not None:
                rtype = mapped
                text = value.strip()
        if rtype == 0x52:  # 'R'
            if msg.rcpt_offset == 0:
                msg.rcpt_unread -= 1
                recipients.append(Recipient(cur, text, orig or "", orcpt or "", notify))
                orig = orcpt = None
                notify = 0
                if len(recipients) >= limit:
                    msg.rcpt_offset = pos
                    if msg.rflags & READ_FLAG_SEEN_ALL_NON_RCPT:
                        break
                    if msg.rflags & READ_FLAG_MIXED_RCPT_OTHER:
                        continue
                    if cur > msg.data_offset:
                        msg.rflags |= READ_FLAG_SEEN_ALL_NON_RCPT
                        break
                    pos = msg.data_offset
            continue
        if rtype in (0x44, 0x2F):  # 'D', '/'
            if msg.rcpt_offset == 0:
                msg.rcpt_unread -= 1
                orig = orcpt = None
                notify = 0
            continue
        if rtype == 0x6F:  # 'o'
            if orcpt is not None:
                warnings.append(f"{qid}: ignoring out-of-order DSN original recipient "
                                f"address <{orcpt[:200]}>")
                orcpt = None
            if msg.rcpt_offset == 0:
                orcpt = text
            continue
        if rtype == 0x6E:  # 'n'
            if notify:
                warnings.append(f"{qid}: ignoring out-of-order DSN notify flags <{notify}>")
                notify = 0
            if msg.rcpt_offset == 0:
                n = int(text) if text.isdigit() else 0
                if n == 0 or n & ~DSN_NOTIFY_MASK:
                    warnings.append(f"{qid}: ignoring malformed DSN notify flags <{text[:200]}>")
                else:
                    notify = n
                continue
        if rtype == 0x4F:  # 'O'
            if orig is not None:
                warnings.append(f"{qid}: ignoring out-of-order original recipient "
                                f"<{orig[:200]}>")
                orig = None
            if msg.rcpt_offset == 0:
                orig = text
            continue
        if msg.rflags & READ_FLAG_SEEN_ALL_NON_RCPT:
            continue
        if rtype == 0x53:  # 'S': first one wins; its arrival starts "(queue active)"
            if msg.sender is None:
                msg.sender = text
                sender_seen_now = True
            continue
        if _envelope_record(msg, rtype, text, cur, warnings):
            failed = True
            break

    if orcpt is not None and not failed:
        warnings.append(f"{qid}: ignoring out-of-order DSN original recipient <{orcpt[:200]}>")
    if orig is not None and not failed:
        warnings.append(f"{qid}: ignoring out-of-order original recipient <{orig[:200]}>")
    if msg.create_time == 0:
        msg.create_time = msg.arrival_time[0]
    if msg.rcpt_unread < 0 or (msg.rcpt_offset == 0 and msg.rcpt_unread != 0):
        warnings.append(f"{qid}: rcpt count mismatch ({msg.rcpt_unread})")
        msg.rcpt_unread = 0
    if not failed:
        if msg.arrival_time[0] == 0:
            warnings.append(f"{qid}: message rejected: missing arrival time record")
            failed = True
        elif msg.sender is None:
            warnings.append(f"{qid}: message rejected: missing sender record")
            failed = True
        elif msg.data_offset == 0:
            warnings.append(f"{qid}: message rejected: missing size record")
            failed = True
    if failed:
        msg.rcpt_offset = save_offset
        msg.rcpt_unread = save_unread
        recipients = []
    return Batch(recipients, warnings, not failed, sender_seen_now)


def _envelope_record(msg: Message, rtype: int, text: str, offset: int,
                     warnings: list[str]) -> bool:
    """Handle a non-recipient record; True means "reject the file"."""
    qid = msg.queue_id
    if rtype == 0x41:  # 'A' not mapped to a pseudo type: the most common record
        name, _, value = text.partition("=")
        name = name.strip()
        if name == "encoding":
            msg.encoding = value
        elif name in _LOG_ATTRS:
            if not msg.seen_log_attrs:
                msg.seen_log_attrs = True
                for legacy in _LEGACY_ATTRS.values():
                    setattr(msg, legacy, "")
            setattr(msg, _LOG_ATTRS[name], value)
        elif name in _LEGACY_ATTRS:
            if not msg.seen_log_attrs:
                setattr(msg, _LEGACY_ATTRS[name], value)
        elif name in _SINGLE_ATTRS:
            if name in msg.seen_single:
                warnings.append(f"{qid}: ignoring multiple {name} attribute: {value}")
            else:
                msg.seen_single.add(name)
                setattr(msg, name, value)
        elif name == "trace_flags":
            if "trace_flags" not in msg.seen_single:
                msg.seen_single.add("trace_flags")
                n = _parse_long(value) or 0
                msg.trace_flags = n & DEL_REQ_TRACE_FLAGS_MASK
                if msg.trace_flags == DEL_REQ_FLAG_RECORD:
                    msg.trace_offset = offset
        return False
    if rtype == 0x43:  # 'C'
        if msg.data_offset == 0:
            fields = text.split()
            nums: list[int] = []
            for f in fields[:6]:
                v = _parse_long(f)
                if v is None:
                    break
                nums.append(v)
            if len(nums) >= 3:
                nums += [0] * (6 - len(nums))
                data_size, data_offset, rcpt, rflags, cont, utf8 = nums
                # Stored before the checks, as stock's sscanf does: a rejected size
                # record still shapes the "rcpt count mismatch" warning that follows.
                msg.data_size, msg.data_offset = data_size, data_offset
                msg.rcpt_count = msg.rcpt_unread = rcpt
                msg.rflags = rflags | (msg.rflags & READ_FLAG_SEEN_ALL_NON_RCPT)
                msg.cont_length, msg.smtputf8 = cont, utf8
                if data_offset <= 0 or data_size <= 0:
                    warnings.append(f"{qid}: invalid size record: {text[:100]}")
                    return True
                if rflags & ~READ_FLAG_USER:
                    warnings.append(f"{qid}: invalid flags in size record: {text[:100]}")
                    return True
            else:
                # One field is a pre-1.0 file, which stock rescans; such files no longer
                # exist in practice, so they are refused like a weird size record.
                warnings.append(f"{qid}: message rejected: weird size record")
                return True
        if msg.cont_length == 0:
            msg.cont_length = msg.data_size
        elif msg.cont_length < 0:
            warnings.append(f"{qid}: invalid size record: {text[:100]}")
            return True
    elif rtype == 0x54:  # 'T'
        if msg.arrival_time[0] == 0:
            parts = text.split()
            sec = _parse_long(parts[0]) if parts else None
            usec = _parse_long(parts[1]) if len(parts) > 1 else 0
            msg.arrival_time = (sec or 0, usec or 0)
    elif rtype == 0x63:  # 'c'
        if msg.create_time == 0:
            msg.create_time = _parse_long(text) or 0
    elif rtype == 0x4C:  # 'L' content filter
        msg.filter = text
    elif rtype == 0x49:  # 'I'
        msg.inspector = text
    elif rtype == 0x3E:  # '>'
        msg.redirect = text
    elif rtype == 0x69:  # 'i'
        msg.envelope_id = text
    elif rtype == 0x3C:  # '<'
        n = _parse_long(text)
        if n is None or n == 0 or n & ~DSN_RET_MASK:
            warnings.append(f"{qid}: ignoring malformed DSN RET flags in queue file record:"
                            f"{text[:100]}")
        else:
            msg.ret_flags = n
    elif rtype == 0x57:  # 'W'
        msg.warn_offset = offset
        msg.warn_time = _parse_long(text) or 0
    elif rtype == 0x56:  # 'V'
        if not msg.sender:
            warnings.append(f"{qid}: ignoring VERP request for null sender")
        elif len(text) != 2:
            warnings.append(f"{qid}: ignoring bad VERP request: \"{text[:100]}\"")
        else:
            msg.verp_delims = text
    return False


# -- in-place updates ----------------------------------------------------------------------


def mark_done(fd: int, offset: int) -> None:
    """Overwrite a recipient's type byte with ``D``, as delivery agents do."""
    os.pwrite(fd, b"D", offset)


def kill_record(fd: int, offset: int) -> None:
    """Overwrite a record's type byte with ``K`` (after a successful trace flush)."""
    os.pwrite(fd, b"K", offset)


def update_warn(fd: int, offset: int, value: int) -> None:
    """Rewrite the ``W`` record in place; ``-1`` means the delay warning was sent."""
    os.pwrite(fd, encode_record("W", b"%15d" % value), offset)
