"""The fleet's shared state in Redis: sessions as leases, rates as GCRA, holds.

Each operation is one Lua script, so it is atomic in Redis and costs one round trip;
the scripts read Redis's own clock (``TIME``), so the nodes' clocks may differ. Keys
live under the fleet's prefix (``shared_state_prefix``) and name the destination by
transport and queue name, as every node names it. Every key of one destination (or
site) carries the same Redis Cluster hash tag, ``{N}``, its bucket (0 to
:data:`BUCKETS` - 1, from a CRC of its transport and name): a Cluster keeps the keys a
script touches in one slot, so every script runs there as on one server (issue #35).

``{prefix}{N}:sessions:{transport}:{queue}``
    A sorted set: one member per delivery under way in the fleet, or about to start
    (``node/instance/serial``), scored by when its lease expires (Redis
    milliseconds). Expired members are dropped whenever the set is touched, so a
    node killed mid-delivery gives its sessions back within the lease time; a live
    node renews its leases well before that.
``{prefix}{N}:waiters:{transport}:{queue}``
    The processes refused for want of a session, oldest first: a session given back
    goes to the first of them only, as a lease made in its name and published on its
    channel (``{prefix}freed:{node}/{instance}``), so a waiting node neither asks
    again and again nor asks at all to start the delivery it was handed.
``{prefix}serial`` (on a Cluster ``{prefix}{N}:serial``)
    A counter that names the leases a release makes for the process it hands them to.
``{prefix}{N}:rate:{transport}:{queue}``
    The GCRA's theoretical arrival time (Redis milliseconds) of the destination's
    fleet-wide rate: a start is allowed when ``now >= tat - (burst - 1) * interval``,
    and moves ``tat`` one interval on.
``{prefix}{N}:site-sessions:{transport}:{site}`` (and ``site-waiters``, ``site-rate``)
    The same for a site (issue #33, ``fleet_site_concurrency_limit``): the deliveries
    to all its destinations count together.
``{prefix}epoch`` (on a Cluster ``{prefix}{N}:epoch``)
    Which Redis process last had the fleet count its sessions (see :data:`ADMIT`). A
    Cluster's shards lose their data apart (a failover, a restart), so there each
    bucket has its own: a fresh Cluster pauses each bucket's first start for one
    recount (:data:`RECOUNT_MS`), at most :data:`BUCKETS` of them.

:meth:`Shared.admit` does both in one script, and takes neither unless both allow:
a start refused for its rate does not hold a session, and one refused for the
sessions does not spend the rate.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import zlib
from dataclasses import dataclass

from pyqmgr.fleet.client import CLUSTER, Arg, RedisClient, RedisError, RedisUnavailable, Reply
from pyqmgr.scheduler.decisions import DEAD, RULE, Throttling
from pyqmgr.scheduler.structures import SITE_SCOPE

#: How the fleet names a site where it would name a destination (issue #33), in a key
#: or in a message on a channel: the core's one site scope name (issue #44), which no
#: queue name can be taken for.
SITE_UNIT = SITE_SCOPE

#: Hash-tag buckets: enough to spread a fleet's destinations over a Cluster's shards,
#: few enough that a fresh Cluster's recount pauses (one per bucket) stay few.
BUCKETS = 64
#: The key layout: 2 since issue #35 (hash tags); servers publish it, and one that
#: finds another layout in the fleet warns (a mixed fleet counts in two places).
KEY_LAYOUT = 2


#: The longest unit name (a destination's queue name, or ``site NAME``) the fleet uses
#: as it is: a site named by its MX hosts can pass 2,000 characters (issue #45), and
#: every roster record listing it was refused. A longer one keeps its first characters
#: and ends in ``~`` and a digest of the whole (:func:`unit_name`), the same on every
#: server, in every key, channel message and record.
MAX_UNIT_NAME = 256
_UNIT_DIGEST = 16


def unit_name(name: str) -> str:
    """The unit's name as the fleet counts it: itself up to :data:`MAX_UNIT_NAME`
    characters; longer, its head, ``~`` and 16 hex digits of SHA-256 of the whole, so
    two long names that share a head stay two units."""
    if len(name) <= MAX_UNIT_NAME:
        return name
    import hashlib  # only a long name loads libcrypto (tests/unit/test_daemon_imports.py)

    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{name[:MAX_UNIT_NAME - _UNIT_DIGEST - 1]}~{digest[:_UNIT_DIGEST]}"


def fleet_mac(key: bytes, prefix: str, body: bytes, label: bytes = b"") -> bytes:
    """HMAC-SHA256, in hex, of what a server signs with the fleet's key: the fleet's
    prefix (a key signs one fleet's data only), a label saying what the body is (none
    for a notice of throttling; ``roster\\0`` for a roster record, so neither is ever
    taken for the other) and the body."""
    # Imported here: hashlib loads libcrypto, which a server without a fleet key never
    # needs (tests/unit/test_daemon_imports.py).
    import hashlib
    import hmac

    return hmac.new(key, prefix.encode() + b"\0" + label + body,
                    hashlib.sha256).hexdigest().encode()


def bucket(transport: str, unit: str) -> int:
    """A destination's (or ``site NAME``'s) hash-tag bucket: the same on every node."""
    return zlib.crc32(f"{transport}\n{unit}".encode()) % BUCKETS

#: KEYS: sessions, rate, waiters, the epoch. ARGV: lease ms, session limit (0: none),
#: rate interval ms (0: none), burst, member, this process's channel, "1" when it has
#: more deliveries waiting for the destination, the recount ms, the recount channel.
#: Returns {admitted 1/0, wait ms, sessions in use, recounting 1/0}. Refused for want
#: of a session, or given the last one with more waiting, the process is on the
#: destination's waiting list (once), to be handed a session when one is given back
#: (RELEASE).
#:
#: The epoch key says which Redis process (its run_id) last had the fleet count its
#: sessions, and from when starts may go on ("RUN_ID MS"). Missing, or of another
#: process, Redis lost its data (a flush, an eviction; a restart, even from a
#: snapshot, which brings back counts older than the deliveries under way; a
#: failover to a replica) or the fleet is new: admitting on those counts would
#: loosen every limit. So the script asks every node to count its leases again (a
#: message on the recount channel) and refuses every start for the recount time.
ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local run = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)') or '-'
local epoch = redis.call('GET', KEYS[4])
local from = nil
if epoch then
  local r, ms = string.match(epoch, '^(%S+) (%d+)$')
  if r == run then from = tonumber(ms) end
end
if not from then
  redis.call('SET', KEYS[4], run .. ' ' .. (now + tonumber(ARGV[8])))
  redis.call('PUBLISH', ARGV[9], 'recount')
  return {0, tonumber(ARGV[8]), 0, 1}
end
if from > now then
  return {0, from - now, 0, 1}
end
local lease, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local interval, burst = tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local used = redis.call('ZCARD', KEYS[1])
if limit > 0 and (used >= limit or (used + 1 >= limit and ARGV[7] == '1')) then
  redis.call('LREM', KEYS[3], 0, ARGV[6])
  redis.call('RPUSH', KEYS[3], ARGV[6])
  redis.call('PEXPIRE', KEYS[3], lease)
  if used >= limit then return {0, 0, used, 0} end
end
local tat = now
if interval > 0 then
  tat = tonumber(redis.call('GET', KEYS[2]) or now) or now
  if tat < now then tat = now end
  -- No start of this rate can put tat further ahead than a full burst: a later one is
  -- damage (or another writer's), and would hold every node back until then.
  if tat > now + burst * interval then tat = now + burst * interval end
  local allow_at = tat - (burst - 1) * interval
  if now < allow_at then
    return {0, allow_at - now, used, 0}
  end
  redis.call('SET', KEYS[2], tat + interval, 'PX', tat + interval - now + 1000)
end
if limit > 0 then
  redis.call('ZADD', KEYS[1], now + lease, ARGV[5])
  redis.call('PEXPIRE', KEYS[1], lease)
  used = used + 1
end
return {1, 0, used, 0}
"""

#: KEYS: sessions. ARGV: lease ms, members... Renews every lease of a delivery still
#: under way, and counts again one that Redis no longer had (it expired while Redis
#: was slow, or Redis lost its data): the count may go over the limit for a while,
#: which holds starts back, never lets more through. Returns how many were missing.
RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
local missing = 0
-- A removal first: Redis at maxmemory under noeviction refuses a script whose first
-- write could grow memory, and a renewal refused lets deliveries' leases lapse.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
for i = 2, #ARGV do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if not score or tonumber(score) <= now then missing = missing + 1 end
  redis.call('ZADD', KEYS[1], now + lease, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], lease)
return missing
"""

#: KEYS: sessions, waiters, the serial. ARGV: member, the destination as "transport NL
#: queue", lease ms, the session limit (0: tell, do not hand), "1" when this process
#: has more deliveries waiting for the destination, its channel, the channels'
#: common prefix, the publishing command (PUBLISH, or SPUBLISH on a Cluster). Gives
#: the session back and passes it on in the same step, so that
#: the next delivery to start needs no question of its own:
#:
#: * to the process that has waited longest (another one): a lease made in its name
#:   and published to it ("transport NL queue NL lease"); it goes to the end of the
#:   line for the next one (a process passes on what it no longer needs, which takes
#:   it out of the line), and so does this process if it has more waiting. With a
#:   limit of 0 (the destination has a fleet rate, which a start must take itself)
#:   the waiter is only told to ask. A waiter nobody listens for (its process died)
#:   is skipped;
#: * else to this process, when it has more waiting: a lease in its own name, kept
#:   for its next delivery.
#:
#: Returns {RELEASED 0 | KEPT 1 | HANDED 2 | TOLD 3, the lease made, sessions in use}.
RELEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease, limit, more = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5] == '1'
local me, plen = ARGV[6], string.len(ARGV[7])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local used = redis.call('ZCARD', KEYS[1])
local function line_up()
  redis.call('LREM', KEYS[2], 0, me)
  if more then
    redis.call('RPUSH', KEYS[2], me)
    redis.call('PEXPIRE', KEYS[2], lease)
  end
end
while limit == 0 or used < limit do
  local waiter = redis.call('LPOP', KEYS[2])
  if not waiter then break end
  if waiter ~= me then
    if limit == 0 then
      if redis.call(ARGV[8], waiter, ARGV[2]) > 0 then
        line_up()
        return {3, '', used}
      end
    else
      local name = string.sub(waiter, plen + 1) .. '/h' .. redis.call('INCR', KEYS[3])
      redis.call('ZADD', KEYS[1], now + lease, name)
      if redis.call(ARGV[8], waiter, ARGV[2] .. '\\n' .. name) > 0 then
        redis.call('PEXPIRE', KEYS[1], lease)
        -- It stays in line for the next (it passes on what it no longer needs).
        redis.call('RPUSH', KEYS[2], waiter)
        line_up()
        return {2, name, used + 1}
      end
      redis.call('ZREM', KEYS[1], name)
    end
  end
end
if more and limit > 0 and used < limit then
  local name = string.sub(me, plen + 1) .. '/k' .. redis.call('INCR', KEYS[3])
  redis.call('ZADD', KEYS[1], now + lease, name)
  redis.call('PEXPIRE', KEYS[1], lease)
  return {1, name, used + 1}
end
if not more then redis.call('LREM', KEYS[2], 0, me) end
return {0, '', used}
"""

#: How long a recount holds every start back (ms): a node hears the recount and
#: renews its leases in two round trips; one cut off from Redis resubscribes within
#: the subscriber's second of retry delay, and renews then.
RECOUNT_MS = 3000

#: RELEASE's outcomes.
RELEASED, KEPT, HANDED, TOLD = 0, 1, 2, 3

#: KEYS: waiters. ARGV: the destination, the publishing command. A process told of a
#: session it no longer needs passes the news on to the next in line.
PASS_ON = """
local waiter = redis.call('LPOP', KEYS[1])
if waiter then redis.call(ARGV[2], waiter, ARGV[1]) end
return 1
"""

#: KEYS: the suspensions hash. ARGV: the target, its record (JSON; a resume's is a
#: tombstone), the channel, the news (JSON: who, which node). One step, so no server
#: reads the table between the change and the news of it.
SUSPENSION = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PUBLISH', ARGV[3], ARGV[4])
return 1
"""

#: KEYS: the suspensions hash. ARGV: the target, the record, the channel, the news.
#: A record Redis lost, written back unless the table has another meanwhile.
RESTORE = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('PUBLISH', ARGV[3], ARGV[4])
end
return 1
"""

#: KEYS: the suspensions hash. ARGV: the target, the record read. An ended record
#: (or tombstone) taken out, unless it was replaced meanwhile.
FORGET = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('HDEL', KEYS[1], ARGV[1])
end
return 1
"""

#: KEYS: sessions. Returns the members of unexpired leases.
HOLDERS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
"""


@dataclass(frozen=True)
class Admission:
    """The fleet's answer to "may this node start a delivery to the destination?"."""

    admitted: bool
    #: When refused for the rate: seconds until a start would be allowed.
    wait: float
    #: Fleet sessions to the destination in use (this one included when admitted).
    in_use: int
    #: The lease to renew and release (empty when no session limit applies).
    lease: str = ""
    #: Refused because the fleet counts its sessions again (Redis lost its data).
    recount: bool = False


class Shared:
    """One node's view of the fleet's shared state, over one :class:`RedisClient`."""

    def __init__(self, client: RedisClient, prefix: str, node: str,
                 lease_time: float) -> None:
        self.client = client
        self.prefix = prefix
        #: On a Cluster the epoch and the serial are per bucket (one slot per script).
        self.cluster = client.endpoint.kind == CLUSTER
        self.node = node
        self.lease_ms = max(1, int(lease_time * 1000))
        self._serial = itertools.count(1)
        #: Lease names are NODE/INSTANCE/SERIAL: the instance, new at every start, keeps
        #: two processes with one node name (a restarted qmgr, or two servers with the
        #: same myhostname) from renewing or counting each other's leases as one.
        self.instance = os.urandom(4).hex()
        #: Where this process hears that a session it waits for was given back (or
        #: handed to it); what follows the prefix is also its leases' stem.
        self.channel_prefix = f"{prefix}freed:"
        self.channel = f"{self.channel_prefix}{node}/{self.instance}"
        #: How a release tells a waiter: on a Cluster by sharded pub/sub, whose channel
        #: is in the destination's slot, so that the count of listeners a script gets
        #: back is the whole fleet's (PUBLISH counts only the node the script runs on,
        #: yet reaches every node: a lease taken back as unheard was heard, and used).
        self.publish = "SPUBLISH" if self.cluster else "PUBLISH"
        self._sha: dict[str, str] = {}
        #: How long a recount holds every start back: long enough for every node to
        #: hear and renew.
        self.recount_channel = f"{prefix}recount"
        self.recount_ms = RECOUNT_MS

    def key(self, kind: str, transport: str, queue: str) -> str:
        """A destination's key, or a site's (``queue`` = ``site NAME``: the kinds are
        ``site-sessions``, ``site-rate`` and ``site-waiters``, so that a site and a
        destination of the same name never share a count)."""
        tag = f"{self.prefix}{{{bucket(transport, queue)}}}:"
        if queue.startswith(SITE_UNIT):
            return f"{tag}site-{kind}:{transport}:{queue[len(SITE_UNIT):]}"
        return f"{tag}{kind}:{transport}:{queue}"

    def epoch_key(self, transport: str, queue: str) -> str:
        """When the fleet last counted its sessions (see :data:`ADMIT`): the fleet's
        one, or on a Cluster the destination's bucket's."""
        if self.cluster:
            return f"{self.prefix}{{{bucket(transport, queue)}}}:epoch"
        return f"{self.prefix}epoch"

    def freed_prefix(self, transport: str, queue: str) -> str:
        """Where this fleet's processes hear of sessions handed to them for the
        destination: one channel each, or on a Cluster one per bucket."""
        if self.cluster:
            return f"{self.prefix}{{{bucket(transport, queue)}}}:freed:"
        return self.channel_prefix

    def freed_channel(self, transport: str, queue: str) -> str:
        """This process's channel for sessions handed to it for the destination."""
        return f"{self.freed_prefix(transport, queue)}{self.node}/{self.instance}"

    def freed_channels(self) -> list[str]:
        """The channels this process listens on for sessions handed to it."""
        if not self.cluster:
            return [self.channel]
        return [f"{self.prefix}{{{n}}}:freed:{self.node}/{self.instance}"
                for n in range(BUCKETS)]

    def serial_key(self, transport: str, queue: str) -> str:
        if self.cluster:
            return f"{self.prefix}{{{bucket(transport, queue)}}}:serial"
        return f"{self.prefix}serial"

    def member(self) -> str:
        """A new lease's name (``node/instance/serial``): admitted, or taken here alone
        while Redis is away (counted at the next renewal)."""
        return f"{self.node}/{self.instance}/{next(self._serial)}"

    async def admit(self, transport: str, queue: str, limit: int,
                    interval: float = 0.0, burst: int = 1, more: bool = False) -> Admission:
        """Take a fleet session (``limit`` > 0) and a rate slot (``interval`` > 0),
        both or neither. RedisUnavailable when Redis does not answer in time."""
        member = self.member() if limit > 0 else ""
        reply = await self._script(
            ADMIT, [self.key("sessions", transport, queue), self.key("rate", transport, queue),
                    self.key("waiters", transport, queue), self.epoch_key(transport, queue)],
            [self.lease_ms, limit, int(round(interval * 1000)), burst, member or "-",
             self.freed_channel(transport, queue),
             "1" if more else "0", self.recount_ms, self.recount_channel])
        if not (isinstance(reply, list) and len(reply) == 4
                and all(isinstance(x, int) for x in reply)):
            raise RedisUnavailable(f"unexpected reply to the admission script: {reply!r:.80}")
        admitted, wait_ms, in_use, recount = (int(x) for x in reply)  # type: ignore[arg-type]
        return Admission(bool(admitted), wait_ms / 1000, in_use, member if admitted else "",
                         bool(recount))

    async def renew(self, transport: str, queue: str, leases: list[str]) -> int:
        """Renew this node's leases on one destination, counting again those Redis
        no longer had; how many those were."""
        if not leases:
            return 0
        reply = await self._script(RENEW, [self.key("sessions", transport, queue)],
                                   [self.lease_ms, *leases])
        if not isinstance(reply, int):
            raise RedisUnavailable(f"unexpected reply to the renewal script: {reply!r:.80}")
        return reply

    async def release(self, transport: str, queue: str, lease: str, limit: int = 0,
                      more: bool = False) -> tuple[int, str, int]:
        """Give a session back to the fleet (a delivery ended) and pass it on (see
        :data:`RELEASE`): (what became of it, the lease made for this process when
        :data:`KEPT`, sessions in use)."""
        if not lease:
            return RELEASED, "", 0
        reply = await self._script(
            RELEASE, [self.key("sessions", transport, queue),
                      self.key("waiters", transport, queue), self.serial_key(transport, queue)],
            [lease, f"{transport}\n{queue}", self.lease_ms, limit, "1" if more else "0",
             self.freed_channel(transport, queue),
             self.freed_prefix(transport, queue), self.publish])
        if not (isinstance(reply, list) and len(reply) == 3 and isinstance(reply[0], int)
                and isinstance(reply[1], bytes) and isinstance(reply[2], int)):
            raise RedisUnavailable(f"unexpected reply to the release script: {reply!r:.80}")
        return reply[0], reply[1].decode("utf-8", "replace"), reply[2]

    async def pass_on(self, transport: str, queue: str) -> None:
        """Tell the next process waiting for the destination instead of this one."""
        await self._script(PASS_ON, [self.key("waiters", transport, queue)],
                           [f"{transport}\n{queue}", self.publish])

    @property
    def throttling_channel(self) -> str:
        return f"{self.prefix}throttling"

    async def tell_throttling(self, payload: str) -> None:
        """Tell every server of the fleet what this one found (:func:`news_payload`)."""
        _checked(await self.client.call("PUBLISH", self.throttling_channel, payload))

    @property
    def suspensions_channel(self) -> str:
        return f"{self.prefix}suspensions"

    async def set_suspension(self, target: str, record: str, news: str) -> None:
        """Put a suspension in the fleet's table (``record`` empty: take it out) and
        tell every server."""
        await self._script(SUSPENSION, [f"{self.prefix}suspensions"],
                           [target, record, self.suspensions_channel, news])

    async def restore_suspension(self, target: str, record: str) -> None:
        """Write back a suspension Redis lost (unless the table has another now)."""
        await self._script(RESTORE, [f"{self.prefix}suspensions"],
                           [target, record, self.suspensions_channel,
                            json.dumps({"by": "restored", "node": self.node})])

    async def forget_suspension(self, target: str, raw: bytes) -> None:
        """Take an ended record out of the table, unless it changed meanwhile."""
        await self._script(FORGET, [f"{self.prefix}suspensions"],
                           [target, raw])

    async def suspensions(self) -> dict[str, bytes]:
        """The fleet's suspensions: target -> record (JSON)."""
        reply = _checked(await self.client.call("HGETALL", f"{self.prefix}suspensions"))
        if not isinstance(reply, list) or len(reply) % 2:
            raise RedisUnavailable(f"unexpected reply to HGETALL: {reply!r:.80}")
        out: dict[str, bytes] = {}
        for name, value in zip(reply[::2], reply[1::2], strict=True):
            if isinstance(name, bytes) and isinstance(value, bytes):
                out[name.decode("utf-8", "replace")] = value
        return out

    async def holders(self, transport: str, queue: str) -> list[str]:
        """The leases under way to a destination, fleet-wide (``node/instance/serial``)."""
        reply = await self._script(HOLDERS, [self.key("sessions", transport, queue)], [])
        if not isinstance(reply, list):
            raise RedisUnavailable(f"unexpected reply to the holders script: {reply!r:.80}")
        return [m.decode("utf-8", "replace") for m in reply if isinstance(m, bytes)]

    async def run(self, script: str, keys: list[str], args: list[object]) -> Reply:
        """Another module's script (the warm-up's credits, :mod:`.warmup`), sent as
        this module's own are."""
        return await self._script(script, keys, args)

    async def _script(self, script: str, keys: list[str], args: list[object]) -> Reply:
        """EVALSHA; EVAL when the server does not have the script (a restart, a
        failover, another shard), which also leaves it cached there."""
        sha = self._sha.get(script)
        if sha is None:
            # Imported here: hashlib loads libcrypto (tests/unit/test_daemon_imports.py).
            import hashlib

            sha = self._sha[script] = hashlib.sha1(script.encode()).hexdigest()
        argv: list[Arg] = [a if isinstance(a, bytes) else str(a) for a in args]
        reply = await self.client.call("EVALSHA", sha, len(keys), *keys, *argv)
        if isinstance(reply, RedisError) and reply.kind == "NOSCRIPT":
            reply = await self.client.call("EVAL", script, len(keys), *keys, *argv)
        return _checked(reply)


def _checked(reply: Reply) -> Reply:
    """An error reply from a script is a broken fleet, not an answer."""
    if isinstance(reply, RedisError):
        raise RedisUnavailable(f"Redis answered an error: {reply.message}")
    return reply


# -- news of throttling (pyqmgr.scheduler.throttling) ---------------------------------
#
# The channel is anyone's who can reach Redis (or sit on its plaintext TCP), and a
# notice changes what a server does with its mail. So each notice is signed with the
# fleet's key (HMAC-SHA256 over the fleet's prefix and the notice), says when it was
# sent and carries a nonce: a server reads a notice only when the signature is its
# fleet's, it was sent within NOTICE_AGE of now, and its nonce was not heard before.
# Even then the notice routes nothing (pyqmgr.scheduler.throttling.learnt).

#: The longest notice of throttling read: a few names and a reply text.
MAX_NEWS = 8192
#: What a reply's text may be at most (Postfix's own DSN texts are shorter).
MAX_REASON = 2000
#: How long news may say a destination is dead (a backoff longer than a day is not
#: one Postfix would use).
MAX_LASTS = 86400.0
#: A notice sent longer ago than this (or this far ahead: the nodes' clocks, NTP's
#: milliseconds apart, are compared) is refused as stale; within it, a nonce heard
#: before is refused as a replay.
NOTICE_AGE = 30.0
#: Nonces remembered at most: only correctly signed notices are remembered, so only
#: the fleet's own nodes fill it, and 100,000 in 30 s is no fleet's news.
MAX_NONCES = 100_000
_STATUS = re.compile(r"[245]\.\d{1,3}\.\d{1,3}$")
_NONCE = re.compile(r"[0-9a-f]{16,64}$")
_MAC = 64


@dataclass(frozen=True)
class Notice:
    """A notice of throttling as read: the news and who sent it, when, with what nonce."""

    news: Throttling
    node: str
    instance: str
    sent: float
    nonce: str


def news_payload(news: Throttling, node: str, instance: str, sent: float,
                 nonce: str) -> str:
    """The notice one server publishes of a destination it found dead or throttled,
    before it is signed (:meth:`NoticeSeal.seal`)."""
    return json.dumps({"node": node, "instance": instance, "transport": news.transport,
                       "queue": news.queue, "nexthop": news.nexthop, "kind": news.kind,
                       "status": news.status, "reason": news.reason,
                       "lasts": news.lasts, "rule": news.rule, "sent": sent,
                       "nonce": nonce})


def parse_news(payload: bytes) -> Notice:
    """A notice's fields, each checked; ValueError naming what is wrong with one that is
    not a notice: even a signed notice must change nothing unless every field is the
    right type, size and range."""
    if len(payload) > MAX_NEWS:
        raise ValueError(f"{len(payload)} bytes, more than {MAX_NEWS}")
    try:
        record = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        raise ValueError("not JSON") from None
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")

    def text(name: str, longest: int, word: bool = False, empty: bool = False) -> str:
        value = record.get(name)
        if not isinstance(value, str) or not (empty or value) or len(value) > longest:
            raise ValueError(f"{name}: a text of up to {longest} characters expected")
        if not value.isprintable() or (word and any(c.isspace() for c in value)):
            raise ValueError(f"{name}: {value!r:.60} has spaces or unprintable characters"
                             if word else f"{name}: unprintable characters")
        return value

    def number(name: str) -> float:
        value = record.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not \
                math.isfinite(value):
            raise ValueError(f"{name}: {value!r:.30} is not a number")
        return float(value)

    node, instance = text("node", 255, word=True), text("instance", 64, word=True)
    kind = record.get("kind")
    if kind not in (DEAD, RULE):
        raise ValueError(f"kind: {kind!r:.30} is neither {DEAD!r} nor {RULE!r}")
    status = text("status", 11)
    if not _STATUS.match(status):
        raise ValueError(f"status: {status!r} is not an enhanced status code")
    lasts = record.get("lasts")
    if isinstance(lasts, bool) or not isinstance(lasts, int | float) or not math.isfinite(
            lasts) or not 0 <= lasts <= MAX_LASTS or (kind == DEAD and lasts <= 0):
        raise ValueError(f"lasts: {lasts!r:.30} is not a number of seconds from "
                         f"{'more than 0' if kind == DEAD else '0'} to {MAX_LASTS:g}")
    news = Throttling(text("transport", 64, word=True), text("queue", 1024),
                      text("nexthop", 1024), str(kind), status,
                      text("reason", MAX_REASON, empty=True), float(lasts),
                      text("rule", 1100, empty=kind == DEAD))
    sent = number("sent")
    nonce = text("nonce", 64)
    if not _NONCE.match(nonce):
        raise ValueError(f"nonce: {nonce!r:.70} is not 16 to 64 hex digits")
    return Notice(news, node, instance, sent, nonce)


class NoticeSeal:
    """Signs this server's notices with the fleet's key, and opens the fleet's: a notice
    opens only when it is signed with the key, fresh, and not heard before."""

    def __init__(self, key: bytes, prefix: str) -> None:
        if not key:
            raise ValueError("a fleet's notices need its key")
        self._key = key
        self._prefix = prefix
        #: Nonce -> when it may be forgotten (it is stale by then), oldest first.
        self._seen: dict[str, float] = {}

    def _mac(self, body: bytes) -> bytes:
        return fleet_mac(self._key, self._prefix, body)

    def seal(self, news: Throttling, node: str, instance: str, now: float) -> str:
        """The signed notice to publish; ``now`` is the wall clock (time.time())."""
        body = news_payload(news, node, instance, round(now, 3), os.urandom(12).hex())
        return f"{self._mac(body.encode()).decode()} {body}"

    def open(self, payload: bytes, now: float) -> Notice:
        """The notice, or ValueError saying why it is refused."""
        if len(payload) > _MAC + 1 + MAX_NEWS:
            raise ValueError(f"{len(payload)} bytes, more than {_MAC + 1 + MAX_NEWS}")
        mac, space, body = payload.partition(b" ")
        if not space or len(mac) != _MAC:
            raise ValueError("not signed")
        import hmac

        if not hmac.compare_digest(mac, self._mac(body)):
            raise ValueError("not signed with this fleet's key")
        notice = parse_news(body)
        age = now - notice.sent
        if not -NOTICE_AGE <= age <= NOTICE_AGE:
            raise ValueError(f"sent {age:.0f} s ago: stale" if age > 0 else
                             f"sent {-age:.0f} s from now: check the nodes' clocks")
        seen = self._seen
        for nonce, until in list(itertools.islice(seen.items(), 64)):
            if until >= now and len(seen) < MAX_NONCES:
                break
            del seen[nonce]
        if notice.nonce in seen:
            raise ValueError(f"heard before (nonce {notice.nonce}): a replay")
        seen[notice.nonce] = now + 2 * NOTICE_AGE
        return notice
