"""What Postfix's ``sent()`` (``global/sent.c``) records besides the maillog line.

A delivery is recorded in the trace log before its ``status=sent`` line when the
request's flags say so: once for ``DEL_REQ_FLAG_RECORD`` (``sendmail -v``, or pyqmgr's
delivery events) or for ``DEL_REQ_FLAG_REC_DLY_SENT`` with a recipient that asked for
no DSN or for DELAY, and once more for a recipient with ``NOTIFY=SUCCESS``. If an
append fails the recipient is deferred instead ("trace service failed"). The agents do
this in C; qmgr does it for the one delivery it makes itself, the double-bounce
discard (``qmgr_message_resolve``).
"""

from __future__ import annotations

from pyqmgr.postfix.deliver_request import DEL_REQ_FLAG_REC_DLY_SENT, DEL_REQ_FLAG_RECORD

#: ``dsn_mask.h``'s notify bits that ``sent()`` looks at.
DSN_NOTIFY_SUCCESS = 1 << 1
DSN_NOTIFY_DELAY = 1 << 3


def trace_appends(flags: int, dsn_notify: int) -> int:
    """How many trace records ``sent()`` appends for a recipient (0, 1 or 2) of a
    normal delivery. (An address probe's ``sent()`` answers the verify service, or with
    ``DEL_REQ_FLAG_USR_VRFY`` appends a "deliverable" record: not counted here.)"""
    count = 0
    if flags & DEL_REQ_FLAG_RECORD or (
            flags & DEL_REQ_FLAG_REC_DLY_SENT
            and (dsn_notify == 0 or dsn_notify & DSN_NOTIFY_DELAY)):
        count += 1
    if dsn_notify & DSN_NOTIFY_SUCCESS:
        count += 1
    return count


def trace_failed_reason(queue_id: str, trace_service: str = "trace") -> str:
    """The reason of the deferral that replaces a delivery whose record failed."""
    return f"{queue_id}: {trace_service} service failed"


__all__ = ["DSN_NOTIFY_DELAY", "DSN_NOTIFY_SUCCESS", "trace_appends", "trace_failed_reason"]
