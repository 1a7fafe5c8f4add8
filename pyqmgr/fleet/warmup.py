"""The warm-up's counts shared by a fleet, in Redis (issue #46 item 2).

Servers that share a cold source's address (a floating IP, NAT) share its count at a
site in the window, so that the fleet as a whole sends the plan. Each server takes
credits from the fleet's count in chunks (:mod:`pyqmgr.scheduler.source_credits`),
by one Lua script, atomic in Redis:

``{prefix}{N}:warmup:{window}/{seconds}:{source}:{site}``
    How many recipients the fleet counted (or holds credits for) for the cold source
    at the site in the window (the window's number from the epoch, and its length in
    seconds, so that a day's and an hour's never meet). The script adds what a
    server owes (taken without credit while Redis was away) or takes off what it
    gives back, then grants ``min(want, allowance - count)`` and adds that: two
    servers asking at once are served one after the other, and never get more than
    the allowance together. The key expires an hour after the window's end. ``{N}``
    is the pair's hash-tag bucket (:func:`pyqmgr.fleet.shared.bucket`), so that on a
    Cluster the script's one key is in one slot, as every other script's.

The script calls only ``GET`` and ``SET``, which the fleet's ACL has already
(:mod:`pyqmgr.fleet.acl`).
"""

from __future__ import annotations

from pyqmgr.fleet.client import RedisUnavailable
from pyqmgr.fleet.shared import Shared, bucket, unit_name

#: KEYS: the pair's count. ARGV: the allowance, credits wanted, what to add first (owed:
#: > 0; given back: < 0), the key's time to live (ms). Returns {granted, the count}.
CREDITS = """
local count = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
count = count + tonumber(ARGV[3])
if count < 0 then count = 0 end
local grant = tonumber(ARGV[1]) - count
if grant > tonumber(ARGV[2]) then grant = tonumber(ARGV[2]) end
if grant < 0 then grant = 0 end
count = count + grant
redis.call('SET', KEYS[1], string.format('%d', count), 'PX', tonumber(ARGV[4]))
return {grant, count}
"""

#: How long a window's count outlives the window (s): a server whose clock is behind
#: still finds it.
KEEP_AFTER = 3600.0


class WarmupCredits:
    """One server's questions to the fleet's warm-up counts, over the fleet's client."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared

    def key(self, source: str, site: str, window: int, seconds: float) -> str:
        site = unit_name(site)
        return (f"{self.shared.prefix}{{{bucket(source, site)}}}:warmup:"
                f"{window}/{int(seconds)}:{source}:{site}")

    async def take(self, source: str, site: str, window: int, seconds: float,
                   allowance: int, want: int, owed: int, now: float) -> tuple[int, int]:
        """Credits for the cold source at the site: (granted, the fleet's count after).
        ``owed`` recipients counted here without credit are added first; a negative
        ``owed`` with ``want`` 0 gives credits back. RedisUnavailable when Redis does
        not answer in time."""
        ttl_ms = max(1000, int(((window + 1) * seconds - now + KEEP_AFTER) * 1000))
        reply = await self.shared.run(CREDITS, [self.key(source, site, window, seconds)],
                                      [allowance, want, owed, ttl_ms])
        if not (isinstance(reply, list) and len(reply) == 2
                and all(isinstance(x, int) for x in reply)):
            raise RedisUnavailable(f"unexpected reply to the warm-up script: {reply!r:.80}")
        return int(reply[0]), int(reply[1])  # type: ignore[arg-type]

    async def give_back(self, source: str, site: str, window: int, seconds: float,
                        n: int, now: float) -> int:
        """``n`` credits (and reservations never sent) back to the fleet; its count."""
        return (await self.take(source, site, window, seconds, 0, 0, -n, now))[1]
