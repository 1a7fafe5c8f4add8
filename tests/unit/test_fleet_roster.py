"""The fleet's roster without Redis (issue #35): records written and read back, every
damaged record refused by name, the stricter rule, the overrides it makes, the
warnings it logs once, and the cap on waits read from Redis.

A record is input from the network (anyone who can write to Redis can write one), so
parsing never raises anything but ValueError and never half-uses a record.
"""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import pytest

from pyqmgr.daemon.fleet.roster import FleetRoster
from pyqmgr.daemon.fleet.stats import FleetStats
from pyqmgr.daemon.fleet.units import FleetUnits
from pyqmgr.fleet.agreement import (
    WAIT_MARGIN,
    differences,
    lease_difference,
    stricter,
    wait_bound,
)
from pyqmgr.fleet.client import RedisUnavailable
from pyqmgr.fleet.roster import (
    ANY_TRANSPORT,
    DESTINATION,
    MAX_RECORD,
    SITE,
    Record,
    RosterRead,
    UnitShare,
    encode_record,
    parse_record,
)
from pyqmgr.fleet.settings import FleetSettings, Limits, fleet_settings
from pyqmgr.fleet.shared import KEY_LAYOUT, RECOUNT_MS
from pyqmgr.pyqmgr_cf import from_text
from pyqmgr.scheduler.shaping import Rate

NAMES = ("fleet_destination_concurrency_limit", "fleet_destination_rate",
         "fleet_destination_rate_burst")


def record(node: str = "relay2", instance: str = "0a1b2c3d", **changes: object) -> Record:
    base: dict[str, object] = dict(
        node=node, instance=instance, pid=4242, version="0.1.0", layout=KEY_LAYOUT,
        sent=1_800_000_000.0, lease_time=60.0, failure="local", failing=False, errors=0,
        last_sync=1_799_999_999.5,
        limits={ANY_TRANSPORT: {DESTINATION: Limits(5)},
                "smtp": {DESTINATION: Limits(10, Rate(10, 1.0), 2)}},
        units=(UnitShare("smtp", "gmail.com", 3, 40, 9, 10),
               UnitShare("smtp", "site yahoo", 1, 0, 1, 10)),
        units_total=2)
    base.update(changes)
    return Record(**base)  # type: ignore[arg-type]


def test_a_record_reads_back_as_written():
    rec = record()
    assert parse_record(encode_record(rec)) == rec
    assert rec.member == "relay2/0a1b2c3d" and rec.mode == "normal"
    assert record(failing=True, failure="hold").mode == "hold"
    # The transport's own limits, else the default ones; none of a kind not published.
    assert rec.limits_for("smtp", DESTINATION) == Limits(10, Rate(10, 1.0), 2)
    assert rec.limits_for("relay", DESTINATION) == Limits(5)
    assert rec.limits_for("relay", SITE) is None


def test_a_large_record_keeps_the_busiest_destinations_within_64_kib():
    units = tuple(UnitShare("smtp", f"d{i:05}.example" + "x" * 200, 5000 - i, 0)
                  for i in range(5000))
    data = encode_record(record(units=units, units_total=5000))
    assert len(data) <= MAX_RECORD
    got = parse_record(data)
    assert 100 < len(got.units) < 5000 and got.units_total == 5000
    assert got.units == units[:len(got.units)], "the first (busiest) kept, in order"


def good() -> dict[str, object]:
    """A record's two lines as one object (``units``: the second line's list)."""
    head, _, tail = encode_record(record()).partition(b"\n")
    return {**json.loads(head), "units": json.loads(tail)}


def two_lines(obj: dict[str, object]) -> bytes:
    head = {k: v for k, v in obj.items() if k != "units"}
    return (json.dumps(head) + "\n" + json.dumps(obj.get("units"))).encode()


@pytest.mark.parametrize(("change", "error"), [
    ({"node": "two words"}, "node: 'two words' has spaces"),
    ({"node": ""}, "node: a text of 1 to 255 characters expected"),
    ({"node": "n" * 256}, "node: a text of 1 to 255"),
    ({"instance": 7}, "instance: a text"),
    ({"pid": "4242"}, "pid: '4242' is not a whole number"),
    ({"pid": True}, "pid: True is not a whole number"),
    ({"layout": -1}, "layout: -1 is not a whole number"),
    ({"sent": float("nan")}, "sent: nan is not a number"),
    ({"sent": "now"}, "sent: 'now' is not a number"),
    ({"lease_time": 0}, "lease_time: 0 is not a number"),
    ({"lease_time": 1e12}, "lease_time: 1000000000000.0 is not a number"),
    # Only what pyqmgr.cf allows (2s to 1h): a day's lease time is no record's.
    ({"lease_time": 86400}, "lease_time: 86400 is not a number from 2 to 3600"),
    ({"lease_time": 1.5}, "lease_time: 1.5 is not a number from 2 to 3600"),
    ({"failure": "panic"}, "failure: 'panic' is neither local nor hold"),
    ({"failing": 1}, "failing: true or false expected"),
    ({"errors": -3}, "errors: -3 is not a whole number"),
    ({"last_sync": "yesterday"}, "last_sync: 'yesterday' is not a number"),
    ({"limits": []}, "limits: an object of at most 32 transports expected"),
    ({"limits": {f"t{i}": {} for i in range(33)}}, "limits: an object of at most 32"),
    ({"limits": {"a b": {}}}, "limits: 'a b' has spaces"),
    ({"limits": {"smtp": {"destination": {"sessions": -1, "burst": 1}}}},
     "limits: smtp: destination: sessions: -1 is not a whole number from 0 to 100000"),
    ({"limits": {"smtp": {"destination": {"sessions": 5, "burst": 0}}}},
     "limits: smtp: destination: burst: 0 is not a whole number"),
    ({"limits": {"smtp": {"destination": {"sessions": 5, "burst": 1, "rate": [0, 1]}}}},
     "limits: smtp: destination: rate count: 0 is not a number"),
    ({"limits": {"smtp": {"destination": {"sessions": 5, "burst": 1, "rate": [1, 0]}}}},
     "limits: smtp: destination: rate period: 0 is not a number"),
    ({"limits": {"smtp": {"destination": {"sessions": 5, "burst": 1, "rate": "10/1s"}}}},
     "limits: smtp: destination: rate: [count, period] expected"),
    ({"limits": {"smtp": {"elsewhere": {}}}}, "limits: smtp: destination and site expected"),
    ({"limits": {"smtp": []}}, "limits: smtp: destination and site expected"),
    ({"units": {}}, "units: a list of at most 1000 expected"),
    ({"units": [["smtp", "gmail.com", 1, 2, 3, 4]] * 1001}, "units: a list of at most"),
    ({"units": [["smtp", "gmail.com", 1, 2, 3]]}, "units: [transport, name, leases"),
    ({"units": [["smtp", "gmail.com", -1, 2, 3, 4]]}, "units: count: -1 is not a whole"),
    ({"units": [["smtp", "", 1, 2, 3, 4]]}, "units: name: a text of 1 to 65536"),
    ({"units": [["smtp", "a\nb", 1, 2, 3, 4]]}, "units: name: 'a\\nb' has spaces or"),
    ({"units_total": 1.5}, "units_total: 1.5 is not a whole number"),
])
def test_a_bad_field_is_refused_by_name(change, error):
    obj = {**good(), **change}
    with pytest.raises(ValueError) as exc:
        parse_record(two_lines(obj))
    assert str(exc.value).startswith(error), str(exc.value)


@pytest.mark.parametrize(("raw", "error"), [
    (b"", "not a record: two lines"), (b"{", "not a record: two lines"),
    (b"{\n[]", "not JSON"), (b"\xff\xfe\n[]", "not JSON"),
    (b"[1, 2]\n[]", ": not a JSON object"), (b'"node"\n[]', ": not a JSON object"),
    (b"[" * 60_000 + b"\n[]", "not JSON"), (b"{}\n[]", "failure: None is neither"),
    (two_lines({**good(), "units": None})[:-4] + b"[[", "not JSON"),
    (b"x" * (MAX_RECORD + 1), f"{MAX_RECORD + 1} bytes, more than {MAX_RECORD}"),
])
def test_what_is_not_a_record_is_refused(raw, error):
    with pytest.raises(ValueError) as exc:
        parse_record(raw)
    assert str(exc.value).startswith(error), str(exc.value)


def test_a_record_cut_or_damaged_anywhere_raises_only_valueerror():
    data = encode_record(record())
    for cut in range(len(data)):
        for damaged in (data[:cut], data[:cut] + b"\x00" + data[cut + 1:],
                        data[:cut] + b"9" + data[cut + 1:]):
            try:
                parse_record(damaged)
            except ValueError:
                pass


# -- the stricter rule ------------------------------------------------------------------


@pytest.mark.parametrize(("own", "theirs", "obeyed"), [
    (Limits(5), Limits(10), Limits(5)),
    (Limits(10), Limits(5), Limits(5)),
    (Limits(0), Limits(5), Limits(5)),   # no limit is looser than any
    (Limits(5), Limits(0), Limits(5)),
    (Limits(0, Rate(10, 1.0), 2), Limits(0, Rate(600, 60.0), 5), Limits(0, Rate(10, 1.0), 2)),
    (Limits(0, Rate(10, 1.0), 2), Limits(0, Rate(1, 86400.0), 9),
     Limits(0, Rate(1, 86400.0), 2)),   # the slowest rate, the smallest burst
    (Limits(5, None, 7), Limits(0, Rate(2, 1.0), 3), Limits(5, Rate(2, 1.0), 3)),
    (Limits(5, Rate(2, 1.0), 3), Limits(8, None, 1), Limits(5, Rate(2, 1.0), 3)),
    (Limits(5, None, 4), Limits(5, None, 1), Limits(5, None, 4)),  # no rate: no burst
])
def test_the_stricter_is_obeyed_part_by_part(own, theirs, obeyed):
    assert stricter(own, theirs) == obeyed


def test_differences_name_both_values_and_what_is_obeyed():
    got = differences(Limits(5, Rate(10, 1.0), 2), Limits(10, Rate(1, 60.0), 4), NAMES)
    assert [(d.setting, d.theirs, d.ours, d.obeyed) for d in got] == [
        ("fleet_destination_concurrency_limit", "10", "5", "5"),
        ("fleet_destination_rate", "1/m", "10/s", "1/m"),
        ("fleet_destination_rate_burst", "4", "2", "2")]
    # The same number of starts a second is no difference, however it is written.
    assert differences(Limits(0, Rate(10, 1.0)), Limits(0, Rate(600, 60.0)), NAMES) == []
    assert differences(Limits(5, None, 3), Limits(5, None, 1), NAMES) == []
    lease = lease_difference(60.0, 120.0, "shared_state_lease_time")
    assert lease is not None and (lease.theirs, lease.ours, lease.obeyed, lease.rule) == (
        "120s", "60s", "120s", "longer")
    assert lease_difference(60.0, 60.0, "shared_state_lease_time") is None


def test_the_wait_bound_is_what_the_settings_explain():
    recount = RECOUNT_MS / 1000
    assert wait_bound(None, recount) == recount + WAIT_MARGIN
    assert wait_bound(Limits(5), recount) == recount + WAIT_MARGIN
    assert wait_bound(Limits(0, Rate(1, 60.0), 2), recount) == 120 + WAIT_MARGIN
    assert wait_bound(Limits(0, Rate(100, 1.0), 50), recount) == recount + WAIT_MARGIN


# -- the daemon's side: overrides, warnings, the cap ------------------------------------


class Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def warning(self, text: str) -> None:
        self.lines.append("warning: " + text)

    def info(self, text: str) -> None:
        self.lines.append(text)


KEY = b"k" * 32


def roster(cf: str, now: list[float] | None = None, key: bool = True
           ) -> tuple[FleetRoster, Log]:
    settings = fleet_settings(from_text("shared_state = redis://127.0.0.1:6379\n"
                                        "shared_state_node = relay1\n" + cf), "relay1",
                              key=KEY if key else b"")
    assert isinstance(settings, FleetSettings)
    log = Log()
    host = SimpleNamespace(log=log, scheduler=SimpleNamespace(sites=None, transports={}))
    clock = (lambda: now[0]) if now is not None else (lambda: 0.0)
    source = SimpleNamespace(
        host=host, settings=settings, units=FleetUnits(host, settings),  # type: ignore[arg-type]
        shared=SimpleNamespace(instance="ffff0000", lease_ms=60_000, client=None),
        stats=FleetStats(clock), leases={}, spares={}, seen={}, down=False, clock=clock)
    return FleetRoster(source), log  # type: ignore[arg-type]


def test_a_looser_node_obeys_the_stricter_and_says_so_once():
    """node1 at 10 sessions meets node0 at 5: a warning naming both, 5 obeyed; the
    same read again logs nothing; node0 gone, its own 10 again."""
    fr, log = roster("smtp_fleet_destination_concurrency_limit = 10\n")
    units = fr.source.units
    assert units.limits("smtp") == Limits(10)
    node0 = record("node0", limits={ANY_TRANSPORT: {DESTINATION: Limits(0)},
                                    "smtp": {DESTINATION: Limits(5)}})
    fr.heard(RosterRead([node0, fr.record()], [], 2))
    assert log.lines == ["warning: fleet: node node0 publishes "
                         "smtp_fleet_destination_concurrency_limit = 5, this node 10; "
                         "obeying the stricter (5)"]
    assert units.limits("smtp") == Limits(5)
    assert units.limits("relay") is None, "a transport nobody limits stays unlimited"
    assert fr.servers == 2 and len(fr.differences) == 1
    fr.heard(RosterRead([node0], [], 1))
    assert len(log.lines) == 1, "once per difference"
    fr.heard(RosterRead([record("node0", limits={
        ANY_TRANSPORT: {DESTINATION: Limits(0)}, "smtp": {DESTINATION: Limits(3)}})], [], 1))
    assert log.lines[-1].endswith("= 3, this node 10; obeying the stricter (3)")
    assert units.limits("smtp") == Limits(3)
    fr.heard(RosterRead([], [], 0))
    assert log.lines[-1] == ("fleet: node node0 no longer differs from this node on "
                             "smtp_fleet_destination_concurrency_limit")
    assert units.limits("smtp") == Limits(10) and units.overrides == {}


def test_the_stricter_node_keeps_its_own_and_says_so():
    fr, log = roster("smtp_fleet_destination_concurrency_limit = 5\n")
    fr.heard(RosterRead([record("node1", limits={
        ANY_TRANSPORT: {DESTINATION: Limits(0)}, "smtp": {DESTINATION: Limits(10)}})], [], 1))
    assert log.lines == ["warning: fleet: node node1 publishes "
                         "smtp_fleet_destination_concurrency_limit = 10, this node 5; "
                         "obeying the stricter (5)"]
    assert fr.source.units.limits("smtp") == Limits(5)


def test_a_default_limit_elsewhere_limits_every_transport_here():
    """The bare parameter on another node: said once (not per transport), obeyed by
    every transport without one of its own here, a transport's own kept where stricter."""
    fr, log = roster("relay_fleet_destination_concurrency_limit = 2\n")
    fr.heard(RosterRead([record("node0", limits={ANY_TRANSPORT: {DESTINATION: Limits(8)}})],
                        [], 1))
    units = fr.source.units
    assert units.limits("smtp") == Limits(8) and units.limits("lmtp") == Limits(8)
    assert units.limits("relay") == Limits(2)
    assert units.limits("retry") is None, "retry and error never ask the fleet"
    assert [line.split(" publishes ")[1].split(" = ")[0] for line in log.lines] == [
        "fleet_destination_concurrency_limit", "relay_fleet_destination_concurrency_limit"]


def test_rates_lease_time_and_layout_differences():
    fr, log = roster("fleet_destination_rate = 10/1s\nfleet_destination_rate_burst = 4\n"
                     "shared_state_lease_time = 30s\n")
    fr.heard(RosterRead([record("node0", lease_time=120.0, layout=1, limits={
        ANY_TRANSPORT: {DESTINATION: Limits(0, Rate(1, 86400.0), 2)}})], [], 1))
    assert sorted(log.lines) == sorted([
        "warning: fleet: node node0 publishes fleet_destination_rate = 1/d, this node "
        "10/s; obeying the stricter (1/d)",
        "warning: fleet: node node0 publishes fleet_destination_rate_burst = 2, this node "
        "4; obeying the stricter (2)",
        "warning: fleet: node node0 publishes shared_state_lease_time = 120s, this node "
        "30s; obeying the longer (120s)",
        "warning: fleet: node node0 publishes key layout 1, this node 2: the two count "
        "each destination's sessions under different keys, so the fleet's limits hold "
        "only among servers of one layout; run one pyqmgr version on every server"])
    assert fr.source.units.limits("smtp") == Limits(0, Rate(1, 86400.0), 2)
    assert fr.lease_time == 120.0 and fr.source.shared.lease_ms == 120_000


def test_this_nodes_own_older_records_are_not_compared():
    """A restarted qmgr's previous record (same node, another instance) may still be in
    the roster with the settings before the reload: never a difference."""
    fr, log = roster("smtp_fleet_destination_concurrency_limit = 5\n")
    fr.heard(RosterRead([record("relay1", "00000001", limits={
        ANY_TRANSPORT: {DESTINATION: Limits(1)}})], [], 1))
    assert log.lines == [] and fr.source.units.overrides == {}


def test_differences_are_logged_in_bounded_number():
    fr, log = roster("")
    others = [record(f"node{i}", limits={ANY_TRANSPORT: {DESTINATION: Limits(i + 1)}})
              for i in range(50)]
    fr.heard(RosterRead(others, [], 50))
    assert len(log.lines) == 21 and log.lines[-1] == (
        "warning: fleet: 30 more differences with other servers (pyqmgr status --fleet "
        "lists them)")
    assert fr.source.units.limits("smtp") == Limits(1)


def test_skipped_records_warn_once_a_minute_per_server():
    now = [100.0]
    fr, log = roster("", now)
    fr.heard(RosterRead([], [("evil/1", "not JSON"), ("evil/2", "not JSON")], 2))
    fr.heard(RosterRead([], [("evil/1", "not JSON")], 1))
    assert log.lines == [
        f"warning: fleet: skipped the roster record of evil/{n}: not JSON; this warning "
        "at most once a minute per server" for n in (1, 2)]
    now[0] += 30
    fr.heard(RosterRead([], [("evil/1", "not JSON"), ("evil/3", "not signed")], 2))
    assert log.lines[-1].startswith("warning: fleet: skipped the roster record of evil/3: "
                                    "not signed;") and len(log.lines) == 3
    now[0] += 31
    fr.heard(RosterRead([], [("evil/1", "more than 65536 bytes")], 1))
    assert len(log.lines) == 4 and fr.skipped == 6


def test_a_thousand_skipped_records_make_twenty_one_lines():
    fr, log = roster("", [0.0])
    fr.heard(RosterRead([], [(f"evil{i}/1", "not signed") for i in range(1000)], 1000))
    fr.heard(RosterRead([], [(f"evil{i}/1", "not signed") for i in range(1000)], 1000))
    assert len(log.lines) == 21 and log.lines[-1] == (
        "warning: fleet: skipped the roster records of 980 more servers (pyqmgr status "
        "--fleet lists them)")
    assert fr.skipped == 2000


def test_a_wait_read_from_redis_is_capped_and_counted():
    now = [0.0]
    fr, log = roster("fleet_destination_rate = 10/1s\nfleet_destination_rate_burst = 2\n", now)
    limits = fr.source.units.limits("smtp")
    assert fr.cap(0.1, limits, "smtp", "gmail.com") == 0.1
    assert fr.cap(2.5, limits, "smtp", "gmail.com") == 2.5, "a recount's pause is explained"
    bound = RECOUNT_MS / 1000 + WAIT_MARGIN
    assert fr.cap(86400.0, limits, "smtp", "gmail.com") == bound
    assert fr.cap(math.inf, None, "smtp", "site yahoo") == bound
    assert fr.source.stats.waits_capped == 2
    assert log.lines == [f"warning: fleet: Redis asked gmail.com (smtp) to wait 86400s, "
                         f"longer than this node's settings explain: waiting {bound:g}s (a "
                         "server with other settings, or a damaged key); this warning at "
                         "most once a minute"]


def test_this_nodes_record_publishes_its_own_settings_and_holdings():
    fr, _ = roster("smtp_fleet_destination_concurrency_limit = 5\n"
                   "fleet_destination_rate = 2/1s\n")
    src = fr.source
    src.leases.update({object(): ("smtp", "gmail.com", "l1"),
                       object(): ("smtp", "gmail.com", "l2")})
    src.spares[("smtp", "yahoo.com")] = [("l3", 0.0)]
    src.seen[("smtp", "gmail.com")] = (4, 5)
    src.stats.failed()
    rec = parse_record(encode_record(fr.record()))
    assert (rec.node, rec.instance, rec.layout, rec.lease_time, rec.errors) == (
        "relay1", "ffff0000", KEY_LAYOUT, 60.0, 1)
    assert rec.limits == {ANY_TRANSPORT: {DESTINATION: Limits(0, Rate(2, 1.0))},
                          "smtp": {DESTINATION: Limits(5, Rate(2, 1.0))}}
    assert rec.units == (UnitShare("smtp", "gmail.com", 2, 0, 4, 5),
                         UnitShare("smtp", "yahoo.com", 1, 0, 0, 0))


def test_stats_time_answers_and_count_failures():
    t = [0.0]
    stats = FleetStats(lambda: t[0], lambda: 1234.5)
    with stats.timed():
        t[0] += 0.003
    with pytest.raises(RedisUnavailable), stats.timed():
        raise RedisUnavailable("gone")
    with pytest.raises(KeyError), stats.timed():
        raise KeyError("a bug is no Redis error")
    assert stats.round_trip.count == 1 and stats.round_trip.total == pytest.approx(0.003)
    assert (stats.errors, stats.errors_since_good, stats.last_sync) == (1, 1, 1234.5)


def test_status_fleet_text_lists_servers_destinations_and_differences():
    from pyqmgr.control.render import reply_lines
    from pyqmgr.daemon.fleet.roster import server_reply

    now = 1_800_000_010.0
    this = server_reply(record("relay1", "aaaa0001", units=(
        UnitShare("smtp", "gmail.com", 3, 12, 5, 5),)), now, this=True)
    other = server_reply(record("relay2", failing=True, failure="hold", last_sync=None,
                                units_total=40), now)
    reply = {"ok": True, "node": "relay1", "shared_state": "redis://10.0.0.5:6379",
             "read": True, "error": "", "total": 2, "servers": [this, other],
             "skipped": [{"server": "evil/1", "why": "not JSON"}],
             "differences": [{"node": "relay2", "setting": "smtp_fleet_destination_"
                              "concurrency_limit", "theirs": "10", "ours": "5",
                              "obeyed": "5"}], "lease_time_in_force": 60.0}
    text = "\n".join(reply_lines("status", reply, {"sort": "name"}))
    print(text)
    lines = text.splitlines()
    assert lines[0] == ("fleet: 2 servers in the roster of redis://10.0.0.5:6379, read by "
                        "relay1; lease time in force 1m")
    head = lines[2].split()
    assert head[:6] == ["SERVER", "INSTANCE", "PID", "VERSION", "LAYOUT", "MODE"]
    assert lines[3].split()[:8] == ["relay1", "*", "aaaa0001", "4242", "0.1.0", "2",
                                    "normal", "0"]
    assert "10s ago" in lines[3] and "default: 5 sessions; smtp: 10 sessions, 10/s burst 2" \
        in lines[3]
    assert lines[4].split()[:7] == ["relay2", "0a1b2c3d", "4242", "0.1.0", "2", "hold",
                                    "0"] and " never " in lines[4]
    assert re.search(r"^relay1 +smtp +gmail\.com +3 +12 +5 of 5 +normal$", text, re.M)
    assert re.search(r"^relay2 +smtp +site yahoo +1 +0 +1 of 10 +hold$", text, re.M)
    assert "  relay2: the busiest 2 of 40 destinations shown" in lines
    assert re.search(r"^relay2 +smtp_fleet_destination_concurrency_limit +10 +5 +5$",
                     text, re.M)
    assert lines[-1] == "skipped the record of evil/1: not JSON"
    down = reply_lines("status", {**reply, "read": False, "error": "no answer within "
                                  "0.5 s", "servers": [this]}, {})
    assert down[1] == "Redis did not answer (no answer within 0.5 s): this server's own " \
        "record only"
