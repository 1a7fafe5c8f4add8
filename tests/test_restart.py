"""`postfix reload` and `kill -9` of the qmgr while 500 messages flow: no loss, no doubles."""

from __future__ import annotations

import os
import signal
import time

import pytest


def _wait_sink(srv, count: int, timeout: float) -> None:
    srv.wait_delivered(count, timeout)


@pytest.mark.parametrize("qmgr", ["stock", "pyqmgr"])
def test_reload_and_kill_mid_flow_lose_and_double_nothing(postfix, sink, qmgr):
    srv = sink(latency=0.04)
    pf = postfix(qmgr=qmgr, transports={"sink.example": f"smtp:[127.0.0.1]:{srv.port}"})
    rcpts = [f"r{i}@sink.example" for i in range(500)]
    qids = pf.preload([("s@sink.example", [r]) for r in rcpts])
    pf.release_preload()

    _wait_sink(srv, 120, 60)
    first = pf.qmgr_pid()
    pf.reload()
    _wait_sink(srv, 300, 60)
    second = pf.qmgr_pid()
    assert second != first, "reload restarts the qmgr (EOF on the status channel)"
    os.kill(second, signal.SIGKILL)
    pf.maillog.wait_for(lambda ln: ln.program == "postfix/master"
                        and f"pid {second} killed by signal 9" in ln.text, timeout=20,
                        what="master noticing the kill")

    # Files still locked by surviving agents are pushed 60 s ahead ("skipped, still
    # being delivered"); a flush ignores time stamps, so keep flushing until done.
    deadline = time.monotonic() + 120
    while not pf.queue_empty():
        assert time.monotonic() < deadline, (
            f"queue not empty: {pf.queue_files('incoming')[:5]} {pf.queue_files('active')[:5]}"
            f" {pf.queue_files('deferred')[:5]}")
        pf.postqueue("-f")
        time.sleep(1)

    assert set(srv.stats.delivered) == set(rcpts), "every recipient delivered"
    doubles = {r: n for r, n in srv.stats.delivered.items() if n != 1}
    assert doubles == {}, "no recipient delivered twice"
    # Nothing stranded anywhere. (A "removed" line can be missing for a message whose
    # file was unlinked just before the kill -9: stock unlinks, then logs, too.)
    for queue in ("incoming", "active", "deferred", "hold", "corrupt"):
        assert pf.queue_files(queue) == [], queue
    assert len(qids) == 500
