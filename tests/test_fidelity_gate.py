"""The fidelity gate on the recorded real runs (benchmarks/fidelity.py, issue #32).

The same recordings give the same bytes, run after run: CI's verdict cannot move with
chance. And the gate is not blind: a replay made wrong on purpose in any of three ways
fails it, each on the shape whose real runs show that part of Postfix.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

from benchmarks.fidelity import DEFAULT, SHAPES, gate
from benchmarks.fidelity_record import RECORDINGS, load, stale

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def _honest(shape: str) -> frozenset[str]:
    """The figures the honest replay of a shape misses (one gate run a shape)."""
    return frozenset(gate([shape], RECORDINGS)[2])


def _verdict() -> subprocess.CompletedProcess[bytes]:
    """The gate as CI runs it, in a process of its own."""
    return subprocess.run([sys.executable, "-m", "benchmarks.run", "fidelity"], cwd=ROOT,
                          capture_output=True, timeout=900, check=False)


def test_every_recording_has_ten_runs_and_says_where_it_came_from():
    for shape in DEFAULT:
        provenance, runs = load(shape)
        assert len(runs) >= 10, (shape, len(runs))
        for key in ("postfix", "date", "machine", "command", "workload_sha256",
                    "pyqmgr_commit"):
            assert provenance[key], (shape, key)
        assert provenance["machine"]["cores"] >= 1
        # The workload the runs were made of is the one in the tree.
        assert stale(shape, SHAPES[shape]) is None
        assert all(b"status=sent" in r.maillog for r in runs)


def test_the_verdict_is_the_same_bytes_twice():
    first, second = _verdict(), _verdict()
    assert first.stdout, first.stderr.decode()[-2000:]
    assert first.stdout == second.stdout
    assert first.returncode == second.returncode
    # Every recorded shape and every figure is in it.
    text = first.stdout.decode()
    for shape in DEFAULT:
        assert f"{shape}: " in text
    assert "target: " in text


@pytest.mark.parametrize("broken, shapes, expect", [
    # A 421 session limit fitted one higher: fewer refusals at the limiters below and
    # near capacity.
    ("limit+1", ("field",), {"field near.example deferred", "field below.example deferred"}),
    # The content filter's hop dropped: the mail is delivered a filter's pass sooner.
    ("no-filter-hop", ("filtered",), {"filtered fast.example p50",
                                      "filtered fast.example p95"}),
    # The backoff halved: mail a limiter refused waits half as long for its next try.
    ("backoff/2", ("field",), {"field below.example p95", "field near.example p95"}),
])
def test_a_broken_replay_fails_the_gate(broken: str, shapes: tuple[str, ...],
                                        expect: set[str]):
    _, _, missed = gate(shapes, RECORDINGS, broken=broken)
    honest = frozenset().union(*(_honest(s) for s in shapes))
    assert expect <= set(missed), missed
    # What fails is the break, not figures the honest replay misses too.
    assert not expect & honest, honest


def test_a_broken_replay_of_an_enforced_shape_fails_the_run():
    """``filtered`` is enforced (``field`` and ``mixed`` are goals until pyqmgr meets
    stock at a rate limiter, benchmarks/target.py): the broken replay exits 1."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "fidelity", "--shape",
                           "filtered", "--break", "no-filter-hop"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "target: every figure of filtered" in proc.stdout and "MISSED" in proc.stdout


def test_a_recording_of_a_changed_workload_is_refused(tmp_path):
    """The workload file is the recording's meaning: changed, its runs no longer stand
    for it, and the gate says so rather than judging a replay against them."""
    import shutil

    shutil.copytree(os.path.join(RECORDINGS, "filtered"), tmp_path / "filtered")
    changed = tmp_path / "filtered.toml"
    changed.write_text(open(SHAPES["filtered"]).read().replace("count = 120", "count = 121"))
    assert stale("filtered", SHAPES["filtered"], str(tmp_path)) is None
    why = stale("filtered", str(changed), str(tmp_path))
    assert why is not None and "record it again" in why
    with pytest.raises(RuntimeError, match="--record mixed"):
        load("mixed", str(tmp_path))
