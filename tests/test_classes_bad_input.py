"""Bad input where message classes look early (issue #34), on real Postfix.

With ``message_classes`` set, pyqmgr reads each new file in incoming/ up to its
envelope as the kernel reports it, before the scan does, and reads its class tables
through ``postmap -s`` at start-up. A file that is cut short or is not a queue file
at all must not change what happens to it (stock's lines, corrupt/) nor to the mail
around it. (A table whose file is a FIFO is refused at start-up, by name, before
postmap could block on it: tests/test_root_files_real.py.)
"""

from __future__ import annotations

import json
import os

from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.sink import SinkServer
from tests.test_control import cli

CLASSES_CF = {"message_classes": "transactional bulk",
              "message_class_maps": "inline:{ shop.example=transactional }"}
#: Real mail of both classes sent after the bad files are dropped in.
REAL = ([("resets@shop.example", [f"reset{i}@dest.example"]) for i in range(4)]
        + [("news@letters.example", [f"n{i}@dest.example"]) for i in range(4)])


def _drop(pf: PostfixInstance, qid: str, data: bytes) -> None:
    """As cleanup leaves a finished file: the mail owner's, mode 0700 last."""
    path = os.path.join(pf.queue_dir, "incoming", qid)
    with open(path, "wb") as f:
        f.write(data)
    os.chown(path, *pf.mail_owner_ids())
    os.chmod(path, 0o700)


def _bad_files(real: bytes) -> dict[str, bytes]:
    """A real transactional message's file cut short in its content (its envelope
    reads whole: only the records after the content show the cut), cut in its
    envelope, and bytes that are no queue file at all."""
    return {"BBBBB1": real[:len(real) - 40],
            "BBBBB2": real[:120],
            "BBBBB3": b"\x00\xffnot a queue file\n" * 40}


def _watched(pf: PostfixInstance) -> bool:
    out = cli(pf, "status", "--json").stdout
    return bool(out) and json.loads(out)["classes"]["incoming"] == "watched"


def _status(pf: PostfixInstance) -> dict:
    return json.loads(cli(pf, "status", "--json").stdout)["classes"]


def _run(postfix_instance, sink, qmgr: str) -> tuple[dict[str, list[str]], dict]:
    """The qmgr's lines naming each bad file; pyqmgr's class status (else {})."""
    srv: SinkServer = sink()
    pf: PostfixInstance = postfix_instance(
        qmgr=qmgr, transports={"dest.example": f"smtp:[127.0.0.1]:{srv.port}"},
        pyqmgr_cf=CLASSES_CF if qmgr == "pyqmgr" else None)
    (template,) = pf.preload([("resets@shop.example", ["template@dest.example"])])
    with open(os.path.join(pf.queue_dir, "incoming", template), "rb") as f:
        bad = _bad_files(f.read())
    pf.release_preload()
    pf.wait_until(lambda: srv.delivered_count() >= 1, 20, "the template message delivered")
    if qmgr == "pyqmgr":
        pf.wait_until(lambda: _watched(pf), 20, "incoming/ watched")
    before = _status(pf) if qmgr == "pyqmgr" else {}
    for qid, data in bad.items():
        _drop(pf, qid, data)
    if qmgr == "pyqmgr":
        # No trigger yet, so no scan: the look into incoming/ reads the three files
        # as the kernel reports them and feeds none (each reads as damaged, so as
        # the lowest class's; BBBBB1's envelope alone would say transactional).
        pf.wait_until(lambda: _status(pf)["files_read"] >= before["files_read"] + 3, 10,
                      "the bad files read by the look into incoming/")
        assert _status(pf)["fed_past_the_scan"] == before["fed_past_the_scan"]
    pf.smtp_send(REAL)  # cleanup's triggers bring the scan
    for qid in bad:
        pf.maillog.wait_for(
            lambda ln, q=qid: ln.text == f'warning: saving corrupt file "{q}" from queue '
            '"active" to queue "corrupt"', timeout=20, what=f"{qid} saved as corrupt")
    pf.wait_until(lambda: srv.delivered_count() >= 1 + len(REAL), 20,
                  "every real message delivered")
    got = sorted(r for m in srv.messages() for r in m.recipients)
    assert got == sorted(["template@dest.example", *(r for _, rs in REAL for r in rs)])
    assert sorted(pf.queue_files("corrupt")) == sorted(bad)
    pf.wait_until(lambda: not pf.queue_files("incoming") and not pf.queue_files("active"),
                  10, "incoming/ and active/ empty")
    lines: dict[str, list[str]] = {q: [] for q in bad}
    for ln in pf.maillog.lines("postfix/qmgr"):
        for q in bad:
            if q in ln.text:
                lines[q].append(ln.text)
    return lines, (_status(pf) if qmgr == "pyqmgr" else {})


def test_cut_short_and_garbage_files_in_incoming_with_classes_on(postfix_instance, sink):
    """The look into incoming/ reads the bad files as they appear and feeds none
    past the scan (checked in _run): the qmgr says of each exactly what stock says,
    each goes to corrupt/, and every real message of both classes is delivered."""
    stock, _ = _run(postfix_instance, sink, "stock")
    ours, status = _run(postfix_instance, sink, "pyqmgr")
    print("\nstock:", json.dumps(stock, indent=1), "\nclasses:", status)
    for qid in stock:
        assert stock[qid], f"stock said nothing of {qid}"
        assert ours[qid] == stock[qid], qid
    assert status["events_lost"] == 0, "the files came as events, not a listing"
