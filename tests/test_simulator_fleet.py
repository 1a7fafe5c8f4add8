"""A fleet in the simulator: N servers on one clock share a provider's limits (issue #23).

The scenario file says ``[fleet] servers = N`` and gives the daemon's own fleet
settings in ``[pyqmgr_cf]``; the result is the fleet's, as one sender's. Deterministic
runs, so the seeded figures are pinned exactly.
"""

from __future__ import annotations

import collections
import copy
import os
import tomllib

import pytest

from pyqmgr.simulator import simulate
from pyqmgr.simulator.scenario import ScenarioError, parse

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIO = os.path.join(os.path.dirname(HERE), "scenarios", "fleet-421-limit.toml")
PROVIDER = "provider.example"


def base() -> dict:
    with open(SCENARIO, "rb") as f:
        return tomllib.load(f)


def run(data: dict):
    return simulate(parse(data))


def most_at_once(res, dest: str = PROVIDER) -> int:
    return max(busy for _, _, busy in res.windows[dest])


def test_three_servers_keep_to_the_fleets_five_sessions():
    res = run(base())
    assert (res.sent[PROVIDER], res.deferred.get(PROVIDER, 0)) == (180, 0)
    assert most_at_once(res) == 5, "the provider never saw more than the fleet's 5"
    assert res.mean_concurrency(PROVIDER) > 4.5, "and was kept busy"
    # The messages are dealt to the three servers in turn; each delivered its own.
    assert collections.Counter(d.server for d in res.deliveries) == {
        "server0": 60, "server1": 60, "server2": 60}


def test_the_same_servers_alone_meet_the_421s():
    data = base()
    del data["pyqmgr_cf"]
    res = run(data)
    assert (res.sent[PROVIDER], res.deferred[PROVIDER]) == (5, 175)
    assert most_at_once(res) > 5


def test_one_server_with_the_limit_is_the_single_server_simulation():
    """servers = 1 is no fleet: the fleet settings are not read, the run is as before."""
    data = base()
    data["fleet"]["servers"] = 1
    del data["pyqmgr_cf"]
    alone = copy.deepcopy(data)
    del alone["fleet"]
    a, b = run(data), run(alone)
    assert [(d.start, d.end, d.outcome) for d in a.deliveries] == [
        (d.start, d.end, d.outcome) for d in b.deliveries]


def test_a_fleet_rate_holds_across_the_servers():
    data = base()
    data["pyqmgr_cf"] = {"smtp_fleet_destination_rate": "10/1s",
                         "smtp_fleet_destination_rate_burst": "2"}
    data["destinations"][PROVIDER]["server_limit"] = 0
    res = run(data)
    assert res.sent[PROVIDER] == 180
    starts = sorted(d.start for d in res.deliveries)
    per_second = collections.Counter(int(t) for t in starts)
    assert max(per_second.values()) <= 12, per_second
    assert res.end_time > 17, "180 starts at 10 a second"


def dead_site(share: bool) -> dict:
    data = base()
    data["pyqmgr_cf"] = {} if share else {"fleet_throttling": "no"}
    data["destinations"][PROVIDER] = {"latency": 0.2, "dead": True}
    data["main_cf"]["initial_destination_concurrency"] = "1"
    data["messages"] = [{"count": 30, "recipients": 1, "destination": PROVIDER,
                         "every": 0.5}]
    return data


def test_a_dead_site_one_server_finds_is_dead_for_all():
    shared, alone = run(dead_site(True)), run(dead_site(False))
    tries = [sum(1 for d in r.deliveries if d.transport == "smtp") for r in (shared, alone)]
    assert tries == [1, 3], "one try for the fleet; one per server alone"
    assert shared.held_dead[PROVIDER] == 29
    (line,) = [text for _, _, text in shared.log if "seen by server0" in text][:1]
    assert line.startswith(f"fleet: {PROVIDER} (smtp): \"4.4.1 connect to {PROVIDER}")
    # The others have no mail for it yet: the news waits for theirs, and holds it.
    assert line.endswith("no mail here for it yet: holds for mail that comes within 5m")


@pytest.mark.parametrize(("change", "error"), [
    ({"fleet": {"servers": 0}}, "fleet.servers must be at least 1"),
    ({"fleet": {"servers": 2.5}}, "fleet.servers must be a whole number"),
    ({"fleet": {"servers": 3, "nodes": 2}}, "fleet"),
    ({"pyqmgr_cf": {"smtp_fleet_destination_concurrency_limit": "many"}},
     "pyqmgr_cf.smtp_fleet_destination_concurrency_limit: bad numerical value"),
    ({"deferred": {"retry": True}}, "does not model the deferred queue"),
    ({"main_cf": {"smtp_destination_recipient_limit": "1"}},
     "smtp_destination_recipient_limit = 1 makes each recipient a destination"),
])
def test_bad_fleet_settings_are_refused_by_name(change, error):
    data = base()
    data.update(change)
    with pytest.raises(ScenarioError, match=error.replace(".", r"\.")):
        run(data)


def test_the_report_says_it_is_a_fleet(capsys):
    from pyqmgr.cli import main

    assert main(["simulate", SCENARIO]) == 0
    out = capsys.readouterr().out
    assert "a fleet of 3 servers sharing limits, reported as one sender" in out
    assert f"{PROVIDER}              180        0    0.0%" in out
