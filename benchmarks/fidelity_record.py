"""Recorded real runs: the data the fidelity gate replays (issue #32).

A recording is K stock runs of one workload shape on a fresh real Postfix each
(``pyqmgr compare``), kept compressed in ``benchmarks/fidelity_recordings/SHAPE/``:
each run's maillog and run.json (the main.cf and master.cf lines it ran with, what
the sinks saw), and ``provenance.json`` saying what made them (Postfix's release,
the date, the machine's cores and load, the command, the workload file's SHA-256,
pyqmgr's commit). The gate reads them back; CI never records, so its verdict cannot
move with the runs a machine happens to make that day.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RECORDINGS = os.path.join(HERE, "fidelity_recordings")


@dataclass(frozen=True)
class RecordedRun:
    """One real run as the gate needs it: its maillog's lines and its run.json."""

    name: str
    maillog: bytes
    record: dict[str, Any]


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def postfix_release() -> str:
    proc = subprocess.run(["postconf", "-dh", "mail_version"], capture_output=True,
                          text=True, check=False)
    return proc.stdout.strip() or "unknown"


def commit() -> str:
    proc = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=False)
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "pyqmgr"],
                           capture_output=True, text=True, check=False).stdout.strip()
    return proc.stdout.strip() + (" (pyqmgr/ modified)" if dirty else "")


def record(shape: str, workload: str, runs: int, out: str | None = None) -> str:
    """Make ``runs`` real stock runs of ``workload`` and keep them as ``shape``'s
    recording (replacing an older one only once every run has drained)."""
    from pyqmgr.compare import compare

    dest = out or os.path.join(RECORDINGS, shape)
    work = tempfile.mkdtemp(prefix=f"pyqmgr-record-{shape}-")
    runs_meta: list[dict[str, Any]] = []
    started = time.time()
    try:
        for i in range(runs):
            run_out = os.path.join(work, f"run{i + 1}")
            base = tempfile.mkdtemp(prefix="pyqmgr-fidelity-", dir="/tmp")
            os.chmod(base, 0o755)  # Postfix's daemons must traverse it
            load_before = os.getloadavg()
            t0 = time.time()
            try:
                report = compare(workload, ["stock"], run_out, base_dir=base)
            finally:
                shutil.rmtree(base, ignore_errors=True)
            if not report["runs"]["stock"]["drained"]:
                raise RuntimeError(f"{workload}: run {i + 1} did not drain")
            runs_meta.append({"run": i + 1, "started": time.strftime(
                "%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), "seconds": round(time.time() - t0, 1),
                "load_before": [round(x, 2) for x in load_before],
                "load_after": [round(x, 2) for x in os.getloadavg()]})
            print(f"  {shape}: real run {i + 1} of {runs} done "
                  f"({time.time() - t0:.0f} s)", flush=True)
        staged = dest + ".new"
        shutil.rmtree(staged, ignore_errors=True)
        os.makedirs(staged)
        for i in range(runs):
            src = os.path.join(work, f"run{i + 1}", "runs", "1-stock")
            for name, target in (("maillog", "maillog.gz"), ("run.json", "run.json.gz")):
                with open(os.path.join(src, name), "rb") as f, \
                        gzip.GzipFile(os.path.join(staged, f"run{i + 1:02d}.{target}"),
                                      "wb", mtime=0) as g:
                    g.write(f.read())
        made = {
            "shape": shape, "runs": runs,
            "workload": os.path.relpath(workload, ROOT), "workload_sha256": sha256(workload),
            "postfix": postfix_release(), "pyqmgr_commit": commit(),
            "date": time.strftime("%Y-%m-%d", time.gmtime(started)),
            "machine": {"cores": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version()},
            "command": "./dev bench fidelity --record " + shape + f" --runs {runs}",
            "seconds": round(time.time() - started, 1), "each": runs_meta}
        with open(os.path.join(staged, "provenance.json"), "w") as f:
            json.dump(made, f, indent=1)
            f.write("\n")
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(staged, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def provenance(shape: str, where: str = RECORDINGS) -> dict[str, Any]:
    """A recording's provenance.json (how many runs, and what made them)."""
    try:
        with open(os.path.join(where, shape, "provenance.json")) as f:
            return dict(json.load(f))
    except FileNotFoundError:
        raise RuntimeError(f"no recording of {shape!r} in {where} (make one with "
                           f"./dev bench fidelity --record {shape})") from None


def load_run(shape: str, index: int, where: str = RECORDINGS) -> RecordedRun:
    """One recorded run (0-based), as a replay job needs it: only its own files."""
    name = f"run{index + 1:02d}"
    d = os.path.join(where, shape)
    with gzip.open(os.path.join(d, f"{name}.maillog.gz"), "rb") as g:
        maillog = g.read()
    with gzip.open(os.path.join(d, f"{name}.run.json.gz"), "rb") as g:
        rec = json.loads(g.read())
    return RecordedRun(name, maillog, rec)


def load(shape: str, where: str = RECORDINGS) -> tuple[dict[str, Any], list[RecordedRun]]:
    """A recording's provenance and runs, in run order."""
    prov = provenance(shape, where)
    return prov, [load_run(shape, i, where) for i in range(int(prov["runs"]))]


def stale(shape: str, workload: str, where: str = RECORDINGS) -> str | None:
    """Why a recording no longer stands for its workload file (it was changed), or None."""
    prov = provenance(shape, where)
    if prov["workload_sha256"] != sha256(workload):
        return (f"{shape}: the workload file changed since it was recorded "
                f"({prov['date']}); record it again")
    return None


if __name__ == "__main__":
    from benchmarks.fidelity import SHAPES

    name, k = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
    print(record(name, SHAPES[name], k))
