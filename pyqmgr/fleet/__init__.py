"""A fleet of Postfix servers as one sender: shared state in Redis (issue #23).

- ``resp``: Redis's wire protocol, no I/O (commands out, bounded replies in);
- ``client``: one pipelined asyncio connection with deadlines, failing fast when
  Redis is slow or gone;
- ``settings``: pyqmgr.cf's ``shared_state`` and its companions, checked at start-up;
- ``shared``: the shared state's operations, each one atomic Lua script (sessions as
  leases, the GCRA rate).

Off unless pyqmgr.cf sets ``shared_state``: the daemon then builds none of it and
asks Redis nothing. The daemon's side is :mod:`pyqmgr.daemon.fleet`.
"""
