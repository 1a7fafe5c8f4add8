"""The fleet's roster: each server's record of what it runs with, kept in Redis (issue #35).

Why: a fleet is only one sender if its servers agree on the limits, the lease time and
the rates, and nothing else tells a server what the others run with. So each server
publishes a record, every third of the lease time and at start, and reads the others':
to obey the stricter of any difference (:mod:`.agreement`), and for ``pyqmgr status
--fleet``, which shows the whole fleet from any of its servers.

Keys, under the fleet's prefix:

``{prefix}roster:{node}/{instance}``
    One server's record: two lines of JSON, at most :data:`MAX_RECORD` bytes in all
    (its settings and state, then the destinations it holds: agreeing reads the first
    line alone), signed with the fleet's key, written with ``SET ...
    PX`` three lease times long, so a server that stopped publishing leaves the roster
    by itself.
``{prefix}roster``
    The index: a sorted set of ``node/instance`` members scored by when their record
    expires (the publisher's wall clock, in ms: keep the servers on NTP); expired
    members are dropped at every publication, and the index itself goes a day after
    the last one.

No command touches keys of two hash slots (a record key and the index are in different
slots on a Redis Cluster): a record is read with one ``GETRANGE`` each, pipelined, which
also bounds what is read of it.

A record is input from the network: anyone who can write to Redis can write one
(issue #45). So with a fleet key (``shared_state_key_file``) each record is signed as
notices of throttling are (HMAC-SHA256 with the fleet's key over the prefix, a label and
the JSON: :func:`seal_record`), and a record whose signature is missing or wrong is
skipped before any of it is parsed (:func:`open_record`); without a key nothing can tell
a server's record from anyone's, so the daemon shows the others' records and obeys
none. What is read is bounded (at most :data:`MAX_RECORDS` records, each at most
:data:`MAX_RECORD` bytes, read :data:`BATCH` at a time), every field is checked
(:func:`parse_record`: a lease time only within what pyqmgr.cf allows, every limit
within its parameter's range), a record published longer ago than its life or from the
future is stale, and a record that fails is skipped, never half-used. The checking is
pure (:func:`examine`) and runs in a thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pyqmgr.fleet.client import RedisClient, RedisError, RedisUnavailable, Reply
from pyqmgr.fleet.settings import HOLD, LOCAL, MAX_FLEET_LIMIT, MAX_LEASE, MIN_LEASE, Limits
from pyqmgr.fleet.shared import fleet_mac, unit_name
from pyqmgr.scheduler.shaping import MAX_RATE_COUNT, MIN_PERIOD, Rate

#: The largest record published or read: the top destinations only.
MAX_RECORD = 64 * 1024
#: The most records read at once (a fleet of a thousand servers is not a small one).
MAX_RECORDS = 1000
#: The longest index member read (``node/instance``: a node name is at most 255).
MAX_MEMBER = 320
#: The most transports a record may name (the default and those with fleet limits of
#: their own: a server names more than a few only by mistake; past this many it
#: publishes the first ones), and destinations or sites it may list.
MAX_TRANSPORTS = 32
MAX_UNITS = 1000
#: The name of a record's default limits: the bare ``fleet_*`` parameters.
ANY_TRANSPORT = "*"
#: The kinds of limits: per destination, per site.
DESTINATION, SITE = "destination", "site"
#: What a server does about the shared state now: it answers, or the failure mode.
NORMAL = "normal"
MODES = (NORMAL, LOCAL, HOLD)
#: How long the index outlives the last publication: not a record's life, which
#: differs from server to server (a server of short lease time would expire the index
#: under the others' records); every publication drops its expired members anyway.
INDEX_LIFE_MS = 86_400_000
#: The longest period a rate may have in a record (pyqmgr.cf bounds none: only finite).
MAX_PERIOD = 1e9
#: A record lives this many of its lease times unless published again (three
#: publications missed: a server that stopped leaves the roster by itself); one read
#: that was published longer ago is a stale copy, skipped.
RECORD_LIFE = 3
#: How far a record's publication time may be from this server's clock (keep the
#: servers on NTP) before it is stale, or from the future.
CLOCK_SLACK = 60.0
#: Records asked of Redis in one pipeline: a read of a thousand 64 KiB records comes
#: in parts of at most 6.4 MiB, the event loop running between them.
BATCH = 100
#: A signed record: 64 hex digits of HMAC-SHA256, a space, the JSON.
MAC_SIZE = 64
#: What the MAC says a roster record is (a notice of throttling has no label).
ROSTER_LABEL = b"roster\0"
_SIGNED = re.compile(rb"[0-9a-f]{64} ")


@dataclass(frozen=True)
class UnitShare:
    """One destination (or ``site NAME``) as one server sees it."""

    transport: str
    unit: str
    #: Sessions this server holds there (deliveries under way and kept for the next).
    leases: int
    #: This server's deliveries waiting for it.
    waiting: int
    #: Sessions in use fleet-wide at this server's last answer, and the limit (0: none).
    in_use: int = 0
    limit: int = 0


@dataclass(frozen=True)
class Record:
    """A server's record: what it runs with and what it holds."""

    node: str
    instance: str
    pid: int
    version: str
    #: The key layout (pyqmgr.fleet.shared.KEY_LAYOUT): servers of two layouts count
    #: each destination in two places.
    layout: int
    #: When it was published (the publisher's wall clock).
    sent: float
    lease_time: float
    failure: str
    #: Whether the failure mode is in force now, and the Redis errors since the last
    #: good answer.
    failing: bool
    errors: int
    #: The publisher's last good answer from Redis (wall clock; None: none yet).
    last_sync: float | None
    #: transport (or :data:`ANY_TRANSPORT`) -> kind -> the limits it runs with.
    limits: dict[str, dict[str, Limits]] = field(default_factory=dict)
    units: tuple[UnitShare, ...] = ()
    #: How many destinations and sites it had, before the record kept the top ones.
    units_total: int = 0

    @property
    def member(self) -> str:
        return f"{self.node}/{self.instance}"

    @property
    def mode(self) -> str:
        """What it does now: ``normal``, or its failure mode while that is in force."""
        return self.failure if self.failing else NORMAL

    def limits_for(self, transport: str, kind: str) -> Limits | None:
        """Its limits of ``kind`` for a transport: the transport's own, else its default
        ones; None when it publishes none of that kind (a site's, with sites off)."""
        found = self.limits.get(transport) or {}
        if kind in found:
            return found[kind]
        return self.limits.get(ANY_TRANSPORT, {}).get(kind)


# -- the record as JSON ------------------------------------------------------------------


def limits_json(limits: Limits) -> dict[str, object]:
    rate = [limits.rate.count, limits.rate.period] if limits.rate is not None else None
    return {"sessions": limits.sessions, "rate": rate, "burst": limits.burst}


def encode_record(record: Record, limit: int = MAX_RECORD) -> bytes:
    """The record as published, at most ``limit`` bytes: a line of JSON (its settings
    and state), a newline, and a JSON list of as many of its destinations (listed
    busiest first) as fit. Compact JSON has no newline of its own, so a reader that
    needs only the settings parses the first line alone."""
    body: dict[str, object] = {
        "node": record.node, "instance": record.instance, "pid": record.pid,
        "version": record.version, "layout": record.layout, "sent": round(record.sent, 3),
        "lease_time": record.lease_time, "failure": record.failure,
        "failing": record.failing, "errors": record.errors,
        "last_sync": None if record.last_sync is None else round(record.last_sync, 3),
        "limits": {t: {k: limits_json(v) for k, v in kinds.items()}
                   for t, kinds in list(record.limits.items())[:MAX_TRANSPORTS]},
        "units_total": record.units_total}
    units = [[u.transport, u.unit, u.leases, u.waiting, u.in_use, u.limit]
             for u in record.units[:MAX_UNITS]]
    head = json.dumps(body, separators=(",", ":")).encode() + b"\n"
    while True:
        data = head + json.dumps(units, separators=(",", ":")).encode()
        if len(data) <= limit:
            return data
        if not units:
            raise ValueError(f"a record without destinations is {len(data)} bytes, "
                             f"more than {limit}")
        units = units[:len(units) // 2]


class _Fields:
    """Checked reads of a JSON object's members: ValueError names the member."""

    def __init__(self, obj: object, what: str) -> None:
        if not isinstance(obj, dict):
            raise ValueError(f"{what}: not a JSON object")
        self.obj, self.what = obj, what

    def text(self, name: str, longest: int, word: bool = True) -> str:
        return _text(self.obj.get(name), f"{self.what}{name}", longest, word)

    def integer(self, name: str, lo: int, hi: int) -> int:
        return _integer(self.obj.get(name), f"{self.what}{name}", lo, hi)

    def number(self, name: str, lo: float, hi: float, none: bool = False) -> float | None:
        value = self.obj.get(name)
        if value is None and none:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                math.isfinite(value) and lo <= value <= hi):
            raise ValueError(f"{self.what}{name}: {value!r:.30} is not a number from "
                             f"{lo:g} to {hi:g}")
        return float(value)


def _text(value: object, what: str, longest: int, word: bool = True) -> str:
    if not isinstance(value, str) or not value or len(value) > longest:
        raise ValueError(f"{what}: a text of 1 to {longest} characters expected")
    if not value.isprintable() or (word and any(c.isspace() for c in value)):
        raise ValueError(f"{what}: {value!r:.60} has spaces or unprintable characters")
    return value


def _integer(value: object, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{what}: {value!r:.30} is not a whole number from {lo} to {hi}")
    return value


def parse_limits(obj: object, what: str) -> Limits:
    fields = _Fields(obj, what + ": ")
    sessions = fields.integer("sessions", 0, MAX_FLEET_LIMIT)
    burst = fields.integer("burst", 1, 100_000)
    rate = fields.obj.get("rate")
    if rate is None:
        return Limits(sessions, None, burst)
    if not isinstance(rate, list) or len(rate) != 2:
        raise ValueError(f"{what}: rate: [count, period] expected")
    count, period = (_Fields({"count": rate[0], "period": rate[1]}, f"{what}: rate ")
                     .number(n, lo, hi) for n, lo, hi in (
                         ("count", 1e-9, MAX_RATE_COUNT), ("period", MIN_PERIOD, MAX_PERIOD)))
    assert count is not None and period is not None
    return Limits(sessions, Rate(count, period), burst)


def parse_record(raw: bytes, units: bool = True, memo: dict[object, object] | None = None
                 ) -> Record:
    """A record's fields, each checked; ValueError says what is wrong with one that is
    not a record (too large, not JSON, a field of the wrong type or range).

    ``units``: False leaves the second line, the destinations it lists, unread:
    agreeing needs the settings alone, and a thousand destinations are most of a
    large record's size and cost.

    ``memo``: limits already read at this read of the roster, shared by the records
    that publish the same (a fleet publishes one configuration): a thousand records
    then hold a few objects, not a hundred thousand for the collector to walk."""
    if len(raw) > MAX_RECORD:
        raise ValueError(f"{len(raw)} bytes, more than {MAX_RECORD}")
    head, newline, tail = raw.partition(b"\n")
    if not newline:
        raise ValueError("not a record: two lines of JSON expected")
    obj = _json(head)
    f = _Fields(obj, "")
    failure = f.obj.get("failure")
    if failure not in (LOCAL, HOLD):
        raise ValueError(f"failure: {failure!r:.30} is neither {LOCAL} nor {HOLD}")
    failing = f.obj.get("failing")
    if not isinstance(failing, bool):
        raise ValueError("failing: true or false expected")
    limits_obj = f.obj.get("limits")
    if not isinstance(limits_obj, dict) or len(limits_obj) > MAX_TRANSPORTS:
        raise ValueError(f"limits: an object of at most {MAX_TRANSPORTS} transports expected")
    limits: dict[str, dict[str, Limits]] = {}
    for transport, kinds in limits_obj.items():
        name = _text(transport, "limits", 64)
        if not isinstance(kinds, dict) or not set(kinds) <= {DESTINATION, SITE}:
            raise ValueError(f"limits: {name}: {DESTINATION} and {SITE} expected")
        found = {k: parse_limits(v, f"limits: {name}: {k}") for k, v in kinds.items()}
        if memo is not None:
            shared = tuple(sorted((k, memo.setdefault(v, v)) for k, v in found.items()))
            found = memo.setdefault(shared, found)  # type: ignore[assignment]
        limits[name] = found
    shares: tuple[UnitShare, ...] = ()
    if units:
        units_obj = _json(tail)
        if not isinstance(units_obj, list) or len(units_obj) > MAX_UNITS:
            raise ValueError(f"units: a list of at most {MAX_UNITS} expected")
        shares = tuple(_unit(u) for u in units_obj)
    last_sync = f.number("last_sync", 0.0, 1e11, none=True)
    return Record(
        f.text("node", 255), f.text("instance", 64), f.integer("pid", 0, 2**31),
        f.text("version", 64), f.integer("layout", 0, 1000),
        f.number("sent", 0.0, 1e11) or 0.0, f.number("lease_time", MIN_LEASE, MAX_LEASE) or 0.0,
        str(failure), failing, f.integer("errors", 0, 2**62), last_sync, limits, shares,
        f.integer("units_total", 0, 2**62))


def _json(data: bytes) -> object:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ValueError("not JSON") from None


def _unit(value: object) -> UnitShare:
    if not isinstance(value, list) or len(value) != 6:
        raise ValueError("units: [transport, name, leases, waiting, in use, limit] expected")
    transport = _text(value[0], "units: transport", 64)
    # A name longer than the fleet's units (an older server's long site name) is
    # bounded as every server bounds it, not a reason to drop the whole record.
    name = unit_name(_text(value[1], "units: name", MAX_RECORD, word=False))
    leases, waiting, in_use, limit = (_integer(v, "units: count", 0, 2**62)
                                      for v in value[2:])
    return UnitShare(transport, name, leases, waiting, in_use, limit)


# -- signatures ------------------------------------------------------------------------


def seal_record(data: bytes, key: bytes, prefix: str) -> bytes:
    """The record as published: signed with the fleet's key (its MAC, a space, the
    JSON), or the JSON alone without a key."""
    if not key:
        return data
    return fleet_mac(key, prefix, data, ROSTER_LABEL) + b" " + data


def open_record(raw: bytes, key: bytes, prefix: str) -> bytes:
    """The record's JSON, before any of it is parsed. With a key, only when signed
    with it: ValueError otherwise. Without one, a signature is taken off unchecked:
    such a server shows what the others publish and obeys none of it."""
    if len(raw) > MAC_SIZE + 1 + MAX_RECORD:
        raise ValueError(f"more than {MAX_RECORD} bytes")
    signed = _SIGNED.match(raw) is not None
    if not key:
        return raw[MAC_SIZE + 1:] if signed else raw
    if not signed:
        raise ValueError("not signed (a server without shared_state_key_file, or a pyqmgr "
                         "that signs no records)")
    import hmac

    body = raw[MAC_SIZE + 1:]
    if not hmac.compare_digest(raw[:MAC_SIZE], fleet_mac(key, prefix, body, ROSTER_LABEL)):
        raise ValueError("not signed with this fleet's key")
    return body


# -- Redis -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RosterRead:
    """What one read of the roster found."""

    records: list[Record]
    #: Records skipped: (the index member, why).
    skipped: list[tuple[str, str]]
    #: Members in the index (more than were read when over the bound; it may count
    #: records that expired since the last publication dropped them).
    total: int


@dataclass(frozen=True)
class Fetched:
    """The roster as Redis gave it, nothing of the records parsed yet."""

    #: The members read, and what Redis answered for each (bytes, an error, None).
    members: list[str]
    replies: list[Reply]
    #: Index members that are no server's name.
    skipped: list[tuple[str, str]]
    total: int


def examine(fetched: Fetched, key: bytes, prefix: str, now: float, units: bool = True,
            pause: Callable[[], None] | None = None) -> RosterRead:
    """The records of a read, each checked (signature first, then every field, then
    that it names its member and is fresh); pure, so a thread can run it. ``now``:
    the wall clock. ``pause`` is called between records (a thread gives up the GIL
    there, so the event loop never waits long for it)."""
    skipped = list(fetched.skipped)
    records: list[Record] = []
    memo: dict[object, object] = {}
    for member, raw in zip(fetched.members, fetched.replies, strict=True):
        if pause is not None:
            pause()
        try:
            record = _record(raw, key, prefix, units, memo)
        except ValueError as exc:
            skipped.append((member, str(exc)))
            continue
        if record is None:
            continue  # expired between the two reads
        age = now - record.sent
        if record.member != member:
            skipped.append((member, f"the record names another server "
                                    f"({record.member[:80]})"))
        elif age > RECORD_LIFE * record.lease_time + CLOCK_SLACK:
            skipped.append((member, f"published {age:.0f} s ago, longer than its life: "
                                    "a stale copy"))
        elif age < -CLOCK_SLACK:
            skipped.append((member, f"published {-age:.0f} s from now: check the servers' "
                                    "clocks"))
        else:
            records.append(record)
    return RosterRead(records, skipped, fetched.total)


class Roster:
    """The roster's keys, over the fleet's :class:`RedisClient`; ``key``: the fleet's
    key, which signs what is published and must have signed what is read (none:
    unsigned, see :func:`open_record`)."""

    def __init__(self, client: RedisClient, prefix: str, key: bytes = b"") -> None:
        self.client = client
        self.prefix = prefix
        self.fleet_key = key
        self.index = f"{prefix}roster"
        self._key_prefix = f"{prefix}roster:"

    def key(self, member: str) -> str:
        return self._key_prefix + member

    async def publish(self, record: Record, ttl: float, now: float) -> None:
        """Write the record for ``ttl`` seconds and drop the index's expired members.
        ``now`` is the wall clock (time.time())."""
        ttl_ms = max(1, int(ttl * 1000))
        now_ms = int(now * 1000)
        data = seal_record(encode_record(record), self.fleet_key, self.prefix)
        _checked(await self.client.pipeline([
            ("SET", self.key(record.member), data, "PX", ttl_ms),
            ("ZADD", self.index, now_ms + ttl_ms, record.member),
            ("ZREMRANGEBYSCORE", self.index, "-inf", now_ms),
            ("PEXPIRE", self.index, max(ttl_ms, INDEX_LIFE_MS))]))

    async def remove(self, member: str) -> None:
        """Take a record out (its server stops)."""
        _checked(await self.client.pipeline([("DEL", self.key(member)),
                                             ("ZREM", self.index, member)]))

    async def fetch(self, now: float, limit: int = MAX_RECORDS) -> Fetched:
        """The unexpired records as Redis has them, at most ``limit``, each cut at a
        signed record's largest size; :data:`BATCH` records a round trip."""
        now_ms = int(now * 1000)
        listed, total = _checked(await self.client.pipeline([
            ("ZRANGEBYSCORE", self.index, now_ms, "+inf", "LIMIT", 0, limit),
            ("ZCARD", self.index)]))
        if not isinstance(listed, list) or not isinstance(total, int):
            raise RedisUnavailable(f"unexpected reply reading the roster: {listed!r:.80}")
        skipped: list[tuple[str, str]] = []
        members: list[str] = []
        for item in listed[:limit]:
            if not isinstance(item, bytes) or len(item) > MAX_MEMBER:
                skipped.append((_shown(item), "not a server's name"))
                continue
            members.append(item.decode("utf-8", "replace"))
        replies: list[Reply] = []
        for at in range(0, len(members), BATCH):
            replies += await self.client.pipeline(
                [("GETRANGE", self.key(m), 0, MAC_SIZE + 1 + MAX_RECORD)
                 for m in members[at:at + BATCH]])
        return Fetched(members, replies, skipped, total)

    async def read(self, now: float, limit: int = MAX_RECORDS, units: bool = True
                   ) -> RosterRead:
        """The unexpired records, at most ``limit`` of them, each checked in a thread
        (:func:`examine`), which gives way to the event loop after each."""
        fetched = await self.fetch(now, limit)
        return await asyncio.to_thread(examine, fetched, self.fleet_key, self.prefix, now,
                                       units, give_way)


def give_way() -> None:
    """In a thread: let the event loop's thread have the GIL now if it waits for it
    (sleep releases it), rather than after the interpreter's 5 ms switch interval."""
    time.sleep(0)


def _record(raw: Reply, key: bytes, prefix: str, units: bool,
            memo: dict[object, object] | None = None) -> Record | None:
    if isinstance(raw, RedisError):
        raise ValueError(f"Redis answered an error: {raw.message[:200]}")
    if not isinstance(raw, bytes):
        raise ValueError(f"not a string ({type(raw).__name__})")
    if not raw:
        return None
    return parse_record(open_record(raw, key, prefix), units, memo)


def _shown(item: object) -> str:
    text = item.decode("utf-8", "replace") if isinstance(item, bytes) else repr(item)
    return text[:80] + ("..." if len(text) > 80 else "")


def _checked(replies: Sequence[Reply]) -> list[Reply]:
    for reply in replies:
        if isinstance(reply, RedisError):
            raise RedisUnavailable(f"Redis answered an error: {reply.message}")
    return list(replies)
