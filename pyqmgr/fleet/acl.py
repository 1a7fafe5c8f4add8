"""The Redis ACL a fleet's user needs: exactly the commands pyqmgr sends and the keys and
channels under its prefix (issue #35).

One list for the docs, the test bed and the tests: docs/fleet.md quotes
:func:`acl_setuser`, the test bed's servers create their fleet user from
:func:`acl_rules`, and the deployment tests run the whole fleet under it, so a command
added to pyqmgr without its rule here fails those tests (``NOPERM``) instead of an
operator's fleet.

What is in it, and why (found by running the fleet under it and reading ``ACL LOG``,
then taking out every rule nothing used; tests/test_fleet_deployments_real.py makes
each operation the fleet has, on one server and on a Cluster):

* The queue manager's own commands: ``EVALSHA`` (and ``EVAL`` when Redis has not the
  script: a restart, a failover, another shard), ``PUBLISH`` and ``SUBSCRIBE`` (the
  fleet's news, suspensions and handed sessions), ``HGETALL`` (the suspensions), and
  the roster's ``SET``, ``GETRANGE`` (which reads a record no further than its 64 KiB
  bound), ``ZADD``, ``ZRANGEBYSCORE``, ``ZREMRANGEBYSCORE``, ``ZCARD``, ``ZREM``,
  ``PEXPIRE`` and ``DEL``; ``XADD`` for the delivery events' stream
  (``delivery_events_stream``, issue #46).
* What the Lua scripts call: Redis checks every ``redis.call`` inside a script against
  the caller's ACL, so ``GET``, ``HGET``, ``HSET``, ``HSETNX``, ``HDEL``, ``LREM``,
  ``RPUSH``, ``LPOP``, ``INCR``, ``ZSCORE``, ``TIME`` and ``INFO`` (the scripts read
  the server's run id from ``INFO server``, to notice a Redis that lost its data) are
  here although pyqmgr never sends them itself.
* What the client library sends on connecting: ``SELECT`` for a database other than
  0, and on a Cluster ``CLUSTER SLOTS`` (the slot map) and ``COMMAND`` (redis-py's
  cluster client reads the command table to find each command's keys, and so its
  slot: without it the first command fails with NOPERM). ``AUTH`` needs no rule (it
  is allowed before authentication). Not ``HELLO``, ``CLIENT SETNAME`` or ``CLIENT
  SETINFO``: the fleet's client speaks RESP2, names no connection and sends no
  library name; ``CLIENT SETINFO`` would not even load in an ACL on Redis 7.0
  (Debian 12's), which does not know it. Not ``PING``, ``SCRIPT LOAD``, ``READONLY``
  or ``CLUSTER SHARDS`` either: nothing sends them.

Nothing else: no ``KEYS``, ``SCAN``, ``FLUSH*``, ``CONFIG``, ``SCRIPT FLUSH``, ``DEBUG``
or ``MONITOR``. Keys are limited to ``~PREFIX*`` and pub/sub channels to ``&PREFIX*``
(Redis 7's channel rules; the fleet's channels are named under its prefix too), so
fleets with different prefixes on one Redis cannot touch each other's state.
"""

from __future__ import annotations

#: Every command (``command|subcommand``) the fleet's user may run, sorted.
ACL_COMMANDS: tuple[str, ...] = tuple(sorted((
    # The queue manager's own.
    "evalsha", "eval", "publish", "subscribe", "hgetall", "set", "getrange", "zadd",
    # On a Cluster: a session handed on by sharded pub/sub, in the destination's slot.
    "spublish", "ssubscribe",
    # Delivery events to a stream (delivery_events_stream), from their own connection.
    "xadd",
    "zrangebyscore", "zremrangebyscore", "zcard", "zrem", "pexpire", "del",
    # Called from the Lua scripts (besides some of the above).
    "get", "hget", "hset", "hsetnx", "hdel", "lrem", "rpush", "lpop", "incr", "zscore",
    "time", "info",
    # Sent by the client library on connecting.
    "select", "cluster|slots", "command",
)))


def _glob_escaped(prefix: str) -> str:
    """The prefix as a literal in Redis's glob patterns (``*?[]\\`` are special)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in prefix)


def acl_rules(prefix: str = "pyqmgr:") -> list[str]:
    """The ACL rules of a fleet user whose keys start with ``prefix`` (the
    ``shared_state_prefix``), as arguments of ``ACL SETUSER`` or words of a ``user``
    line: no key, channel or command but these."""
    if not prefix or any(c.isspace() for c in prefix):
        raise ValueError(f"a fleet prefix is one word, not {prefix!r}")
    pattern = _glob_escaped(prefix) + "*"
    return ["resetkeys", f"~{pattern}", "resetchannels", f"&{pattern}", "-@all",
            *(f"+{command}" for command in ACL_COMMANDS)]


def acl_setuser(user: str = "pyqmgr", prefix: str = "pyqmgr:",
                password: str = "<password>") -> str:
    """The whole ``ACL SETUSER`` command for the docs and for redis-cli: the user on,
    with ``password`` (as given: quote it for a shell) and :func:`acl_rules`."""
    return " ".join(["ACL SETUSER", user, "on", f">{password}", *acl_rules(prefix)])
