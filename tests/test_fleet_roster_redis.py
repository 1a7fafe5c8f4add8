"""The fleet's roster in a real redis-server (pyqmgr/fleet/roster.py, issue #35): records
published, read and taken out; expired ones gone; what anyone else wrote under the
roster's keys (not JSON, another type, 200 KiB, a thousand records, a name too long)
skipped by name or bounded, never trusted and never a failed read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from pyqmgr.fleet.client import Endpoint, RedisClient
from pyqmgr.fleet.roster import MAX_RECORD, MAX_RECORDS, Record, Roster, encode_record
from pyqmgr.fleet.settings import Limits
from pyqmgr.fleet.shared import KEY_LAYOUT
from pyqmgr.testbed.redis import RedisServer

PREFIX = "pyqmgr:"


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 60))


def record(node: str, instance: str = "0000aaaa", sessions: int = 5) -> Record:
    now = round(time.time(), 3)  # as published: to the millisecond
    return Record(node, instance, 1, "0.1.0", KEY_LAYOUT, now, 60.0, "local", False, 0, now,
                  {"*": {"destination": Limits(sessions)}}, (), 0)


def test_published_records_are_read_back_and_leave(redis_server):
    server: RedisServer = redis_server()

    async def main() -> None:
        client = RedisClient(Endpoint(host="127.0.0.1", port=server.port), timeout=2.0)
        roster = Roster(client, PREFIX)
        a, b = record("relay1", sessions=5), record("relay2", "0000bbbb", 10)
        await roster.publish(a, 60.0, time.time())
        await roster.publish(b, 0.3, time.time())
        read = await roster.read(time.time())
        assert sorted(r.node for r in read.records) == ["relay1", "relay2"]
        assert read.skipped == [] and read.total == 2
        assert [r for r in read.records if r.node == "relay2"][0] == b
        # The record and its index entry expire with the lease times asked for.
        ttl = server.command("PTTL", "pyqmgr:roster:relay1/0000aaaa")
        assert isinstance(ttl, int) and 59_000 < ttl <= 60_000
        await asyncio.sleep(0.4)
        read = await roster.read(time.time())
        assert [r.node for r in read.records] == ["relay1"]
        # A publication drops the index's expired members.
        await roster.publish(a, 60.0, time.time())
        assert server.command("ZRANGE", "pyqmgr:roster", "0", "-1") == [b"relay1/0000aaaa"]
        await roster.remove(a.member)
        assert (await roster.read(time.time())).records == []
        assert server.command("EXISTS", "pyqmgr:roster:relay1/0000aaaa") == 0
        await client.close()

    run(main)


def test_what_others_wrote_is_skipped_by_name_and_bounded(redis_server):
    server: RedisServer = redis_server()
    expires = str(int((time.time() + 600) * 1000))
    good = record("relay1")
    hand = {
        "junk/1": b"not json at all",
        "big/1": b"{" + b" " * (200 * 1024) + b"}",
        "liar/1": encode_record(record("someone-else")),
    }
    for member, data in hand.items():
        server.client().set(f"pyqmgr:roster:{member}", data)
        server.command("ZADD", "pyqmgr:roster", expires, member)
    server.command("HSET", "pyqmgr:roster:hash/1", "a", "b")
    server.command("ZADD", "pyqmgr:roster", expires, "hash/1")
    server.command("ZADD", "pyqmgr:roster", expires, "x" * 1000)
    server.command("ZADD", "pyqmgr:roster", expires, "gone/1")  # no record: skipped quietly

    async def main() -> None:
        client = RedisClient(Endpoint(host="127.0.0.1", port=server.port), timeout=2.0)
        roster = Roster(client, PREFIX)
        await roster.publish(good, 60.0, time.time())
        started = time.monotonic()
        read = await roster.read(time.time())
        took = time.monotonic() - started
        assert [r.node for r in read.records] == ["relay1"]
        why = dict(read.skipped)
        assert why["junk/1"] == "not a record: two lines of JSON expected"
        assert why["big/1"] == f"more than {MAX_RECORD} bytes"
        assert why["liar/1"].startswith("the record names another server (someone-else/")
        assert why["hash/1"].startswith("Redis answered an error: WRONGTYPE")
        assert why["x" * 80 + "..."] == "not a server's name"
        assert "gone/1" not in why and len(read.skipped) == 5
        print(f"\nroster read with 5 bad records of 7 in {took * 1000:.1f} ms")
        await client.close()

    run(main)


def test_a_thousand_records_read_in_one_round_and_no_more(redis_server):
    server: RedisServer = redis_server()
    n = MAX_RECORDS + 200

    async def main() -> None:
        client = RedisClient(Endpoint(host="127.0.0.1", port=server.port), timeout=5.0)
        roster = Roster(client, PREFIX)
        await asyncio.gather(*(roster.publish(record(f"relay{i}"), 60.0, time.time())
                               for i in range(n)))
        started = time.monotonic()
        read = await roster.read(time.time())
        took = time.monotonic() - started
        print(f"\nroster of {n} servers: {len(read.records)} read in {took * 1000:.0f} ms")
        assert len(read.records) == MAX_RECORDS and read.total == n and not read.skipped
        await client.close()

    run(main)
