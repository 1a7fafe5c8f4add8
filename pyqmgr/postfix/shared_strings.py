"""One copy of the strings many messages in core repeat.

A full active queue holds thousands of messages from the same few clients and
senders, routed to the same few transports and next hops: the queue file's
attributes and trivial-rewrite's replies give each message its own copy of the same
text (about 1 KB a message, issue #24's memory figure). ``shared`` hands back the copy
already held. The table is bounded and simply emptied when full: a value seen once
costs one entry until then, and a flood of unique values cannot grow it. Callers
keep values unique to a message (a queue id, a client port) out of it.
"""

from __future__ import annotations

_TABLE: dict[str, str] = {}
#: Entries at most; the table is emptied when it reaches this many.
LIMIT = 4096


def shared(text: str) -> str:
    """The one copy of ``text`` the table holds (``text`` itself the first time)."""
    kept = _TABLE.get(text)
    if kept is None:
        if len(_TABLE) >= LIMIT:
            _TABLE.clear()
        kept = _TABLE[text] = text
    return kept
