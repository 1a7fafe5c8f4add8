"""pyqmgr compare with message classes (issue #34), on real Postfix: the shipped
workload compat/workloads/priority.toml, stock against pyqmgr with its [pyqmgr_cf]."""

from __future__ import annotations

import os
import shutil
import tempfile

from pyqmgr.compare import compare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOAD = os.path.join(ROOT, "compat", "workloads", "priority.toml")


def test_the_resets_wait_for_the_newsletter_under_stock_and_not_under_pyqmgr():
    base = tempfile.mkdtemp(prefix="pyqmgr-compare-priority-", dir="/tmp")
    os.chmod(base, 0o755)
    try:
        report = compare(WORKLOAD, ["stock", "pyqmgr"], os.path.join(base, "out"),
                         base_dir=base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    stock = report["runs"]["stock"]["classes"]["transactional"]
    ours = report["runs"]["pyqmgr"]["classes"]["transactional"]
    bulk = report["runs"]["pyqmgr"]["classes"]["bulk"]
    print(f"\nresets p50/p95: stock {stock['p50']}/{stock['p95']} s, pyqmgr with classes "
          f"{ours['p50']}/{ours['p95']} s; newsletter under pyqmgr p50 {bulk['p50']} s")
    assert report["runs"]["stock"]["drained"] and report["runs"]["pyqmgr"]["drained"]
    assert ours["sent"] == stock["sent"] == 10
    assert ours["p95"] < 0.5 and stock["p50"] > 1.0
