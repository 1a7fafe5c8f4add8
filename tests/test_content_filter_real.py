"""A content filter on real Postfix: compare's re-injecting filter, and replay of its log.

``[compare.content_filter]`` puts every message through a filter as amavis is set up
(FILTER_README's advanced filter): Postfix's ``content_filter`` hands it to the
filter's SMTP server over the ``scan`` transport, the filter re-injects it into a
second smtpd and answers "250 2.0.0 Ok: queued as ID". Checked here on a fresh real
Postfix: every message goes through the filter once and reaches its destination
once, compare's figures are the mail's end to end (not the hop's), and replay reads
the log as an admin's: the filter a destination of its own on its main.cf transport.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter

import pytest

from pyqmgr.compare import compare
from pyqmgr.testbed.instance import MASTER_CF_DIST

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("postfix") is None,
    reason="needs root and Debian's postfix package")

N = 12
WORKLOAD = f"""
title = "twelve messages through a content filter"
seed = 5

[compare]
time_scale = 1
timeout = 120
contenders = ["stock"]

[compare.content_filter]
latency = 0.3
process_limit = 2

[destinations."a.example"]
latency = 0.1

[[messages]]
count = {N}
every = 0.1
destination = "a.example"
"""
PYQMGR = [sys.executable, "-c", "import sys; from pyqmgr.cli import main; sys.exit(main())"]
_LINE = re.compile(r"\]: ([0-9A-F]+): to=<([^>]+)>, relay=([^,]+), .*status=(\w+) \((.*)\)$", re.M)


@pytest.fixture(scope="module")
def run():
    root = tempfile.mkdtemp(prefix="pyqmgr-filter-test-", dir="/tmp")
    os.chmod(root, 0o755)  # Postfix's daemons must traverse it
    try:
        path = os.path.join(root, "w.toml")
        with open(path, "w") as f:
            f.write(WORKLOAD)
        out = os.path.join(root, "out")
        report = compare(path, ["stock"], out, base_dir=root)
        run_dir = os.path.join(out, "runs", "1-stock")
        with open(os.path.join(run_dir, "run.json")) as f:
            record = json.load(f)
        with open(os.path.join(run_dir, "maillog")) as f:
            maillog = f.read()
        yield report, record, maillog, run_dir
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_every_message_goes_through_the_filter_once_and_arrives_once(run):
    report, record, maillog, _ = run
    assert record["drained"] and record["error"] is None
    port = record["content_filter"]["port"]
    assert record["content_filter"] == {"port": port, "reinjected": N, "errors": []}
    hops, finals = {}, Counter()
    for qid, to, relay, status, detail in _LINE.findall(maillog):
        assert status == "sent", (qid, to, status, detail)
        if relay.endswith(f"]:{port}"):
            hops[qid] = re.search(r"queued as (\w+)", detail).group(1)
        else:
            finals[qid] += 1
    assert len(hops) == N and set(hops.values()) == set(finals) and set(finals.values()) == {1}
    assert not set(hops) & set(finals), "the copy has a queue id of its own"
    sink = record["sinks"]["a.example"]
    assert sink["accepted"] == N and sink["duplicates"] == 0


def test_compare_counts_the_mail_end_to_end(run):
    """The hop to the filter is no delivery to a.example: sent is N, not 2N, and each
    message's delay spans the filter's 0.3 s hold and the destination's 0.1 s."""
    report, *_ = run
    fig = report["runs"]["stock"]
    assert fig["destinations"]["a.example"]["sent"] == N
    [klass] = fig["classes"].values()
    assert klass["sent"] == N and klass["p50"] >= 0.4, klass


def test_replay_reads_the_filter_as_a_destination_on_its_transport(run):
    """With the run's main.cf and master.cf (--config-dir), the filter hop is a
    destination of its own on main.cf's content_filter transport (scan, 2 processes),
    and the mail's delays at a.example are end to end."""
    _, record, maillog, run_dir = run
    cfg = os.path.join(run_dir, "config")
    os.makedirs(cfg)
    with open(os.path.join(cfg, "main.cf"), "w") as f:
        f.writelines(f"{k} = {v}\n" for k, v in record["main_cf"].items())
    with open(MASTER_CF_DIST) as src, open(os.path.join(cfg, "master.cf"), "w") as f:
        f.write(src.read() + "".join(ln + "\n" for ln in record["master_cf_extra"]))
    proc = subprocess.run([*PYQMGR, "replay", os.path.join(run_dir, "maillog"), "--json",
                           "--config-dir", cfg], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    [inst] = json.loads(proc.stdout)["instances"]
    port = record["content_filter"]["port"]
    name = f"filter-127-0-0-1-{port}.invalid"
    models = {m["destination"]: m for m in inst["model"]}
    assert models[name]["transport"] == "scan"
    log = inst["figures"]["log"]
    assert log[name]["sent"] == N and log["a.example"]["sent"] == N
    assert log["a.example"]["p50"] >= 0.4
    sim = inst["figures"]["stock"]["a.example"]
    assert sim["sent"] == N and abs(sim["p50"] - log["a.example"]["p50"]) <= 0.5
