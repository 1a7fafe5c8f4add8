"""Shaping in the core: rates with concurrency, response rules, their settings.

Each transition is driven directly on a Scheduler: a start closes the gate for the
rate's interval while the window lets several run; the gate opens from the deadline
heap; a throttling reply caps the window (never a failed cohort), a quiet interval
steps it back up, the TTL ends it; a rule's suspend and after=K/PERIOD; shaping state
surviving a queue that went idle. Then the parsers, with their error texts.
"""

from __future__ import annotations

import pytest

from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.explain import explain, status
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.policy import PolicyTable
from pyqmgr.scheduler.queue import Dsn
from pyqmgr.scheduler.shaping import (
    Rate,
    Shaping,
    ShapingError,
    ShapingTable,
    parse_duration,
    parse_rate,
    parse_rule,
    parse_rules,
)
from pyqmgr.settings.policies import load
from tests.unit.params import Params

TOO_MANY = Dsn("4.7.0", "host mx[192.0.2.1] refused to talk to me: 421 4.7.0 Error: too "
                        "many connections from 192.0.2.9")
REFUSED = Dsn("4.4.1", "connect to mx[192.0.2.1]:25: Connection refused")
RULES = """
# comment
/too many connections/   throttle window=0.8 quiet=30s step=1 ttl=5m
/4\\.7\\.28/               throttle rate=0.5 quiet=1m
   ttl=1h
/\\[TS01\\]/              throttle suspend=10m
/burst of/               throttle window=0.5 after=3/1m
/hard failure/           failure
"""


def sched(shaping: Shaping | None, policy: str = "nqmgr", **params: int) -> Scheduler:
    p = {"destination_recipient_limit": 1, "initial_destination_concurrency": 5,
         "destination_concurrency_limit": 20, "failed_cohort_limit": 1, **params}
    return Scheduler(lambda n: Params(**p), policies=PolicyTable(load(policy)),
                     shaping_for=lambda name: shaping, min_backoff_time=300)


def routes(n: int, dest: str = "d.example", start: int = 0) -> list[Route]:
    return [Route("smtp", dest, dest, Recipient(i, f"r{i}@{dest}"))
            for i in range(start, start + n)]


def starts(s: Scheduler, now: float, gate_timers: list | None = None) -> list:
    """Every entry an agent would get now (agents are plentiful); the gate timers the
    selections asked for go to ``gate_timers``."""
    got = []
    while s.allocate() is not None:
        d = s.select("smtp", now)
        if gate_timers is not None:
            gate_timers += d.gate_timers
        if d.deliver is not None:
            got.append(d.deliver)
    return got


def rules() -> tuple:
    return tuple(parse_rules(RULES, "rules"))


@pytest.mark.parametrize("policy", ["nqmgr", "oqmgr", "finch"])
def test_a_rate_spaces_starts_while_several_run_at_once(policy):
    s = sched(Shaping(Rate(2, 1.0)), policy)
    s.assign(Message("Q1", 0.0), routes(10), now=0.0)
    timers: list[float] = []
    first = starts(s, 0.0, timers)
    assert len(first) == 1, "one start, then the gate closes for 0.5 s"
    q = s.transports["smtp"].queues["d.example"]
    assert q.gate is not None and q.gate.kind == "rate" and q.gate.until == 0.5
    assert timers == [0.5]
    assert starts(s, 0.4) == []
    s.open_gates(0.5)
    assert len(starts(s, 0.5)) == 1
    s.open_gates(1.0)
    assert len(starts(s, 1.0)) == 1
    assert q.busy_count == 3, "three in flight at once: the rate does not cap concurrency"
    (r,) = explain(s, "d.example", 1.2)["reasons"]
    assert r["constraint"] == "rate" and r["setting"] == "smtp_destination_rate"
    assert r["opens_in"] == 0.3


def test_zmailer_one_session_is_spaced_by_the_rate_too():
    s = sched(Shaping(Rate(2, 1.0)), "zmailer")
    s.assign(Message("Q1", 0.0), routes(10), now=0.0)
    (e,) = starts(s, 0.0)
    s.done(e, 0, None, False, 0.1)
    assert starts(s, 0.2) == [], "its one session is free, but the rate says 0.5"
    s.open_gates(0.5)
    assert len(starts(s, 0.5)) == 1


def test_a_burst_lets_that_many_start_back_to_back():
    s = sched(Shaping(Rate(1, 1.0), burst=3))
    s.assign(Message("Q1", 0.0), routes(10), now=0.0)
    assert len(starts(s, 0.0)) == 3
    s.open_gates(1.0)
    assert len(starts(s, 1.0)) == 1


def test_the_rate_survives_a_queue_that_went_idle():
    """An idle queue is discarded; the next message must still wait for the rate."""
    s = sched(Shaping(Rate(1, 10.0)))
    s.assign(Message("Q1", 0.0), routes(1), now=0.0)
    (e,) = starts(s, 0.0)
    s.done(e, 0, None, False, 1.0)
    assert "d.example" not in s.transports["smtp"].queues
    s.assign(Message("Q2", 2.0), routes(1), now=2.0)
    assert starts(s, 2.0) == [], "still 8 s to wait"
    s.open_gates(10.0)
    assert len(starts(s, 10.0)) == 1


def test_a_throttling_reply_caps_the_window_and_is_no_failed_cohort():
    s = sched(Shaping(rules=rules()))
    s.assign(Message("Q1", 0.0), routes(20), now=0.0)
    out = starts(s, 0.0)
    assert len(out) == 5
    q = s.transports["smtp"].queues["d.example"]
    d = s.done(out[0], 1, TOO_MANY, False, 1.0)
    assert not q.throttled and q.fail_cohorts == 0, "alive, and no cohort counted"
    assert q.cap == 4 and q.window == 4, "0.8 x 5 in flight"
    assert any("matched rules, line 3: window capped at 4 (5 in flight)" in text
               for _, text in d.log)
    (r,) = [r for r in explain(s, "d.example", 1.0)["reasons"]
            if r["constraint"] == "window capped by throttling"]
    assert r["setting"] == "rules, line 3" and r["cap"] == 4
    assert status(s, 1.0)["destinations"][0]["cap"] == 4
    # Successes do not lift the cap past 4.
    for e in out[1:]:
        s.done(e, 0, None, False, 2.0)
    for e in starts(s, 2.0):
        s.done(e, 0, None, False, 2.5)
    assert q.window <= 4
    # A quiet interval steps up by one; the TTL ends it.
    s.open_gates(31.0)
    assert q.cap == 5
    s.open_gates(301.0 + 30)
    assert q.cap == 0 and q.shape is not None and q.shape.rule is None


def one_at_a_time(shaping: Shaping | None) -> Scheduler:
    return sched(shaping, initial_destination_concurrency=1, destination_concurrency_limit=1)


def test_an_unmatched_hop_failure_is_still_a_failure():
    s = one_at_a_time(Shaping(rules=rules()))
    s.assign(Message("Q1", 0.0), routes(3), now=0.0)
    e = starts(s, 0.0)[0]
    s.done(e, 1, REFUSED, False, 1.0)
    assert s.transports["smtp"].queues["d.example"].throttled, "dead: cohort limit 1"


def test_a_failure_rule_keeps_stock_behaviour():
    s = one_at_a_time(Shaping(rules=rules()))
    s.assign(Message("Q1", 0.0), routes(3), now=0.0)
    e = starts(s, 0.0)[0]
    s.done(e, 1, Dsn("4.0.0", "hard failure here"), False, 1.0)
    assert s.transports["smtp"].queues["d.example"].throttled


def test_stock_with_no_rules_kills_on_421():
    """The control: without rules the same reply is a failed cohort."""
    s = one_at_a_time(None)
    s.assign(Message("Q1", 0.0), routes(3), now=0.0)
    e = starts(s, 0.0)[0]
    s.done(e, 1, TOO_MANY, False, 1.0)
    assert s.transports["smtp"].queues["d.example"].throttled


def test_the_same_421_with_rules_leaves_the_destination_alive():
    s = one_at_a_time(Shaping(rules=rules()))
    s.assign(Message("Q1", 0.0), routes(3), now=0.0)
    e = starts(s, 0.0)[0]
    s.done(e, 1, TOO_MANY, False, 1.0)
    q = s.transports["smtp"].queues["d.example"]
    assert not q.throttled and q.fail_cohorts == 0 and q.cap == 1


def test_a_rate_rule_learns_the_rate_then_halves_it():
    s = one_at_a_time(Shaping(rules=rules()))
    s.assign(Message("Q1", 0.0), routes(40), now=0.0)
    # Four starts a second for 2 s, then the one that fails: the learnt rate.
    t = 0.0
    for _ in range(8):
        (e,) = starts(s, t)[:1] or [None]
        assert e is not None
        s.done(e, 0, None, False, t + 0.01)
        t += 0.25
    e = starts(s, t)[0]
    s.done(e, 1, Dsn("4.7.28", "host said: 421 4.7.28 unusual rate"), False, t)
    q = s.transports["smtp"].queues["d.example"]
    assert q.shape is not None and q.shape.rate_factor == 0.5
    assert q.shape.learnt_rate == pytest.approx(4.5), "9 starts over the last 2 s"
    nxt = starts(s, t + 0.01)
    assert len(nxt) == 1 and q.gate is not None
    assert q.gate.until == pytest.approx(t + 0.01 + 1 / 2.25, abs=0.01), "2.25 a second now"
    assert not q.throttled and q.fail_cohorts == 0


def test_a_suspend_rule_holds_the_destination_back():
    s = sched(Shaping(rules=rules()))
    s.assign(Message("Q1", 0.0), routes(10), now=0.0)
    e = starts(s, 0.0)[0]
    s.done(e, 1, Dsn("4.7.0", "[TS01] Messages from 192.0.2.9 temporarily deferred"),
           False, 1.0)
    q = s.transports["smtp"].queues["d.example"]
    assert q.gate is not None and q.gate.kind == "backoff" and q.gate.until == 601.0
    assert starts(s, 2.0) == []
    (r,) = [r for r in explain(s, "d.example", 2.0)["reasons"] if r["constraint"] == "backoff"]
    assert r["setting"] == "rules, line 6"
    s.open_gates(601.0)
    assert q.gate is None and starts(s, 601.0)


def test_after_k_in_a_period_waits_for_the_kth_match():
    s = sched(Shaping(rules=rules()))
    s.assign(Message("Q1", 0.0), routes(20), now=0.0)
    out = starts(s, 0.0)
    q = s.transports["smtp"].queues["d.example"]
    burst = Dsn("4.7.0", "a burst of replies")
    s.done(out[0], 1, burst, False, 1.0)
    s.done(out[1], 1, burst, False, 2.0)
    assert q.cap == 0 and q.fail_cohorts == 0, "two matches: not yet, and no cohort"
    s.done(out[2], 1, burst, False, 3.0)
    assert q.cap == 1, "the third within a minute: 0.5 x 3 in flight, floor 1"


def test_no_shaping_means_no_gates_and_no_shapes():
    s = sched(None)
    s.assign(Message("Q1", 0.0), routes(10), now=0.0)
    timers: list[float] = []
    assert len(starts(s, 0.0, timers)) == 5
    q = s.transports["smtp"].queues["d.example"]
    assert q.shape is None and q.gate is None and not s.gate_heap and not timers


# -- parsing ----------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "rate"), [
    ("10/1s", Rate(10, 1.0)), ("10/s", Rate(10, 1.0)), ("1/200ms", Rate(1, 0.2)),
    ("600/h", Rate(600, 3600.0)), ("5/30s", Rate(5, 30.0)), ("0", None), ("", None),
    ("2.5/1m", Rate(2.5, 60.0)),
])
def test_rates(text, rate):
    assert parse_rate(text, "smtp_destination_rate") == rate


@pytest.mark.parametrize(("text", "error"), [
    ("10", "write N/PERIOD"), ("x/1s", "'x' is not a number"), ("0/1s", "more than 0"),
    ("10/0s", "more than 0"), ("10/1y", "bad duration"), ("1/0.5ms", "at least 1ms"),
])
def test_bad_rates(text, error):
    with pytest.raises(ShapingError) as err:
        parse_rate(text, "smtp_destination_rate")
    assert error in str(err.value) and str(err.value).startswith("smtp_destination_rate: ")


def test_rate_text():
    assert str(Rate(10, 1.0)) == "10/s" and str(Rate(1, 0.2)) == "1/200ms"
    assert str(Rate(600, 3600.0)) == "600/h" and str(Rate(5, 30.0)) == "5/30s"


def test_durations():
    assert parse_duration("500ms", "x") == 0.5 and parse_duration("2h", "x") == 7200
    assert parse_duration("90", "x") == 90
    for bad in ("", "m", "-5s", "0", "5y"):
        with pytest.raises(ShapingError):
            parse_duration(bad, "x")


def test_rules_file_parses_with_continuations_and_flags():
    rs = parse_rules(RULES, "rules")
    assert [r.where for r in rs] == ["rules, line 3", "rules, line 4", "rules, line 6",
                                     "rules, line 7", "rules, line 8"]
    assert rs[1].ttl == 3600 and rs[1].rate == 0.5
    assert rs[0].pattern.search("TOO MANY CONNECTIONS"), "case-insensitive by default"
    assert not parse_rule("/abc/i throttle", "x").pattern.search("ABC"), "i toggles"
    assert not rs[4].throttle


@pytest.mark.parametrize(("line", "error"), [
    ("no slashes throttle", "expected /pattern/ then an action"),
    ("/abc/", "no action after the pattern"),
    ("/abc/ slow", "unknown action 'slow'"),
    ("/abc/q throttle", "unknown pattern flag 'q'"),
    ("/(/ throttle", "bad pattern"),
    ("/abc/ throttle window=2", "a factor between 0 and 1"),
    ("/abc/ throttle window=x", "'x' is not a number"),
    ("/abc/ throttle window_floor=0", "a whole number, 1 or more"),
    ("/abc/ throttle after=3", "write K/DURATION"),
    ("/abc/ throttle ttl=forever", "bad duration"),
    ("/abc/ throttle colour=blue", "unknown parameter 'colour'"),
    ("/abc/ throttle window", "expected name=value"),
    ("/abc/ failure window=0.5", "failure takes no arguments"),
])
def test_bad_rules_name_the_line(line, error):
    with pytest.raises(ShapingError) as err:
        parse_rules("# a comment\n" + line + "\n", "/etc/postfix/rules")
    assert str(err.value).startswith("/etc/postfix/rules, line 2: ")
    assert error in str(err.value)


def test_the_table_reads_each_rules_file_once_and_checks_every_form(tmp_path):
    path = tmp_path / "rules"
    path.write_text(RULES)
    reads = []

    def read(p: str) -> list:
        reads.append(p)
        return parse_rules(RULES, p)

    values = {"smtp_response_rules": str(path), "relay_response_rules": str(path),
              "destination_rate": "10/s", "relay_destination_rate_burst": "4"}

    def setting(name: str, transport: str, default: str) -> str:
        return values.get(f"{transport}_{name}", values.get(name, default))

    table = ShapingTable(values, setting, read)
    assert reads == [str(path)] and table.active
    relay = table.shaping_for("relay")
    assert relay is not None and relay.burst == 4 and relay.rate == Rate(10, 1.0)
    assert len(relay.rules) == 5
    other = table.shaping_for("other")
    assert other is not None and other.rules == () and other.rate == Rate(10, 1.0)
    for bad, error in ({"smtp_destination_rate": "fast"}, "smtp_destination_rate: "), (
            {"smtp_destination_rate_burst": "0"}, "smtp_destination_rate_burst: "), (
            {"smtp_response_rules": "rules"}, "is not an absolute path"):
        with pytest.raises(ShapingError) as err:
            ShapingTable(bad, setting, read)
        assert error in str(err.value)
    assert not ShapingTable({}, setting, read).active


def test_one_reduction_per_round_trip():
    """Five deliveries started together all get 421: one cut, not five."""
    s = sched(Shaping(rules=rules()))
    s.assign(Message("Q1", 0.0), routes(20), now=0.0)
    out = starts(s, 0.0)
    assert len(out) == 5
    q = s.transports["smtp"].queues["d.example"]
    for e in out:
        s.done(e, 1, TOO_MANY, False, 0.5)
    assert q.cap == 4, "the first reply cuts (0.8 x 5); the others were sent at the old pace"
    later = starts(s, 0.6)
    assert later
    s.done(later[0], 1, TOO_MANY, False, 1.0)
    assert q.cap == 3, "a delivery started after the cut may cut again"


def test_tolerate_lives_with_a_background_share_of_throttling_replies():
    rule = parse_rule("/too many connections/ throttle window=0.9 after=2/5s tolerate=10%", "r")
    assert rule.tolerate == 0.1 and rule.after == (2, 5.0)
    s = sched(Shaping(rules=(rule,)))
    s.assign(Message("Q1", 0.0), routes(60), now=0.0)
    q = s.transports["smtp"].queues["d.example"]
    t = 0.0
    # Twenty good deliveries, then two 421s within 5 s: 2 of 22 is under... 10%.
    for _ in range(20):
        e = starts(s, t)[0]
        s.done(e, 0, None, False, t + 0.1)
        t += 0.2
    for _ in range(2):
        e = starts(s, t)[0]
        s.done(e, 1, TOO_MANY, False, t + 0.1)
        t += 0.2
    assert q.cap == 0, "2 of the 22 done in 5 s: 9%, tolerated"
    e = starts(s, t)[0]
    s.done(e, 1, TOO_MANY, False, t + 0.1)
    assert q.cap > 0, "3 of 23: 13%, acted on"


@pytest.mark.parametrize("value", ["x", "100%", "-1%", "1.5"])
def test_bad_tolerate(value):
    with pytest.raises(ShapingError) as err:
        parse_rule(f"/a/ throttle tolerate={value}", "r")
    assert "tolerate" in str(err.value)


def test_a_rules_file_too_large_not_utf8_or_missing_is_refused(tmp_path):
    from pyqmgr.settings.scheduling import load_rules

    big = tmp_path / "big"
    big.write_bytes(b"# padding\n" * 200)
    with pytest.raises(ShapingError, match="larger than 1000 bytes"):
        load_rules(str(big), max_bytes=1000)
    binary = tmp_path / "binary"
    binary.write_bytes(b"/a/ throttle\n\xff\xfe\n")
    with pytest.raises(ShapingError, match="not UTF-8"):
        load_rules(str(binary))
    with pytest.raises(ShapingError, match="No such file"):
        load_rules(str(tmp_path / "missing"))
