"""The roster signed and bounded (issue #45, item 3), without Redis.

A record is signed with the fleet's key as notices of throttling are, and checked before
any of it is parsed; without a key a server obeys no other's record. What is obeyed is
bounded: a lease time only within pyqmgr.cf's range, agreement work and differences
capped; a unit's name bounded the same way on every server.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time

import pytest

from pyqmgr.fleet.agreement import MAX_COMPARED, MAX_DIFFERENCES, Ours, agree
from pyqmgr.fleet.roster import (
    ANY_TRANSPORT,
    CLOCK_SLACK,
    DESTINATION,
    MAX_RECORD,
    Fetched,
    UnitShare,
    encode_record,
    examine,
    open_record,
    parse_record,
    seal_record,
)
from pyqmgr.fleet.settings import Limits
from pyqmgr.fleet.shared import MAX_UNIT_NAME, NoticeSeal, fleet_mac, unit_name
from pyqmgr.scheduler.decisions import DEAD, Throttling
from tests.unit.test_fleet_roster import KEY, record, roster

PREFIX = "pyqmgr:"


def test_a_record_is_signed_with_the_fleet_key_and_opened_only_with_it():
    data = encode_record(record())
    sealed = seal_record(data, KEY, PREFIX)
    mac, _, body = sealed.partition(b" ")
    assert body == data
    assert mac == hmac.new(KEY, b"pyqmgr:\0roster\0" + data, hashlib.sha256).hexdigest().encode()
    assert open_record(sealed, KEY, PREFIX) == data
    assert parse_record(open_record(sealed, KEY, PREFIX)) == record()
    for bad, why in [
            (data, "not signed"),                                    # an older server's
            (seal_record(data, b"x" * 32, PREFIX), "not signed with this fleet's key"),
            (seal_record(data, KEY, "other:"), "not signed with this fleet's key"),
            (sealed[:-2] + b"9}", "not signed with this fleet's key"),  # changed after
            (b"0" * 64 + b" " + data, "not signed with this fleet's key"),
            (b"x" * (MAX_RECORD + 66), f"more than {MAX_RECORD} bytes")]:
        with pytest.raises(ValueError) as exc:
            open_record(bad, KEY, PREFIX)
        assert str(exc.value).startswith(why), (bad[:80], str(exc.value))
    # Without a key: published unsigned, and a signature read is taken off unchecked.
    assert seal_record(data, b"", PREFIX) == data
    assert open_record(sealed, b"", PREFIX) == data == open_record(data, b"", PREFIX)


def test_a_notice_and_a_record_are_never_taken_for_each_other():
    """The same key signs both; the label keeps each signature to its own kind."""
    seal = NoticeSeal(KEY, PREFIX)
    notice = seal.seal(Throttling("smtp", "a.example", "a.example", DEAD, "4.4.1", "x",
                                  60.0, ""), "relay2", "0a1b2c3d", time.time())
    mac, _, body = notice.encode().partition(b" ")
    assert mac == fleet_mac(KEY, PREFIX, body)
    with pytest.raises(ValueError, match="not signed with this fleet's key"):
        open_record(notice.encode(), KEY, PREFIX)
    sealed = seal_record(encode_record(record()), KEY, PREFIX)
    with pytest.raises(ValueError, match="not signed with this fleet's key"):
        seal.open(sealed, time.time())


def fetched(*records: tuple[str, bytes]) -> Fetched:
    return Fetched([m for m, _ in records], [d for _, d in records], [], len(records))


def test_examine_checks_the_signature_the_member_and_the_age():
    now = 1_800_000_000.0
    good = record(sent=now - 10)
    stale = record("relay3", sent=now - 3 * 60 - CLOCK_SLACK - 1)
    ahead = record("relay4", sent=now + CLOCK_SLACK + 1)
    read = examine(fetched(
        ("relay2/0a1b2c3d", seal_record(encode_record(good), KEY, PREFIX)),
        ("relay3/0a1b2c3d", seal_record(encode_record(stale), KEY, PREFIX)),
        ("relay4/0a1b2c3d", seal_record(encode_record(ahead), KEY, PREFIX)),
        ("forged/1", encode_record(record("forged", "1", sent=now))),
        ("liar/1", seal_record(encode_record(record("x", sent=now)), KEY, PREFIX)),
        ("gone/1", b"")), KEY, PREFIX, now, units=False)
    assert read.records == [record(sent=now - 10, units=())]
    why = dict(read.skipped)
    assert why["relay3/0a1b2c3d"].startswith("published 241 s ago, longer than its life")
    assert why["relay4/0a1b2c3d"].startswith("published 61 s from now: check the servers'")
    assert why["forged/1"].startswith("not signed (a server without shared_state_key_file")
    assert why["liar/1"].startswith("the record names another server (x/")
    assert len(why) == 4


def test_a_forged_record_in_the_daemon_changes_nothing():
    """Strict limits, a day's lease time, unsigned: skipped, warned of, nothing obeyed."""
    fr, log = roster("fleet_destination_concurrency_limit = 10\n", [0.0])
    strict = {ANY_TRANSPORT: {DESTINATION: Limits(1)}}
    head, _, tail = encode_record(record("evil", limits=strict)).partition(b"\n")
    raw = json.loads(head)
    raw["lease_time"] = 86400
    read = examine(fetched(("evil/0a1b2c3d", json.dumps(raw).encode() + b"\n" + tail)),
                   KEY, PREFIX, 1_800_000_000.0)
    fr.heard(read)
    assert fr.source.units.overrides == {} and fr.lease_time == 60.0
    assert fr.source.units.limits("smtp") == Limits(10)
    assert log.lines == ["warning: fleet: skipped the roster record of evil/0a1b2c3d: not "
                         "signed (a server without shared_state_key_file, or a pyqmgr that "
                         "signs no records); this warning at most once a minute per server"]


def test_without_a_key_no_record_is_obeyed_and_that_is_said_once():
    fr, log = roster("fleet_destination_concurrency_limit = 10\n", key=False)
    stricter = record("node0", limits={ANY_TRANSPORT: {DESTINATION: Limits(5)}},
                      lease_time=120.0)
    fr.heard(examine(fetched(("node0/0a1b2c3d", encode_record(stricter))), b"", PREFIX,
                     stricter.sent))
    fr.heard(examine(fetched(("node0/0a1b2c3d", encode_record(stricter))), b"", PREFIX,
                     stricter.sent))
    assert fr.servers == 1 and fr.source.units.overrides == {} and fr.lease_time == 60.0
    assert log.lines == ["warning: fleet: 1 other servers in the roster; without "
                         "shared_state_key_file no record is signed, so this node compares "
                         "and obeys none of their settings (set the same key on every "
                         "server)"]


def test_a_longer_lease_is_in_force_for_leases_only_and_at_most_an_hour():
    fr, _ = roster("shared_state_lease_time = 30s\n")
    fr.heard(examine(fetched(("node0/0a1b2c3d", seal_record(encode_record(record(
        "node0", lease_time=3600.0)), KEY, PREFIX))), KEY, PREFIX, 1_800_000_000.0))
    assert fr.lease_time == 3600.0 and fr.source.shared.lease_ms == 3_600_000
    # The roster's and the renewal's loops sleep a third of this server's own.
    assert fr.source.settings.lease_time / 3 == 10.0


def ours(**kw: object) -> Ours:
    base: dict[str, object] = dict(
        node="relay1", lease_time=60.0, layout=2,
        own=lambda t, kind: Limits(10), grouped=lambda t: False, named=frozenset())
    base.update(kw)
    return Ours(**base)  # type: ignore[arg-type]


def test_agreement_is_bounded_in_transports_and_differences():
    """A thousand records of 256 transports each: at most MAX_COMPARED of the
    transports only others name are compared, and MAX_DIFFERENCES kept; the rest
    counted. The known transports are always compared."""
    limits = {ANY_TRANSPORT: {DESTINATION: Limits(10)}}
    for i in range(255):
        limits[f"t{i:03}"] = {DESTINATION: Limits(1 + i % 7)}
    others = [record(f"n{i}", limits=limits) for i in range(1000)]
    started = time.process_time()
    got = agree(ours(known=frozenset({"t254"})), others)
    took = time.process_time() - started
    print(f"\nagree(), 1,000 records of 256 transports: {took * 1000:.0f} ms CPU, "
          f"{len(got.found)} differences kept, {got.more} more, {got.uncompared} "
          "transports uncompared")
    assert len(got.found) == MAX_DIFFERENCES and got.more > 0
    assert got.uncompared == 254 - MAX_COMPARED
    compared = {t for t, _ in got.overrides}
    assert "t254" in compared and len(compared) == MAX_COMPARED + 2
    assert got.overrides[("t254", DESTINATION)] == Limits(1 + 254 % 7)


def test_a_long_unit_name_is_bounded_alike_everywhere():
    site = "site " + ".".join(["mx-" + "a" * 60] * 34)[:2055]
    bounded = unit_name(site)
    assert len(bounded) == MAX_UNIT_NAME and bounded.startswith("site mx-aaa")
    assert bounded == unit_name(site), "stable"
    assert unit_name(site[:-1] + "b") != bounded, "two long names stay two"
    assert unit_name("gmail.com") == "gmail.com" and unit_name(bounded) == bounded
    # An older server's record listing the whole name is read, the name bounded.
    rec = record(units=(UnitShare("smtp", site, 1, 2, 3, 4),))
    assert parse_record(encode_record(rec)).units[0].unit == bounded
