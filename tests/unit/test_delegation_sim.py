"""The simulator's delivery policy service: a postfwd-style rate, or a function.

The engine asks the scenario's service at selection time and applies the answer through
the core's delegation API, as the daemon does: the shipped scenario's rate of 3 per
10 s gives windows of three 10 s apart while the other destination flows at once (the
real-Postfix test measured windows at 0, 10.1 and 20.1 s against postfwd); a function
answering HOLD, REJECT and DEFER with ``delay=`` is followed too.
"""

from __future__ import annotations

import os

import pytest

from pyqmgr.simulator import load, simulate
from pyqmgr.simulator.report import summary
from pyqmgr.simulator.scenario import ScenarioError, parse

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIO = os.path.join(os.path.dirname(os.path.dirname(HERE)), "scenarios",
                        "delegation-rate.toml")


def test_the_rate_scenario_spaces_one_destination_and_not_the_other():
    sc = load(SCENARIO)
    res = simulate(sc)
    limited = sorted(d.start for d in res.deliveries if d.destination == "limited.example")
    free = sorted(d.end for d in res.deliveries if d.destination == "free.example")
    groups = [limited[i:i + 3] for i in range(0, len(limited), 3)]
    print("limited.example starts:", [round(g[0], 2) for g in groups])
    assert len(limited) == 12 and all(len(g) == 3 for g in groups)
    for a, b in zip(groups, groups[1:], strict=False):
        assert b[0] - a[0] >= 10.0 and b[0] - a[-1] >= 9.0
    assert max(free) < 3.0, "the other destination is not held back"
    assert res.sent == {"limited.example": 12, "free.example": 12}
    assert res.held_back["limited.example"] > 0 and "free.example" not in res.held_back
    assert any(line.startswith("policy service: ") for line in summary(sc, res))


def decide(request: dict[str, object], now: float) -> str:
    """A scenario's own service: HOLD one message, reject one domain, defer another."""
    recipient = str(request["recipient"])
    if request["queue_id"] == "H0":
        return "HOLD"
    if recipient.endswith("@rejected.example"):
        return "REJECT 5.7.1 not today"
    if recipient.endswith("@later.example") and now < 5:
        return "DEFER 4.7.1 later"
    return "DUNNO"


def scenario(reject: str = "bounce") -> dict:
    dest = {"latency": 0.1}
    return {
        "delegation": {"function": "tests.unit.test_delegation_sim:decide",
                       "reject": reject, "defer_delay": 2},
        "destinations": {"held.example": dest, "rejected.example": dest,
                         "later.example": dest, "ok.example": dest},
        "messages": [
            {"count": 1, "destination": "held.example", "name": "H", "recipients": 3},
            {"count": 2, "destination": "rejected.example"},
            {"count": 2, "destination": "later.example"},
            {"count": 2, "destination": "ok.example"},
        ],
    }


def test_a_function_answers_hold_reject_and_defer():
    res = simulate(parse(scenario()))
    assert res.held == 1, "one message on hold, asked once"
    assert not any(d.message == "H0" for d in res.deliveries)
    assert res.rejected == {"rejected.example": 2}
    bounced = [d for d in res.deliveries if d.outcome == "bounced"]
    assert len(bounced) == 2 and all(d.transport == "error" for d in bounced)
    later = [d.start for d in res.deliveries if d.destination == "later.example"]
    assert len(later) == 2 and min(later) >= 5.0, "held back until the answer changed"
    assert res.sent.get("ok.example") == 2


def test_reject_without_bounce_holds_back():
    sc = parse(scenario(reject="defer"))
    sc.duration = 30
    res = simulate(sc)
    assert res.rejected == {}
    assert res.held_back.get("rejected.example", 0) >= 2
    assert not [d for d in res.deliveries if d.destination == "rejected.example"]


@pytest.mark.parametrize("table, text", [
    ({"rate": {"x.example": "3/soon"}}, "bad duration"),
    ({"rate": {"x.example": "1.5/10s"}}, "a whole number of deliveries"),
    ({"reject": "discard"}, "delegation.reject must be defer or bounce"),
    ({"function": "no.such.module:decide"}, "ModuleNotFoundError"),
])
def test_bad_delegation_tables_are_scenario_errors(table, text):
    data = scenario()
    data["delegation"] = table
    with pytest.raises(ScenarioError, match=text):
        parse(data)
