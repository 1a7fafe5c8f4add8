"""Routing overrides carried by the queue file, side by side with stock qmgr."""

from __future__ import annotations

import os

from compat.harness import normalize


def _redirect_run(postfix, qmgr: str) -> list[str]:
    pf = postfix(qmgr=qmgr, start=False, transports={"discard.example": "discard:"})
    checks = os.path.join(pf.config_dir, "header_checks")
    with open(checks, "w") as f:
        f.write("/^Subject: redirectme/ REDIRECT redirected@discard.example\n")
    pf.set_main(header_checks=f"regexp:{checks}")
    pf.start()
    (qid,) = pf.smtp_send([("s@discard.example", ["a@discard.example", "b@discard.example"])],
                          subject="redirectme")
    pf.maillog.wait_for(lambda ln: ln.queue_id == qid and ln.text.endswith(": removed"),
                        timeout=20, what="the redirected message removed")
    pf.wait_queue_empty(10)
    ids: dict[str, str] = {}
    return [normalize(ln, ids) for ln in pf.maillog.lines()
            if ln.queue_id == qid and ln.program in ("postfix/qmgr", "postfix/discard")]


def test_redirect_delivers_once_to_the_redirect_address(postfix):
    stock = _redirect_run(postfix, "stock")
    ours = _redirect_run(postfix, "pyqmgr")
    assert ours == stock
    delivered = [line for line in ours if "status=sent" in line]
    assert len(delivered) == 1
    assert "to=<redirected@discard.example>, orig_to=<a@discard.example>" in delivered[0]


def _verp_run(postfix, qmgr: str, sink) -> list[str]:
    srv = sink()
    pf = postfix(qmgr=qmgr, transports={"sink.example": f"smtp:[127.0.0.1]:{srv.port}"})
    pf.sendmail("list@test.example", ["a@sink.example", "b@sink.example"], extra_args=["-XV"])
    pf.maillog.wait_for(r"postfix/qmgr\[\d+\]: \w+: removed", timeout=20, what="removal")
    return sorted(srv.received_senders)


def test_verp_rewrites_the_sender_per_recipient(postfix, sink):
    stock = _verp_run(postfix, "stock", sink)
    ours = _verp_run(postfix, "pyqmgr", sink)
    assert ours == stock == ["list+a=sink.example@test.example",
                             "list+b=sink.example@test.example"]
