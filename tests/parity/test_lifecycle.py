"""Parity scenarios for a message's life cycle: deferral, flushes, notices, holds, dead paths.

Each scenario runs on a fresh instance under stock qmgr and under pyqmgr; the test
fails when the outcomes differ, and the result goes into compat/parity.md.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

from tests.parity.common import (
    FAST,
    SLOW,
    delivered,
    outcome,
    settle,
    sink_config,
    wait_deferred,
    wait_log,
)


def _seconds(value: str) -> int:
    """A FAST timer's seconds ("2s" -> 2)."""
    return int(value.rstrip("s"))


@pytest.fixture
def srv(sink):
    return sink()


@pytest.mark.oqmgr
def test_deferred_then_flush(side_by_side, srv):
    def scenario(inst, qmgr):
        start = len(srv.messages())
        srv.set_replies({"later@sink.example": "450 4.2.0 try again later"})
        (qid,) = inst.smtp_send([("s@sink.example", ["now@sink.example",
                                                      "later@sink.example"])])
        wait_log(inst, lambda ln: ln.queue_id == qid and ln.status == "deferred",
                 "the deferral")
        inst.wait_until(lambda: inst.queue_path("deferred", qid) is not None, 20,
                        "the file in deferred/")
        st = os.stat(inst.queue_path("deferred", qid))
        # ctime: when qmgr set the times (and renamed the file); the mtime is qmgr's
        # whole-second clock plus the backoff, which is (now - arrival) clamped to
        # minimal..maximal_backoff_time. Both the clamp and the clock's truncation move
        # the difference by up to a second on a loaded machine (stock's CI run gave 1,
        # not 2), so the figure compared is whether it lies within the clamp, less the
        # clock's second and half a second of lag; outside it, the raw difference shows.
        ahead = st.st_mtime - st.st_ctime
        low, high = _seconds(FAST["minimal_backoff_time"]), _seconds(FAST["maximal_backoff_time"])
        backoff = ("within minimal..maximal_backoff_time" if low - 1.5 < ahead <= high + 0.5
                   else round(ahead, 1))
        srv.set_replies({})
        inst.postqueue("-f")
        wait_log(inst, lambda ln: ln.queue_id == qid and ln.text.endswith("removed"),
                 "removal after the flush")
        settle(inst)
        return outcome(inst, backoff_s=backoff, delivered=delivered(srv, start))

    side_by_side(scenario, name="4xx, deferred queue, postqueue -f",
                 item="4.1 deferred queue",
                 description="A recipient answered 450 goes to deferred/ with its retry "
                             "time (minimal_backoff_time) on the file's mtime; "
                             "postqueue -f delivers it.", **sink_config(srv, "other.example"))


def test_postqueue_s_flushes_one_site(side_by_side, srv):
    def scenario(inst, qmgr):
        start = len(srv.messages())
        srv.set_replies({"*": "450 4.2.0 not now"})
        # One at a time, the second after the first was deferred: sent together, the
        # two could be in incoming/ at one scan, whose directory order then decided
        # which qmgr logged first, differently from run to run (CI, 2026-11-29:
        # parity 47/48 on that order alone).
        qids = []
        for rcpt in ("a@sink.example", "b@other.example"):
            (qid,) = inst.smtp_send([("s@sink.example", [rcpt])])
            qids.append(qid)
            inst.wait_until(lambda q=qid: inst.queue_path("deferred", q) is not None, 30,
                            f"the message to {rcpt} deferred")
        srv.set_replies({})
        inst.postqueue("-s", "sink.example")
        wait_log(inst, lambda ln: ln.queue_id == qids[0] and ln.text.endswith("removed"),
                 "the flushed site's message removed")
        settle(inst)
        still = inst.queue_path("deferred", qids[1]) is not None
        assert still, f"{qmgr}: the other site's message left deferred/ before its retry"
        return outcome(inst, delivered=delivered(srv, start), other_still_deferred=still)

    # SLOW timers: with FAST ones the other site's message came back by its own
    # retry (2 s) before or after the flush, a race that made the order of qmgr's
    # lines differ between runs, and the scenario did not show that only the named
    # site is flushed.
    side_by_side(scenario, name="postqueue -s site", item="4.1 deferred queue",
                 description="Two deferred messages for two sites; postqueue -s flushes "
                             "only the named site's mail.",
                 **sink_config(srv, "other.example", **SLOW,
                               fast_flush_domains="sink.example, other.example"))


@pytest.mark.oqmgr
def test_bounce_for_a_permanent_failure(side_by_side, srv):
    def scenario(inst, qmgr):
        srv.set_replies({"gone@sink.example": "550 5.1.1 no such user"})
        (qid,) = inst.smtp_send([(inst.local_address, ["gone@sink.example",
                                                       "ok@sink.example"])])
        wait_log(inst, lambda ln: ln.program_name == "local" and ln.status == "sent",
                 "the bounce notice delivered to the sender")
        settle(inst)
        return outcome(inst, grouped=True)

    side_by_side(scenario, name="bounce for 5xx", item="4.2 expiry and notices",
                 description="A 550 recipient is bounced: the bounce daemon's notice "
                             "reaches the (local) sender; the other recipient is "
                             "delivered.", **sink_config(srv, "other.example"))


def test_delay_warning_then_delay_cleared(side_by_side, srv):
    def scenario(inst, qmgr):
        srv.set_replies({"slow@sink.example": "450 4.2.0 later"})
        (qid,) = inst.smtp_send([(inst.local_address, ["slow@sink.example"])])
        wait_log(inst, lambda ln: ln.program_name == "bounce"
                 and "delay notification" in ln.text, "the delay warning", timeout=40)
        wait_log(inst, lambda ln: ln.program_name == "local" and ln.status == "sent",
                 "the warning delivered", timeout=40)
        settle(inst)
        srv.set_replies({})
        inst.postqueue("-f")
        wait_log(inst, lambda ln: ln.queue_id == qid and ln.text.endswith("removed"),
                 "delivery after the warning", timeout=40)
        wait_log(inst, lambda ln: ln.program_name == "local" and ln.status == "sent",
                 "notices delivered", count=2, timeout=40)
        settle(inst)
        # Grouped: the "delay cleared" notice is a new file that the qmgr may pick up
        # before or after it logs the original's removal (seen both ways with stock).
        return outcome(inst, collapse=True, grouped=True)

    side_by_side(scenario, name="delay warning and delay cleared",
                 item="4.2 expiry and notices",
                 description="delay_warning_time=1s: a deferred message gets a delay "
                             "warning on its next attempt; with confirm_delay_cleared, "
                             "its delivery sends a 'delay cleared' notice.",
                 **sink_config(srv, "other.example", delay_warning_time="1s",
                               confirm_delay_cleared="yes"))


@pytest.mark.oqmgr
def test_force_expire(side_by_side, srv):
    def scenario(inst, qmgr):
        srv.set_replies({"*": "450 4.2.0 later"})
        (qid,) = inst.smtp_send([(inst.local_address, ["x@sink.example"])])
        wait_deferred(inst, qid)
        inst.postsuper("-f", qid)
        inst.postqueue("-i", qid)
        wait_log(inst, lambda ln: ln.queue_id == qid and ln.text.endswith("removed"),
                 "the expired message removed", timeout=40)
        wait_log(inst, lambda ln: ln.program_name == "local" and ln.status == "sent",
                 "the bounce delivered")
        settle(inst)
        # Grouped: the bounce is a new file that the qmgr may pick up before or after
        # it logs the original's removal (seen both ways, in separate full runs).
        return outcome(inst, grouped=True)

    # SLOW timers: with FAST ones (a 2 s backoff) a loaded machine let the deferred
    # scan take the message again between its deferral and postsuper -f, one more
    # attempt than the other side made (CI, Postfix 3.10); postqueue -i needs none.
    side_by_side(scenario, name="postsuper -f force-expire", item="4.2 expiry and notices",
                 description="A deferred message force-expired with postsuper -f is "
                             "returned to the sender with its defer log's reason.",
                 **sink_config(srv, "other.example", **SLOW))


@pytest.mark.oqmgr
def test_hold_and_release(side_by_side, srv):
    def scenario(inst, qmgr):
        start = len(srv.messages())
        srv.set_replies({"*": "450 4.2.0 later"})
        (qid,) = inst.smtp_send([("s@sink.example", ["h@sink.example"])])
        wait_deferred(inst, qid)
        inst.postsuper("-h", qid)
        srv.set_replies({})
        inst.postqueue("-f")
        time.sleep(2)
        held = inst.queue_path("hold", qid) is not None
        inst.postsuper("-H", qid)
        inst.postqueue("-f")
        wait_log(inst, lambda ln: ln.queue_id == qid and ln.text.endswith("removed"),
                 "delivery after release", timeout=40)
        settle(inst)
        return outcome(inst, held_during_flush=held, delivered=delivered(srv, start))

    # The scenario needs no retry (its flushes force every try), and with FAST's 2 s
    # backoff a loaded machine let the deferred scan retry the file before postsuper
    # -h held it: one more deferral under pyqmgr than under stock in one CI run.
    side_by_side(scenario, name="postsuper -h / -H", item="4.3 hold and admin tools",
                 description="A held message is not delivered by a flush; released, it "
                             "is.", **sink_config(srv, "other.example",
                                                  minimal_backoff_time="60s",
                                                  maximal_backoff_time="120s"))


@pytest.mark.oqmgr
def test_missing_agent_defers(side_by_side):
    def scenario(inst, qmgr):
        (qid,) = inst.smtp_send([("s@test.example", ["x@nowhere.example"])])
        wait_log(inst, lambda ln: ln.queue_id == qid and ln.status == "deferred",
                 "the deferral")
        wait_deferred(inst, qid)
        settle(inst)
        return outcome(inst)

    side_by_side(scenario, name="missing agent socket", item="4.4 dead transports",
                 description="A transport with no master.cf service: qmgr warns, the "
                             "transport is throttled and the mail deferred through "
                             "retry ('mail transport unavailable').",
                 transports={"nowhere.example": "nosuch:"},
                 main_cf={"queue_run_delay": "300s", "minimal_backoff_time": "300s"})


@pytest.mark.oqmgr
def test_error_and_relocated(side_by_side):
    def scenario(inst, qmgr):
        inst.smtp_send([(inst.local_address, ["e@err.example", "moved@test.example"])])
        wait_log(inst, lambda ln: ln.program_name == "local" and ln.status == "sent",
                 "the bounce delivered")
        settle(inst)
        return outcome(inst, grouped=True)

    side_by_side(scenario, name="error transport and relocated_maps",
                 item="4.4 dead transports",
                 description="error:5.1.1 bounces; relocated_maps bounces with the new "
                             "address.",
                 transports={"err.example": "error:5.1.1 mailbox is gone"},
                 main_cf={**FAST, "relocated_maps": "inline:{moved@test.example="
                                                    "new@else.example}"})


def test_defer_transports_then_flush(side_by_side, srv):
    def scenario(inst, qmgr):
        start = len(srv.messages())
        (qid,) = inst.smtp_send([("s@sink.example", ["d@sink.example"])])
        wait_log(inst, lambda ln: ln.queue_id == qid and ln.status == "deferred",
                 "the deferral")
        wait_deferred(inst, qid)
        inst.postqueue("-f")
        wait_log(inst, lambda ln: ln.queue_id == qid and ln.text.endswith("removed"),
                 "delivery by the flush")
        settle(inst)
        return outcome(inst, delivered=delivered(srv, start))

    side_by_side(scenario, name="defer_transports, postqueue -f", item="4.4 dead transports",
                 description="defer_transports=smtp defers without trying; postqueue -f "
                             "ignores it and delivers.",
                 **sink_config(srv, "other.example", defer_transports="smtp"))


@pytest.mark.oqmgr
def test_startup_recovers_active(side_by_side, srv):
    def scenario(inst, qmgr):
        start = len(srv.messages())
        qids = inst.preload([("s@sink.example", [f"r{i}@sink.example"]) for i in range(5)])
        for q in qids:
            shutil.move(os.path.join(inst.queue_dir, "incoming", q),
                        os.path.join(inst.queue_dir, "active", q))
        inst.release_preload()
        for q in qids:
            wait_log(inst, lambda ln, q=q: ln.queue_id == q and ln.text.endswith("removed"),
                     "every recovered message delivered")
        settle(inst)
        return outcome(inst, unordered=True, delivered=delivered(srv, start))

    side_by_side(scenario, name="start-up recovery of active/", item="4.6 faults",
                 description="Files left in active/ by a stopped qmgr are moved back "
                             "and delivered when qmgr starts.", **sink_config(srv, "other.example"))
