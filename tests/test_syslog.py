"""With maillog_file empty, qmgr logs through syslog: same tag, facility and text as stock."""

from __future__ import annotations

import re
import time

from pyqmgr.testbed.instance import wait_until
from pyqmgr.testbed.syslog_capture import SyslogCapture

MAIL_INFO = 2 * 8 + 6  # facility mail (2), severity info (6)


def _run(postfix, qmgr: str) -> list[tuple[int, str]]:
    with SyslogCapture() as capture:
        pf = postfix(qmgr=qmgr, start=False, transports={"discard.example": "discard:"},
                     main_cf={"maillog_file": ""})
        pf.start(prefix=capture.start_prefix())
        pf.smtp_send([("s@discard.example", ["r@discard.example"])])
        wait_until(lambda: any(t.endswith(": removed") for _, t in
                               capture.lines("postfix/qmgr")), 20,
                   f"{qmgr} logging 'removed' through syslog")
        time.sleep(0.2)
        pf.stop()
        return [(pri, re.sub(r"^[0-9A-F]+: ", "QID: ", text))
                for pri, text in capture.lines("postfix/qmgr")]


def test_syslog_lines_match_stock(postfix):
    stock = _run(postfix, "stock")
    ours = _run(postfix, "pyqmgr")
    assert ours == stock
    assert (MAIL_INFO, "QID: removed") in ours
    assert any(pri == MAIL_INFO and text.endswith("nrcpt=1 (queue active)")
               for pri, text in ours)
