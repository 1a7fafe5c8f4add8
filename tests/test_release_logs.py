"""Maillogs written by each Postfix release read the same in `replay` and compare.

3.11 inserts ``tls=...`` between ``delays=`` and ``dsn=`` in delivery lines and logs
the bounce daemon's ``sender non-delivery notification`` before cleanup's lines of the
notice. The lines here are written by each release's own daemons (3.11 from Debian's
forky, in its root), not typed in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pyqmgr.compare.figures import parse_delivery
from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.sink import SinkServer

CLI = os.path.join(os.path.dirname(sys.executable), "pyqmgr")
#: What a delivery line that replay could not read is counted as (derive.py).
UNREAD_STATUS = "address verification and other statuses"


def _write_log(release: str | None, postfix_instance, sink) -> PostfixInstance:
    srv: SinkServer = sink(replies={"bad@sink.example": "550 5.1.1 no such user"})
    pf: PostfixInstance = postfix_instance(
        qmgr="stock", release=release,
        transports={"sink.example": f"smtp:[127.0.0.1]:{srv.port}"},
        # A TLS policy, so that 3.11 has a feature status to log (the sink offers no
        # STARTTLS: "may:none").
        main_cf={"smtp_tls_security_level": "may"})
    qids = pf.smtp_send([("s@test.example", [f"{u}@sink.example"])
                         for u in ("a", "b", "c", "d", "e", "bad")])
    pf.wait_removed(qids, 30)
    pf.maillog.wait_for(lambda ln: ln.program == "postfix/smtp" and "relay=none" in ln.text,
                        timeout=30, what="the notice's own delivery line")
    return pf


@pytest.mark.parametrize("release", [None, "3.11"], ids=["machine", "3.11"])
def test_replay_and_compare_read_each_release_s_lines(release, postfix_instance, sink):
    pf = _write_log(release, postfix_instance, sink)
    with open(pf.maillog_path) as f:
        raw = f.read().splitlines()
    deliveries = [d for d in map(parse_delivery, raw) if d is not None]
    to_sink = [d for d in deliveries if d.to.endswith("@sink.example")]
    assert sorted(d.status for d in to_sink) == ["bounced"] + ["sent"] * 5, to_sink
    if release == "3.11":
        assert all(", tls=may:none, dsn=" in ln for ln in raw if "to=<" in ln
                   and "relay=127.0.0.1" in ln), "3.11 logs the TLS feature status"
        notice = next(i for i, ln in enumerate(raw) if "sender non-delivery notification" in ln)
        new_qid = raw[notice].rsplit(" ", 1)[1]
        cleanup = next(i for i, ln in enumerate(raw) if "cleanup[" in ln and new_qid in ln)
        assert notice < cleanup, "3.11 names the notice before cleanup's line"

    proc = subprocess.run([CLI, "replay", pf.maillog_path, "--json", "--runs", "1",
                           "--config-dir", pf.config_dir], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [inst] = json.loads(proc.stdout)["instances"]
    dest = inst["figures"]["log"]["sink.example"]
    assert (dest["sent"], dest["bounced"], dest["deferred"]) == (5, 1, 0), dest
    unread = json.dumps(inst["unused"])
    assert UNREAD_STATUS not in unread, f"a delivery line went unread: {unread}"
