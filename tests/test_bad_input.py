"""Bad input loses no mail: corrupt files, missing agents, an unreachable trivial-rewrite."""

from __future__ import annotations

import os
import time

import pytest

from pyqmgr.postfix.record import encode_record


def _drop_in_incoming(pf, qid: str, data: bytes) -> None:
    path = os.path.join(pf.queue_dir, "incoming", qid)
    with open(path, "wb") as f:
        f.write(data)
    os.chown(path, *pf.mail_owner_ids())
    os.chmod(path, 0o700)


def _truncated_file() -> bytes:
    size = b"%15d %15d %15d %15d %15d %15d" % (10, 200, 1, 0, 10, 0)
    whole = (encode_record("C", size) + encode_record("T", b"1795344681 411377")
             + encode_record("S", b"a@discard.example") + encode_record("R", b"b@discard.example"))
    return whole[:-5]


def _good_records(**drop: bool) -> bytes:
    size = b"%15d %15d %15d %15d %15d %15d" % (7, 0, 1, 0, 7, 0)
    recs = [("C", size), ("T", b"1795344681 411377"), ("A", b"create_time=1795344681"),
            ("S", b"a@discard.example"), ("O", b"b@discard.example"),
            ("R", b"b@discard.example"), ("M", b""), ("N", b"hello")]
    recs = [r for r in recs if not drop.get(r[0])]
    head = b"".join(encode_record(t, p) for t, p in recs[:-1])
    data_offset = len(head) + (0 if drop.get("C") else 0)
    if not drop.get("C"):
        size = b"%15d %15d %15d %15d %15d %15d" % (7, data_offset, 1, 0, 7, 0)
        head = encode_record("C", size) + head[len(encode_record("C", size)):]
    return head + encode_record("N", b"hello") + encode_record("X", b"") + encode_record("E", b"")


MALFORMED = {
    "AAAAA1": _truncated_file(),
    "AAAAA2": b"garbage text that is not a queue file\n" * 5,
    "AAAAA3": encode_record("C", b"1 2") + encode_record("E", b""),
    "AAAAA4": _good_records(T=True),
    "AAAAA5": _good_records(S=True),
    "AAAAA6": _good_records().replace(b"O\x11b@discard", b"Z\x11b@discard"),
    "AAAAA7": _good_records(E=True)[:-2],
    "AAAAA8": encode_record("C", b"%15d %15d %15d %15d %15d %15d" % (5, 9, 1, 64, 5, 0)),
}


def _corrupt_run(postfix, qmgr: str, pyqmgr_cf: dict[str, str] | None = None
                 ) -> dict[str, list[str]]:
    pf = postfix(qmgr=qmgr, transports={"discard.example": "discard:"}, pyqmgr_cf=pyqmgr_cf)
    for qid, data in MALFORMED.items():
        _drop_in_incoming(pf, qid, data)
    pf.postqueue("-f")
    for qid in MALFORMED:
        pf.maillog.wait_for(
            lambda ln, q=qid: ln.text == f'warning: saving corrupt file "{q}" from queue '
            '"active" to queue "corrupt"', timeout=20, what=f"{qid} saved as corrupt")
    assert sorted(pf.queue_files("corrupt")) == sorted(MALFORMED)
    # The instance keeps working after the bad files.
    (qid,) = pf.smtp_send([("s@discard.example", ["r@discard.example"])])
    pf.maillog.wait_for(lambda ln: ln.queue_id == qid and ln.text.endswith(": removed"),
                        timeout=20, what="a good message after the bad ones")
    lines: dict[str, list[str]] = {q: [] for q in MALFORMED}
    for ln in pf.maillog.lines("postfix/qmgr"):
        for q in MALFORMED:
            if q in ln.text:
                lines[q].append(ln.text)
    return lines


def test_corrupt_files_get_stock_warnings_and_go_to_corrupt(postfix):
    """Side by side: every malformation gives exactly stock's lines, file kept."""
    stock = _corrupt_run(postfix, "stock")
    ours = _corrupt_run(postfix, "pyqmgr")
    for qid in MALFORMED:
        assert ours[qid] == stock[qid], qid
    # "Unexpected record type" carries no queue id; compare those too.
    assert all(stock[q] for q in MALFORMED)


def test_corrupt_files_with_classes_on(postfix):
    """With message classes (incoming/ watched, each new file's envelope and headers
    read as it appears) the same files give the same lines as stock's, and go to
    corrupt/; the good message after them is delivered (issue #34)."""
    stock = _corrupt_run(postfix, "stock")
    ours = _corrupt_run(postfix, "pyqmgr", {
        "message_classes": "transactional bulk",
        "message_class_maps": "inline:{ discard.example=transactional }",
        "tenant_key": "header:X-Tenant"})
    for qid in MALFORMED:
        assert ours[qid] == stock[qid], qid


@pytest.mark.parametrize("qmgr", ["stock", "pyqmgr"])
def test_missing_agent_defers_through_retry(postfix, qmgr):
    pf = postfix(qmgr=qmgr, transports={"nosuch.example": "nosuch:"})
    (qid,) = pf.smtp_send([("s@test.example", ["u@nosuch.example"])])
    pf.maillog.wait_for(
        lambda ln: ln.text == "warning: connect to transport private/nosuch: "
        "No such file or directory", timeout=20, what="the connect warning")
    line = pf.maillog.wait_for(
        lambda ln: ln.queue_id == qid and ln.program == "postfix/error"
        and ln.status == "deferred", timeout=20, what="the retry deferral")[0]
    assert line.text.endswith("dsn=4.3.0, status=deferred (mail transport unavailable)")
    deadline = time.monotonic() + 10
    while pf.queue_path("deferred", qid) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pf.queue_path("deferred", qid) is not None


def test_unreachable_rewrite_defers_and_loses_nothing(postfix):
    pf = postfix(qmgr="pyqmgr", transports={"discard.example": "discard:"},
                 main_cf={"qmgr_ipc_timeout": "3s"})
    qids = pf.preload([("s@discard.example", [f"r{i}@discard.example"]) for i in range(5)])
    rewrite_line = pf.postconf("-M", "rewrite/unix").strip()
    pf.postconf("-M#", "rewrite/unix")
    pf.reload()
    pf.release_preload()
    for qid in qids:
        pf.maillog.wait_for(
            lambda ln, q=qid: ln.text == f"warning: {q}: address resolver failure -- "
            "deferring message", timeout=60, what=f"{qid} deferred for resolver failure")
    time.sleep(0.5)
    assert sorted(pf.queue_files("deferred")) == sorted(qids)
    pf.postconf("-Me", f"rewrite/unix={rewrite_line}")
    pf.reload()
    pf.postqueue("-f")
    for qid in qids:
        pf.maillog.wait_for(lambda ln, q=qid: ln.queue_id == q and ln.text.endswith("removed"),
                            timeout=60, what=f"{qid} delivered once trivial-rewrite is back")
    assert pf.queue_empty()
