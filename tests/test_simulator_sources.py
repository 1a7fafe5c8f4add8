"""Source pools and warm-up plans in the simulator (issue #46 item 4): a plan tried
before a new address sends a day of it.

The simulator routes each recipient as the daemon does, by the same
:class:`~pyqmgr.scheduler.source_route.SourceRouter` over the same core, on a virtual
clock whose 0 is the scenario's ``date``: a cold source's count is exact. A
provider's per-source rule (``[destinations.X.sources.src1] day_limit``) answers
``421 4.7.28`` past its own N, so that a steep plan shows what it would earn.
tests/test_sources_real.py holds the daemon to the same counts on real Postfix
(100 of a plan of 100 from 127.0.0.21).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pyqmgr.simulator.engine import simulate
from pyqmgr.simulator.report import as_json, summary
from pyqmgr.simulator.scenario import ScenarioError, load

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "scenarios", "warmup-plan.toml")
SITE = "mx1.x.test"


def scenario(tmp_path, plan: str, *, messages: int = 600, every: float = 0.5,
             date: str = "2026-12-01T08:00:00Z", members: str = "src1 src2 src3",
             starts: tuple[str, ...] = ("src1",), day_limit: int = 150,
             extra: str = "") -> str:
    """A pool of three sources, src1 cold from 2026-12-01, one site (x.test and
    y.test share the MX host mx1.x.test), whose server refuses src1 past day_limit
    recipients a day."""
    (tmp_path / "plan").write_text(plan)
    start_lines = "".join(f'{s}_source_warmup_start = "2026-12-01"\n' for s in starts)
    transports = "".join(f"[transports.{m}]\nprocess_limit = 10\n" for m in members.split())
    rule = (f'[destinations."x.test".sources.src1]\nday_limit = {day_limit}\n'
            f'[destinations."y.test".sources.src1]\nday_limit = {day_limit}\n'
            if "src1" in members else "")
    text = f"""title = "three sources, one cold"
seed = 7
date = {date}
[pyqmgr_cf]
site_grouping = "mx"
message_classes = "bulk"
source_pools = "bulk"
bulk_sources = "{members}"
source_pool_maps = "inline:{{ bulk=bulk }}"
source_warmup_plan = "plan"
{start_lines}{extra}
{transports}
[destinations."x.test"]
mx = "{SITE}"
latency = {{dist = "uniform", low = 0.05, high = 0.2}}
[destinations."y.test"]
mx = "{SITE}"
latency = {{dist = "uniform", low = 0.05, high = 0.2}}
{rule}
[[messages]]
count = {messages * 2 // 3}
every = {{dist = "exponential", mean = {every * 1.5}}}
destination = "x.test"
sender = "news@lists.example"
[[messages]]
count = {messages - messages * 2 // 3}
every = {{dist = "exponential", mean = {every * 3}}}
destination = "y.test"
sender = "news@lists.example"
"""
    path = tmp_path / "scenario.toml"
    path.write_text(text)
    return str(path)


def rows(doc: dict) -> dict[tuple[str, str], dict]:
    return {(r["source"], r["site"]): r for r in doc["per_source_site"]}


def run(path: str) -> tuple[dict, list[str]]:
    sc = load(path)
    res = simulate(sc)
    assert res.sources is not None
    return res.sources, summary(sc, res)


def test_a_plan_of_100_sends_exactly_100_from_the_cold_source(tmp_path):
    doc, text = run(scenario(tmp_path, "0 100\n1 200\n7 warm\n"))
    by = rows(doc)
    print("\n" + "\n".join(text))
    assert by[("src1", SITE)]["sent"] == 100, "the plan, exactly: a virtual clock"
    warm = by[("src2", SITE)]["sent"] + by[("src3", SITE)]["sent"]
    assert warm == 500, "the rest on the warm sources"
    assert all(r["deferred"] == r["held"] == r["bounced"] == 0 for r in by.values())
    assert doc["cold_counts"] == [{"window": "2026-12-01T00:00:00Z", "source": "src1",
                                   "site": SITE, "counted": 100, "allowance": 100,
                                   "age_days": 0}]
    assert doc["refused"] == [] and doc["waited"] == 0
    assert doc["unknown_site"] >= 1, "the first mail, before the MX answered, went warm"
    assert f"warm-up 2026-12-01T00:00:00Z: src1 at {SITE} counted 100 of 100 (day 0)" in text


def test_a_steeper_plan_meets_the_providers_421s_past_its_own_limit(tmp_path):
    doc, text = run(scenario(tmp_path, "0 1000\n7 warm\n"))
    by = rows(doc)
    print("\n" + "\n".join(text))
    src1 = by[("src1", SITE)]
    assert src1["sent"] == 150, "the provider's day_limit, not the plan's 1000"
    assert src1["deferred"] > 0
    [refused] = doc["refused"]
    assert refused["source"] == "src1" and refused["server"] == SITE
    assert refused["reply"].startswith("421 4.7.28 ")
    assert refused["recipients"] == src1["deferred"]
    assert by[("src2", SITE)]["deferred"] == by[("src3", SITE)]["deferred"] == 0
    assert any(line.startswith(f"refused: src1 at {SITE}: ") for line in text)
    assert src1["sent"] + src1["deferred"] + by[("src2", SITE)]["sent"] + \
        by[("src3", SITE)]["sent"] == 600


def test_the_same_seed_gives_the_same_report_twice(tmp_path):
    path = scenario(tmp_path, "0 100\n7 warm\n")
    first, second = (as_json(load(path), simulate(load(path))) for _ in range(2))
    assert json.dumps(first) == json.dumps(second)
    other = as_json(load(path), simulate(load(path), seed=8))
    assert other != first, "another seed, another run"


def test_each_window_is_counted_against_its_days_allowance(tmp_path):
    """A run across midnight: day 0's 20, then day 1's 40, each window from zero."""
    doc, _ = run(scenario(tmp_path, "0 20\n1 40\n7 warm\n", messages=900, every=1.0,
                          date="2026-12-01T23:55:00Z"))
    counts = [(c["window"], c["counted"], c["allowance"], c["age_days"])
              for c in doc["cold_counts"]]
    assert counts == [("2026-12-01T00:00:00Z", 20, 20, 0), ("2026-12-02T00:00:00Z", 40, 40, 1)]
    assert rows(doc)[("src1", SITE)]["sent"] == 60


def test_overflow_wait_holds_what_no_cold_source_may_take(tmp_path):
    """Two cold sources and nothing warm: each sends its 100, the rest waits (deferred
    with the plan's reason, as the daemon defers it to the retry transport). The first
    mail, before the MX answered, waits too: the router asks for the lookup that no
    queue would (its mail all goes to the retry transport), so the site becomes known."""
    doc, text = run(scenario(tmp_path, "overflow wait\n0 100\n7 warm\n", messages=300,
                             members="src1 src2", starts=("src1", "src2"), day_limit=1000))
    by = rows(doc)
    assert by[("src1", SITE)]["sent"] == by[("src2", SITE)]["sent"] == 100
    assert by[("(none)", SITE)]["held"] == 100 == doc["waited"]
    assert "sources: 100 recipients waited (no source could take them), 0 went warm " \
           "before their site was known" in text


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pyqmgr.cli", "simulate", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_shipped_example_a_b(tmp_path):
    """scenarios/warmup-plan.toml: its gentle plan gives src1 100 at each site and no
    421; --set with the steep plan meets Google's 421s. The same run twice, the same
    report."""
    gentle = run_cli(EXAMPLE, "--json")
    assert gentle.returncode == 0, gentle.stderr
    assert gentle.stdout == run_cli(EXAMPLE, "--json").stdout
    doc = json.loads(gentle.stdout)["sources"]
    assert [(c["source"], c["site"], c["counted"]) for c in doc["cold_counts"]] == [
        ("src1", "google", 100), ("src1", "microsoft", 100)]
    assert doc["refused"] == []
    steep = run_cli(EXAMPLE, "--set", "source_warmup_plan=warmup-plan-steep")
    assert steep.returncode == 0, steep.stderr
    assert "refused: src1 at aspmx.l.google.com: " in steep.stdout
    assert "src1   google         150" in steep.stdout


@pytest.mark.parametrize("extra, members, message", [
    ("", "src1 src2 nosuch", r"pyqmgr_cf.bulk_sources: \"nosuch\" is not a unix service "
                             r"in master.cf \(a scenario names its services as "
                             r"\[transports.NAME\]\)"),
    ("src2_source_warmup_start = \"someday\"\n", "src1 src2 src3",
     "pyqmgr_cf.src2_source_warmup_start: \"someday\" is not a date"),
])
def test_bad_pool_settings_are_scenario_errors(tmp_path, extra, members, message):
    path = scenario(tmp_path, "0 100\n", members=members, extra=extra)
    if "nosuch" in members:  # a pool member the scenario does not declare
        text = open(path).read().replace("[transports.nosuch]\nprocess_limit = 10\n", "")
        open(path, "w").write(text)
    with pytest.raises(ScenarioError, match=message):
        simulate(load(path))


def test_bad_source_rules_and_dates_are_scenario_errors(tmp_path):
    path = scenario(tmp_path, "0 100\n")
    text = open(path).read()
    for old, new, message in [
            ("[destinations.\"y.test\".sources.src1]",
             "[destinations.\"y.test\".sources.src9]",
             "destinations.y.test.sources.src9: not a member of a pool"),
            ("day_limit = 150\n[destinations.\"y", "day_reply = \"550 no\"\n[destinations.\"y",
             "day_reply must be an SMTP reply starting with a 4xx code"),
            ("date = 2026-12-01T08:00:00Z", "date = \"tomorrow\"",
             "date must be a date or a date and time in UTC")]:
        open(path, "w").write(text.replace(old, new, 1))
        with pytest.raises(ScenarioError, match=message):
            simulate(load(path))
    no_pool = text.replace('source_pools = "bulk"\n', "")
    open(path, "w").write(no_pool)
    with pytest.raises(ScenarioError, match="rules for a source need pyqmgr_cf.source_pools"):
        simulate(load(path))
