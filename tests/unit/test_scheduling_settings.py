"""One route for pyqmgr.cf's scheduling settings: the daemon, check and the simulator.

Issue #22: the settings took three hand-written routes, so a value could pass one and
fail another. Now :func:`pyqmgr.settings.scheduling.scheduling_settings` is the only
parser; these tests give each route the same bad values and the same good ones and
compare what comes out, so a route that parses on its own again shows as a difference.
"""

from __future__ import annotations

import tomllib

import pytest

from pyqmgr.daemon.policies import policy_setup
from pyqmgr.install import _settings_problems
from pyqmgr.postfix.config import QmgrConfig
from pyqmgr.pyqmgr_cf import PyqmgrCfError, from_text
from pyqmgr.settings.scheduling import scheduling_settings
from pyqmgr.simulator import simulate
from pyqmgr.simulator.engine import scenario_settings
from pyqmgr.simulator.scenario import ScenarioError, parse

#: (parameter, bad value, what the refusal says).
BAD = [
    ("scheduler_policy", "nosuch", "nosuch"),
    ("smtp_scheduler_policy", "finch", None),  # good: a control for the loop below
    ("finch_scale_max_concurrency", "-1", "finch_scale_max_concurrency"),
    ("smtp_destination_rate", "fast", "bad rate"),
    ("destination_rate_burst", "0", "a whole number from 1 to 100000"),
    ("smtp_response_rules", "/nonexistent/pyqmgr-rules", "/nonexistent/pyqmgr-rules"),
    ("deferred_retry_jitter", "2d", "more than a day"),
    ("deferred_recovery_rate", "many", "bad rate"),
    ("deferred_recovery_limit", "0", "out of range"),
]

SCENARIO = """
seed = 1
duration = 60
[destinations."d.example"]
latency = 0.1
[[messages]]
at = 0
recipients = 3
destination = "d.example"
[deferred]
retry = true
"""


@pytest.fixture
def cfg(tmp_path) -> QmgrConfig:
    (tmp_path / "master.cf").write_text("smtp unix - - n - 10 smtp\n")
    return QmgrConfig.from_text("", config_dir=str(tmp_path), hostname="h.example")


def daemon_says(text: str, cfg: QmgrConfig) -> str | None:
    try:
        policy_setup(from_text(text, "/etc/postfix/pyqmgr.cf"), cfg)
    except PyqmgrCfError as exc:
        return str(exc)
    return None


def check_says(text: str, cfg: QmgrConfig) -> str | None:
    problems = _settings_problems(from_text(text, "/etc/postfix/pyqmgr.cf"), cfg)
    return problems[0] if problems else None


def simulator_says(name: str, value: str, tmp_path) -> str | None:
    data = tomllib.loads(SCENARIO)
    data["pyqmgr_cf"] = {name: value}
    try:
        simulate(parse(data, str(tmp_path)))
    except ScenarioError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("name, value, says", BAD, ids=[b[0] for b in BAD])
def test_each_route_refuses_a_bad_value_with_the_same_text(name, value, says, cfg,
                                                          tmp_path):
    if name.startswith("finch_"):
        text = f"scheduler_policy = finch\n{name} = {value}\n"
    else:
        text = f"{name} = {value}\n"
    daemon = daemon_says(text, cfg)
    check = check_says(text, cfg)
    if says is None:
        assert daemon is None and check is None
        assert simulator_says(name, value, tmp_path) is None
        return
    assert daemon is not None and says in daemon, daemon
    # check: the daemon's refusal, word for word, as the reason it would not start.
    assert check == f"the daemon would refuse to start: {daemon}"
    if name.startswith("finch_"):
        data = tomllib.loads(SCENARIO)
        data["pyqmgr_cf"] = {"scheduler_policy": "finch", name: value}
        with pytest.raises(ScenarioError) as exc:
            simulate(parse(data, str(tmp_path)))
        simulator = str(exc.value)
    else:
        simulator = simulator_says(name, value, tmp_path)
    # The simulator names its section where the daemon names the file.
    assert simulator == daemon.replace("/etc/postfix/pyqmgr.cf: parameter ", "pyqmgr_cf.")


def test_the_routes_read_good_values_alike(cfg, tmp_path):
    rules = tmp_path / "rules"
    rules.write_text('/^421/ throttle rate=0.5\n')
    values = {"scheduler_policy": "oqmgr", "relay_scheduler_policy": "finch",
              "smtp_destination_rate": "5/1s", "destination_rate_burst": "3",
              "smtp_response_rules": str(rules), "deferred_retry_jitter": "20%",
              "deferred_recovery_rate": "10/1s"}
    text = "".join(f"{k} = {v}\n" for k, v in values.items())
    parsed = scheduling_settings(from_text(text))
    daemon = policy_setup(from_text(text), cfg)
    data = tomllib.loads(SCENARIO)
    data["pyqmgr_cf"] = values
    sim = parse(data, str(tmp_path))
    simulated = scenario_settings(sim)
    for got in (daemon.table, simulated.policies):
        assert got.default is parsed.policies.default
        assert got.by_transport == parsed.policies.by_transport == {
            "relay": parsed.policies.policy_for("relay")}
    for shaping in (daemon.shaping, simulated.shaping):
        assert shaping is not None and parsed.shaping is not None
        assert shaping.shaping_for("smtp") == parsed.shaping.shaping_for("smtp")
        assert shaping.shaping_for("relay") == parsed.shaping.shaping_for("relay") is None
    assert daemon.retry == simulated.retry == parsed.retry
    assert parsed.retry is not None and parsed.retry.jitter_share == 0.2
