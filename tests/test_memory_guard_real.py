"""The qmgr's resident size in ``pyqmgr status``, and memory_warning_limit (issue #30).

Against a real Postfix instance with pyqmgr as its qmgr: the status reply and its
text carry the resident size whether or not a limit is set; a limit below it makes a
warning in the maillog within seconds, once (the next comes an hour later); no
limit makes none; and a limit the daemon cannot read is fatal at start-up, naming
the parameter, with mail left in the queue as for every bad pyqmgr.cf setting.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.sink import SinkServer
from tests.test_control import cli, wait_for_channel

OVER = "is over memory_warning_limit"


def _memory(pf: PostfixInstance) -> dict[str, object]:
    proc = cli(pf, "status", "--json")
    assert proc.returncode == 0, proc.stderr
    memory = json.loads(proc.stdout)["memory"]
    assert isinstance(memory, dict)
    return memory


def test_status_shows_the_resident_size_and_no_limit_warns_nothing(postfix_instance):
    pf: PostfixInstance = postfix_instance(qmgr="pyqmgr")
    wait_for_channel(pf)
    memory = _memory(pf)
    rss, peak = memory["resident_bytes"], memory["peak_bytes"]
    assert isinstance(rss, int) and isinstance(peak, int)
    # A Python qmgr is tens of MiB; what the kernel says of it is the same order.
    pid = pf.qmgr_pid()
    with open(f"/proc/{pid}/status") as f:
        kernel = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))
    assert 8 << 20 < rss < 500 << 20 and peak >= rss * 0.5
    assert abs(rss - kernel) < kernel * 0.5, (rss, kernel)
    assert memory["warning_limit"] is None
    text = cli(pf, "status")
    assert text.returncode == 0 and "qmgr memory: " in text.stdout, text.stdout
    assert " resident, peak " in text.stdout and "memory_warning_limit" not in text.stdout
    time.sleep(2)
    assert not pf.maillog.lines("postfix/qmgr", contains=OVER)


def test_a_limit_below_the_resident_size_warns_once(postfix_instance, sink):
    srv: SinkServer = sink()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", pyqmgr_cf={"memory_warning_limit": "1048576"},
        transports={"d.example": f"smtp:[127.0.0.1]:{srv.port}"})
    warned = pf.maillog.wait_for(
        lambda ln: ln.program_name == "qmgr" and OVER in ln.text, timeout=20,
        what="the memory warning")[0]
    assert warned.severity == "warning", warned.text
    assert "(1.0 MiB)" in warned.text and "MiB is over" in warned.text
    wait_for_channel(pf)
    assert _memory(pf)["warning_limit"] == 1048576
    assert "warning over 1.0 MiB (memory_warning_limit)" in cli(pf, "status").stdout
    # Mail flows regardless, and the warning is not repeated every second.
    (qid,) = pf.smtp_send([("s@test.example", ["r@d.example"])])
    pf.wait_removed([qid], timeout=30)
    time.sleep(3)
    assert len(pf.maillog.lines("postfix/qmgr", contains=OVER)) == 1


@pytest.mark.parametrize("value", ["12k", "-1", "99999999999999999999", "lots"])
def test_a_bad_limit_is_fatal_and_mail_stays_queued(postfix_instance, sink, value):
    srv: SinkServer = sink()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", start=False, transports={"d.example": f"smtp:[127.0.0.1]:{srv.port}"})
    pf.write_pyqmgr_cf({"memory_warning_limit": value})
    pf.start()
    (qid,) = pf.smtp_send([("s@test.example", ["r@d.example"])])
    fatal = pf.maillog.wait_for(lambda ln: ln.program_name == "qmgr" and ln.severity == "fatal",
                                timeout=30, what="qmgr's fatal line")[0]
    cf = os.path.join(pf.config_dir, "pyqmgr.cf")
    assert fatal.text.startswith(f"fatal: {cf}: parameter memory_warning_limit"), fatal.text
    assert pf.queue_path("incoming", qid) or pf.queue_path("active", qid)
    assert srv.delivered_count() == 0
