"""Parity scenarios for broken delivery agents: one that crashes mid-request, one that
never answers. Both are tiny programs in the instance's own daemon_directory, run by
master(8) like any agent."""

from __future__ import annotations

import os
import time

from compat.parity import Outcome
from tests.parity.common import log_lines, outcome, settle, wait_deferred, wait_log

# An agent that announces itself, reads the request, and exits without a reply; with
# "hang", keeps the connection open and never answers; with "noread", goes away half a
# second after its announcement without reading anything.
AGENT = """#!/usr/bin/python3
import os, socket, sys, time
listen = socket.socket(fileno=6)
conn, _ = listen.accept()
conn.sendall(b"protocol\\0delivery_request_protocol\\0\\0")
if sys.argv[-1] == "noread":
    time.sleep(0.5)
    os._exit(1)
conn.recv(65536)
if sys.argv[-1] == "hang":
    time.sleep(3600)
os._exit(1)
"""


def _install_agent(inst, name: str) -> None:
    path = os.path.join(inst.daemon_dir, name)
    with open(path, "w") as f:
        f.write(AGENT)
    os.chmod(path, 0o755)


def _agent_transport(name: str, mode: str = "", **main: str) -> dict[str, object]:
    """side_by_side settings: ``<name>.example`` goes to the fake agent ``<name>agent``
    (installed by the scenario) as transport ``<name>``; retries are far off, so the
    first attempt is all a scenario sees."""
    return {
        "transports": {f"{name}.example": f"{name}:"},
        "master_cf_extra": [f"{name} unix - - n - - {name}agent {mode}".rstrip()],
        "main_cf": {"queue_run_delay": "300s", "minimal_backoff_time": "300s", **main},
    }


def test_agent_crash_defers_the_message(side_by_side):
    def scenario(inst, qmgr):
        _install_agent(inst, "crashagent")
        (qid,) = inst.smtp_send([("s@test.example", ["x@crash.example"])])
        wait_log(inst, lambda ln: ln.queue_id == qid and ln.status == "deferred"
                 or ln.program_name == "qmgr" and "malformed" in ln.text
                 or ln.program_name == "qmgr" and "crash" in ln.text, "the crash noticed")
        wait_deferred(inst, qid)
        settle(inst)
        return outcome(inst)

    side_by_side(scenario, name="agent crashes without a reply", item="4.4 dead transports",
                 description="An agent that reads the request and exits: qmgr (3.7.11) "
                             "defers the message and leaves the transport alive.",
                 **_agent_transport("crash"))


def test_request_that_cannot_be_written_defers_the_transport(side_by_side):
    def scenario(inst, qmgr):
        _install_agent(inst, "noreadagent")
        # One request of about 400 kB: more than a unix socket buffers, so the write
        # is still under way when the agent goes away, and fails.
        rcpts = [f"{'x' * 180}{i:04d}@noread.example" for i in range(1000)]
        (qid,) = inst.smtp_send([("s@test.example", rcpts)])
        wait_deferred(inst, qid)
        settle(inst)
        return outcome(inst, collapse=True)

    side_by_side(scenario, name="request write fails", item="4.4 dead transports",
                 description="An agent that goes away without reading a large request: "
                             "qmgr logs 'write to process', puts the entry back, throttles "
                             "the transport and defers its mail through retry.",
                 **_agent_transport("noread", "noread",
                                    noread_destination_recipient_limit="5000"))


def test_agent_without_reply_is_fatal_and_loses_nothing(side_by_side):
    def scenario(inst, qmgr):
        _install_agent(inst, "hangagent")
        (qid,) = inst.smtp_send([("s@test.example", ["x@hang.example"])])
        wait_log(inst, lambda ln: ln.program_name == "qmgr" and ln.severity == "fatal",
                 "the qmgr's fatal timeout", timeout=30)
        wait_log(inst, lambda ln: ln.program_name == "master" and "exit status 1" in ln.text,
                 "master seeing the qmgr exit", timeout=30)
        # The file is still in the queue (active/, recovered by the next qmgr).
        still_queued = any(inst.queue_path(q, qid) for q in ("active", "incoming"))
        inst.stop()
        qmgr_lines, _ = log_lines(inst, {})
        # Up to the first fatal: after it, master's restarts repeat the cycle on a timer.
        upto = next(i for i, x in enumerate(qmgr_lines) if "fatal:" in x)
        return Outcome(log=qmgr_lines[:upto + 1], extra={"still_queued": still_queued})

    side_by_side(scenario, name="agent never replies", item="4.4 dead transports",
                 description="An agent that takes the request and never answers: after "
                             "daemon_timeout the qmgr logs stock's fatal error and exits; "
                             "master starts a new one and the message is still queued.",
                 **_agent_transport("hang", "hang", daemon_timeout="5s"))


def test_unreachable_trivial_rewrite(side_by_side):
    def scenario(inst, qmgr):
        qids = inst.preload([("s@test.example", [f"r{i}@discard.example"]) for i in range(3)])
        line = inst.postconf("-M", "rewrite/unix").strip()
        inst.postconf("-M#", "rewrite/unix")
        inst.reload()
        inst.release_preload()
        time.sleep(8)  # > qmgr_ipc_timeout
        where = {qid: next((q for q in ("incoming", "active", "deferred")
                            if inst.queue_path(q, qid)), "gone") for qid in qids}
        inst.postconf("-Me", f"rewrite/unix={line}")
        inst.reload()
        inst.postqueue("-f")
        for qid in qids:
            wait_log(inst, lambda ln, q=qid: ln.queue_id == q and ln.text.endswith("removed"),
                     "delivery once trivial-rewrite is back", timeout=60)
        settle(inst)
        return outcome(inst, unordered=True, collapse=True,
                       while_down=sorted(where.values()))

    side_by_side(scenario, name="trivial-rewrite unreachable", item="4.6 faults",
                 description="With the rewrite service gone, stock's qmgr retries the "
                             "resolver forever (its whole loop stalls, the files wait in "
                             "active/); pyqmgr gives up after qmgr_ipc_timeout, logs "
                             "'address resolver failure -- deferring message' and defers "
                             "them. Either way every message is delivered once the "
                             "service is back.",
                 intended="pyqmgr does not stall the whole queue on one dead service; "
                          "it defers, which loses nothing",
                 transports={"discard.example": "discard:"},
                 main_cf={"qmgr_ipc_timeout": "3s"})
