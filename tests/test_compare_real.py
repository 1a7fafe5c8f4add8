"""pyqmgr compare on real Postfix: every shipped workload, its figures recomputed, the page.

One module-scoped run of every workload in compat/workloads/ with its own contenders
(two or three each; the time scales keep the whole at a few minutes). Then:

* each run drained, lost nothing and delivered nothing twice (the sinks' counts);
* every figure of report.json is computed again here, independently: the maillog read
  with the test bed's own parser (``pyqmgr.testbed.maillog``, not the compare
  package's), percentiles by numpy, sessions open from the sink's raw timeline, the
  orders' similarity by difflib; they must agree;
* the maillog and the sinks, two observers of the same run, agree with each other:
  recipients sent per destination equal recipients the sink accepted, and the 4xx
  replies the maillog quotes are the ones the sink gave;
* what each workload is there to show shows (the 421 limiter's deferrals, oqmgr's
  order from both oqmgrs, ...);
* report.html opens in Debian's headless Chromium with no console error, exception or
  failed load and fetches nothing; a full-page screenshot is a non-blank PNG. The
  check is itself checked on a page with a console error, an exception and a fetch;
* Ctrl-C during a compare stops every instance and leaves no directory behind.
"""

from __future__ import annotations

import contextlib
import difflib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy
import pytest

from pyqmgr.compare import compare
from pyqmgr.testbed.chromium import chromium_path, open_page
from pyqmgr.testbed.maillog import parse_line

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKLOADS = sorted(glob.glob(os.path.join(ROOT, "compat", "workloads", "*.toml")))

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("postfix") is None,
    reason="needs root and Debian's postfix package")


def _base_dir() -> str:
    # Postfix's daemons must traverse it: pytest's tmp_path is 0700.
    path = tempfile.mkdtemp(prefix="pyqmgr-compare-test-", dir="/tmp")
    os.chmod(path, 0o755)
    return path


@pytest.fixture(scope="module")
def reports() -> Any:
    out_root = _base_dir()
    instances = _base_dir()
    done: dict[str, tuple[str, dict[str, Any], float]] = {}

    def run(path: str) -> tuple[str, tuple[str, dict[str, Any], float]]:
        name = os.path.splitext(os.path.basename(path))[0]
        out = os.path.join(out_root, name)
        start = time.monotonic()
        report = compare(path, None, out, base_dir=instances)
        return name, (out, report, time.monotonic() - start)

    try:
        # Two workloads at a time, each on its own instances and sinks: the runs mostly
        # wait on their sinks' latencies and Postfix's timers (issue #32: the suite's
        # time). Each workload's contenders still run one after the other.
        with ThreadPoolExecutor(2) as pool:
            for name, result in pool.map(run, WORKLOADS):
                done[name] = result
                print(f"\n{name}: {result[2]:.1f} s for "
                      f"{', '.join(result[1]['contenders'])}")
                for line in result[1]["differences"]:
                    print(f"  - {line}")
        assert os.listdir(instances) == [], "every instance directory is removed"
        yield done
    finally:
        shutil.rmtree(out_root, ignore_errors=True)
        shutil.rmtree(instances, ignore_errors=True)


def test_every_shipped_workload_runs_and_drains(reports):
    assert set(reports) == {os.path.splitext(os.path.basename(p))[0] for p in WORKLOADS}
    for name, (out, report, seconds) in reports.items():
        assert seconds < 120, f"{name} took {seconds:.0f} s"
        for f in ("report.html", "report.json", "summary.md"):
            assert os.path.getsize(os.path.join(out, f)) > 0
        for label, run in report["runs"].items():
            assert run["drained"] and not run["error"], (name, label, run["error"])
            assert run["submission_errors"] == 0
            for dest, d in run["destinations"].items():
                sink = d["sink"]
                if sink.get("kind") == "sink":
                    assert sink["duplicates"] == 0, (name, label, dest)


def test_priority_the_resets_wait_under_stock_and_not_under_pyqmgr(reports):
    """compat/workloads/priority.toml (issue #34): the workload's [pyqmgr_cf] gives
    pyqmgr two classes; stock's resets wait for the newsletter ahead of them."""
    _, report, _ = reports["priority"]
    stock = report["runs"]["stock"]["classes"]["transactional"]
    ours = report["runs"]["pyqmgr"]["classes"]["transactional"]
    print(f"\nresets p50/p95: stock {stock['p50']}/{stock['p95']} s, pyqmgr with classes "
          f"{ours['p50']}/{ours['p95']} s")
    assert ours["sent"] == stock["sent"] == 10
    assert ours["p95"] < 0.5 and stock["p50"] > 1.0


# -- the independent recomputation --------------------------------------------------------

def _recompute(run_dir: str) -> dict[str, Any]:
    """The report's figures from the run's raw files, without the compare package."""
    with open(os.path.join(run_dir, "run.json")) as f:
        record = json.load(f)
    submitted = {m["qid"]: m["submitted"] for m in record["messages"] if m["qid"]}
    klass_of, dest_of, mid_of = {}, {}, {}
    for m in record["messages"]:
        for r in m["recipients"]:
            local, _, domain = r.partition("@")
            klass_of[r], dest_of[r], mid_of[r] = local.split(".")[0], domain, m["mid"]
    delays: dict[str, list[float]] = defaultdict(list)
    counts: dict[tuple[str, str], int] = Counter()
    by_reply: dict[str, Counter[str]] = defaultdict(Counter)
    order, ends = [], []
    with open(os.path.join(run_dir, "maillog"), errors="replace") as f:
        for raw in f.read().splitlines():
            ln = parse_line(raw)
            if ln is None or ln.to not in klass_of or ln.queue_id not in submitted:
                continue
            status, to = ln.status, ln.to
            delay = float(ln.fields["delay"])
            counts[(dest_of[to], status)] += 1
            if status == "sent":
                delays[klass_of[to]].append(delay)
                order.append(mid_of[to])
            if status in ("sent", "bounced"):
                ends.append(submitted[ln.queue_id] + delay)
            detail = ln.detail or ""
            if status == "deferred":
                for marker in ("said: ", "refused to talk to me: "):
                    if marker in detail:
                        words = detail.split(marker, 1)[1].split()
                        code = " ".join(words[:2]) if words[1][:1].isdigit() else words[0]
                        if code[0] == "4":
                            by_reply[dest_of[to]][code] += 1
    replies: dict[str, Counter[str]] = defaultdict(Counter)
    for dest, sink in record["sinks"].items():
        texts = record["destinations"][dest]
        replies[dest]["421 4.7.0"] += sink.get("refused_421", 0)
        replies[dest][" ".join(texts["rate_reply"].split()[:2])] += sink.get(
            "refused_rate", 0)
        for code, n in sink.get("replies", {}).items():
            if code.startswith("4"):
                replies[dest][" ".join(texts["rcpt_4xx_reply"].split()[:2])] += n
    classes = {}
    for klass, values in delays.items():
        classes[klass] = {f"p{p}": float(numpy.percentile(values, p)) for p in (50, 95, 99)}
        classes[klass]["sent"] = len(values)
    sessions = {}
    for dest, sink in record["sinks"].items():
        tl = sink.get("timeline")
        if not tl:
            continue
        busy = total = 0.0
        for (t0, n), (t1, _) in zip(tl, tl[1:], strict=False):
            if n:
                busy += t1 - t0
                total += n * (t1 - t0)
        sessions[dest] = (max(n for _, n in tl), total / busy if busy else 0.0)
    return {"record": record, "classes": classes, "counts": counts, "by_reply": by_reply,
            "replies": {d: {k: v for k, v in c.items() if v} for d, c in replies.items()},
            "drain": max(ends), "order": order, "sessions": sessions}


def test_the_figures_agree_with_an_independent_reading_of_each_maillog(reports):
    for name, (out, report, _) in reports.items():
        orders = {}
        for label, run in report["runs"].items():
            mine = _recompute(os.path.join(out, run["run_dir"]))
            where = f"{name}/{label}"
            assert run["drain_time"] == pytest.approx(mine["drain"], abs=1e-3), where
            for klass, c in mine["classes"].items():
                got = run["classes"][klass]
                assert got["sent"] == c["sent"], where
                for p in ("p50", "p95", "p99"):
                    assert got[p] == pytest.approx(c[p], abs=1e-3), (where, klass, p)
            tried = 0
            for dest, d in run["destinations"].items():
                n = {s: mine["counts"].get((dest, s), 0) for s in ("sent", "bounced",
                                                                   "deferred")}
                assert (d["sent"], d["bounced"], d["deferred"]) == (
                    n["sent"], n["bounced"], n["deferred"]), (where, dest)
                t = sum(n.values())
                tried += t
                assert d["deferral_rate"] == pytest.approx(n["deferred"] / t if t else 0,
                                                           abs=1e-4), (where, dest)
                assert d["deferred_by_reply"] == dict(mine["by_reply"].get(dest, {})), (
                    where, dest)
                assert d["replies_4xx"] == mine["replies"].get(dest, {}), (where, dest)
                if dest in mine["sessions"]:
                    peak, mean = mine["sessions"][dest]
                    assert d["in_flight_peak"] == peak, (where, dest)
                    assert d["in_flight_mean"] == pytest.approx(mean, abs=1e-3), (where, dest)
            assert run["deferral_rate"] == pytest.approx(
                sum(v for (_, s), v in mine["counts"].items() if s == "deferred") / tried,
                abs=1e-4), where
            assert run["order"] == mine["order"], where
            record = mine["record"]
            assert run["qmgr_cpu_s"] == record["qmgr"]["cpu_s"] > 0, where
            assert run["qmgr_vmhwm_mib"] == pytest.approx(
                record["qmgr"]["vmhwm_kib"] / 1024, abs=0.01), where
            orders[label] = mine["order"]
        for a in orders:
            for b in orders:
                ratio = difflib.SequenceMatcher(None, orders[a], orders[b],
                                                autojunk=False).ratio()
                assert report["similarity"][a][b] == pytest.approx(ratio, abs=1e-4)


def test_the_maillog_and_the_sinks_agree(reports):
    """Two observers of one run: what Postfix logged and what the remote side saw."""
    for name, (_, report, _) in reports.items():
        for label, run in report["runs"].items():
            for dest, d in run["destinations"].items():
                sink = d["sink"]
                where = f"{name}/{label}/{dest}"
                logged_421 = sum(n for code, n in d["deferred_by_reply"].items()
                                 if code.startswith("421"))
                if sink.get("kind") == "mx":
                    # One sink behind several destinations (an MX host): what it tells
                    # apart by recipient is the destination's; a refusal comes before
                    # the recipients and is the host's (below).
                    assert d["sent"] == sink["accepted"], where
                    rcpt = sum(n for code, n in sink["replies"].items() if code[0] == "4")
                    assert sum(d["deferred_by_reply"].values()) - logged_421 == rcpt, where
                    continue
                if sink.get("kind") != "sink":
                    assert d["sent"] == 0, where
                    continue
                assert d["sent"] == sink["accepted"], where
                # Postfix logs a 421 refusal once per recipient of the delivery: as
                # many lines as refusals with one recipient a delivery, more with more.
                refused = sink["refused_421"] + sink["refused_rate"]
                limit = report["workload"]["main_cf"].get("smtp_destination_recipient_limit")
                if limit == "1":
                    assert logged_421 == refused, where
                else:
                    assert refused <= logged_421 <= refused * int(limit or 50), where
                rcpt = sum(n for code, n in sink["replies"].items() if code[0] == "4")
                assert sum(d["deferred_by_reply"].values()) - logged_421 == rcpt, where
            for host, h in run.get("mx_hosts", {}).items():
                # An MX host's refusals against its destinations' 421 lines together
                # (a suspended destination's mail is logged with the last 421 too).
                refused = h["sink"].get("refused_421", 0) + h["sink"].get("refused_rate", 0)
                logged = sum(n for dest in h["domains"] for code, n in
                             run["destinations"][dest]["deferred_by_reply"].items()
                             if code.startswith("421"))
                assert refused <= logged <= refused * 50, f"{name}/{label}/{host}"
                assert h["sink"]["accepted"] == sum(run["destinations"][dest]["sent"]
                                                    for dest in h["domains"])


def test_each_workload_shows_what_it_is_there_for(reports):
    def runs(name: str) -> dict[str, Any]:
        return reports[name][1]["runs"]

    lim = runs("limiter-421")
    stock, ours = (lim[c]["destinations"]["limited.example"] for c in ("stock", "pyqmgr"))
    assert stock["deferral_rate"] > 0.08 and ours["deferral_rate"] < stock["deferral_rate"] / 2
    assert stock["in_flight_peak"] <= 5 and ours["in_flight_peak"] <= 5

    small = {c: r["classes"]["small"]["p50"] for c, r in runs("bulk-and-small").items()}
    assert small["stock"] < small["pyqmgr:finch"], small  # preemption against FCFS

    # Both oqmgrs serve the quiet destinations in turn, and as fast as each other.
    # (Not their order's similarity: arrivals interleave with deliveries here, and
    # the message-level order moved between 0.54 and 0.78 from run to run.)
    # The median is the policy's; the p95 is the 5th-slowest of 100 quiet messages at
    # 0.05 s a delivery, where a moment without a CPU shows: a clean clone's lane 2 had
    # {'stock': 10.05, 'oqmgr': 4.4, 'pyqmgr:oqmgr': 5.8} where this machine alone gives
    # 4.2 and 4.2 (3 of 3) and 4.4-4.5 and 4.5 beside three CPU hogs (3 of 3). So the
    # p95s are held to stay clear of stock's and within 1.4x of each other.
    gw = reports["inbound-gateway"][1]
    quiet = {c: r["classes"]["quiet"]["p95"] for c, r in gw["runs"].items()}
    median = {c: r["classes"]["quiet"]["p50"] for c, r in gw["runs"].items()}
    for oqmgr in ("oqmgr", "pyqmgr:oqmgr"):
        assert quiet[oqmgr] < quiet["stock"] / 1.5, quiet
    assert median["pyqmgr:oqmgr"] == pytest.approx(median["oqmgr"], rel=0.25), median
    assert quiet["pyqmgr:oqmgr"] == pytest.approx(quiet["oqmgr"], rel=0.4), quiet

    # The agents are used (the sink may briefly count a few more sessions than 42
    # processes: a server sees a session close after the client has moved on).
    finch = runs("finch-big-envelopes")
    assert all(r["destinations"]["big.example"]["in_flight_peak"] >= 30
               for r in finch.values())

    rate = runs("provider-rate-limit")
    r_stock, r_ours = (rate[c]["destinations"]["gmail.example"]["replies_4xx"]
                       .get("421 4.7.28", 0) for c in ("stock", "pyqmgr"))
    assert r_ours < r_stock, (r_ours, r_stock)

    # Three servers against a provider's 5 sessions: stock's each open their own and
    # meet the 421s; pyqmgr's share the fleet's 5 through Redis and meet none.
    fleet = runs("fleet-421")
    f_stock, f_ours = (fleet[c]["destinations"]["provider.example"]
                       for c in ("stock", "pyqmgr"))
    assert f_stock["deferral_rate"] > 0.2, f_stock
    assert f_ours["deferral_rate"] == 0 and not f_ours["replies_4xx"], f_ours
    assert f_ours["in_flight_peak"] <= 5
    with open(os.path.join(reports["fleet-421"][0], "summary.md"), encoding="utf-8") as f:
        assert "ran as a fleet of 3 servers" in f.read()

    # Ten domains at one MX host of 5 sessions: stock's ten destinations meet the
    # 421s; pyqmgr with sites counts one site of five and meets none.
    sites = runs("sites-one-server")
    s_stock, s_ours = (sites[c]["mx_hosts"]["mx.site.example"] for c in ("stock", "pyqmgr"))
    assert sites["stock"]["deferral_rate"] > 0.2 and s_stock["sink"]["refused_421"] > 0
    assert sites["pyqmgr"]["deferral_rate"] == 0 and s_ours["sink"]["refused_421"] == 0
    assert s_ours["in_flight_peak"] <= 5

    for label, run in runs("dead-mx").items():
        assert run["classes"]["live"]["sent"] == 120, label
        assert run["classes"]["dead"]["undelivered"] == 20, label
        assert run["destinations"]["dead.example"]["deferral_rate"] == 1.0


# -- the page, in a real browser ----------------------------------------------------------

chromium = pytest.mark.skipif(chromium_path() is None,
                              reason="needs Debian's chromium (./dev installs it)")


@chromium
def test_the_browser_check_sees_errors_and_fetches():
    """The control: a page with a console error, an exception and a fetch is caught."""
    with tempfile.TemporaryDirectory() as tmp:
        page = os.path.join(tmp, "bad.html")
        with open(page, "w") as f:
            f.write('<!DOCTYPE html><html><head><title>bad</title></head><body>'
                    '<script>console.error("boom"); undefinedFunction();</script>'
                    '<img src="http://127.0.0.1:9/x.png"></body></html>')
        seen = open_page(f"file://{page}", screenshot=False, settle=0.5)
    errors = "\n".join(seen.errors())
    assert "console.error: boom" in errors and "undefinedFunction" in errors
    assert seen.fetched(f"file://{page}") == ["http://127.0.0.1:9/x.png"]


@chromium
def test_the_html_report_opens_in_chromium_without_errors(reports):
    shots = os.environ.get("PYQMGR_COMPARE_SCREENSHOTS")
    for name, (out, _report, _) in reports.items():
        url = f"file://{os.path.abspath(os.path.join(out, 'report.html'))}"
        seen = open_page(url)
        assert seen.errors() == [], (name, seen.errors())
        assert seen.fetched(url) == [], (name, seen.fetched(url))
        assert seen.title.startswith("pyqmgr compare: "), seen.title
        png = seen.screenshot
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000, (name, len(png))
        # Every fourth pixel of every fourth row: a blank or one-colour page shows as
        # well, and sorting the colours of a 12,000-pixel-high page took seconds each.
        pixels = _pixels(png)[::4, ::4]
        assert pixels.std() > 10 and len(numpy.unique(pixels.reshape(-1, pixels.shape[-1]),
                                                      axis=0)) > 50, f"{name}: blank"
        if shots:
            os.makedirs(shots, exist_ok=True)
            with open(os.path.join(shots, f"{name}.png"), "wb") as f:
                f.write(png)


def _pixels(png: bytes) -> Any:
    import io

    import matplotlib.image

    return (matplotlib.image.imread(io.BytesIO(png), format="png")[:, :, :3] * 255)


# -- Ctrl-C -------------------------------------------------------------------------------

def test_ctrl_c_stops_everything_and_leaves_nothing_behind():
    instances = _base_dir()
    out = _base_dir()
    # PYTHONFAULTHANDLER: a run that hangs after Ctrl-C is sent SIGABRT, and prints
    # every thread's stack on its way out.
    env = dict(os.environ, PYQMGR_TESTBED_DIR=instances, PYTHONFAULTHANDLER="1")
    script = os.path.join(os.path.dirname(sys.executable), "pyqmgr")
    proc = subprocess.Popen(
        [script, "compare", os.path.join(ROOT, "compat", "workloads", "dead-mx.toml"),
         "--time-scale", "1", "--with", "stock", "--out", out], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # As from a terminal: a suite started in the background (nohup, &) has SIGINT
        # ignored, children inherit that, and Python then leaves it ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 30
        # Wait until its instance runs: a master process of that directory.
        while time.monotonic() < deadline and not _masters(instances):
            time.sleep(0.2)
        assert _masters(instances), "the run started an instance"
        time.sleep(2)  # mail flowing
        proc.send_signal(signal.SIGINT)
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            # Once in a full suite it took over 60 s (never alone): say where it was.
            proc.send_signal(signal.SIGABRT)
            try:
                stdout, stderr = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
            raise AssertionError(f"compare still running 120 s after Ctrl-C; it printed:\n"
                                 f"{stdout[-2000:]}\n{stderr[-4000:]}") from None
        assert proc.returncode == 130, (proc.returncode, stderr)
        assert "interrupted; every instance and sink was stopped" in stderr
        assert _masters(instances) == []
        assert os.listdir(instances) == []
        assert os.path.exists(os.path.join(out, "runs", "1-stock", "run.json"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        # Whatever compare left running when it failed is stopped here: a hung run
        # once left its instance's master delivering for an hour after the suite.
        _stop_masters(instances)
        shutil.rmtree(instances, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def _stop_masters(base: str) -> None:
    """Stop every Postfix instance under ``base`` that still runs (postfix stop, then
    SIGKILL for a master that outlives it)."""
    for pid in _masters(base):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            subprocess.run(["postfix", "-c", env[b"MAIL_CONFIG"].decode(), "stop"],
                           capture_output=True, timeout=60)
        except (OSError, KeyError, subprocess.TimeoutExpired):
            pass
    for pid in _masters(base):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _masters(base: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if f"MAIL_CONFIG={base}/".encode() in env:
            found.append(int(pid))
    return found
