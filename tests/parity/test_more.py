"""More parity scenarios: triggers, expiry, admin tools, dead sites, corrupt files,
a full active queue, a 50,000-recipient message, and kill -9 trials."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from tests.parity.common import (
    SLOW,
    delivered,
    outcome,
    postkick,
    settle,
    sink_config,
    wait_deferred,
    wait_log,
)
from tests.test_bad_input import MALFORMED, _drop_in_incoming

DISCARD = {"discard.example": "discard:"}


def test_d_and_a_triggers(side_by_side, sink):
    srv = sink()

    def scenario(inst, qmgr):
        start = len(srv.messages())
        srv.set_replies({"*": "450 4.2.0 later"})
        (qid,) = inst.smtp_send([("s@sink.example", ["t@sink.example"])])
        wait_deferred(inst, qid)
        srv.set_replies({})
        postkick(inst, "D")  # a deferred scan: the file's retry time is in the future
        time.sleep(1.5)
        after_d = delivered(srv, start)
        postkick(inst, "AD")  # the same scan, ignoring retry times
        wait_log(inst, lambda ln: ln.queue_id == qid and ln.text.endswith("removed"),
                 "delivery after the A trigger")
        settle(inst)
        return outcome(inst, after_d=after_d, after_ad=delivered(srv, start))

    side_by_side(scenario, name="D and A triggers", item="4.1 deferred queue",
                 description="A D trigger scans deferred/ but skips files whose retry time "
                             "has not come; A with D scans them all.",
                 **sink_config(srv, extra=DISCARD, **SLOW))


def test_expiry_by_maximal_queue_lifetime(side_by_side, sink):
    srv = sink(replies={"*": "450 4.2.0 later"})

    def scenario(inst, qmgr):
        (qid,) = inst.smtp_send([(inst.local_address, ["x@sink.example"])])
        wait_log(inst, lambda ln: ln.queue_id == qid and ln.status == "expired",
                 "the expiry", timeout=40)
        wait_log(inst, lambda ln: ln.program_name == "local" and ln.status == "sent",
                 "the bounce delivered")
        settle(inst)
        return outcome(inst, grouped=True)

    side_by_side(scenario, name="maximal_queue_lifetime", item="4.2 expiry and notices",
                 description="maximal_queue_lifetime=2s: after a deferral, the next "
                             "attempt finds the message too old and returns it.",
                 # A 4 s backoff puts the second attempt well past the 2 s lifetime;
                 # with FAST's 2 s it could fall on the second boundary, and then
                 # either qmgr may try a third time (seen once with stock).
                 **sink_config(srv, extra=DISCARD, maximal_queue_lifetime="2s",
                               bounce_queue_lifetime="2s", minimal_backoff_time="4s",
                               maximal_backoff_time="8s"))


@pytest.mark.oqmgr
def test_postsuper_d_and_r(side_by_side, sink):
    srv = sink()

    def scenario(inst, qmgr):
        start = len(srv.messages())
        srv.set_replies({"*": "450 4.2.0 later"})
        gone, back = inst.smtp_send([("s@sink.example", ["gone@sink.example"]),
                                     ("s@sink.example", ["back@sink.example"])])
        for q in (gone, back):
            inst.wait_until(lambda q=q: inst.queue_path("deferred", q) is not None, 30,
                            "both deferred")
        srv.set_replies({})
        inst.postsuper("-d", gone)
        inst.postsuper("-r", back)
        postkick(inst, "W", "pickup")  # maildrop/ is otherwise read once a minute
        wait_log(inst, lambda ln: ln.program_name == "smtp" and ln.status == "sent",
                 "the requeued message delivered", timeout=40)
        settle(inst)
        return outcome(inst, unordered=True, delivered=delivered(srv, start))

    side_by_side(scenario, name="postsuper -d and -r", item="4.3 hold and admin tools",
                 description="A deleted deferred message is never tried again; a "
                             "requeued one goes through cleanup again and is delivered.",
                 **sink_config(srv, extra=DISCARD, **SLOW))


def test_dead_site_suspends_delivery(side_by_side, sink):
    srv = sink()
    srv.refuse()

    def scenario(inst, qmgr):
        (first,) = inst.smtp_send([("s@sink.example", ["one@sink.example"])])
        wait_log(inst, lambda ln: ln.queue_id == first and ln.program_name == "smtp"
                 and ln.status == "deferred", "connection refused")
        (second,) = inst.smtp_send([("s@sink.example", ["two@sink.example"])])
        wait_log(inst, lambda ln: ln.queue_id == second and ln.status == "deferred"
                 and "delivery temporarily suspended" in ln.text, "the dead site")
        inst.wait_until(lambda: inst.queue_path("deferred", second) is not None, 20,
                        "the second message deferred")
        settle(inst)
        return outcome(inst)

    side_by_side(scenario, name="dead destination", item="4.4 dead transports",
                 description="A refused connection kills the site (failed cohort limit "
                             "1); the next message for it goes through retry with "
                             "'delivery temporarily suspended'.",
                 **sink_config(srv, extra=DISCARD, queue_run_delay="300s",
                               minimal_backoff_time="300s",
                               initial_destination_concurrency="1"))


@pytest.mark.oqmgr
def test_every_malformation_goes_to_corrupt(side_by_side):
    def scenario(inst, qmgr):
        for qid, data in MALFORMED.items():
            _drop_in_incoming(inst, qid, data)
        inst.postqueue("-f")
        for qid in MALFORMED:
            wait_log(inst, lambda ln, q=qid: ln.text == f'warning: saving corrupt file "{q}" '
                     'from queue "active" to queue "corrupt"', f"{qid} saved as corrupt")
        settle(inst)
        return outcome(inst, grouped=True, corrupt=sorted(inst.queue_files("corrupt")))

    side_by_side(scenario, name="malformed queue files", item="4.6 faults",
                 description="Eight kinds of damaged queue file (truncated, not a queue "
                             "file, short size record, no time, no sender, bad record "
                             "type, no end record, nothing after the size record) get "
                             "stock's warnings and go to corrupt/.",
                 transports={"discard.example": "discard:"})


@pytest.mark.oqmgr
def test_active_queue_limit(side_by_side, sink):
    srv = sink(latency=0.05)

    def scenario(inst, qmgr):
        start = len(srv.messages())
        inst.preload([("s@sink.example", [f"r{i}@sink.example"]) for i in range(30)])
        inst.release_preload()
        peak = 0
        deadline = time.monotonic() + 60
        while len(srv.messages()) - start < 30:
            assert time.monotonic() < deadline, "30 deliveries"
            peak = max(peak, len(inst.queue_files("active")))
            time.sleep(0.01)
        inst.wait_queue_empty(30)
        settle(inst)
        out = outcome(inst, unordered=True, peak_within_limit=peak <= 5,
                      delivered=delivered(srv, start))
        # The clog warning ("mail for X is using up 2 of 2 active queue entries") and
        # its advice are said again when the destination's queue emptied between two
        # feeds and was made anew (qmgr_queue_create clears clog_time_to_warn), which
        # is timing: under load stock said it twice, pyqmgr once. Said is what counts.
        warned: set[str] = set()
        out.log = [x for x in out.log if "warning:" not in x
                   or not (x in warned or warned.add(x))]
        return out

    side_by_side(scenario, name="qmgr_message_active_limit", item="4.5 large messages and "
                 "a full queue",
                 description="With qmgr_message_active_limit=5, no more than 5 files are "
                             "ever in active/ while 30 messages are delivered.",
                 **sink_config(srv, extra=DISCARD, qmgr_message_active_limit="5",
                        qmgr_message_recipient_limit="5"))


def test_fifty_thousand_recipients(side_by_side):
    n = 50_000

    def scenario(inst, qmgr):
        inst.sendmail("s@test.example", [f"r{i}@discard.example" for i in range(n)])
        wait_log(inst, lambda ln: ln.program_name == "qmgr" and ln.text.endswith("removed"),
                 "the big message removed", timeout=300)
        settle(inst)
        qids: dict[str, str] = {}
        lines = inst.maillog.lines()
        discarded = [ln.to for ln in lines if ln.program_name == "discard"
                     and ln.status == "sent"]
        out = outcome(inst, discarded=len(discarded), distinct=len(set(discarded)))
        # 50,000 agent lines make a poor diff: keep qmgr's lines and the counts.
        out.log = [x for x in out.log if "postfix/discard" not in x]
        del qids
        return out

    side_by_side(scenario, name="one message, 50,000 recipients",
                 item="4.5 large messages and a full queue",
                 description="Read in batches within the recipient slot pools, every "
                             "recipient is delivered exactly once.",
                 transports={"discard.example": "discard:"})


def _kill_trials(make, sink, qmgr: str, trials: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    srv = sink(latency=0.03)
    # A qmgr killed before it told master it was ready gets its service throttled for
    # service_throttle_time (60 s): "bad command startup -- throttling". pyqmgr's
    # start-up takes long enough to be caught now and then (issue #24), and each time
    # the trial waited a minute. What is counted here is mail lost or doubled, not the
    # restart's pace, so both qmgrs get a 1 s throttle.
    inst = make(qmgr=qmgr, transports={"sink.example": f"smtp:[127.0.0.1]:{srv.port}"},
                main_cf={"service_throttle_time": "1s"})
    sent: list[str] = []
    for t in range(trials):
        rcpts = [f"t{t}m{i}@sink.example" for i in range(10)]
        sent += rcpts
        inst.smtp_send([("s@sink.example", [r]) for r in rcpts])
        time.sleep(rng.uniform(0.0, 0.4))
        pid = inst.qmgr_pid()
        os.kill(pid, signal.SIGKILL)
        inst.maillog.wait_for(lambda ln, p=pid: ln.program == "postfix/master"
                              and f"pid {p} killed by signal 9" in ln.text, timeout=20,
                              what="master noticing the kill")
        deadline = time.monotonic() + 120
        while not inst.queue_empty():
            assert time.monotonic() < deadline, f"trial {t}: queue not empty"
            inst.postqueue("-f")
            time.sleep(0.5)
    counts = srv.stats.delivered
    return {"recipients": len(sent),
            "lost": sum(1 for r in sent if counts.get(r, 0) == 0),
            "doubled": sum(1 for r in sent if counts.get(r, 0) > 1)}


def test_kill_9_trials_lose_and_double_nothing(postfix_instance, sink, parity_report):
    from compat.parity import Outcome, Result

    figures = {q: _kill_trials(postfix_instance, sink, q, 20, seed=4)
               for q in ("stock", "pyqmgr")}
    print(f"kill -9 trials: {figures}")
    parity_report.add(Result(
        "20 kill -9 trials under load", "4.6 faults",
        "In each of 20 trials, 10 messages are sent and the qmgr is killed with "
        "SIGKILL after a random 0-0.4 s; flushes then finish the queue. Counted: "
        "recipients lost and recipients delivered twice.",
        Outcome(extra=figures["stock"]), Outcome(extra=figures["pyqmgr"])))
    assert figures["pyqmgr"]["lost"] == 0
    assert figures["pyqmgr"]["doubled"] <= figures["stock"]["doubled"]
    assert figures["stock"]["recipients"] == figures["pyqmgr"]["recipients"] == 200


def _valid_with(extra_envelope: list[tuple[str, bytes]] = (), sender: bytes = b"a@discard.example",
                size: bytes | None = None) -> bytes:
    """A valid queue file with extra envelope records (and optionally a bad size record)."""
    from pyqmgr.postfix.record import encode_record

    recs = [("T", b"1795344681 411377"), ("A", b"create_time=1795344681"),
            *extra_envelope, ("S", sender), ("O", b"b@discard.example"),
            ("R", b"b@discard.example"), ("M", b"")]
    body = b"".join(encode_record(t, p) for t, p in recs)
    probe = encode_record("C", b"%15d %15d %15d %15d %15d %15d" % (7, 0, 1, 0, 7, 0))
    offset = len(probe) + len(body)
    head = encode_record("C", size if size is not None else
                         b"%15d %15d %15d %15d %15d %15d" % (7, offset, 1, 0, 7, 0))
    return head + body + encode_record("N", b"hello") + encode_record("X", b"") \
        + encode_record("E", b"")


MORE_MALFORMED = {
    "BBBBB1": b"C\x80",  # EOF in the middle of a length
    "BBBBB2": b"C" + b"\xff" * 6 + b"\x01" + b"x" * 10,  # too many length bits
    "BBBBB3": _valid_with([("p", b"not-a-number")]),  # malformed pointer record
    "BBBBB4": _valid_with(size=b"abc def ghi"),  # invalid size record
    "BBBBB5": _valid_with([("A", b"no-equals-sign")]),  # bad attribute record
    "BBBBB6": _valid_with([("A", b"dsn_ret=junk")]),  # malformed DSN RET flags
    "BBBBB7": _valid_with([("V", b"+=")], sender=b""),  # VERP for a null sender
    "BBBBB8": _valid_with([("V", b"abc")]),  # bad VERP delimiters
    "BBBBB9": _valid_with(size=b"%15d %15d %15d %15d %15d %15d" % (7, 9, 1, 0, 7, 999)),
}


def test_more_malformations(side_by_side):
    def scenario(inst, qmgr):
        for qid, data in MORE_MALFORMED.items():
            _drop_in_incoming(inst, qid, data)
        inst.postqueue("-f")
        for qid in MORE_MALFORMED:
            wait_log(inst, lambda ln, q=qid: q in ln.text and (
                "corrupt" in ln.text or ln.text.endswith("removed")),
                f"{qid} delivered or saved as corrupt")
        settle(inst)
        return outcome(inst, grouped=True, corrupt=sorted(inst.queue_files("corrupt")))

    side_by_side(scenario, name="reader and record malformations", item="4.6 faults",
                 description="The other reader errors the facts list: EOF inside a "
                             "length, too many length bits, a malformed pointer record, "
                             "an invalid size record or flags, a bad attribute record, "
                             "bad DSN RET flags, VERP for a null sender, bad VERP "
                             "delimiters. Warnings and fates (corrupt/ or delivered) "
                             "as stock's.",
                 transports={"discard.example": "discard:"})
