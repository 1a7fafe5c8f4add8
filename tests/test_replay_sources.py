"""pyqmgr replay A/Bs a warm-up plan (issue #46 item 4) on a maillog real Postfix wrote.

tests/data/replay-sources-steep.log.gz is the maillog of a real relay with three
sources, each an smtp service bound to its own address (127.0.0.21-23) and logging
under its own name (``-o syslog_name=postfix/srcN``), src1 new and on a steep plan
(1000 recipients a site on day 0). The x.test and y.test sink (one server, one site)
took 60 messages a day from 127.0.0.21 and answered ``421 4.7.28`` at RCPT past
them; z.test's took everything. tests/data/replay-sources-gentle.log.gz is the same
workload under a gentle plan (40 a site on day 0). Both were made by ``record`` below
(``python -m tests.test_replay_sources DIR``: ``pyqmgr compare`` of WORKLOAD on the
test bed); the test reads them and starts no Postfix.

Replayed with the relay's pool settings, the steep log gives src1 at the x.test
server a day_limit of 60 (what the sink counted) and no rule elsewhere; the steep
plan then meets the refusals as the log did, the gentle one does not, and the
gentle log shows the gentle plan's counts exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

from pyqmgr.compare.contender import parse_contenders
from pyqmgr.replay import Options, replay
from pyqmgr.replay.sources import Seen, read_pools, rule_of
from pyqmgr.replay.workload import session_rate, write
from pyqmgr.simulator.engine import simulate
from pyqmgr.simulator.scenario import load

HERE = os.path.dirname(os.path.abspath(__file__))
STEEP_LOG = os.path.join(HERE, "data", "replay-sources-steep.log.gz")
GENTLE_LOG = os.path.join(HERE, "data", "replay-sources-gentle.log.gz")
#: The relay's settings when the logs were written (2026-11-30): src1's day 0.
PYQMGR_CF = """site_grouping = mx
message_classes = bulk
source_pools = bulk
bulk_sources = src1 src2 src3
source_pool_maps = inline:{ bulk=bulk }
source_warmup_plan = steep
src1_source_warmup_start = 2026-11-30
"""
STEEP, GENTLE, PROVIDER = "0 1000\n7 warm\n", "0 40\n7 warm\n", 60
#: The run's timers (compare's, at its time scale of 0.05) and master.cf's limits.
MAIN_CF = {"minimal_backoff_time": "15s", "maximal_backoff_time": "200s",
           "queue_run_delay": "15s"}
LIMITS = {"src1": 10, "src2": 10, "src3": 10}


def config_dir(tmp: Path) -> str:
    (tmp / "pyqmgr.cf").write_text(PYQMGR_CF)
    (tmp / "steep").write_text(STEEP)
    (tmp / "gentle").write_text(GENTLE)
    return str(tmp)


def run(tmp: Path, log: str, contenders: list[str]) -> dict[str, Any]:
    pools, rest = read_pools(config_dir(tmp), [])
    assert rest == [] and pools["source_warmup_plan"] == str(tmp / "steep")
    opts = Options(parse_contenders(contenders), dict(MAIN_CF), dict(LIMITS), year=2026,
                   pools=pools)
    workloads: dict[str, Any] = {}
    report = replay([log], opts, None, workloads)
    [inst] = report["instances"]
    inst["workload"] = next(iter(workloads.values()))
    return inst


def rows(inst: dict[str, Any], label: str) -> dict[tuple[str, str], dict[str, int]]:
    return {(r["source"], r["server"]): r for r in inst["sources"]["figures"][label]}


def servers(inst: dict[str, Any]) -> tuple[str, str]:
    """The x.test/y.test server and z.test's, as the relay= fields name them."""
    sites = inst["sites"]
    shared = next(h for h, d in sites.items() if d == ["x.test", "y.test"])
    other = next(h for h, d in sites.items() if d == ["z.test"])
    return shared, other


def test_the_providers_day_limit_for_the_cold_source_is_read_off_the_log(tmp_path):
    inst = run(tmp_path, STEEP_LOG, ["pyqmgr:nqmgr"])
    x, z = servers(inst)
    [rule] = inst["sources"]["rules"]
    print("\n" + "\n".join(n for r in inst["sources"]["rules"] for n in r["notes"]))
    assert (rule["source"], rule["server"]) == ("src1", x)
    assert rule["day_limit"] == PROVIDER, "what the sink took from 127.0.0.21 that day"
    assert rule["day_reply"].startswith("421 4.7.28 Our system has detected")
    assert rule["rate_limit"] == 0
    log = rows(inst, "log")
    assert log[("src1", x)]["sent"] == PROVIDER and log[("src1", x)]["refused"] == 53
    assert log[("src1", z)] == {"source": "src1", "server": z, "sent": 49, "refused": 0,
                                "deferred": 0, "bounced": 0}
    assert inst["sources"]["cold"] == ["src1"]
    assert inst["sources"]["pools"] == {"bulk": ["src1", "src2", "src3"]}
    # The refusals are the source's, played by its rule, not the recipients' scripts:
    # nothing else at x.test answered a 4xx.
    sc = inst["workload"]
    assert sc.date is not None and sc.pyqmgr_cf["source_pools"] == "bulk"
    assert {d.transport for d in sc.destinations.values()} == {"smtp"}
    assert sc.destinations["x.test"].rcpt_4xx == 0
    assert not any("d" in s for m in sc.trace for _, _, s in m.recipients)
    assert sc.destinations["x.test"].sources["src1"].day_limit == PROVIDER
    assert sc.destinations["z.test"].sources == {}


def test_a_steep_plan_meets_the_refusals_and_a_gentle_one_does_not(tmp_path):
    """The A/B: the steep plan (the log's own) sends the provider's 60 from src1 at
    x.test's server and is refused past them, as the log shows; the gentle plan sends
    40 at each server and is never refused, as the gentle run's log shows."""
    gentle_label = f"pyqmgr:nqmgr,source_warmup_plan={tmp_path / 'gentle'}"
    inst = run(tmp_path, STEEP_LOG, ["stock", "pyqmgr:nqmgr", gentle_label])
    x, z = servers(inst)
    from pyqmgr.replay.report import text
    print("\n" + "\n".join(text({"input": {"files": 1, "lines": 0, "skipped": {}},
                                 "instances": [inst]})[-12:]))
    steep, gentle = rows(inst, "pyqmgr:nqmgr"), rows(inst, gentle_label)
    assert steep[("src1", x)]["sent"] == PROVIDER, "the provider's day, not the plan's 1000"
    logged = rows(inst, "log")[("src1", x)]["refused"]
    assert abs(steep[("src1", x)]["refused"] - logged) <= 0.25 * logged, (
        "about as many refused tries as the log's")
    assert steep[("src1", z)]["refused"] == 0 and steep[("src1", z)]["sent"] >= 40
    assert gentle[("src1", x)] == {"source": "src1", "server": x, "sent": 40,
                                   "refused": 0, "deferred": 0, "held": 0, "bounced": 0}
    assert gentle[("src1", z)]["sent"] == 40 and gentle[("src1", z)]["refused"] == 0
    assert sum(r["refused"] for r in gentle.values()) == 0
    # The log ends with src1's refused mail waiting for its retry (437 of 450 sent):
    # so does the steep plan's replay, never the gentle one's.
    total = {label: sum(r["sent"] for r in rows(inst, label).values())
             for label in ("log", "pyqmgr:nqmgr", gentle_label)}
    assert total["log"] == 437 and total["pyqmgr:nqmgr"] < 450 == total[gentle_label]
    assert inst["sources"]["figures"]["stock"] == [], "stock has no pools"
    assert inst["figures"]["stock"]["x.test"]["deferred"] == 0
    # What the gentle run on real Postfix shows: the plan's 40 at each site, exactly.
    (tmp_path / "g").mkdir()
    real = run(tmp_path / "g", GENTLE_LOG, ["pyqmgr:nqmgr"])
    gx, gz = servers(real)
    log = rows(real, "log")
    assert (log[("src1", gx)]["sent"], log[("src1", gz)]["sent"]) == (40, 40)
    assert sum(r["refused"] for r in log.values()) == 0 and real["sources"]["rules"] == []


def test_the_written_workload_runs_the_same_a_b_in_simulate(tmp_path):
    inst = run(tmp_path, STEEP_LOG, ["pyqmgr:nqmgr"])
    path = write(inst["workload"], str(tmp_path / "wl"))
    with open(path, "rb") as f:
        doc = tomllib.load(f)
    x, _ = servers(inst)
    assert doc["pyqmgr_cf"]["bulk_sources"] == "src1 src2 src3"
    assert doc["destinations"]["x.test"]["sources"]["src1"]["day_limit"] == PROVIDER
    assert doc["transports"]["src1"]["process_limit"] == 10
    for plan, sent, refused in (("steep", PROVIDER, True), ("gentle", 40, False)):
        sc = load(path)
        sc.pyqmgr_cf["source_warmup_plan"] = str(tmp_path / plan)
        result = simulate(sc)
        assert result.sources is not None
        by = {(r["source"], r["site"]): r for r in result.sources["per_source_site"]}
        assert by[("src1", x)]["sent"] == sent, plan
        assert bool(result.sources["refused"]) is refused, plan


def test_the_command_line_takes_the_pools_from_config_dir_and_o(tmp_path):
    """The relay's configuration directory as it was: main.cf's timers, master.cf's
    three services, pyqmgr.cf's pool; -o gives a pool setting over pyqmgr.cf's."""
    cfg = config_dir(tmp_path)
    (tmp_path / "main.cf").write_text("".join(f"{k} = {v}\n" for k, v in MAIN_CF.items()))
    shutil.copy("/etc/postfix/master.cf", tmp_path / "master.cf")
    with open(tmp_path / "master.cf", "a") as f:
        for n, source in enumerate(LIMITS, 21):
            f.write(f"{source} unix - - n - 10 smtp -o smtp_bind_address=127.0.0.{n}"
                    f" -o syslog_name=postfix/{source}\n")
    args = [sys.executable, "-m", "pyqmgr.cli", "replay", STEEP_LOG, "--year", "2026",
            "--config-dir", cfg, "--runs", "1", "--json", "--with", "pyqmgr:nqmgr", "--with",
            f"pyqmgr:nqmgr,source_warmup_plan={tmp_path / 'gentle'}"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    [inst] = json.loads(done.stdout)["instances"]
    figures = inst["sources"]["figures"]
    x, z = servers(inst)
    log = {(r["source"], r["server"]): r["sent"] for r in figures["log"]}
    assert (log[("src1", x)], log[("src1", z)]) == (60, 49)
    assert {r["source"] for r in figures["pyqmgr:nqmgr"]} == {"src1", "src2", "src3"}
    # -o gives a pool setting over pyqmgr.cf's: the gentle plan as the relay's own.
    done = subprocess.run([*args[:-4], f"-o source_warmup_plan={tmp_path / 'gentle'}",
                           "--with", "pyqmgr:nqmgr"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    [inst] = json.loads(done.stdout)["instances"]
    src1 = [r for r in inst["sources"]["figures"]["pyqmgr:nqmgr"] if r["source"] == "src1"]
    assert [r["sent"] for r in src1] == [40, 40], "the gentle plan at both servers"
    assert inst["sources"]["figures"]["log"] == figures["log"]


def test_without_pools_the_replay_is_as_before(tmp_path):
    """No pool settings: the refusals stay in the recipients' scripts and shares."""
    opts = Options(parse_contenders(["stock"]), dict(MAIN_CF), dict(LIMITS), year=2026)
    workloads: dict[str, Any] = {}
    [inst] = replay([STEEP_LOG], opts, None, workloads)["instances"]
    sc = next(iter(workloads.values()))
    assert "sources" not in inst and "sites" not in inst
    assert sc.pyqmgr_cf == {} and sc.date is None
    assert sc.destinations["x.test"].rcpt_4xx > 0
    assert inst["figures"]["log"]["x.test"]["deferred"] == 36
    assert inst["figures"]["stock"]["x.test"]["deferred"] > 0, "the scripts' 421s"


def test_refusals_between_accepted_sessions_are_a_rate_not_a_day():
    day = 20_000 * 86400.0
    seen = Seen()
    for i in range(100):
        seen.took.append(day + i)
        seen.sessions.append(day + i)
        seen.sessions.append(day + i + 0.5)
        if i % 10 == 5:
            seen.refused.append(day + i + 0.2)
            seen.replies["421 4.7.28 slow down"] += 1
    rule = rule_of("src1", "mx.example", seen, day, session_rate)
    assert rule.rule is not None and rule.rule.day_limit == 0
    assert rule.rule.rate_limit == 2 and rule.rule.rate_reply == "421 4.7.28 slow down"
    assert "a rate, 2 sessions a second at most" in rule.notes[0]


# -- how the recorded logs were made (real Postfix; not run by the tests) ------------------

WORKLOAD = """title = "three sources, src1 new; x.test's server takes 60 a day from it"
seed = 7
date = 2026-12-01T08:00:00Z
[pyqmgr_cf]
site_grouping = "mx"
message_classes = "bulk"
source_pools = "bulk"
bulk_sources = "src1 src2 src3"
source_pool_maps = "inline:{ bulk=bulk }"
source_warmup_plan = "plan"
src1_source_warmup_start = "2026-12-01"
[transports.src1]
process_limit = 10
[transports.src2]
process_limit = 10
[transports.src3]
process_limit = 10
[destinations."x.test"]
mx = "mx1.x.test"
latency = {dist = "uniform", low = 0.05, high = 0.2}
[destinations."y.test"]
mx = "mx1.x.test"
latency = {dist = "uniform", low = 0.05, high = 0.2}
[destinations."z.test"]
mx = "mx1.z.test"
latency = {dist = "uniform", low = 0.05, high = 0.2}
[destinations."x.test".sources.src1]
day_limit = 60
[destinations."y.test".sources.src1]
day_limit = 60
[[messages]]
count = 200
every = {dist = "exponential", mean = 0.75}
destination = "x.test"
sender = "news@lists.example"
[[messages]]
count = 100
every = {dist = "exponential", mean = 1.5}
destination = "y.test"
sender = "news@lists.example"
[[messages]]
count = 150
every = {dist = "exponential", mean = 1.0}
destination = "z.test"
sender = "news@lists.example"
"""


def record(out: str, plan: str) -> str:
    """Run WORKLOAD under ``plan`` on real Postfix (``pyqmgr compare``, time scale
    0.05, 30 s at most), each source's service logging under its own name as an
    admin's master.cf gives it (``-o syslog_name=postfix/src1``: compare's
    master_cf_line does); the maillog's path.
    Run it from the checkout (``python -m``): pyqmgr refuses to be installed with a
    directory others may write, such as /tmp, on its Python path."""
    from pyqmgr.compare import compare

    os.makedirs(out, exist_ok=True)
    Path(out, "plan").write_text(plan)
    Path(out, "workload.toml").write_text(WORKLOAD)
    report = compare(os.path.join(out, "workload.toml"), ["pyqmgr"], os.path.join(out, "run"),
                     scale=0.05, timeout=30)
    [run_] = report["runs"].values()
    return os.path.join(out, "run", run_["run_dir"], "maillog")


if __name__ == "__main__":
    # python -m tests.test_replay_sources DIR: the steep log, then the gentle one.
    for name, text in (("steep", STEEP), ("gentle", GENTLE)):
        print(record(os.path.join(sys.argv[1], name), text))
