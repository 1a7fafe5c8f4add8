"""The qmgr's trigger socket under a slow client.

Postfix's trigger clients (postqueue, postkick, postsuper) write the request and then a
NUL in a second write. A server that reads once and closes at once can close between
the two, and the client then dies of SIGPIPE; pyqmgr waits briefly for that NUL.
"""

from __future__ import annotations

import os
import socket
import time


def test_request_and_nul_in_two_writes_apart(postfix, sink):
    srv = sink(replies={"*": "450 4.2.0 later"})
    pf = postfix(qmgr="pyqmgr", transports={"sink.example": f"smtp:[127.0.0.1]:{srv.port}"},
                 main_cf={"queue_run_delay": "300s", "minimal_backoff_time": "300s",
                          "maximal_backoff_time": "600s"})
    (qid,) = pf.smtp_send([("s@sink.example", ["x@sink.example"])])
    pf.wait_until(lambda: pf.queue_path("deferred", qid) is not None, 30,
                  f"{qid} deferred")
    srv.set_replies({})
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(os.path.join(pf.queue_dir, "public", "qmgr"))
        s.sendall(b"FAD")  # what postqueue -f sends: flush, scan deferred, all
        time.sleep(0.3)  # a client preempted between its two writes
        s.sendall(b"\0")  # BrokenPipeError here when the server closed after "FAD"
        assert s.recv(16) == b"", "the qmgr closes the connection after the request"
    pf.maillog.wait_for(lambda ln: ln.queue_id == qid and ln.text.endswith("removed"),
                        timeout=30, what="delivery after the flush trigger")
