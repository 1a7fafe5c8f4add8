"""Operator controls on real Postfix: suspend, resume and retry, through the CLI.

Each test runs an instance with pyqmgr and sinks, uses ``pyqmgr suspend|resume|retry``
as an admin would (as root), and checks the mail at the sinks, the queue, what
status and explain say, and the maillog's record of the control (who, what, reason,
TTL). One suspension outlives ``postfix reload`` and ends on time by itself.
"""

from __future__ import annotations

import json
import os
import re
import time

from pyqmgr.testbed.instance import PostfixInstance, free_port
from pyqmgr.testbed.sink import SinkServer
from tests.test_control import cli, control_path, wait_for_channel
from tests.test_explain_real import reasons_for


def control_lines(pf: PostfixInstance, contains: str = "") -> list[str]:
    return [ln.text for ln in pf.maillog.lines("postfix/qmgr", contains="control: ")
            if contains in ln.text]


def held_messages(pf: PostfixInstance) -> int:
    return len(pf.queue_files("active")) + len(pf.queue_files("incoming"))


def new_qmgr_after_reload(pf: PostfixInstance) -> None:
    old = pf.qmgr_pid()
    pf.reload()
    pf.wait_until(lambda: pf.pids("qmgr") not in ([], [old]), 20,
                  "a new qmgr after postfix reload")
    wait_for_channel(pf)


def test_a_suspended_destination_keeps_its_mail_until_resumed(postfix_instance, sink):
    held: SinkServer = sink()
    other: SinkServer = sink()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"held.example": f"smtp:[127.0.0.1]:{held.port}",
                                   "other.example": f"smtp:[127.0.0.1]:{other.port}"})
    wait_for_channel(pf)
    nexthop = f"[127.0.0.1]:{held.port}"
    done = cli(pf, "suspend", nexthop, "--ttl", "10m", "--reason", "remote asked for a pause")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"suspended destination {nexthop} for 10m\n")

    pf.smtp_send([("s@test.example", [f"h{i}@held.example"]) for i in range(5)]
                 + [("s@test.example", [f"o{i}@other.example"]) for i in range(5)])
    other.wait_delivered(5, 60)
    pf.wait_until(lambda: held_messages(pf) == 5, 30, "the five held messages in the queue")
    time.sleep(2)  # the held destination has had every chance to get an agent
    assert held.delivered_count() == 0, "nothing reaches a suspended destination"
    assert held_messages(pf) == 5 and not pf.queue_files("deferred"), (
        "suspended mail stays queued, not deferred")

    (why,) = reasons_for(pf, nexthop)
    assert why["constraint"] == "suspended" and why["setting"] == "pyqmgr suspend", why
    assert why["by"].startswith("root (uid=0 pid=") and "remote asked" in why["text"]
    assert 0 < why["ends_in"] <= 600
    qid = os.path.basename(pf.queue_files("active")[0])
    assert [r["constraint"] for r in reasons_for(pf, qid)] == ["suspended"]
    status = json.loads(cli(pf, "status", "--json").stdout)
    (dest,) = [d for d in status["destinations"] if d["name"] == nexthop]
    assert dest["suspended"]["reason"] == "remote asked for a pause"
    assert dest["queued_entries"] == 5 and dest["in_flight"] == 0
    text = cli(pf, "status").stdout
    assert f"destination {nexthop}" in text and "suspended by root" in text

    (logged,) = control_lines(pf, "suspend")
    assert re.fullmatch(
        rf"control: suspend destination {re.escape(nexthop)} by root \(uid=0 pid=\d+\) "
        r"for 10m, until \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \w+: reason: remote asked for a pause",
        logged), logged

    resumed = cli(pf, "resume", nexthop)
    assert resumed.returncode == 0, resumed.stderr
    held.wait_delivered(5, 60)
    pf.wait_queue_empty(30)
    got = sorted(r for m in held.messages() for r in m.recipients)
    assert got == sorted(f"h{i}@held.example" for i in range(5)), "each exactly once"
    (logged,) = control_lines(pf, "resume")
    assert re.fullmatch(rf"control: resume destination {re.escape(nexthop)} by root "
                        r"\(uid=0 pid=\d+\) \(suspended by root \(uid=0 pid=\d+\): reason: "
                        r"remote asked for a pause\)", logged), logged
    assert json.loads(cli(pf, "status", "--json").stdout)["suspensions"] == []


def test_a_suspension_survives_reload_and_ends_on_time(postfix_instance, sink):
    srv: SinkServer = sink()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"ttl.example": f"smtp:[127.0.0.1]:{srv.port}"})
    wait_for_channel(pf)
    nexthop = f"[127.0.0.1]:{srv.port}"
    ttl = 15
    t0 = time.monotonic()
    assert cli(pf, "suspend", nexthop, "--ttl", f"{ttl}s").returncode == 0
    pf.smtp_send([("s@test.example", [f"t{i}@ttl.example"]) for i in range(4)])
    pf.wait_until(lambda: held_messages(pf) == 4, 30, "the four held messages")

    new_qmgr_after_reload(pf)
    assert time.monotonic() - t0 < ttl - 5, "the test bed was too slow to test the TTL"
    (kept,) = json.loads(cli(pf, "status", "--json").stdout)["suspensions"]
    assert kept["target"] == f"destination {nexthop}" and kept["reason"] == ""
    assert 0 < kept["ends_in"] <= ttl - (time.monotonic() - t0) + 0.5, kept
    assert control_lines(pf, f"destination {nexthop} stays suspended (by root")
    assert [r["constraint"] for r in reasons_for(pf, nexthop)] == ["suspended"]

    # Held until the TTL: poll the sink until just before the end.
    while time.monotonic() - t0 < ttl - 1.5:
        assert srv.delivered_count() == 0, "delivered before the suspension ended"
        time.sleep(0.2)
    srv.wait_delivered(4, 30)
    ended_after = time.monotonic() - t0
    print(f"suspension of {ttl} s: mail delivered {ended_after:.2f} s after the suspend")
    assert ended_after < ttl + 3, f"the suspension ended {ended_after:.1f} s after it began"
    lines = control_lines(pf, "ended: its ttl")
    assert len(lines) == 1, lines
    ended = lines[0]
    assert ended == (f"control: suspension of destination {nexthop} ended: its ttl of "
                     f"{ttl}s ran out (suspended by root "
                     + ended.split("suspended by root ", 1)[1])
    pf.wait_queue_empty(30)
    assert sorted(r for m in srv.messages() for r in m.recipients) == sorted(
        f"t{i}@ttl.example" for i in range(4)), "nothing lost, nothing twice"
    state = os.path.join(pf.data_dir, "pyqmgr", "suspensions.json")
    assert json.load(open(state))["suspensions"] == [], "the ended suspension is forgotten"


def test_a_suspended_transport_and_a_retried_dead_destination(postfix_instance, sink):
    srv: SinkServer = sink()
    dead_port = free_port()  # nothing listens yet: the destination dies
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr",
        transports={"slow.example": f"one:[127.0.0.1]:{srv.port}",
                    "dead.example": f"smtp:[127.0.0.1]:{dead_port}"},
        master_cf_extra=["one unix - - n - - smtp"],
        main_cf={"smtp_destination_concurrency_failed_cohort_limit": "1",
                 "initial_destination_concurrency": "1",
                 "minimal_backoff_time": "600s", "maximal_backoff_time": "1200s"})
    wait_for_channel(pf)

    # The whole transport "one", named by its master.cf service name.
    assert cli(pf, "suspend", "one", "--reason", "one's relay is down").returncode == 0
    pf.smtp_send([("s@test.example", ["a@slow.example"])])
    pf.wait_until(lambda: held_messages(pf) == 1, 30, "the held message")
    time.sleep(2)
    assert srv.delivered_count() == 0
    reasons = reasons_for(pf, f"[127.0.0.1]:{srv.port}")
    assert [r["constraint"] for r in reasons] == ["suspended"]
    assert reasons[0]["text"].startswith("transport one is suspended by root")
    (t,) = [t for t in json.loads(cli(pf, "status", "--json").stdout)["transports"]
            if t["name"] == "one"]
    assert t["suspended"]["target"] == "transport one"
    assert cli(pf, "resume", "one:").returncode == 0, "TRANSPORT: names it too"
    srv.wait_delivered(1, 60)

    # A dead destination: revived by retry, the next message goes at once.
    pf.smtp_send([("s@test.example", ["d0@dead.example"])])
    dead_hop = f"[127.0.0.1]:{dead_port}"
    pf.wait_until(lambda: any(r["constraint"] == "dead destination"
                              for r in reasons_for(pf, dead_hop)), 60, "the dead destination")
    with SinkServer(port=dead_port) as revived:
        pf.smtp_send([("s@test.example", ["d1@dead.example"])])
        pf.wait_until(lambda: any("d1@dead.example" in ln.text and "status=deferred" in ln.text
                                  for ln in pf.maillog.lines()), 30,
                      "d1 deferred while the destination is dead")
        retried = cli(pf, "retry", dead_hop, "--json")
        assert retried.returncode == 0, retried.stderr
        assert json.loads(retried.stdout)["revived"] == [f"smtp:{dead_hop}"]
        assert not any(r["constraint"] == "dead destination" for r in reasons_for(pf, dead_hop))
        pf.smtp_send([("s@test.example", ["d2@dead.example"])])
        revived.wait_delivered(1, 30)
        assert [r for m in revived.messages() for r in m.recipients] == ["d2@dead.example"]
        (logged,) = control_lines(pf, "retry")
        assert re.fullmatch(rf"control: retry destination {re.escape(dead_hop)} by root "
                            rf"\(uid=0 pid=\d+\): revived smtp:{re.escape(dead_hop)}", logged)
        again = cli(pf, "retry", dead_hop)
        assert again.stdout == f"destination {dead_hop}: nothing dead in core\n"
        # The deferred ones keep their retry time until a flush, as the CLI says.
        pf.flush()
        revived.wait_delivered(3, 60)
    pf.wait_queue_empty(30)


def test_bad_controls_get_clear_errors(postfix_instance, sink):
    srv: SinkServer = sink()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"fine.example": f"smtp:[127.0.0.1]:{srv.port}"})
    wait_for_channel(pf)
    cases = [
        (["suspend", ":x.example"], 1, "bad target ':x.example': no transport before ':'"),
        (["suspend", "x.example", "--ttl", "31d"], 1, "ttl longer than 30 days"),
        (["suspend", "x.example", "--reason", "a" * 201], 1,
         "reason longer than 200 characters"),
        (["suspend", "x.example", "--reason", "two\nlines"], 1,
         "reason has control characters"),
        (["resume", "never.example"], 1,
         "destination never.example is not suspended (in force: none)"),
    ]
    for args, code, text in cases:
        proc = cli(pf, *args)
        assert proc.returncode == code, (args, proc.stdout, proc.stderr)
        assert proc.stderr == f"pyqmgr {args[0]}: {text}\n", (args, proc.stderr)
    usage = cli(pf, "suspend", "x.example", "--ttl", "soon")
    assert usage.returncode == 2 and "not a duration: 'soon'" in usage.stderr
    # The raw protocol with a ttl the CLI would never send.
    from pyqmgr.control.client import request

    reply = request(control_path(pf), "suspend", {"target": "x.example", "ttl": -1})
    assert reply == {"ok": False, "code": "bad_request",
                     "error": "ttl must be more than 0 seconds"}
    assert json.loads(cli(pf, "status", "--json").stdout)["suspensions"] == []
    pf.smtp_send([("s@test.example", ["ok@fine.example"])])
    srv.wait_delivered(1, 30)


def test_a_corrupt_state_file_is_set_aside_and_mail_flows(postfix_instance, sink):
    srv: SinkServer = sink()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"fine.example": f"smtp:[127.0.0.1]:{srv.port}"})
    wait_for_channel(pf)
    state = os.path.join(pf.data_dir, "pyqmgr", "suspensions.json")
    st = os.stat(os.path.dirname(state))
    assert oct(st.st_mode & 0o777) == "0o700" and st.st_uid == os.stat(pf.data_dir).st_uid
    with open(state, "w") as f:
        f.write('{"version": 1, "suspensions": [')
    new_qmgr_after_reload(pf)
    pf.wait_until(lambda: any("suspensions.json: not JSON" in ln.text and "moved aside" in ln.text
                              for ln in pf.maillog.lines("postfix/qmgr")), 20,
                  "the warning about the corrupt state file")
    assert os.path.exists(state + ".corrupt") and not os.path.exists(state)
    pf.smtp_send([("s@test.example", ["ok@fine.example"])])
    srv.wait_delivered(1, 30)


def test_suspensions_persist_for_a_chrooted_qmgr(postfix_instance):
    """Chrooted in the queue directory, the daemon still reaches data_directory."""
    pf: PostfixInstance = postfix_instance(qmgr="pyqmgr", start=False)
    pf.postconf("-F", "qmgr/unix/chroot=y")
    pf.start()
    wait_for_channel(pf)
    assert cli(pf, "suspend", "far.example", "--ttl", "1h", "--reason", "chroot").returncode == 0
    state = os.path.join(pf.data_dir, "pyqmgr", "suspensions.json")
    (saved,) = json.load(open(state))["suspensions"]
    assert saved["destination"] == "far.example" and saved["reason"] == "chroot"
    new_qmgr_after_reload(pf)
    (kept,) = json.loads(cli(pf, "status", "--json").stdout)["suspensions"]
    assert kept["target"] == "destination far.example" and kept["reason"] == "chroot"
    assert cli(pf, "resume", "far.example").returncode == 0
    assert json.load(open(state))["suspensions"] == []
    pf.sendmail("s@test.example", [pf.local_address])
    pf.wait_queue_empty(30)
