"""A fleet of Postfix servers as one sender: shared state in Redis (issue #23).

- ``resp``: Redis's wire protocol, no I/O (commands out, bounded replies in);
- ``client``: one pipelined asyncio connection with deadlines, failing fast when
  Redis is slow or gone;
- ``settings``: pyqmgr.cf's ``shared_state`` and its companions, checked at start-up.

Off unless pyqmgr.cf sets ``shared_state``: nothing here is imported by the daemon
then.
"""
