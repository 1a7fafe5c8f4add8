"""Retry jitter and deferred-mail recovery on real Postfix, each beside its control.

Jitter: 1,000 messages meet a dead destination (nothing listens on its port) and are
deferred within a few seconds; the retry times are the deferred files' mtimes, read
back from the queue. Stock gives them a handful of distinct seconds; with
``deferred_retry_jitter = 30s`` no second holds more than twice its fair share.

Recovery: N messages are deferred by a dead destination with an hour's backoff; then a
sink starts on that port, ``pyqmgr retry`` revives the destination and one new
message to it is delivered. With ``deferred_recovery_rate`` the N deferred ones
arrive paced at the rate, within one queue scan; without it (the control) they stay
in deferred/.

Everything listens on loopback; the fixtures stop every instance and sink even when a
test fails.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

from pyqmgr.testbed.instance import PostfixInstance, free_port
from pyqmgr.testbed.sink import SinkServer
from tests.test_control import cli, wait_for_channel

BACKOFF = {"minimal_backoff_time": "3600s", "maximal_backoff_time": "3600s"}


def deferred_times(pf: PostfixInstance) -> list[tuple[float, float]]:
    """(mtime, ctime) of every deferred file: its retry time, and when it was deferred."""
    out = []
    for dirpath, _dirs, files in os.walk(os.path.join(pf.queue_dir, "deferred")):
        for name in files:
            if name.isalnum():
                st = os.stat(os.path.join(dirpath, name))
                out.append((st.st_mtime, st.st_ctime))
    return out


def _defer_1000(postfix_instance, qmgr: str, pyqmgr_cf: dict[str, str] | None,
                ) -> list[tuple[float, float]]:
    dead = free_port()
    pf: PostfixInstance = postfix_instance(
        qmgr=qmgr, pyqmgr_cf=pyqmgr_cf,
        transports={"dead.example": f"smtp:[127.0.0.1]:{dead}"},
        main_cf={**BACKOFF, "initial_destination_concurrency": "2"})
    n = 1000
    pf.preload(n, recipients=lambda i: [f"r{i}@dead.example"])
    pf.release_preload()
    pf.wait_until(lambda: len(pf.queue_files("deferred")) >= n, 180,
                  f"{n} messages in deferred/")
    pf.wait_until(lambda: not pf.queue_files("active"), 30, "an empty active queue")
    times = deferred_times(pf)
    pf.stop()
    return times


def test_jitter_spreads_the_retries_of_1000_messages(postfix_instance):
    window = 30
    stock = _defer_1000(postfix_instance, "stock", None)
    ours = _defer_1000(postfix_instance, "pyqmgr", {"deferred_retry_jitter": f"{window}s"})
    n = len(ours)
    assert len(stock) == n == 1000
    stock_busiest = max(Counter(int(m) for m, _ in stock).values())
    per_second = Counter(int(m) for m, _ in ours)
    busiest = max(per_second.values())
    deferred_over = max(c for _, c in ours) - min(c for _, c in ours)
    after = [m - c for m, c in ours]
    fair = n / window
    print(f"1000 messages deferred over {deferred_over:.1f} s: stock's retry times fall in "
          f"{len(Counter(int(m) for m, _ in stock))} seconds (busiest {stock_busiest}); "
          f"with deferred_retry_jitter = {window}s in {len(per_second)} seconds, busiest "
          f"{busiest} (fair share {fair:.1f}, limit {2 * fair:.0f}); retry {min(after):.1f}"
          f"-{max(after):.1f} s after the deferral")
    assert stock_busiest > 4 * fair, "the control: stock retries them in a few seconds"
    assert busiest <= 2 * fair
    # Never before stock's time (ctime is the deferral to within the second stock
    # truncates to), never beyond the window.
    assert min(after) >= 3600 - 1
    assert max(after) < 3600 + window + 1


def _recovery_run(postfix_instance, sink, recovery: bool, n: int = 20, rate: int = 10,
                  ) -> tuple[PostfixInstance, SinkServer, list[str], float]:
    srv: SinkServer = sink()
    srv.refuse()
    nexthop = f"[127.0.0.1]:{srv.port}"
    pyqmgr_cf = {"deferred_recovery_rate": f"{rate}/1s"} if recovery else {}
    # Recovery follows a destination's death (failed_cohort_limit failed cohorts), and
    # a failure counts 1/window of a cohort. With the default initial window of 5 the
    # destination dies only if 4 failures meet one in-core queue; on a loaded machine
    # the messages trickle in, each fails alone, the idle queue is discarded with its
    # count (stock's qmgr_entry_done) and the destination never dies: nothing is
    # recovered, rightly. A window of 1 makes the first refused connection its death.
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", pyqmgr_cf=pyqmgr_cf,
        transports={"back.example": f"smtp:{nexthop}"},
        main_cf={**BACKOFF, "queue_run_delay": "5s", "initial_destination_concurrency": "1",
                 "smtp_connection_cache_on_demand": "no"})
    wait_for_channel(pf)
    old = pf.smtp_send([("s@test.example", [f"old{i}@back.example"]) for i in range(n)])
    pf.wait_until(lambda: len(pf.queue_files("deferred")) >= n
                  and not pf.queue_files("active") and not pf.queue_files("incoming"),
                  60, f"{n} messages deferred by the dead destination")
    srv.start()
    proc = cli(pf, "retry", nexthop, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["revived"] == [f"smtp:{nexthop}"], \
        "the destination was dead when the sink came back"
    t0 = time.monotonic()
    pf.smtp_send([("s@test.example", ["new@back.example"])])
    return pf, srv, old, t0


def test_recovery_brings_a_destinations_deferred_mail_forward_paced(postfix_instance,
                                                                     sink):
    n, rate, scan = 20, 10, 5.0
    pf, srv, old, t0 = _recovery_run(postfix_instance, sink, True, n, rate)
    srv.wait_delivered(n + 1, n / rate + scan + 15)
    took = time.monotonic() - t0
    arrivals = sorted(m.time for m in srv.messages() if m.recipients[0].startswith("old"))
    assert len(arrivals) == n
    span = arrivals[-1] - arrivals[0]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    print(f"recovery at {rate}/1s: {n} deferred messages arrived {took:.2f} s after the new "
          f"one was sent, over {span:.2f} s ({(n - 1) / span:.1f} a second; gaps "
          f"{min(gaps):.3f}-{max(gaps):.3f} s); queue_run_delay {scan:g}s")
    assert took <= n / rate + scan, "within one queue scan of the recovery"
    assert (n - 1) / span <= rate * 1.1, "paced at the rate, not a flush"
    assert sum(1 for g in gaps if g < 0.5 / rate) <= 2
    lines = [ln.text for ln in pf.maillog.lines("postfix/qmgr", contains="deferred recovery")]
    assert lines[0].startswith(
        f"deferred recovery: [127.0.0.1]:{srv.port} (smtp) delivers again after it "
        f"was dead (4.4.1 connect to 127.0.0.1[127.0.0.1]:{srv.port}: Connection refused): "
        f"bringing {n} deferred messages forward at {rate}/s (deferred_recovery_rate)"), lines
    closing = "deferred messages brought forward in"
    pf.wait_until(lambda: bool(pf.maillog.lines("postfix/qmgr", contains=closing)), 10,
                  "the recovery's closing line")
    (done,) = pf.maillog.lines("postfix/qmgr", contains=closing)
    assert done.text.startswith(f"deferred recovery: [127.0.0.1]:{srv.port} (smtp): {n} "
                                f"{closing}")
    proc = cli(pf, "status", "--json")
    retry = json.loads(proc.stdout)["deferred_retry"]
    assert (retry["recoveries"], retry["brought_forward"]) == (1, n)
    assert "recovery at 10/s" in cli(pf, "status").stdout
    pf.wait_queue_empty(30)
    assert sorted(srv.snapshot().delivered) == sorted(
        [f"old{i}@back.example" for i in range(n)] + ["new@back.example"])


def test_without_recovery_the_deferred_mail_waits_its_backoff(postfix_instance, sink):
    n, scan = 20, 5.0
    pf, srv, old, _ = _recovery_run(postfix_instance, sink, False, n)
    srv.wait_delivered(1, 30)
    time.sleep(3 * scan)
    print(f"control: after {3 * scan:g} s (three queue scans) {srv.delivered_count()} "
          f"delivered, {len(pf.queue_files('deferred'))} still deferred")
    assert srv.delivered_count() == 1
    assert sorted(pf.queue_files("deferred")) == sorted(old)
    assert not pf.maillog.lines("postfix/qmgr", contains="deferred recovery")
