"""Misspelled settings and unreadable tables in pyqmgr.cf, on real Postfix (issue #43).

``metrics_lisen``, ``smtp_destinaton_rate`` and ``site_groupping`` used to pass ``pyqmgr
check`` ("ok: no problems found") and start the daemon without a word, the features
they meant off; a class table that cannot be read passed check too, and only the
daemon warned. Now check exits 1 naming all four (with the nearest known names), and
the daemon, which runs regardless as stock's qmgr runs past an unused main.cf name,
logs each once. The forms that are right must stay quiet: ``<transport>_`` names of
master.cf's transports, the admin's own ``$name`` helpers, and the knobs of a
``module:`` policy in use.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter

from tests.trust_helpers import trusted_dir

CLI = os.path.join(os.path.dirname(sys.executable), "pyqmgr")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check(config_dir: str, *more: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, "check", "--config-dir", config_dir, *more],
                          capture_output=True, text=True, timeout=120)


def test_three_misspellings_and_a_missing_class_table(postfix):
    # Installed first: install runs check and would refuse this file, as it should.
    pf = postfix(qmgr="pyqmgr", start=False)
    table = os.path.join(pf.config_dir, "message_classes")  # never made
    cf = pf.write_pyqmgr_cf({
        "metrics_lisen": "127.0.0.1:9155",
        "smtp_destinaton_rate": "10/1s",
        "site_groupping": "mx",
        "message_classes": "transactional bulk",
        "message_class_maps": f"texthash:{table}",
        # Right, and quiet: a transport form for master.cf's relay, and a name of the
        # admin's own that a value uses.
        "my_rate": "20/1s",
        "relay_destination_rate": "$my_rate",
    })
    unread = (f"classes: message_class_maps: texthash:{table}: cannot read {table}: "
              "No such file or directory: left out, its mail takes the defaults")
    unknown = [f"{cf}: unknown parameter metrics_lisen (did you mean metrics_listen?)",
               f"{cf}: unknown parameter smtp_destinaton_rate (did you mean "
               "smtp_destination_rate?)",
               f"{cf}: unknown parameter site_groupping (did you mean site_grouping?)"]

    proc = check(pf.config_dir)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr == ""
    problems = [ln.strip() for ln in proc.stdout.splitlines() if ln.startswith("  ")]
    assert problems == [*unknown, f"{cf}: the daemon would warn: {unread}"], proc.stdout
    assert "parses, 7 parameter(s), 3 unknown" in proc.stdout
    report = json.loads(check(pf.config_dir, "--json").stdout)
    assert report["ok"] is False and report["problems"] == problems
    assert [(u["name"], u["suggestion"]) for u in report["unknown_parameters"]] == [
        ("metrics_lisen", "metrics_listen"), ("smtp_destinaton_rate", "smtp_destination_rate"),
        ("site_groupping", "site_grouping")]
    assert report["unreadable_tables"] == [unread] and report["missing_extras"] == []

    # The daemon starts, names each once, and delivers (its mail of the default class).
    pf.start()
    (qid,) = pf.smtp_send([("s@test.example", [pf.local_address])])
    pf.maillog.wait_for(lambda ln: ln.queue_id == qid and ln.text.endswith("removed"),
                        timeout=30, what="delivery under the misspelled pyqmgr.cf")
    said = Counter(ln.text for ln in pf.maillog.lines(program="postfix/qmgr")
                   if ln.severity in ("warning", "fatal"))
    assert said == Counter(f"warning: {text}" for text in [*unknown, unread]), said


def test_transport_forms_own_names_and_a_module_policys_knobs_are_known(postfix):
    """contrib's sender_classes policy in use: its knobs, in a transport form, are
    known to check and to the daemon, as are relay_ forms and $name helpers."""
    with trusted_dir("pyqmgr-check-settings-") as base:
        policy = os.path.join(base, "sender_classes.py")
        shutil.copy(os.path.join(ROOT, "contrib", "sender_classes.py"), policy)
        os.chmod(policy, 0o644)
        pf = postfix(qmgr="pyqmgr", start=False, base_dir=base)
        pf.write_pyqmgr_cf({
            "scheduler_policy": f"module:{policy}",
            "smtp_sender_classes_small_limit": "5",
            "sender_classes_large_weight": "1",
            "rate_of_mine": "20/1s",
            "relay_destination_rate": "$rate_of_mine",
            "relay_delivery_policy_context": "relayed",
        })
        proc = check(pf.config_dir)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "ok: no problems found" in proc.stdout
        assert "parses, 6 parameter(s)" in proc.stdout and "unknown" not in proc.stdout

        pf.start()
        (qid,) = pf.smtp_send([("s@test.example", [pf.local_address])])
        pf.maillog.wait_for(lambda ln: ln.queue_id == qid and ln.text.endswith("removed"),
                            timeout=30, what="delivery under sender_classes")
        assert not [ln.text for ln in pf.maillog.lines(program="postfix/qmgr")
                    if ln.severity in ("warning", "fatal")]


def test_delivery_event_categories_a_bad_line_is_named_and_a_good_file_passes(postfix):
    """The admin's reply categories (docs/events.md) are read as start-up reads them:
    a line that is no rule fails check naming the parameter, the file and the line; a
    good file passes."""
    pf = postfix(qmgr="pyqmgr", start=False)
    rules = os.path.join(pf.config_dir, "reply-categories")
    with open(rules, "w") as f:
        f.write("# ours first\n/quota limit reached for/  mailbox_full\n"
                "/unclosed  policy\n")
    os.chmod(rules, 0o644)
    events = os.path.join(pf.root, "events", "delivery.jsonl")
    pf.write_pyqmgr_cf({"delivery_events_file": events,
                        "delivery_event_categories": rules})
    proc = check(pf.config_dir)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    problems = [ln.strip() for ln in proc.stdout.splitlines() if ln.startswith("  ")]
    assert len(problems) == 1 and "delivery_event_categories" in problems[0] \
        and f"{rules}, line 3" in problems[0], proc.stdout
    with open(rules, "w") as f:
        f.write("/quota limit reached for/  mailbox_full\n")
    proc = check(pf.config_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_delivery_events_stream_needs_a_fleet_a_file_and_a_plain_name(postfix):
    """``delivery_events_stream`` (the fleet's Redis stream): each wrong form fails
    check with one problem naming the parameter and what it needs; a right one passes."""
    pf = postfix(qmgr="pyqmgr", start=False)
    events = os.path.join(pf.root, "events", "delivery.jsonl")
    fleet = {"shared_state": "redis://127.0.0.1:6390"}
    cases = [
        ({"delivery_events_file": events, "delivery_events_stream": "events"},
         "delivery_events_stream", "needs shared_state"),
        ({**fleet, "delivery_events_stream": "events"},
         "delivery_events_stream", "needs delivery_events_file"),
        ({**fleet, "delivery_events_file": events, "delivery_events_stream": "x" * 201},
         "delivery_events_stream", "at most 200 characters"),
        ({**fleet, "delivery_events_file": events, "delivery_events_stream": "events",
          "delivery_events_stream_max_length": "10"},
         "delivery_events_stream_max_length", "10"),
    ]
    for values, name, why in cases:
        pf.write_pyqmgr_cf(values)
        proc = check(pf.config_dir)
        assert proc.returncode == 1, (values, proc.stdout + proc.stderr)
        problems = [ln.strip() for ln in proc.stdout.splitlines() if ln.startswith("  ")]
        assert len(problems) == 1 and name in problems[0] and why in problems[0], (
            values, proc.stdout)
    pf.write_pyqmgr_cf({**fleet, "delivery_events_file": events,
                        "delivery_events_stream": "events",
                        "delivery_events_stream_max_length": "50000"})
    proc = check(pf.config_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
