"""The test bed itself, with STOCK qmgr: if these fail, no pyqmgr comparison means much.

Covers each delivery path the qmgr tests use (discard, smtp to the sink, error, local),
the maillog reader, the queue helpers, reload, preloading, and that stop() leaves no
process behind.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from pyqmgr.testbed.instance import LOCAL_DOMAIN, LOCAL_USER, PostfixInstance, TestbedError
from pyqmgr.testbed.maillog import Maillog, parse_line


def removed(qid):
    return lambda ln: ln.queue_id == qid and ln.program == "postfix/qmgr" \
        and ln.text.endswith(": removed")


def test_every_delivery_path_with_stock_qmgr(postfix_instance, sink):
    srv = sink()
    pf = postfix_instance(transports={
        "discard.example": "discard:",
        "sink.example": f"smtp:[127.0.0.1]:{srv.port}",
        "err.example": "error:5.1.1 test",
    })
    assert pf.postconf("-h", "transport_maps").strip().startswith("inline:{")
    (qid,) = pf.smtp_send([("s@discard.example", ["d@discard.example", "r@sink.example",
                                                  "x@err.example", pf.local_address])])
    pf.sendmail("s@discard.example", ["viasendmail@discard.example"], subject="sm")

    def delivered(to, program, status):
        (line,) = pf.maillog.wait_for(
            lambda ln: ln.to == to and ln.program == f"postfix/{program}", timeout=20,
            what=f"{program} delivery to {to}")
        assert line.status == status, line.raw
        return line

    line = delivered("d@discard.example", "discard", "sent")
    assert line.queue_id == qid and line.relay == "none" and line.dsn == "2.0.0"
    line = delivered("r@sink.example", "smtp", "sent")
    assert line.relay == f"127.0.0.1[127.0.0.1]:{srv.port}"
    assert line.detail.startswith("250 2.0.0 queued")
    line = delivered("x@err.example", "error", "bounced")
    assert (line.dsn, line.detail) == ("5.1.1", "test")
    line = delivered(f"{LOCAL_USER}@{LOCAL_DOMAIN}", "local", "sent")
    assert line.detail == "delivered to mailbox"
    delivered("viasendmail@discard.example", "discard", "sent")

    # The bounce for x@err.example goes back to the sender (discard) too.
    pf.maillog.wait_for(r"sender non-delivery notification", timeout=20)
    pf.maillog.wait_for(removed(qid), timeout=20)
    pf.wait_queue_empty(20)
    assert pf.queue_json() == []

    (msg,) = srv.messages()
    assert msg.recipients == ("r@sink.example",) and msg.sender == "s@discard.example"
    with open(pf.mailbox()) as f:
        assert "Delivered-To: pyqmgrtest@local.test.example" in f.read()
    active = pf.maillog.lines("qmgr", queue_id=qid, contains="queue active")
    assert active[0].sender == "s@discard.example" and active[0].fields["nrcpt"] == "4"
    assert pf.maillog.unparsed == []
    assert [ln for ln in pf.maillog.lines() if ln.severity != "info"] == []


def test_deferred_mail_is_found_in_hashed_queue_dirs_and_flushed(postfix_instance, sink):
    srv = sink()
    srv.refuse()
    pf = postfix_instance(transports={"sink.example": f"smtp:[127.0.0.1]:{srv.port}"})
    (qid,) = pf.smtp_send([("s@test.example", ["r@sink.example"])])
    pf.maillog.wait_for(lambda ln: ln.queue_id == qid and ln.status == "deferred",
                        timeout=20)
    pf.wait_until(lambda: qid in pf.queue_files("deferred"), 10, "the deferred file")
    path = pf.queue_path("deferred", qid)
    assert path is not None and os.path.dirname(path) != os.path.join(pf.queue_dir,
                                                                      "deferred")
    (entry,) = pf.queue_json()
    assert entry["queue_id"] == qid and entry["queue_name"] == "deferred"
    srv.reopen()
    pf.flush()
    pf.maillog.wait_for(removed(qid), timeout=20)
    assert srv.stats.delivered == {"r@sink.example": 1}
    assert pf.queue_empty()


def test_reload_restarts_qmgr_and_mail_still_flows(postfix_instance):
    pf = postfix_instance(transports={"discard.example": "discard:"})
    old = pf.qmgr_pid()
    master = pf.master_pid()
    assert master in pf.pids("master")
    pf.set_main(smtpd_banner="$myhostname ESMTP reloaded")
    pf.reload()
    pf.maillog.wait_for(r"postfix/master\[\d+\]: reload -- version", timeout=10)
    pf.wait_until(lambda: pf.pids("qmgr") not in ([], [old]), 10, "a new qmgr")
    assert pf.master_pid() == master and master in pf.pids("master"), "master kept its pid"
    (qid,) = pf.smtp_send([("s@discard.example", ["r@discard.example"])])
    pf.maillog.wait_for(removed(qid), timeout=20)
    assert os.stat(pf.config_dir + "/main.cf").st_mtime < time.time() - 60, "backdated"


def test_stop_leaves_no_process_even_one_that_ignores_sigterm(postfix_instance):
    pf = postfix_instance(transports={"discard.example": "discard:"})
    # master starts qmgr and pickup a moment after postfix start returns.
    pf.wait_until(lambda: {"master", "qmgr", "pickup", "postlogd"} <= {
        os.path.basename(argv[0]) for argv in pf.processes().values()}, 10,
        "master, qmgr, pickup and postlogd running")
    # A stray child that ignores SIGTERM, as a wedged daemon would.
    stray = subprocess.Popen(["sh", "-c", "trap '' TERM; while :; do sleep 0.1; done"],
                             env={"MAIL_CONFIG": pf.config_dir, "PATH": os.environ["PATH"]})
    assert stray.pid in pf.pids()
    pf.stop(grace=0.3)
    assert pf.processes() == {}
    assert stray.wait(5) == -9
    assert not pf.running()


def test_preload_then_release_drains(postfix_instance):
    pf = postfix_instance(transports={"discard.example": "discard:"})
    qids = pf.preload(200, recipients=lambda i: [f"r{i}@discard.example"],
                      sender="s@discard.example")
    assert len(set(qids)) == 200
    assert sorted(pf.queue_files("incoming")) == sorted(qids)
    assert pf.pids("qmgr") == [], "no qmgr while preloaded"
    assert "qmgr" not in pf.postconf("-M")
    assert pf.postconf("-n", "in_flow_delay") == "", "in_flow_delay restored"
    pf.release_preload()
    pf.maillog.wait_for(lambda ln: ln.program == "postfix/qmgr"
                        and ln.text.endswith(": removed"), timeout=30, count=200)
    pf.wait_queue_empty(10)
    assert pf.postconf("-M", "qmgr/unix").split()[-1] == "qmgr"


def test_start_failure_is_reported_with_the_reason(postfix_instance):
    pf = postfix_instance(start=False, main_cf={"maillog_file_prefixes": "/var"})
    with pytest.raises(TestbedError, match="does not match any prefix"):
        pf.start()
    assert pf.processes() == {}


def test_keep_env_keeps_the_directory(monkeypatch, capsys):
    monkeypatch.setenv("PYQMGR_KEEP_TESTBED", "1")
    pf = PostfixInstance()
    try:
        pf.close()
        assert os.path.isfile(os.path.join(pf.config_dir, "main.cf"))
        assert pf.root in capsys.readouterr().out
        assert oct(os.stat(pf.root).st_mode & 0o777) == "0o755"
    finally:
        subprocess.run(["rm", "-rf", pf.root], check=True)
    monkeypatch.delenv("PYQMGR_KEEP_TESTBED")
    pf = PostfixInstance()
    pf.close()
    assert not os.path.exists(pf.root)


def test_instance_config(postfix_instance):
    pf = postfix_instance(start=False, qmgr_args=["-o", "qmgr_message_active_limit=500"],
                          main_cf={"smtpd_banner": "hi"},
                          transports={"b.example": "error:5.1.1 no such user",
                                      "a.example": "discard:"},
                          master_cf_extra=["extra unix - - n - - discard"])
    line = pf.postconf("-M", "qmgr/unix").split()
    assert line[-3:] == ["qmgr", "-o", "qmgr_message_active_limit=500"]
    assert pf.postconf("-M", "extra/unix").split()[-1] == "discard"
    assert pf.postconf("-M", f"127.0.0.1:{pf.smtpd_port}/inet").split()[-1] == "smtpd"
    assert all(v.endswith("= n") for v in pf.postconf("-F", "*/*/chroot").splitlines())
    assert pf.postconf("-h", "smtpd_banner").strip() == "hi"
    q = pf.postconf("-h", "-o", "x=y", "transport_maps").strip()
    assert q == "inline:{{b.example=error:5.1.1 no such user}, a.example=discard:}"
    out = subprocess.run(["postmap", "-c", pf.config_dir, "-q", "b.example", q],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "error:5.1.1 no such user"


# -- the maillog reader on its own -------------------------------------------------------

LINES = [
    "Nov 22 10:48:39 pfx postfix/qmgr[6815]: 10AEC20E202: from=<s@x.example>, size=276, "
    "nrcpt=1 (queue active)",
    "Nov  2 10:48:39 pfx postfix/smtp[7]: 10AEC20E202: to=<\"a, b\"@x>, orig_to=<y@z>, "
    "relay=127.0.0.1[127.0.0.1]:2525, delay=0.01, delays=0/0/0/0.01, dsn=4.2.0, "
    "status=deferred (host 127.0.0.1[127.0.0.1] said: 450 4.2.0 later (in reply to RCPT "
    "TO command))",
    "Nov 22 10:48:39 pfx postfix/qmgr[6815]: warning: mail for x is using up 3 of 3",
    "Nov 22 10:48:39 pfx postfix/submission/smtpd[9]: 3ZgpQq5rNWz9tYW: client=localhost",
]


def test_parse_line_fields():
    a, b, c, d = (parse_line(s) for s in LINES)
    assert (a.program, a.pid, a.queue_id, a.sender, a.fields["nrcpt"]) == (
        "postfix/qmgr", 6815, "10AEC20E202", "s@x.example", "1")
    assert (b.time, b.to, b.orig_to, b.relay, b.dsn, b.status) == (
        "Nov  2 10:48:39", '"a, b"@x', "y@z", "127.0.0.1[127.0.0.1]:2525", "4.2.0",
        "deferred")
    assert b.detail.startswith("host 127.0.0.1[127.0.0.1] said: 450")
    assert (c.severity, c.queue_id, c.text[:8]) == ("warning", None, "warning:")
    assert (d.queue_id, d.program_name) == ("3ZgpQq5rNWz9tYW", "smtpd")
    assert parse_line("garbage") is None


def test_maillog_reads_incrementally(tmp_path):
    path = tmp_path / "maillog"
    log = Maillog(str(path))
    assert log.refresh() == []  # no file yet
    with open(path, "w") as f:
        f.write(LINES[0] + "\n" + LINES[1][:30])  # second line torn mid-write
    assert [ln.queue_id for ln in log.refresh()] == ["10AEC20E202"]
    mark = log.mark()
    with open(path, "a") as f:
        f.write(LINES[1][30:] + "\n" + LINES[2] + "\n")
    assert [ln.program for ln in log.lines(since=mark)] == ["postfix/smtp", "postfix/qmgr"]
    assert len(log.lines("qmgr")) == 2 and len(log.lines("postfix/smtp")) == 1
    assert len(log.lines(queue_id="10AEC20E202")) == 2
    assert log.wait_for(r"status=deferred", timeout=1)[0].status == "deferred"
    with pytest.raises(TimeoutError, match=r"(?s)2 maillog line.*found 1.*using up 3"):
        log.wait_for(lambda ln: ln.status == "deferred", timeout=0.1, count=2)
    with open(path, "w") as f:  # truncated and rewritten: read from the start again
        f.write(LINES[3] + "\n")
    assert [ln.program_name for ln in log.refresh()] == ["smtpd"]


def test_cloned_queue_files_are_real_mail_to_every_qmgr():
    """Field-sized benchmarks copy a few real queue files to thousands (issue #30):
    the copies are delivered as the originals would be, under names Postfix keeps
    (its start renames any file whose name does not end in its inode number, under
    a running qmgr: a benchmark once lost a message to that), and a past mtime in
    deferred/ is due at the first scan."""
    with PostfixInstance(qmgr="pyqmgr", transports={"discard.example": "discard:"}) as pf:
        pf.start()
        originals = pf.preload(3, recipients=lambda i: [f"r{i}@discard.example"])
        templates = pf.queue_file_bytes("incoming")
        assert len(templates) == 3
        incoming = pf.clone_queue_files(templates, 30)
        deferred = pf.clone_queue_files(templates, 20, queue="deferred",
                                        mtime=time.time() - 3600)
        assert len(set(incoming + deferred + originals)) == 53
        for qid in incoming + deferred:
            st = os.stat(pf.queue_path("incoming", qid) or pf.queue_path("deferred", qid))
            assert int(qid[5:], 16) == st.st_ino and st.st_mode & 0o777 == 0o700
        pf.release_preload()
        pf.wait_removed(incoming + deferred + originals, timeout=60)
        assert pf.queue_empty()
        assert not pf.maillog.lines(contains="Renamed to match inode number")


def test_chromium_pipe_keeps_an_event_read_together_with_a_reply():
    """The DevTools pipe's framing: a reply and the events after it, in one read, are
    all kept. A page that loaded at once had its load event in the navigation reply's
    read; it was dropped and the wait for it timed out (CI, under load)."""
    import json

    from pyqmgr.testbed.chromium import _Pipe

    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    try:
        batch = b"".join(json.dumps(m).encode() + b"\0" for m in (
            {"method": "Network.requestWillBeSent", "params": {}},
            {"id": 1, "result": {"frameId": "F"}},
            {"method": "Page.loadEventFired", "params": {"timestamp": 1}}))
        os.write(from_w, batch)
        pipe = _Pipe(None, to_w, from_r)  # type: ignore[arg-type]
        assert pipe.send("Page.navigate", {"url": "about:blank"}, timeout=2) == {"frameId": "F"}
        assert pipe.wait_event("Page.loadEventFired", 0.5)["params"] == {"timestamp": 1}
        assert [m.get("method") for m in pipe.events] == ["Network.requestWillBeSent",
                                                          "Page.loadEventFired"]
        sent = os.read(to_r, 4096)
        assert json.loads(sent.rstrip(b"\0"))["method"] == "Page.navigate"
    finally:
        for fd in (to_r, to_w, from_r, from_w):
            os.close(fd)


def test_chromium_evaluates_an_expression_in_the_laid_out_page(tmp_path):
    """open_page's ``evaluate`` (docs/images/regenerate.py cuts the compare report's
    screenshot where it says): where an element is, in the page at the screenshot's
    size; a script that throws is an error, not a None."""
    from pyqmgr.testbed.chromium import ChromiumError, open_page

    page = tmp_path / "p.html"
    page.write_text('<!DOCTYPE html><html><body style="margin:0"><div style="height:700px">'
                    '</div><h2 id=x style="margin:0;height:40px">here</h2></body></html>')
    os.chmod(tmp_path, 0o755)
    seen = open_page(f"file://{page}", width=400, height=300, evaluate=(
        "(() => { const b = document.getElementById('x').getBoundingClientRect();"
        " return [b.top + window.scrollY, b.bottom + window.scrollY]; })()"))
    assert seen.evaluated == [700, 740]
    assert seen.screenshot[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ChromiumError, match="evaluate"):
        open_page(f"file://{page}", screenshot=False, evaluate="no_such_name.x")
