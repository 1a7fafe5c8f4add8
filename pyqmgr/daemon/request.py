"""The delivery request for a selected entry (stock's qmgr_deliver_send_request).

What goes to the agent: the message's envelope as the active queue read it, the
entry's nexthop and recipients, VERP's per-recipient sender, and the SMTPUTF8 and
REQUIRETLS option bits in the dialect of the installed Postfix release.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyqmgr.daemon.active import request_flags
from pyqmgr.postfix.deliver_request import encode_request
from pyqmgr.postfix.verp import verp_sender

if TYPE_CHECKING:
    from pyqmgr.daemon.active import ActiveMessage
    from pyqmgr.postfix.config import QmgrConfig
    from pyqmgr.scheduler.entry import Entry

SMTPUTF8_FLAG_SENDER = 4
SMTPUTF8_FLAG_RECIPIENT = 8


def _utf8_address(address: str) -> bool:
    """Non-ASCII and valid UTF-8 (undecodable bytes arrive as surrogates)."""
    if address.isascii():
        return False
    try:
        address.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def delivery_request(cfg: QmgrConfig, entry: Entry, record: int = 0) -> bytes:
    """The request's bytes, ready to send; ``record``: flags delivery events add."""
    am: ActiveMessage = entry.message.owner
    recipients = entry.recipients
    verp = am.qf.verp_delims
    sendopts = am.request.sendopts
    if cfg.smtputf8_enable and any(_utf8_address(r.address) for r in recipients):
        sendopts |= SMTPUTF8_FLAG_RECIPIENT | (SMTPUTF8_FLAG_SENDER if verp else 0)
    sender = am.request.sender
    if verp:
        # One recipient per request with VERP (Message.single_rcpt).
        first = recipients[0]
        sender = verp_sender(verp, sender, first.address, first.orig_addr)
    return encode_request(request_flags(am, entry.queue.dflags) | record, am.request,
                          entry.queue.nexthop, sendopts, sender, recipients,
                          cfg.postfix_version.options_attribute)
