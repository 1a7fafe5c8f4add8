"""pyqmgr compare of two warm-up plans on real Postfix (issue #46 item 4: "compare and
replay can A/B a warm-up plan").

The workload of tests/test_simulator_sources.py, scaled: three sources, each pool
member an smtp service bound to its own address (127.0.0.21-23), one MX host behind
two domains (unbound answers the MX records), whose sink counts messages per client
address and, past 60 from src1's address, answers its recipients ``421 4.7.28``. The
gentle plan (40 on day 0) against a steep one (1000): the sink counts exactly the
gentle plan from 127.0.0.21 and refuses nothing; the steep run meets the 421s past
the provider's 60. The simulator predicted both, and says so beside them.
"""

from __future__ import annotations

import json
import os
import time

from pyqmgr.compare import compare
from pyqmgr.simulator.engine import simulate
from pyqmgr.simulator.scenario import load
from tests.test_simulator_sources import SITE, rows, scenario

GENTLE, STEEP, PROVIDER = 40, 1000, 60


def test_two_plans_on_real_postfix_as_the_simulator_predicts(tmp_path):
    path = scenario(tmp_path, f"0 {GENTLE}\n7 warm\n", messages=300, day_limit=PROVIDER)
    steep = tmp_path / "steep"
    steep.write_text(f"0 {STEEP}\n7 warm\n")
    predicted = {}
    for name, plan in (("gentle", None), ("steep", str(steep))):
        sc = load(path)
        if plan is not None:
            sc.pyqmgr_cf["source_warmup_plan"] = plan
        result = simulate(sc)
        assert result.sources is not None
        predicted[name] = rows(result.sources)[("src1", SITE)]
    assert predicted["gentle"]["sent"] == GENTLE and predicted["steep"]["sent"] == PROVIDER
    out = str(tmp_path / "out")
    began = time.monotonic()
    report = compare(path, ["pyqmgr", f"pyqmgr:nqmgr,source_warmup_plan={steep}"], out,
                     scale=0.05, timeout=15)
    took = time.monotonic() - began
    gentle_run, steep_run = (report["runs"][label] for label in report["contenders"])
    with open(os.path.join(out, gentle_run["run_dir"], "run.json")) as f:
        record = json.load(f)
    summary = open(os.path.join(out, "summary.md")).read()
    print(f"\ncompare took {took:.1f} s\n" + summary[summary.index("## Sources"):])
    assert record["source_addresses"] == {"src1": "127.0.0.21", "src2": "127.0.0.22",
                                          "src3": "127.0.0.23"}
    assert ("src1 unix - - n - 10 smtp -o smtp_bind_address=127.0.0.21"
            " -o syslog_name=postfix/src1") in \
        record["master_cf_extra"]
    gentle = gentle_run["sources"]["by_source"]
    assert gentle["src1"][SITE] == {"messages": GENTLE, "sessions": GENTLE, "over_quota": 0}, \
        "the plan, exactly, from the cold source's address"
    assert gentle["src2"][SITE]["messages"] + gentle["src3"][SITE]["messages"] == 300 - GENTLE
    assert gentle_run["drained"] and gentle_run["deferred"] == 0
    cold = steep_run["sources"]["by_source"]["src1"][SITE]
    # The sink's quota is judged at RCPT against the messages it has accepted: a
    # session of src1's already past RCPT may still finish its message.
    assert PROVIDER <= cold["messages"] <= PROVIDER + 5, cold
    assert cold["over_quota"] > 0 and steep_run["deferred"] > 0
    assert "| src1 (127.0.0.21) | mx1.x.test | 40 | 40 | 0 |" in summary
