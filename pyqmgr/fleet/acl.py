"""The Redis ACL a fleet's user needs: exactly the commands pyqmgr sends and the keys and
channels under its prefix (issue #35).

One list for the docs, the test bed and the tests: docs/fleet.md quotes
:func:`acl_setuser`, the test bed's servers create their fleet user from
:func:`acl_rules`, and the deployment tests run the whole fleet under it, so a command
added to pyqmgr without its rule here fails those tests (``NOPERM``) instead of an
operator's fleet.

What is in it, and why:

* The queue manager's own commands: ``EVALSHA`` (and ``EVAL`` and ``SCRIPT LOAD`` /
  ``SCRIPT EXISTS`` when Redis has forgotten a script), ``PUBLISH`` and ``SUBSCRIBE``
  (the fleet's news and suspensions), ``HGETALL``, and the plain reads and writes the
  control commands and the roster make (``GET``, ``SET``, ``DEL``, ``HGET``, ``HSET``,
  ``ZADD``, ``ZRANGEBYSCORE``, ``ZREMRANGEBYSCORE``; ``GETRANGE``, which reads a
  roster record no further than its 64 KiB bound), ``PING``.
* What the Lua scripts call: Redis checks every ``redis.call`` inside a script against
  the caller's ACL, so ``ZCARD``, ``LREM``, ``RPUSH``, ``PEXPIRE``, ``ZSCORE``, ``ZREM``,
  ``LPOP``, ``INCR``, ``HSETNX``, ``HDEL``, ``TIME`` and ``INFO`` (the scripts read the
  server's run id from ``INFO server``, to notice a Redis that restarted empty) are here
  although pyqmgr never sends them itself.
* What the client library sends on connecting: ``HELLO`` and ``AUTH``, ``CLIENT
  SETNAME`` (the connection's name), ``SELECT`` for a database other than 0, and on
  Redis Cluster ``CLUSTER SLOTS`` / ``CLUSTER SHARDS`` (the slot map), ``READONLY``,
  and ``COMMAND`` (redis-py's cluster client reads the command table to find each
  command's keys, and so each command's slot: without it, the first command fails with
  NOPERM).
  Not ``CLIENT SETINFO``: Redis 7.0 (Debian 12's) does not know it, and an ACL naming
  it does not load there; redis-py sends it by default and ignores its refusal, which
  on Redis 7.2 and later and Valkey is an entry in ``ACL LOG`` (the fleet's client is
  to be made without a library name, so it does not send it).

Nothing else: no ``KEYS``, ``SCAN``, ``FLUSH*``, ``CONFIG``, ``SCRIPT FLUSH``, ``DEBUG``
or ``MONITOR``. Keys are limited to ``~PREFIX*`` and pub/sub channels to ``&PREFIX*``
(Redis 7's channel rules; the fleet's channels are named under its prefix too), so
fleets with different prefixes on one Redis cannot touch each other's state.
"""

from __future__ import annotations

#: Every command (``command|subcommand``) the fleet's user may run, sorted.
ACL_COMMANDS: tuple[str, ...] = tuple(sorted((
    # The queue manager's own.
    "evalsha", "eval", "script|load", "script|exists", "publish", "subscribe",
    "hgetall", "hget", "hset", "get", "set", "del", "zadd", "zrangebyscore",
    "zremrangebyscore", "ping", "getrange",
    # Called from the Lua scripts.
    "zcard", "lrem", "rpush", "pexpire", "zscore", "zrem", "lpop", "incr", "hsetnx",
    "hdel", "time", "info",
    # Sent by the client library on connecting.
    "hello", "auth", "client|setname", "select",
    "cluster|slots", "cluster|shards", "readonly", "command",
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
