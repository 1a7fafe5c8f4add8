"""replay says when the log's retry timing contradicts the configuration (issue #43).

The shipped test-bed logs were written with minimal_backoff_time = 10s,
maximal_backoff_time = 20s and queue_run_delay = 1s (their workloads' [compare.main_cf]);
replayed without -o they ran under stock's 300 s / 4000 s / 300 s, and down.example's
mail, down for the first 40 s, was delivered once (1 recipient against the log's 15)
with no hint why. Every one of them is read here: each shows its own timers, and the
replay says which -o to pass. The seven public logs of six servers (default timers,
flushes, restarts, mail held for days) must say nothing.
"""

from __future__ import annotations

import glob
import os

import pytest

from pyqmgr.cli import main
from pyqmgr.compare.contender import parse_contenders
from pyqmgr.replay import Options, derive, replay
from pyqmgr.replay.timing import retry_timing

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
SHIPPED = sorted(glob.glob(os.path.join(DATA, "*-run*.log.gz"))
                 + glob.glob(os.path.join(DATA, "fidelity-field-*.log.gz")))
PUBLIC = sorted(glob.glob(os.path.join(DATA, "public-maillogs", "*.gz")))
FIELD = os.path.join(DATA, "fidelity-field-run1.log.gz")
THEIRS = {"minimal_backoff_time": 10, "maximal_backoff_time": 20, "queue_run_delay": 1}
OPTIONS = "-o minimal_backoff_time=10s -o maximal_backoff_time=20s -o queue_run_delay=1s"


def _retries(path: str) -> dict[str, list[tuple[float, float]]]:
    _, instances = derive([path], Options([]))
    return {name: d.retries for name, d in instances.items()}


@pytest.mark.parametrize("path", sorted(set(SHIPPED) - {os.path.join(
    DATA, "replay-sites-run1.log.gz")}), ids=os.path.basename)
def test_every_shipped_test_bed_log_shows_its_own_timers(path):
    (retries,) = _retries(path).values()
    timing = retry_timing(retries, {})
    assert timing is not None and timing.retries >= 200
    assert timing.seen == THEIRS and timing.suggest == THEIRS, timing
    assert timing.early == timing.retries and timing.late == 0
    # Under its own timers the same log says nothing.
    fits = retry_timing(retries, {k: f"{v}s" for k, v in THEIRS.items()})
    assert fits is not None and fits.suggest == {} and fits.warning() is None
    assert fits.early == 0 and fits.late <= timing.retries // 20


@pytest.mark.parametrize("path", PUBLIC, ids=os.path.basename)
def test_real_servers_logs_with_default_timers_say_nothing(path):
    for name, retries in _retries(path).items():
        timing = retry_timing(retries, {})
        assert timing is None or (timing.suggest == {} and timing.warning() is None), \
            (name, timing)


def test_the_replay_without_o_says_which_o_to_pass_and_with_them_says_nothing():
    opts = Options(parse_contenders(["stock"]), runs=1)
    (inst,) = replay([FIELD], opts)["instances"]
    said = [w for w in inst["warnings"] if "retry timing" in w]
    assert len(said) == 1, inst["warnings"]
    assert said[0].startswith(
        "the log's retry timing contradicts the configuration replayed under "
        "(minimal_backoff_time = 300s, maximal_backoff_time = 4000s, queue_run_delay = "
        "300s): its deferred mail came back after 9-19 s (402 retries, median 17 s), as "
        "minimal_backoff_time = 10s, maximal_backoff_time = 20s, queue_run_delay = 1s "
        "would")
    assert f"replay with {OPTIONS} (or --config-dir" in said[0]
    assert inst["retry_timing"]["suggest"] == THEIRS
    # What it costs: down.example, down for the log's first 40 s, is delivered once
    # in the log's 177 s under the defaults; under the log's timers, as in the log.
    assert inst["figures"]["log"]["down.example"]["sent"] == 15
    assert inst["figures"]["stock"]["down.example"]["sent"] <= 2
    opts.main_cf = {k: f"{v}s" for k, v in THEIRS.items()}
    (fixed,) = replay([FIELD], opts)["instances"]
    assert not any("retry timing" in w for w in fixed["warnings"])
    assert fixed["retry_timing"]["suggest"] == {}
    assert fixed["figures"]["stock"]["down.example"]["sent"] == 15


def test_the_text_report_shows_it_before_the_table(capsys):
    assert main(["replay", FIELD, "--runs", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    at = next(i for i, ln in enumerate(out) if "retry timing contradicts" in ln)
    assert out[at].startswith("  warning: the log's retry timing")
    assert out[at].endswith(f"replay with {OPTIONS} (or --config-dir with the logged "
                            "instance's main.cf)")
    assert at < next(i for i, ln in enumerate(out) if ln.startswith("destination"))


def test_a_log_with_longer_timers_than_the_defaults():
    """Retries later than the configuration allows: maximal_backoff_time = 8000s seen
    on mail days old, min 600 s on young mail (a wait for a 60 s scan on each)."""
    retries = [(100000.0 + k, 8000.0 + (k * 7) % 60) for k in range(20)]
    retries += [(30.0 + k, 600.0 + (k * 11) % 60) for k in range(20)]
    timing = retry_timing(retries, {})
    # Under the defaults (300 s, 4000 s, 300 s) nearly all are late.
    assert timing is not None and timing.late >= 36 and timing.early == 0
    assert timing.seen["maximal_backoff_time"] in range(8000, 8010)
    assert timing.seen["minimal_backoff_time"] in range(600, 610)
    assert 30 <= timing.seen["queue_run_delay"] <= 60
    assert timing.suggest == timing.seen, timing
    # Half the retries late is enough to say so; a few late (a busy queue) is not.
    fits = [(100000.0, 4000.0 + k * 13) for k in range(17)]
    fits += [(30.0 + k, 300.0 + k * 13) for k in range(20)]
    quiet = retry_timing(retries[:3] + fits, {})
    assert quiet is not None and quiet.suggest == {}


def test_too_few_retries_say_nothing():
    assert retry_timing([(0.0, 9.0)] * 4, {}) is None
