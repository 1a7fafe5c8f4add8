"""Delivery events on real Postfix: one event per recipient per attempt, none lost.

A sink answers by recipient (250 for ok*, 450 for soft*, 550 for hard*); messages of
one to three recipients go through real Postfix with pyqmgr and
``delivery_events_file`` set; the qmgr is killed with SIGKILL and Postfix reloaded
while mail flows. At the end the events, each key counted once, must equal the
maillog's status= lines of the delivery agents, recipient by recipient and status by
status, and pflogsumm's delivered, deferred and bounced totals on the same maillog.

The size is set by PYQMGR_EVENTS_MESSAGES (the suite's default is small: CI's budget;
benchmarks/README.md records the 20,000-message run's figures and time).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable

import pytest

from pyqmgr.testbed.instance import PostfixInstance

N = int(os.environ.get("PYQMGR_EVENTS_MESSAGES", "300"))
#: Seconds each wait allows: the suite's size in well under the first, 20,000 in the last.
WAIT = max(300, N // 10)
REPLIES = {"ok*@sink.example": "250 2.0.0 Ok", "soft*@sink.example": "450 4.2.0 Try later",
           "hard*@sink.example": "550 5.1.1 No such user"}
AGENTS = ("postfix/smtp", "postfix/error", "postfix/local", "postfix/discard")


def recipients(i: int) -> list[str]:
    """One to three recipients, of each kind in turn."""
    kinds = ("ok", "soft", "hard")
    return [f"{kinds[(i + k) % 3]}{i}x{k}@sink.example" for k in range(1 + i % 3)]


def read_events(path: str) -> list[dict[str, object]]:
    events = []
    directory, name = os.path.split(path)
    for f in sorted(os.listdir(directory)):
        if f == name or f.startswith(name + "."):
            with open(os.path.join(directory, f), "rb") as fh:
                events += [json.loads(line) for line in fh if line.strip()]
    return events


def status_lines(pf: PostfixInstance,
                 programs: tuple[str, ...] = AGENTS) -> list[tuple[str, str, str]]:
    """(queue id, recipient, status) of every agent's status= line."""
    out = []
    for program in programs:
        for ln in pf.maillog.lines(program, contains="status="):
            if ln.queue_id and ln.to and ln.status:
                out.append((ln.queue_id, ln.to, ln.status))
    return out


def events_instance(postfix_instance, sink, extra: dict[str, str] | None = None,
                    before_start: Callable[[str], None] | None = None,
                    **kw: object) -> tuple[PostfixInstance, str]:
    """A Postfix with pyqmgr writing events under its own root (not pytest's tmp_path:
    other runs on the machine prune those) and a sink answering by recipient."""
    srv = sink(replies=REPLIES)
    pf: PostfixInstance = postfix_instance(
        start=False, qmgr="pyqmgr",
        transports={"sink.example": f"smtp:[127.0.0.1]:{srv.port}"},
        # queue_run_delay: what a reload finds "still being delivered" waits one scan.
        main_cf={"minimal_backoff_time": "3600s", "maximal_backoff_time": "3600s",
                 "queue_run_delay": "5s",
                 **kw.pop("main_cf", {})},  # type: ignore[dict-item]
        **kw)
    path = os.path.join(pf.root, "events", "delivery.jsonl")
    pf.write_pyqmgr_cf({"delivery_events_file": path, **(extra or {})})
    if before_start is not None:
        before_start(path)
    pf.start()
    return pf, path


def test_events_equal_the_maillog_across_kill_and_reload(postfix_instance, sink):
    t0 = time.monotonic()
    pf, path = events_instance(postfix_instance, sink)
    msgs = [("s@sink.example", recipients(i)) for i in range(N)]
    pf.preload(msgs, timeout=WAIT)
    pf.release_preload()
    total = sum(len(r) for _, r in msgs)
    expect_done = sum(1 for _, rs in msgs for r in rs if not r.startswith("soft"))

    def settled() -> int:
        return len(status_lines(pf))

    pf.wait_until(lambda: settled() >= total // 3, WAIT, "a third of the recipients tried")
    killed = pf.qmgr_pid()
    os.kill(killed, signal.SIGKILL)

    _wait_for_new_qmgr(pf, killed, 120, "a new qmgr after the kill", pause=1.0)
    pf.wait_until(lambda: settled() >= total * 2 // 3, WAIT, "two thirds tried")
    pf.reload()
    touched = [time.monotonic()]

    def flush_now_and_then() -> None:
        # What the new qmgr found "still being delivered" goes back to incoming/ dated
        # in the future, minutes off: dated now and an incoming scan asked for, it goes
        # at once. The deferred ones wait their hour (each recipient tried about once).
        if time.monotonic() - touched[0] > 5:
            touched[0] = time.monotonic()
            waiting = pf.queue_files("incoming")
            for qid in waiting:
                where = pf.queue_path("incoming", qid)
                if where is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.utime(where)
            if waiting:  # an incoming scan (QMGR_REQ_SCAN_INCOMING)
                pf.run(["postkick", "-c", pf.config_dir, "public", "qmgr", "I"], check=False)

    pf.wait_until(lambda: flush_now_and_then() or settled() >= total
                  and not pf.queue_files("active") and not pf.queue_files("incoming"),
                  2 * WAIT, "every recipient tried once")
    # The notices to the sender (delivered to the sink) come and go too; then every
    # status= line's event must follow within a second or so.
    try:
        # flush_now_and_then here too: a notice the reload found "still being
        # delivered" would wait minutes in incoming/, dated in the future.
        pf.wait_until(lambda: flush_now_and_then() or not pf.queue_files("active")
                      and not pf.queue_files("incoming")
                      and len({e["key"] for e in read_events(path)}) >= settled(), 60,
                      "an event for every status= line")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{_missing_events(pf, path)}") from None
    events = read_events(path)
    lines = status_lines(pf)
    by_key = {}
    for e in events:
        by_key.setdefault(e["key"], e)
    repeats = len(events) - len(by_key)
    ev = Counter((e["queue_id"], e["recipient"], e["status"]) for e in by_key.values())
    log = Counter(lines)
    print(f"{N} messages, {total} recipients: {len(lines)} status= lines, {len(events)} "
          f"events, {len(by_key)} keys ({repeats} repeats); "
          f"{time.monotonic() - t0:.1f} s")
    assert ev == log, (f"only in events: {list((ev - log).items())[:5]}; "
                       f"only in the maillog: {list((log - ev).items())[:5]}")
    statuses = Counter(s for _, r, s in lines if r != "s@sink.example")
    assert statuses["sent"] + statuses["bounced"] == expect_done
    _pflogsumm_agrees(pf, by_key.values())
    # Each sent message's trace log goes once its events are written; deferred keep theirs.
    pf.wait_until(lambda: len(_trace_logs(pf)) <= len(pf.queue_files("deferred")), 30,
                  "no trace log left of a message that left the queue")


def test_a_delivery_the_last_qmgr_asked_for_has_its_event(postfix_instance, sink):
    """An agent of the last qmgr delivers after this qmgr's start-up read of the trace
    logs; this qmgr then finds the message with nothing left to deliver and removes it.
    Its trace log is read before it goes: the event is not lost (a clean clone's kill
    and reload test lost two notices' events so, once in four runs)."""
    made = []

    def slow_sink(**kw: object):
        made.append(sink(latency={"slow*@sink.example": 6}, **kw))
        return made[-1]

    pf, path = events_instance(postfix_instance, slow_sink)
    (qid,) = pf.smtp_send([("s@sink.example", ["slow1@sink.example"])])
    pf.wait_until(lambda: bool(made[0].active), 30, "the slow delivery under way")
    old = pf.qmgr_pid()
    pf.reload()

    _wait_for_new_qmgr(pf, old, 30, "a new qmgr after the reload", pause=0.5)
    assert not pf.maillog.lines("postfix/smtp", contains="status=sent"), (
        "the delivery ended before the new qmgr started: the test proves nothing")
    pf.wait_until(lambda: bool(pf.maillog.lines("postfix/smtp", contains="status=sent")),
                  30, "the slow delivery's end")

    def gone() -> bool:
        # The new qmgr found it "still being delivered": back in incoming/, dated later.
        where = pf.queue_path("incoming", qid)
        if where is not None:
            with contextlib.suppress(FileNotFoundError):
                os.utime(where)
            pf.run(["postkick", "-c", pf.config_dir, "public", "qmgr", "I"], check=False)
            time.sleep(0.5)
        return not any(qid in pf.queue_files(q) for q in ("incoming", "active"))

    pf.wait_until(gone, 30, "the message removed by the new qmgr")
    assert pf.maillog.lines("postfix/qmgr", contains=f"{qid}: removed")
    try:
        pf.wait_until(lambda: any(e["queue_id"] == qid and e["status"] == "sent"
                                  for e in read_events(path))
                      and not _trace_logs(pf), 15, "the delivery's event, its log removed")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{_missing_events(pf, path)}") from None
    _events_equal_the_maillog(pf, path)


def _wait_for_new_qmgr(pf: PostfixInstance, old: int, timeout: float, what: str,
                       pause: float) -> None:
    """Wait for a qmgr other than ``old``: master starts one again on a trigger (or
    its 300 s wakeup), after its throttle (service_throttle_time) if the dead one had
    served none, so each look that finds none kicks it and waits ``pause``."""

    def restarted() -> bool:
        if [pid for pid in pf.pids("qmgr") if pid != old]:
            return True
        pf.run(["postkick", "-c", pf.config_dir, "public", "qmgr", "I"], check=False)
        time.sleep(pause)
        return False

    pf.wait_until(restarted, timeout, what)


def _missing_events(pf: PostfixInstance, path: str) -> str:
    """What a timed-out wait for the events lacked: the status= lines with no event
    (queue id, recipient, status), where those messages are now, the trace logs left,
    and the qmgr's own lines about events (start-up reads, warnings), so that a rare
    failure says why without being run again."""
    by_key: dict[object, dict[str, object]] = {}
    for e in read_events(path):
        by_key.setdefault(e["key"], e)
    missing = Counter(status_lines(pf)) - Counter(
        (e["queue_id"], e["recipient"], e["status"]) for e in by_key.values())
    qids = sorted({qid for qid, _, _ in missing})
    where = {qid: [q for q in ("incoming", "active", "deferred", "hold")
                   if qid in pf.queue_files(q)] for qid in qids[:20]}
    said = [ln.text for ln in pf.maillog.lines("postfix/qmgr")
            if "event" in ln.text or ln.severity in ("warning", "fatal")]
    queued = {q: len(pf.queue_files(q)) for q in ("incoming", "active", "deferred")}
    return (f"queue files: {queued}\n{sum(missing.values())} status= lines have no event: "
            f"{list(missing.items())[:20]}\nwhere their messages are: {where}\n"
            f"trace logs left: {len(_trace_logs(pf))}\nqmgr said: {said[-20:]}")


def _trace_logs(pf: PostfixInstance) -> list[str]:
    out = []
    for _d, _s, files in os.walk(os.path.join(pf.queue_dir, "trace")):
        out += files
    return out


def _pflogsumm_agrees(pf: PostfixInstance, events) -> None:
    exe = shutil.which("pflogsumm")
    if exe is None:
        pytest.fail("pflogsumm is not installed (./dev installs Debian's pflogsumm)")
    proc = subprocess.run([exe, "--no_no_msg_size", pf.maillog.path], capture_output=True,
                          text=True, timeout=300, check=True)
    totals = {}
    # Its Grand Totals: "delivered" and "bounced" count status= lines (recipients),
    # "deferred (N deferrals)" messages and then lines.
    for what, pattern in (("delivered", r"(\d+)\s+delivered"), ("bounced", r"(\d+)\s+bounced"),
                          ("deferred", r"\d+\s+deferred\s+\((\d+)\s+deferrals\)")):
        m = re.search(rf"^\s*{pattern}\s*$", proc.stdout, re.M)
        assert m, f"pflogsumm printed no {what} total:\n{proc.stdout[:2000]}"
        totals[what] = int(m.group(1))
    counts = Counter(e["status"] for e in events)
    print(f"pflogsumm: {totals}; events: {dict(counts)}")
    assert totals["delivered"] == counts["sent"]
    assert totals["bounced"] == counts["bounced"]
    assert totals["deferred"] == counts["deferred"]


def test_a_message_that_asked_for_a_trace_gets_its_report_as_from_stock(postfix_instance,
                                                                         sink):
    """``sendmail -v`` (RECORD in the message's own trace flags) and NOTIFY=SUCCESS:
    no flag is added, stock's trace flush mails the sender its report (once) and
    removes the log, and the events are what the log held."""
    pf, path = events_instance(postfix_instance, sink)
    sender = pf.local_address
    pf.sendmail(sender, ["ok1@sink.example", "hard1@sink.example"], subject="verbose",
                extra_args=["-v"])
    pf.sendmail(sender, ["ok2@sink.example", "hard2@sink.example"], subject="dsn",
                extra_args=["-N", "success,failure"])
    reports = "sender delivery status notification"
    pf.wait_until(lambda: len(pf.maillog.lines("postfix/bounce", contains=reports)) >= 2
                  and pf.queue_empty() and len(read_events(path)) >= 3, 60,
                  "both reports sent and the events written")
    time.sleep(1)
    assert len(pf.maillog.lines("postfix/bounce", contains=reports)) == 2
    got = sorted((e["recipient"], e["status"]) for e in read_events(path)
                 if e["recipient"].endswith("@sink.example"))
    # -v: every recipient recorded; NOTIFY=SUCCESS: the delivered one only. (The
    # reports and notices delivered to the sender have events of their own.)
    assert got == [("hard1@sink.example", "bounced"), ("ok1@sink.example", "sent"),
                   ("ok2@sink.example", "sent")], got
    assert _trace_logs(pf) == []
    with open(pf.mailbox()) as f:
        subjects = [ln for ln in f.read().splitlines() if ln.startswith("Subject: ")]
    print(f"the sender's mailbox: {subjects}")
    assert subjects.count("Subject: Successful Mail Delivery Report") == 1
    assert subjects.count("Subject: Mail Delivery Status Report") == 1


def test_an_events_file_that_cannot_be_written_delays_no_mail(postfix_instance, sink):
    """A directory where the events file should be (any open fails): mail flows as
    before, one warning says so, the delivered messages' trace logs stay; once the
    name is free the waiting events are written and the logs removed."""
    def block(path: str) -> None:
        os.makedirs(path)  # the events file's name, taken by a directory
        uid, gid = pwd.getpwnam("postfix")[2:4]
        os.chown(os.path.dirname(path), uid, gid)

    pf, path = events_instance(postfix_instance, sink, before_start=block)
    msgs = [("s@sink.example", [f"ok{i}@sink.example"]) for i in range(20)]
    pf.smtp_send(msgs)
    pf.wait_until(lambda: len(status_lines(pf)) >= 20 and pf.queue_empty(), 60,
                  "20 messages delivered while the events file cannot be written")
    warned = pf.maillog.lines("postfix/qmgr", contains="delivery_events_file")
    assert len(warned) == 1 and "events wait in memory" in warned[0].text, warned
    assert len(_trace_logs(pf)) == 20, "their trace logs are kept"
    os.rmdir(path)
    pf.wait_until(lambda: os.path.isfile(path) and len(read_events(path)) == 20
                  and not _trace_logs(pf), 30, "the events written, the logs removed")
    assert sorted(e["recipient"] for e in read_events(path)) == sorted(
        r for _, rs in msgs for r in rs)


def test_with_the_trace_service_down_mail_waits_and_nothing_is_lost(postfix_instance, sink):
    """No trace service (master.cf without it): the agent's sent() cannot record and
    defers the recipient ("trace service failed"), as for sendmail -v in stock, after
    the server took the message (so it gets it again on the retry); back, the retried
    deliveries are recorded and their events written."""
    pf, path = events_instance(postfix_instance, sink)
    entry = pf.postconf("-M", "trace/unix").strip()
    assert entry, "master.cf has a trace service"
    pf.postconf("-MX", "trace/unix")
    pf.reload()
    pf.smtp_send([("s@sink.example", [f"ok{i}@sink.example"]) for i in range(5)])
    failed = "trace service failed"
    pf.wait_until(lambda: len(pf.maillog.lines("postfix/smtp", contains=failed)) >= 5
                  and len(pf.queue_files("deferred")) == 5, 60,
                  "5 recipients deferred for want of the trace service")
    assert not pf.maillog.lines("postfix/smtp", contains="status=sent")
    pf.postconf("-M", f"trace/unix={entry}")
    pf.reload()
    pf.flush()
    pf.wait_until(lambda: pf.queue_empty() and len(read_events(path)) >= 5, 60,
                  "the 5 delivered and their events written")
    sent = sorted(e["recipient"] for e in read_events(path) if e["status"] == "sent")
    assert sent == [f"ok{i}@sink.example" for i in range(5)]


def _normalized(pf: PostfixInstance) -> Counter[str]:
    """The agents' status= lines without what differs from run to run (time, pid,
    queue id, delays, connection reuse, the sink's port)."""
    out: Counter[str] = Counter()
    for program in AGENTS:
        for ln in pf.maillog.lines(program, contains="status="):
            text = re.sub(r"^[0-9A-F]+: ", "", ln.text)
            text = re.sub(r"(delay|delays|conn_use)=[^,]*, ", "", text)
            text = re.sub(r"\]:\d+", "]:PORT", text)  # each run's sink has its own port
            out[text.replace(ln.queue_id or "-", "QID")] += 1
    return out


def test_the_maillog_is_the_same_with_events_on(postfix_instance, sink):
    """The same mail with and without events: the same status= lines, apart from the
    times, queue ids, connection reuse and port that differ between any two runs."""
    msgs = [("s@sink.example", recipients(i)) for i in range(30)]
    seen = []
    for on in (False, True):
        if on:
            pf, _path = events_instance(postfix_instance, sink)
        else:
            srv = sink(replies=REPLIES)
            pf = postfix_instance(
                qmgr="pyqmgr", transports={"sink.example": f"smtp:[127.0.0.1]:{srv.port}"},
                main_cf={"minimal_backoff_time": "3600s", "maximal_backoff_time": "3600s"})
        pf.smtp_send(msgs)
        total = sum(len(r) for _, r in msgs) + 20  # and the 20 notices of a bounce
        pf.wait_until(lambda pf=pf, total=total: len(status_lines(pf)) >= total
                      and not pf.queue_files("active") and not pf.queue_files("incoming"),
                      60, "every recipient and notice tried")
        seen.append(_normalized(pf))
        pf.stop()
    off, on_ = seen
    assert on_ == off, f"only with events: {on_ - off}; only without: {off - on_}"


#: Every program that logs a recipient's status= line: the agents and the qmgr itself.
ALL_PROGRAMS = (*AGENTS, "postfix/virtual", "postfix/pipe", "postfix/qmgr")


def _events_equal_the_maillog(pf: PostfixInstance, path: str) -> list[dict[str, object]]:
    """Each key once, the events equal every status= line (queue id, recipient,
    status), whatever program logged it; the events, each key once."""
    by_key: dict[object, dict[str, object]] = {}
    for e in read_events(path):
        by_key.setdefault(e["key"], e)
    ev = Counter((e["queue_id"], e["recipient"], e["status"]) for e in by_key.values())
    log = Counter(status_lines(pf, ALL_PROGRAMS))
    assert ev == log, (f"only in events: {list((ev - log).items())[:5]}; "
                       f"only in the maillog: {list((log - ev).items())[:5]}")
    return list(by_key.values())


def test_events_of_qmgr_itself_and_of_every_agent(postfix_instance):
    """The outcomes qmgr writes itself and those of the agents the other tests do not
    run, each with its event: the retry agent's deferral (defer_transports), then,
    with the retry service out of master.cf, qmgr's own deferral; qmgr's discard of
    mail to double-bounce; the error agent's bounce; virtual(8)'s delivery and its
    unknown user; pipe(8)'s success, failure and temporary failure (exit 75); discard(8);
    local(8) to a command and to a file (aliases), and the notices to the local sender;
    and one message to four transports at once, each event with its own transport."""
    t0 = time.monotonic()
    user = pwd.getpwnam("pyqmgrtest")
    pipe = "unix - n n - - pipe user=pyqmgrtest argv="
    pf: PostfixInstance = postfix_instance(
        start=False, qmgr="pyqmgr",
        transports={"slow.example": "slowx:[127.0.0.1]:9", "err.example": "error:5.1.1 nope",
                    "pipeok.example": "pipeok:", "pipefail.example": "pipefail:",
                    "pipetemp.example": "pipetemp:", "disc.example": "discard:"},
        master_cf_extra=["slowx unix - - n - - smtp", f"pipeok {pipe}/bin/true",
                         f"pipefail {pipe}/bin/false", f"pipetemp {pipe}/bin/sh -c {{exit 75}}"],
        main_cf={"minimal_backoff_time": "3600s", "maximal_backoff_time": "3600s",
                 "defer_transports": "slowx",
                 "alias_maps": "inline:{topipe=|/bin/true, tofile=/dev/null}",
                 "virtual_mailbox_domains": "virt.example",
                 "virtual_mailbox_maps": "inline:{v1@virt.example=v1/}",
                 "virtual_uid_maps": f"static:{user.pw_uid}",
                 "virtual_gid_maps": f"static:{user.pw_gid}"})
    vmail = os.path.join(pf.root, "vmail")
    os.makedirs(vmail)
    os.chown(vmail, user.pw_uid, user.pw_gid)
    pf.postconf(f"virtual_mailbox_base={vmail}")
    path = os.path.join(pf.root, "events", "delivery.jsonl")
    pf.write_pyqmgr_cf({"delivery_events_file": path})
    pf.start()
    sender = pf.local_address
    local = sender.partition("@")[2]
    rcpts = ["d1@slow.example", "e1@err.example", "v1@virt.example", "v2@virt.example",
             "p1@pipeok.example", "p2@pipefail.example", "p3@pipetemp.example",
             f"topipe@{local}", f"tofile@{local}", f"double-bounce@{local}",
             "x1@disc.example"]
    # And one message to four transports at once: each event carries its own
    # request's transport, though the agents' records land in any order.
    mixed = ["m1@pipeok.example", "m2@disc.example", "m3@err.example", "m4@pipefail.example"]
    *sent_ids, mixed_id = pf.smtp_send([(sender, [r]) for r in rcpts] + [(sender, mixed)])
    qids = dict(zip(rcpts, sent_ids, strict=True)) | dict.fromkeys(mixed, mixed_id)
    # Each of the 15 and the notices of the 4 messages with bounces (to the local sender).
    pf.wait_until(lambda: len(status_lines(pf, ALL_PROGRAMS)) >= 19
                  and not pf.queue_files("active") and not pf.queue_files("incoming"),
                  60, "every recipient tried once")
    # Their events written and the gone messages' logs removed before the reload, so
    # that the next qmgr reads no leftover log (whose events would repeat with the
    # message's last transport: docs/events.md).
    pf.wait_until(lambda: len({e["key"] for e in read_events(path)}) >= 19
                  and len(_trace_logs(pf)) <= len(pf.queue_files("deferred")), 30,
                  "the events of the first 19 lines")
    # The retry service gone: qmgr defers the next one to the deferred transport itself.
    pf.postconf("-MX", "retry/unix")
    pf.reload()
    (qids["d2@slow.example"],) = pf.smtp_send([(sender, ["d2@slow.example"])])
    pf.wait_until(lambda: len(status_lines(pf, ALL_PROGRAMS)) >= 20
                  and len({e["key"] for e in read_events(path)}) >= 20, 60,
                  "qmgr's own deferral and every event")
    time.sleep(0.5)  # an event too many would come now
    events = _events_equal_the_maillog(pf, path)
    got = {(e["recipient"], e["status"], e["transport"]) for e in events
           if e["recipient"] != sender}
    print(f"{len(events)} events: {sorted(got)}; {time.monotonic() - t0:.1f} s")
    want = {("d1@slow.example", "deferred", "retry"), ("e1@err.example", "bounced", "error"),
            ("v1@virt.example", "sent", "virtual"), ("v2@virt.example", "bounced", "virtual"),
            ("p1@pipeok.example", "sent", "pipeok"),
            ("p2@pipefail.example", "bounced", "pipefail"),
            ("p3@pipetemp.example", "deferred", "pipetemp"),
            (f"topipe@{local}", "sent", "local"), (f"tofile@{local}", "sent", "local"),
            ("x1@disc.example", "sent", "discard"),
            ("m1@pipeok.example", "sent", "pipeok"), ("m2@disc.example", "sent", "discard"),
            ("m3@err.example", "bounced", "error"),
            ("m4@pipefail.example", "bounced", "pipefail"),
            # qmgr's own: no agent, so no transport, next hop or relay.
            (f"double-bounce@{local}", "sent", ""), ("d2@slow.example", "deferred", "")}
    assert got == want, f"missing: {want - got}; unexpected: {got - want}"
    own = {str(e["recipient"]): e for e in events if e["transport"] == ""}
    assert set(own) == {"d2@slow.example", f"double-bounce@{local}"}
    for e in events:
        assert e["queue_id"] == qids.get(str(e["recipient"]), e["queue_id"])
        assert e["attempt"] == 1, e
    for e in own.values():
        assert (e["relay"], e["nexthop"]) == ("", ""), e
    assert own["d2@slow.example"]["reply"] == "mail transport unavailable"
    assert own[f"double-bounce@{local}"]["reply"] == (
        "undeliverable postmaster notification discarded")
    assert not pf.maillog.lines("postfix/qmgr", contains="service failure")
    # The deferred three once more: each one's second record is its attempt 2, whoever
    # writes it (a deferred transport goes to smtp on a flush, or qmgr defers it again).
    pf.flush()
    pf.wait_until(lambda: len(status_lines(pf, ALL_PROGRAMS)) >= 23
                  and len({e["key"] for e in read_events(path)}) >= 23, 60,
                  "the deferred three tried again and their events")
    retried = [e for e in _events_equal_the_maillog(pf, path) if e["status"] == "deferred"]
    print("attempts:", sorted((e["recipient"], e["attempt"], e["transport"]) for e in retried))
    again = {(e["recipient"], e["attempt"]) for e in retried}
    assert again == {(r, n) for r in ("d1@slow.example", "d2@slow.example",
                                      "p3@pipetemp.example") for n in (1, 2)}, again
