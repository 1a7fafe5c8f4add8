"""pyqmgr explain on messages outside the active queue, on real Postfix (issue #43).

"Why is this deferred, and when is it tried again" is the first question an admin
asks; the answer is in files only the daemon may read. Here real mail is deferred by
a dead destination, put on hold with postsuper -h and kept waiting in incoming/ by a
full active queue, and each field of explain's answer is held against what Postfix
itself wrote: the queue file's arrival record and time stamps, the defer log's
reasons, the scheduler's view of the destination. Asked as root and as an ordinary
user that authorized_mailq_users lets read (who cannot read the queue files), from a
daemon chrooted into the queue directory.
"""

from __future__ import annotations

import json
import os
import pwd
import time

from pyqmgr.postfix import queue_file
from pyqmgr.testbed.instance import PostfixInstance, free_port
from pyqmgr.testbed.sink import SinkServer
from tests.test_control import cli, wait_for_channel
from tests.trust_helpers import PyqmgrForOthers

FIVE_DAYS = 5 * 86400


def explain(pf: PostfixInstance, qid: str, user: pwd.struct_passwd | None = None,
            others: PyqmgrForOthers | None = None) -> dict:
    proc = cli(pf, "explain", qid, "--json", user=user, others=others)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def arrival(pf: PostfixInstance, queue: str, qid: str) -> tuple[float, str]:
    """The T record and the sender, as the file says (read as root, here)."""
    path = pf.queue_path(queue, qid)
    assert path is not None, f"{qid} not in {queue}/"
    with open(path, "rb") as f:
        msg, _ = queue_file.read_message(f, qid)
    return msg.arrival_time[0] + msg.arrival_time[1] / 1e6, msg.sender or ""


def test_explain_a_deferred_a_held_and_an_unread_message(postfix_instance, sink,
                                                         pyqmgr_for_others):
    dead_port = free_port()  # nothing listens: every connection is refused
    slow: SinkServer = sink(latency=lambda a: 25.0 if a.startswith("slow@") else 0.05)
    dead = f"[127.0.0.1]:{dead_port}"
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr",
        transports={"dead.example": f"smtp:{dead}",
                    "slow.example": f"smtp:[127.0.0.1]:{slow.port}"},
        main_cf={"initial_destination_concurrency": "1",
                 "smtp_destination_concurrency_failed_cohort_limit": "1",
                 # Deferred mail stays put for the whole test.
                 "minimal_backoff_time": "900s", "maximal_backoff_time": "1800s",
                 "queue_run_delay": "900s",
                 # One message in core at a time: the next waits in incoming/.
                 "qmgr_message_active_limit": "1"}, start=False)
    # Chrooted into the queue directory, as master.cf may run it: every path the
    # explain reads is relative to it.
    pf.postconf("-F", "qmgr/unix/chroot=y")
    pf.start()
    wait_for_channel(pf)
    nobody = pwd.getpwnam("nobody")

    sent = time.time()
    deferred_id, held_id = pf.smtp_send([("s@test.example", ["a1@dead.example",
                                                             "a2@dead.example"]),
                                         ("s@test.example", ["b@dead.example"])])
    for qid in (deferred_id, held_id):
        pf.wait_until(lambda q=qid: q in pf.queue_files("deferred"), 60, f"{qid} deferred")

    # -- deferred: each recipient's reason, the next try, the destination -----------
    reply = explain(pf, deferred_id)
    path = pf.queue_path("deferred", deferred_id)
    assert path is not None
    st = os.stat(path)
    when, sender = arrival(pf, "deferred", deferred_id)
    assert (reply["kind"], reply["queue"], reply["in_core"]) == ("message", "deferred", False)
    assert reply["sender"] == sender == "s@test.example"
    assert reply["arrival_time"] == when and sent - 1 <= when <= time.time(), reply
    assert 0 <= reply["arrived_ago"] < 60
    # The next try is the file's time stamp, as qmgr set it: 900 s after the deferral.
    assert reply["next_try_time"] == st.st_mtime
    assert 800 < reply["next_try_in"] <= 900, reply["next_try_in"]
    assert reply["lifetime_setting"] == "maximal_queue_lifetime"
    assert abs(reply["expires_time"] - (int(when) + FIVE_DAYS)) <= 1, reply
    assert reply["recipients_pending"] == 2 and reply["recipients_more"] is False
    rcpts = {r["address"]: r for r in reply["recipients"]}
    assert set(rcpts) == {"a1@dead.example", "a2@dead.example"}
    for r in rcpts.values():
        assert r["status"] == "4.4.1" and r["action"] == "delayed", r
        assert "Connection refused" in r["reason"], r
        assert (r["transport"], r["nexthop"]) == ("smtp", dead), r
    assert reply["defer_log"]["entries"] == 2, reply["defer_log"]
    (where, *more) = reply["reasons"]
    assert where["constraint"] == "deferred" and f"postqueue -i {deferred_id}" in where["text"]
    assert 800 < where["next_try_in"] <= 900
    (state,) = reply["destinations"]
    assert (state["transport"], state["nexthop"], state["in_core"]) == ("smtp", dead, True)
    (dead_reason,) = [r for r in more if r["constraint"] == "dead destination"]
    assert dead_reason["destination"] == dead and dead_reason["setting"] == "minimal_backoff_time"

    text = cli(pf, "explain", deferred_id)
    assert text.returncode == 0, text.stderr
    out = text.stdout
    print(out)
    assert out.startswith(f"{deferred_id}: message in the deferred queue (not in core)\n")
    assert "  from <s@test.example>, arrived " in out and "next try after " in out
    assert "recipients: 2 to deliver" in out and "Connection refused" in out
    assert f"dead destination [{dead}]" in out
    # Durations in human units (597.943s is 9m58s): minutes and seconds here.
    assert "(in 14m" in out or "(in 15m)" in out, out

    # The same answer for a user authorized_mailq_users allows (static:anyone), who
    # cannot read the queue file or the defer log: the daemon reads them.
    assert not os.access(path, os.R_OK, effective_ids=False) or os.getuid() == 0
    as_nobody = explain(pf, deferred_id, user=nobody, others=pyqmgr_for_others)
    assert as_nobody["recipients"] == reply["recipients"]

    # -- on hold: since when, and the reasons it had ------------------------------------
    before_hold = time.time()
    pf.postsuper("-h", held_id)
    held = explain(pf, held_id)
    assert (held["queue"], held["in_core"]) == ("hold", False)
    assert before_hold - 1 <= held["held_since"] <= time.time() + 1, held
    assert 0 <= held["held_for"] < 30
    assert held["reasons"][0]["constraint"] == "on hold"
    assert f"postsuper -H {held_id}" in held["reasons"][0]["text"]
    assert "next_try_time" not in held
    (b,) = held["recipients"]
    assert b["address"] == "b@dead.example" and "Connection refused" in b["reason"]
    held_text = cli(pf, "explain", held_id).stdout
    assert f"{held_id}: message in the hold queue (not in core)" in held_text
    assert "on hold since " in held_text

    # A defer log past the reader's limit (2 MiB of entries) is read in part, and
    # a malformed one is answered with its warnings: explain still answers.
    log_path = pf.queue_path("defer", held_id)
    assert log_path is not None
    entry = b"\nrecipient=x@dead.example\noffset=1\nstatus=4.4.1\nreason=" + b"y" * 200 + b"\n\n"
    with open(log_path, "wb") as f:
        f.write(entry * (2 * 2**20 // len(entry) + 1))
    big = explain(pf, held_id)
    assert big["defer_log"]["read"] == 2**20 < big["defer_log"]["size"], big["defer_log"]
    assert "the first 1048576 of" in cli(pf, "explain", held_id).stdout
    with open(log_path, "wb") as f:
        f.write(b"\x00garbage\nno equals sign\nrecipient=b@dead.example\nwhat=ever\n\n")
    bad = explain(pf, held_id)
    assert any("malformed record" in w for w in bad["warnings"]), bad["warnings"]
    assert any("unknown attribute name: what" in w for w in bad["warnings"])

    # -- incoming: not read yet, behind a full active queue (its limit is 1) -----------
    pf.smtp_send([("s@test.example", ["slow@slow.example"])])
    pf.wait_until(lambda: slow.open_sessions() >= 1, 30, "the slow delivery under way")
    (waiting,) = pf.smtp_send([("s@test.example", ["w@slow.example"])])
    pf.wait_until(lambda: waiting in pf.queue_files("incoming"), 20, f"{waiting} in incoming/")
    unread = explain(pf, waiting)
    assert (unread["queue"], unread["in_core"]) == ("incoming", False), unread
    (why,) = [r for r in unread["reasons"] if r["constraint"] == "not read yet"]
    assert why["setting"] == "qmgr_message_active_limit"
    assert "1 of qmgr_message_active_limit 1 messages are in core" in why["text"], why
    assert [r["address"] for r in unread["recipients"]] == ["w@slow.example"]
    assert "reason" not in unread["recipients"][0]  # never tried: no defer log
    (slow_state,) = unread["destinations"]
    assert slow_state["in_core"] is True and slow_state["nexthop"] == f"[127.0.0.1]:{slow.port}"
    pf.wait_until(lambda: slow.delivered_count() >= 2, 90, "both slow deliveries")

    # A queue id that names nothing.
    gone = explain(pf, "ABCDEF0123")
    assert gone["kind"] == "unknown" and gone["reasons"][0]["constraint"] == "not found"
