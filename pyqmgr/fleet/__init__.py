"""A fleet of Postfix servers as one sender: shared state in Redis (issue #23).

- ``client``: redis-py's asyncio client (one server, Sentinel, Cluster; TLS, ACL
  users) with the fleet's deadlines, batches and bounds, failing fast when Redis is
  slow or gone;
- ``settings``: pyqmgr.cf's ``shared_state`` and its companions, checked at start-up;
- ``shared``: the shared state's operations, each one atomic Lua script (sessions as
  leases, the GCRA rate).

Off unless pyqmgr.cf sets ``shared_state``: the daemon then builds none of it and
asks Redis nothing. The daemon's side is :mod:`pyqmgr.daemon.fleet`.
"""
