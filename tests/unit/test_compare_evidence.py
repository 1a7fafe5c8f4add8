"""What compare's report says did not take effect, from recorded real maillogs (#43).

tests/data/compare-dns-stopped/ is a real compare run (run.json and maillog, recorded
by tests/test_compare_sites.py with PYQMGR_RECORD_DNS_STOPPED): pyqmgr with
``site_grouping = mx`` and two domains at one MX host, the DNS server stopped while
it looked them up and started again after, so the mail was delivered without sites.
tests/data/qmgr-fatal-at-start.log is a real test-bed instance whose pyqmgr.cf was
made bad after install: three fatal starts, each throttled by master(8). The controls
are the same runs with the lines in question taken out: then nothing is said.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pyqmgr.compare.evidence import looked_up, not_in_effect
from pyqmgr.compare.figures import run_figures
from pyqmgr.compare.report import build, markdown, to_html

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
LEAD = "learnt no site: 2 of 2 MX lookups failed (first: d0.example: timeout after 1s)"


def _dns_stopped() -> tuple[dict[str, Any], str]:
    with open(os.path.join(DATA, "compare-dns-stopped", "run.json")) as f:
        record = json.load(f)
    with open(os.path.join(DATA, "compare-dns-stopped", "maillog")) as f:
        return record, f.read()


def _without(text: str, *marks: str) -> str:
    return "".join(ln for ln in text.splitlines(keepends=True)
                   if not any(m in ln for m in marks))


def _report(runs: list[dict[str, Any]]) -> dict[str, Any]:
    workload = {"title": "recorded", "path": "recorded.toml", "time_scale": 1,
                "messages": 6, "recipients": 6, "destinations": ["d0.example",
                                                                 "d1.example"],
                "main_cf": {}}
    return build(workload, runs, {r["contender"]: 30 for r in runs})


def test_a_run_whose_lookups_all_failed_leads_the_report_with_it():
    record, text = _dns_stopped()
    label = record["contender"]
    assert "warning: sites: d0.example: MX lookup failed" in text
    assert looked_up(record) == ["d0.example", "d1.example"]
    figures = run_figures(record, text)
    # The run looks whole: every recipient sent, drained.
    assert figures["drained"] and figures["sent"] == 6
    assert figures["not_in_effect"] == [f"{label} {LEAD}; the comparison does not show "
                                        "sites"]
    report = _report([figures])
    assert report["differences"][0] == figures["not_in_effect"][0]
    assert report["not_in_effect"] == figures["not_in_effect"]
    md = markdown(report)
    assert md.split("## Differences that matter\n\n", 1)[1].startswith(f"- {label} {LEAD}")
    page = to_html(report)
    assert page.split("<ul class=diffs>", 1)[1].startswith(f"<li class=missed>{label} ")


def test_it_leads_before_the_comparison_with_another_contender():
    record, text = _dns_stopped()
    ours = run_figures(record, text)
    stock = run_figures({**record, "contender": "stock", "pyqmgr_cf": None},
                        _without(text, "MX lookup failed"))
    assert stock["not_in_effect"] == []
    report = _report([stock, ours])
    assert report["differences"][0].startswith(f"{record['contender']} {LEAD}")


def test_one_failed_lookup_of_two_is_said_as_such():
    record, text = _dns_stopped()
    one = _without(text, "sites: d1.example: MX lookup failed")
    assert not_in_effect(record, one) == [
        f"{record['contender']}'s MX lookups failed for 1 of 2 domains (first: d0.example: "
        "timeout after 1s): those domains were sites of their own, outside their site's "
        "limits"]


def test_lookups_that_worked_and_a_contender_without_sites_say_nothing():
    record, text = _dns_stopped()
    assert not_in_effect(record, _without(text, "MX lookup failed")) == []
    # The same lines under a contender that did not turn sites on are not its feature.
    assert not_in_effect({**record, "pyqmgr_cf": {"scheduler_policy": "nqmgr"}}, text) == []


def test_a_qmgr_fatal_at_start_and_masters_throttle():
    with open(os.path.join(DATA, "qmgr-fatal-at-start.log")) as f:
        text = f.read()
    said = not_in_effect({"contender": "pyqmgr", "pyqmgr_cf": {}}, text)
    assert len(said) == 2, said
    assert said[0].startswith("pyqmgr's qmgr stopped on a fatal error (3 fatal lines): "
                              "fatal: ")
    assert said[0].endswith('pyqmgr.cf: parameter site_grouping: "bogus" is not one of: '
                            "none, mx")
    assert said[1] == ("pyqmgr's qmgr exited 3 times while the run went on (master: exit "
                       "status 1); master throttled its restart (bad command startup): no "
                       "mail moved meanwhile")
    # The issue's case: the daemon died at start-up and wrote no fatal line of its own.
    silent = not_in_effect({"contender": "pyqmgr"}, _without(text, "qmgr[", "fatal:"))
    assert silent == ["pyqmgr's qmgr exited 3 times while the run went on (master: exit "
                      "status 1); master throttled its restart (bad command startup): no "
                      "mail moved meanwhile; no fatal line of the qmgr's says why"]


def test_what_comes_after_postfix_stop_is_not_the_runs():
    with open(os.path.join(DATA, "qmgr-fatal-at-start.log")) as f:
        lines = f.read().splitlines(keepends=True)
    stop = next(i for i, ln in enumerate(lines) if "stopping the Postfix" in ln)
    moved = lines[:3] + [lines[stop]] + lines[3:stop]
    assert not_in_effect({"contender": "pyqmgr"}, "".join(moved)) == []


def test_the_fleets_the_policy_services_and_the_classes_warnings():
    # The daemon's own texts (pyqmgr/daemon/fleet/, delegation.py, classes.py,
    # pyqmgr_cf_names.py), as its maillog has them.
    head = "Nov 29 05:24:25 pfx postfix/qmgr[26977]: warning: "
    text = (head + "shared state redis://127.0.0.1:6390/0: Redis is unreachable: "
            "Connection refused; delivering under this node's own limits "
            "(shared_state_failure = local; this warning at most once a minute)\n"
            + head + "policy.example: no answer after 1s; delivering by default_action = "
            "DUNNO (this warning at most once a minute)\n"
            + head + "classes: class_sender_maps: texthash:/etc/postfix/senders: cannot "
            "open: No such file or directory: left out, its mail takes the defaults\n"
            + head + "/etc/postfix/pyqmgr.cf: unknown parameter metrics_lisen (did you "
            "mean metrics_listen?)\n")
    said = not_in_effect({"contender": "pyqmgr", "pyqmgr_cf": {}}, text)
    assert said == [
        "pyqmgr's fleet lost its shared state redis://127.0.0.1:6390/0 (at least 1 warning; "
        "first: Redis is unreachable: Connection refused): its servers' limits were not "
        "shared meanwhile",
        "pyqmgr's policy service policy.example did not answer (at least 1 warning; first: "
        "no answer after 1s): default_action = DUNNO decided instead",
        "pyqmgr's qmgr left a table of class_sender_maps out (texthash:/etc/postfix/senders:"
        " cannot open: No such file or directory): the mail it names took the default "
        "class",
        "pyqmgr's qmgr warned about its settings: /etc/postfix/pyqmgr.cf: unknown parameter "
        "metrics_lisen (did you mean metrics_listen?): what it names did not take effect"]
