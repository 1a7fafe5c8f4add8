"""REQUIRETLS reaches the delivery agent: the option bits under pyqmgr are stock's.

Postfix 3.10 sets ``SOPT_REQUIRETLS_HEADER`` (0x10) for a ``TLS-Required: no`` header
and 3.11 also ``SOPT_REQUIRETLS_ESMTP`` (0x20) for ``sendmail -O REQUIRETLS=yes``; qmgr
passes them to smtp(8) in the ``sendopts`` attribute, masked by ``SOPT_FLAG_ALL``. A
qmgr that dropped them would silently send mail that asked for TLS in the clear.

Read from the request itself: a recording agent in master.cf (run by the release's own
master, in the release's Debian root) writes the attributes it was sent, then exits
without a reply, which both queue managers treat as a crash and defer. The same
messages go through stock qmgr and pyqmgr on fresh instances of each release.
"""

from __future__ import annotations

import json
import os
import smtplib
import time

import pytest

from pyqmgr.postfix.deliver_request import DEL_REQ_FLAG_CONN_LOAD, DEL_REQ_FLAG_CONN_STORE
from pyqmgr.testbed.instance import PostfixInstance

#: Reads the request's first attribute list (name NUL value NUL ..., ended by NUL) and
#: writes it as JSON next to the instance, named after the queue id.
RECORDER = """#!/usr/bin/python3
import json, os, socket, sys
listen = socket.socket(fileno=6)
conn, _ = listen.accept()
conn.sendall(b"protocol\\0delivery_request_protocol\\0\\0")
data = b""
attrs = {}
while True:
    chunk = conn.recv(65536)
    if not chunk:
        break
    data += chunk
    words = data.split(b"\\0")
    attrs, i = {}, 0
    while i + 1 < len(words) and words[i]:
        attrs[words[i].decode()] = words[i + 1].decode()
        i += 2
    if i < len(words) - 1 and not words[i]:
        break
# master(8) puts its own options first: the master.cf arguments come last.
path = os.path.join(sys.argv[-1], "request-%s.json" % attrs.get("queue_id", "unknown"))
with open(path + ".tmp", "w") as f:
    json.dump(attrs, f)
os.rename(path + ".tmp", path)
os._exit(0)
"""

HEADER_MESSAGE = ("From: s@test.example\r\nTo: r@rec.example\r\nSubject: plain ok\r\n"
                  "TLS-Required: no\r\n\r\nThis may go in the clear.\r\n")


def _requests(release: str, qmgr: str, postfix_instance) -> dict[str, dict[str, str]]:
    """The recorded request of each submission: by SMTP with the header, and on 3.11
    with ``sendmail -O REQUIRETLS=yes``."""
    pf: PostfixInstance = postfix_instance(
        qmgr=qmgr, release=release, start=False, transports={"rec.example": "rec:"},
        master_cf_extra=["rec unix - n n - - recagent RECORD_DIR"],
        # An agent that exits after each request would be throttled for a minute.
        main_cf={"queue_run_delay": "300s", "minimal_backoff_time": "300s",
                 "service_throttle_time": "1s"})
    record_dir = os.path.join(pf.root, "requests")
    os.makedirs(record_dir)
    with open(os.path.join(pf.config_dir, "master.cf")) as f:
        text = f.read().replace("RECORD_DIR", record_dir)
    with open(os.path.join(pf.config_dir, "master.cf"), "w") as f:
        f.write(text)
    agent = os.path.join(pf.daemon_dir, "recagent")
    with open(agent, "w") as f:
        f.write(RECORDER)
    os.chmod(agent, 0o755)
    pf.start()
    sent: dict[str, str] = {}
    with smtplib.SMTP("127.0.0.1", pf.smtpd_port, timeout=30) as smtp:
        smtp.sendmail("s@test.example", ["r@rec.example"], HEADER_MESSAGE)
    sent["header"] = ""
    if release == "3.11":
        pf.sendmail("s@test.example", ["r@rec.example"], subject="requiretls",
                    extra_args=["-O", "REQUIRETLS=yes"])
        sent["esmtp"] = ""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(os.listdir(record_dir)) < len(sent):
        time.sleep(0.1)
    files = sorted(n for n in os.listdir(record_dir) if n.endswith(".json"))
    assert len(files) == len(sent), (
        f"{qmgr} on {release}: {len(files)} of {len(sent)} requests reached the agent in "
        f"60 s; last maillog lines:\n{pf.maillog.tail(15)}")
    recorded = []
    for name in files:
        with open(os.path.join(record_dir, name)) as f:
            recorded.append(json.load(f))
    # The two submissions are told apart by their bits, not by order.
    out = {}
    for request in recorded:
        bits = int(request.get("sendopts", request.get("smtputf8", "-1")))
        out["esmtp" if bits & 0x20 else "header"] = request
    return out


@pytest.mark.parametrize("release", ["3.10", "3.11"])
def test_requiretls_bits_reach_smtp_as_under_stock(release, postfix_instance):
    stock = _requests(release, "stock", postfix_instance)
    ours = _requests(release, "pyqmgr", postfix_instance)
    # 3.10: the header's bit; 3.11: the ESMTP option's bit too (its message has no
    # TLS-Required header).
    expected = {"header": 0x10} if release == "3.10" else {"header": 0x10, "esmtp": 0x20}
    assert set(stock) == set(expected) == set(ours), (stock, ours)
    for kind, bits in expected.items():
        assert "smtputf8" not in stock[kind], f"{release} speaks sendopts: {stock[kind]}"
        assert int(stock[kind]["sendopts"]) & 0x30 == bits, (kind, stock[kind])
        assert ours[kind].get("sendopts") == stock[kind]["sendopts"], (
            f"{release} {kind}: pyqmgr sent sendopts={ours[kind].get('sendopts')}, "
            f"stock {stock[kind]['sendopts']}")
        # The rest of the request's head agrees too, but for the per-message values and
        # the connection-cache flags (DEL_REQ_FLAG_CONN_LOAD/STORE), which follow
        # whether the other message was still waiting at that moment: timing, not policy.
        differ = {k for k in stock[kind] if ours[kind].get(k) != stock[kind][k]}
        cache = DEL_REQ_FLAG_CONN_LOAD | DEL_REQ_FLAG_CONN_STORE
        if int(ours[kind]["flags"]) & ~cache == int(stock[kind]["flags"]) & ~cache:
            differ.discard("flags")
        assert differ <= {"queue_id", "log_ident", "time", "offset", "size",
                          "log_client_port"}, differ
