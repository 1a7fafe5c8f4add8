"""pyqmgr replay on real maillogs that no one on the project wrote.

tests/data/public-maillogs holds seven logs of six servers from public repositories
(their provenance, licences and grep counts are in its README). Each is replayed by
the real command as an admin would run it on their own log. Its figures must be the
log's own: per instance, the recipients sent, deferred and bounced add up to the
lines a plain text search counts (``status=sent``...), made here independently of
pyqmgr's parser; the report says how many lines were not used, by kind, and what of
each destination was not modelled; and nothing ends in a traceback.
"""

from __future__ import annotations

import gzip
import json
import os
import re

import pytest

from tests.test_replay import run

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "public-maillogs")

#: File, and the year of its first line (syslog lines have none; see the README).
CLEAN = [
    ("kdent-postfix_log_analysis-conch-mail2.log.gz", 2015),
    ("louisitvn-pflgviewer-phoenix-mail.log.gz", 2014),
    ("teliten-log.plemma-vultr-2022-01-mail.log.1.log.gz", 2022),
    ("teliten-log.plemma-vultr-2021-08-mail.log.gz", 2021),
    ("oleg-medovikov-mail-server-anal-amavis-mail.log.gz", 2024),
    ("StarshipEngineer-email-setup-raspberrypi-mail.log.gz", 2016),
]
#: A troubleshooting dump: pasted fragments out of time order, debug lines, a delivery
#: line wrapped over three lines. Read for robustness only: its grep counts include
#: lines a log reader must refuse.
MESSY = ("infohtreasure-Postfix-Maillog-Dump-mailog2.log.gz", 2022)


def grep_counts(path: str) -> dict[str, int]:
    """What ``zgrep -c 'status=X'`` gives, per status."""
    counts = dict.fromkeys(("sent", "deferred", "bounced"), 0)
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
        for line in f:
            for status in counts:
                if f"status={status}" in line:
                    counts[status] += 1
    return counts


def replayed(name: str, year: int) -> tuple[dict, str]:
    path = os.path.join(DATA, name)
    proc = run("replay", path, "--year", str(year), "--json", "--runs", "1")
    assert "Traceback" not in proc.stderr
    text = run("replay", path, "--year", str(year), "--runs", "1")
    assert "Traceback" not in text.stderr
    return json.loads(proc.stdout), text.stdout


@pytest.mark.parametrize(("name", "year"), CLEAN, ids=[n.split("-")[0] for n, _ in CLEAN])
def test_public_log_figures_are_the_logs_own(name, year):
    rep, text = replayed(name, year)
    totals = dict.fromkeys(("sent", "deferred", "bounced"), 0)
    for inst in rep["instances"]:
        for fig in inst["figures"]["log"].values():
            for key in totals:
                totals[key] += fig[key]
    want = grep_counts(os.path.join(DATA, name))
    print(name, totals, want)
    assert totals == want
    # Each instance says how much of its log was not used, by kind, and the counts
    # add up to the share it prints.
    for inst in rep["instances"]:
        unused = sum(inst["unused"].values())
        assert 0 <= unused <= inst["read"]
        if unused:
            share = f"not used: {unused} of {inst['read']} lines ({unused / inst['read']:.0%})"
            assert share in text, share
            for kind, n in inst["unused"].items():
                assert f"    {n} {kind}" in text
    # What each destination did that the simulation does not play is said per
    # destination, with counts.
    assert "what the log shows of each destination" in text
    assert re.search(r"^pyqmgr replay: 1 file\(s\), \d+ lines", text, re.M)


def test_a_messy_dump_is_read_without_a_traceback():
    rep, text = replayed(*MESSY)
    skipped = rep["input"]["skipped"]
    assert skipped["out of order (back in time: another year's line?)"] > 1000
    assert "skipped:" in text
    totals = sum(f["sent"] + f["deferred"] + f["bounced"] for inst in rep["instances"]
                 for f in inst["figures"]["log"].values())
    want = sum(grep_counts(os.path.join(DATA, MESSY[0])).values())
    assert 0 < totals <= want


def test_the_backlogged_server_keeps_its_backlog():
    """phoenix's log begins with 1,915 messages already in the active queue (up to
    952 s waited there): their deliveries are replayed, not dropped, and the
    destination's delays keep their hours (the simulation's p95 collapsed to 5 s
    when they were dropped)."""
    rep, _ = replayed(*CLEAN[1])
    inst = rep["instances"][0]
    assert inst["messages"]["in the active queue as the log began"] == 1915
    log = inst["figures"]["log"]["dmnesisparty.co.uk"]
    sim = inst["figures"]["stock"]["dmnesisparty.co.uk"]
    assert log["sent"] == sim["sent"] == 1314
    assert sim["p95"] > 0.4 * log["p95"] > 500


def test_a_relayhost_is_one_destination():
    """teliten 2022 sends everything remote through Gmail's relay on port 587: with
    its relayhost given (as --config-dir's main.cf would give it), that mail is one
    destination, as stock queues it, and the log's counts stay the grep's."""
    name, year = CLEAN[2]
    path = os.path.join(DATA, name)
    rep = json.loads(run("replay", path, "--year", str(year), "--json", "--runs", "1",
                         "-o", "relayhost=[smtp-relay.gmail.com]:587").stdout)
    [inst] = rep["instances"]
    log = inst["figures"]["log"]
    relay = log["relay-smtp-relay-gmail-com-587.invalid"]
    smtp_lines = 0
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
        for line in f:
            if " postfix/smtp[" in line and " to=<" in line and " status=" in line:
                smtp_lines += 1
    assert relay["sent"] + relay["deferred"] + relay["bounced"] == smtp_lines == 700
    totals = {k: sum(f[k] for f in log.values()) for k in ("sent", "deferred", "bounced")}
    assert totals == grep_counts(path)
    assert inst["figures"]["stock"]["relay-smtp-relay-gmail-com-587.invalid"]["sent"] == 696
