"""pyqmgr as the qmgr of real Postfix: mail to discard, smtp (sink), local and error."""

from __future__ import annotations

import os
import random
import re
from collections import Counter

import pytest

from pyqmgr.testbed.instance import LOCAL_DOMAIN, LOCAL_USER, wait_until

ACTIVE_RE = re.compile(r"^([0-9A-F]+): from=<[^>]*>, size=\d+, nrcpt=(\d+) \(queue active\)$")
REMOVED_RE = re.compile(r"^([0-9A-F]+): removed$")


@pytest.mark.parametrize("qmgr", ["stock", "pyqmgr"])
def test_200_mixed_messages_every_recipient_once(postfix, sink, qmgr):
    srv = sink()
    pf = postfix(
        qmgr=qmgr,
        transports={"discard.example": "discard:", "err.example": "error:5.1.1 no such user",
                    "sink.example": f"smtp:[127.0.0.1]:{srv.port}"},
        main_cf={"recipient_delimiter": "+"},
    )
    rng = random.Random(2)
    messages = []
    expected: dict[str, tuple[str, str]] = {}  # recipient -> (agent program, status)
    for i in range(200):
        rcpts = []
        for j in range(rng.randint(1, 50)):
            kind = rng.random()
            if kind < 0.5:
                addr = f"m{i}r{j}@discard.example"
                expected[addr] = ("postfix/discard", "sent")
            else:
                addr = f"m{i}r{j}@sink.example"
                expected[addr] = ("postfix/smtp", "sent")
            rcpts.append(addr)
        if i % 10 == 0:
            addr = f"{LOCAL_USER}+m{i}@{LOCAL_DOMAIN}"
            expected[addr] = ("postfix/local", "sent")
            rcpts.append(addr)
        if i % 7 == 0:
            addr = f"m{i}@err.example"
            expected[addr] = ("postfix/error", "bounced")
            rcpts.append(addr)
        messages.append(("sender@discard.example", rcpts))
    qids = pf.smtp_send(messages)
    bounces = sum(1 for i in range(200) if i % 7 == 0)

    pf.maillog.wait_for(lambda ln: ln.program == "postfix/qmgr" and ln.text.endswith(": removed"),
                        timeout=120, count=200 + bounces, what="every message removed")
    pf.wait_queue_empty(30)

    # Every recipient got exactly one status line, from its own agent, with its status.
    status_lines = Counter()
    for ln in pf.maillog.lines():
        if ln.to and ln.status and ln.queue_id in set(qids):
            status_lines[(ln.to, ln.program, ln.status)] += 1
    def about(needle: str) -> str:
        return "\n".join(ln.raw for ln in pf.maillog.lines() if needle in ln.raw)

    for addr, (program, status) in expected.items():
        assert status_lines[(addr, program, status)] == 1, about(addr)
    assert sum(status_lines.values()) == len(expected), status_lines.most_common(3)
    sink_rcpts = {a for a, (p, _) in expected.items() if p == "postfix/smtp"}
    assert set(srv.stats.delivered) == sink_rcpts
    assert all(n == 1 for n in srv.stats.delivered.values())

    # One "(queue active)" and one "removed" per message (bounces included), stock format.
    qmgr_lines = pf.maillog.lines("postfix/qmgr")
    assert [ln.raw for ln in qmgr_lines if ln.severity != "info"] == []
    active = Counter(m.group(1) for ln in qmgr_lines if (m := ACTIVE_RE.match(ln.text)))
    removed = Counter(m.group(1) for ln in qmgr_lines if (m := REMOVED_RE.match(ln.text)))
    # Counted per line, not per id: short queue ids come round again (the same inode
    # and microsecond field), and one full run saw two of these messages share one.
    assert set(qids) <= set(active)
    extra = set(active) - set(qids)
    assert sum(active.values()) == 200 + bounces, "\n".join(about(q) for q in extra)
    assert active == removed, "one removed line per (queue active) line"
    sent = Counter(qids)
    assert all(active[q] == sent[q] for q in sent), "each message activated once"
    nrcpt = Counter((m.group(1), int(m.group(2)))
                    for ln in qmgr_lines if (m := ACTIVE_RE.match(ln.text)))
    wanted = Counter((qid, len(rcpts)) for qid, (_, rcpts) in zip(qids, messages, strict=True))
    assert not wanted - nrcpt, wanted - nrcpt


def test_chrooted_pyqmgr_delivers_and_bounces(postfix):
    """qmgr with chroot=y in master.cf: everything after start-up is queue-relative."""
    pf = postfix(qmgr="pyqmgr", start=False,
                 transports={"discard.example": "discard:", "err.example": "error:5.1.1 nope"})
    pf.postconf("-F", "qmgr/unix/chroot=y")
    pf.start()
    pid = pf.qmgr_pid()
    wait_until(lambda: os.readlink(f"/proc/{pid}/root") == pf.queue_dir, 10,
               "qmgr to enter its chroot jail")
    qids = pf.smtp_send([("s@discard.example", ["a@discard.example", "b@err.example"])])
    pf.maillog.wait_for(lambda ln: ln.queue_id == qids[0] and ln.text.endswith("removed"),
                        timeout=20, what="the chrooted qmgr finishing the message")
    pf.maillog.wait_for(r"sender non-delivery notification", timeout=20, what="the bounce")
    pf.wait_queue_empty(20)
    assert [ln for ln in pf.maillog.lines("postfix/qmgr") if ln.severity != "info"] == []


@pytest.mark.parametrize("qmgr", ["stock", "pyqmgr"])
def test_sender_is_logged_in_external_form(postfix, qmgr):
    pf = postfix(qmgr=qmgr, transports={"discard.example": "discard:"})
    (qid,) = pf.smtp_send([('"odd sender"@discard.example', ["r@discard.example"])])
    line = pf.maillog.wait_for(lambda ln: ln.queue_id == qid and "queue active" in ln.text,
                               timeout=20, what="the queue active line")[0]
    assert line.text.startswith(f'{qid}: from=<"odd sender"@discard.example>, size=')


def _clog_run(postfix, sink, qmgr: str) -> list[str]:
    srv = sink(latency=1.0)
    pf = postfix(qmgr=qmgr, transports={"sink.example": f"smtp:[127.0.0.1]:{srv.port}"},
                 main_cf={"qmgr_message_active_limit": "10"})
    pf.preload([("s@sink.example", [f"r{i}@sink.example"]) for i in range(5)])
    pf.release_preload()
    pf.maillog.wait_for("to turn off these warnings", timeout=20, what="the clog warning")
    srv.wait_delivered(5, 30)
    return [ln.text.replace(str(srv.port), "PORT") for ln in pf.maillog.lines("postfix/qmgr")
            if ln.severity == "warning"]


def test_clog_warning_matches_stock(postfix, sink):
    stock = _clog_run(postfix, sink, "stock")
    ours = _clog_run(postfix, sink, "pyqmgr")
    assert ours == stock
    assert ours[0] == ("warning: mail for [127.0.0.1]:PORT is using up 3 of 3 active queue "
                       "entries")


def test_request_larger_than_the_socket_buffer_is_delivered(postfix):
    # One delivery request of about 400 kB: more than a unix socket holds, so pyqmgr
    # writes it in several goes, with the agent's reply unread until the last byte is
    # out. Every recipient must get discard's status line, in one request.
    pf = postfix(qmgr="pyqmgr", transports={"discard.example": "discard:"},
                 main_cf={"discard_destination_recipient_limit": "5000"})
    rcpts = [f"{'y' * 180}{i:04d}@discard.example" for i in range(1000)]
    (qid,) = pf.smtp_send([("s@discard.example", rcpts)])
    pf.maillog.wait_for(lambda ln: ln.queue_id == qid and ln.text.endswith("removed"),
                        timeout=20, what="the big message removed")
    sent = pf.maillog.lines("postfix/discard", queue_id=qid, contains="status=sent")
    assert sorted(re.search(r"to=<([^>]+)>", ln.text).group(1) for ln in sent) == rcpts
    # One request: every status line came from the same discard process.
    assert len({ln.pid for ln in sent}) == 1
    assert [ln for ln in pf.maillog.lines("postfix/qmgr") if ln.severity != "info"] == []
