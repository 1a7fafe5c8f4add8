"""The floor: a stand-in qmgr that does only what no Python qmgr can avoid.

The drain benchmark runs it beside stock qmgr and pyqmgr to answer one question with a
measurement: how close to stock can a qmgr written in Python get at all, here, before
any scheduling? Per message it does the unavoidable I/O and nothing else: rename the file
into active/, read it and walk its envelope records, resolve the recipient through
trivial-rewrite, hand the delivery to the agent, unlink the file and log stock's two
lines. It runs under pyqmgr's own start-up, master protocol, logging, asyncio loop and
protocol layer (``AgentCall``, ``ResolveClient``, ``encode_request``), i.e. the parts
that speak Postfix, with the scheduler and all bookkeeping left out: no concurrency
feedback (a fixed window), no jobs or peers, no defer/bounce log checks, no flow-control
tokens, no retries. A failed delivery is logged and its file left in active/, so the
drain's wait for an empty queue fails loudly.

It is a measuring instrument for the drain only, never something to run as a qmgr.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections import deque
from typing import cast

from pyqmgr.daemon.delivery import AgentCall
from pyqmgr.daemon.setup import DaemonSetup
from pyqmgr.postfix.config import QmgrConfig
from pyqmgr.postfix.deliver_request import (
    DEL_REQ_FLAG_DEFLT,
    DeliveryReply,
    RequestMessage,
    encode_request,
    msg_stats,
)
from pyqmgr.postfix.maillog_client import MailLog
from pyqmgr.postfix.master import FlowControl
from pyqmgr.postfix.resolve import ResolveClient, Resolved
from pyqmgr.scheduler.message import Recipient
from pyqmgr.testbed.instance import PostfixInstance

#: Files read per event-loop turn, so that replies are handled while reading goes on.
READ_CHUNK = 10
#: Deliveries queued ahead of the agents; reading pauses above this.
QUEUED_AHEAD = 100


class Envelope:
    __slots__ = ("size", "arrival", "sender", "attrs", "recipients")

    def __init__(self) -> None:
        self.size: list[int] = []
        self.arrival = (0, 0)
        self.sender = ""
        self.attrs: dict[bytes, bytes] = {}
        self.recipients: list[Recipient] = []


def read_envelope(data: bytes) -> Envelope:
    """Walk every envelope record once, skipping the content as stock does.

    No validation beyond what the walk needs: a truncated or odd file raises. It does
    not call ``record.rec_get_buf`` on purpose: the floor wants the least work per record.
    """
    env = Envelope()
    pos = 0
    end = len(data)
    while pos < end:
        start = pos
        rtype = data[pos]
        pos += 1
        length = 0
        shift = 0
        while True:
            byte = data[pos]
            pos += 1
            length |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
            shift += 7
        payload = data[pos:pos + length]
        pos += length
        if rtype == 0x52:  # R: recipient
            env.recipients.append(Recipient(start, payload.decode("utf-8", "surrogateescape")))
        elif rtype == 0x41:  # A: name=value
            name, _, value = payload.partition(b"=")
            env.attrs[name] = value
        elif rtype == 0x43:  # C: data size, data offset, ..., content length
            env.size = [int(f) for f in payload.split()]
        elif rtype == 0x54:  # T: arrival seconds and microseconds
            sec, usec = payload.split()[:2]
            env.arrival = (int(sec), int(usec))
        elif rtype == 0x53:  # S: sender
            env.sender = payload.decode("utf-8", "surrogateescape")
        elif rtype == 0x4D:  # M: content follows; the extracted segment is after it
            pos = env.size[1] + env.size[0]
        elif rtype == 0x45:  # E: end
            break
    return env


Delivery = tuple[RequestMessage, Resolved, Recipient]


class FloorQmgr:
    """Scan incoming/, read, resolve, deliver, unlink: one fixed window, nothing else."""

    def __init__(self, cfg: QmgrConfig, log: MailLog, flow: FlowControl | None,
                 setup: DaemonSetup) -> None:
        self.loop = asyncio.get_running_loop()
        self.log = log
        self.window = cfg.default_destination_concurrency_limit
        self.resolver = ResolveClient(f"private/{cfg.rewrite_service_name}",
                                      warn=log.warning)
        self.names: deque[str] = deque()
        self.rescan = False
        self.reading = False
        self.queued: deque[Delivery] = deque()
        self.in_flight = 0

    def start(self) -> None:
        self.trigger(b"")

    def trigger(self, data: bytes) -> None:
        if self.names:
            self.rescan = True  # list again once these are read; no name twice
        else:
            self.names.extend(os.listdir("incoming"))
        self._read_soon()

    def close(self) -> None:
        self.resolver.close()

    def _read_soon(self) -> None:
        if not self.reading and self.names and len(self.queued) < QUEUED_AHEAD:
            self.reading = True
            self.loop.call_soon(self._read)

    def _read(self) -> None:
        self.reading = False
        for _ in range(READ_CHUNK):
            if not self.names or len(self.queued) >= QUEUED_AHEAD:
                break
            self._load(self.names.popleft())
        if not self.names and self.rescan:
            self.rescan = False
            self.names.extend(os.listdir("incoming"))
        self._dispatch()
        self._read_soon()

    def _load(self, qid: str) -> None:
        try:
            os.rename(f"incoming/{qid}", f"active/{qid}")
        except FileNotFoundError:
            return
        with open(f"active/{qid}", "rb") as f:
            env = read_envelope(f.read())
        now = time.time()
        request = RequestMessage(
            queue_id=qid, data_offset=env.size[1], cont_length=env.size[4], encoding="",
            sendopts=0, sender=env.sender, envelope_id="", ret_flags=0,
            stats=msg_stats(env.arrival, (int(now), int(now % 1 * 1e6))),
            log_ident=qid,
            rewrite_context=env.attrs.get(b"rewrite_context", b"local").decode())
        self.log.info(f"{qid}: from=<{env.sender}>, size={env.size[4]}, "
                      f"nrcpt={len(env.recipients)} (queue active)")
        for rcpt in env.recipients:
            self.queued.append((request, self.resolver.resolve(env.sender, rcpt.address),
                                rcpt))

    def _dispatch(self) -> None:
        while self.queued and self.in_flight < self.window:
            delivery = self.queued.popleft()
            self.in_flight += 1
            call = AgentCall(self.loop, f"private/{delivery[1].transport}", 3600.0,
                             self._ready, self._reply, self._failed, self._failed)
            call.entry = delivery
            call.start()

    def _ready(self, call: AgentCall) -> bytes:
        request, resolved, rcpt = cast(Delivery, call.entry)
        return encode_request(DEL_REQ_FLAG_DEFLT, request, resolved.nexthop, 0,
                              request.sender, [rcpt])

    def _reply(self, call: AgentCall, reply: DeliveryReply | None, why: str | None) -> None:
        self.in_flight -= 1
        request = cast(Delivery, call.entry)[0]
        if reply is None or reply.status != 0:
            self.log.warning(f"{request.queue_id}: floor qmgr: delivery failed; file left")
        else:
            os.unlink(f"active/{request.queue_id}")
            self.log.info(f"{request.queue_id}: removed")
        self._dispatch()
        self._read_soon()

    def _failed(self, call: AgentCall, why: str) -> None:
        self.in_flight -= 1
        self.log.warning(f"floor qmgr: {call.path}: {why}; file left")


def main(argv: list[str]) -> int:
    from pyqmgr.daemon.startup import main as startup_main

    return startup_main(argv, daemon=FloorQmgr)


#: Where the launcher goes, under the instance's own daemon_directory. The file is named
#: ``qmgr`` so that log lines read ``postfix/qmgr[pid]`` as with the other two.
LAUNCHER = os.path.join("pyqmgr-floor", "qmgr")


def install(pf: PostfixInstance) -> None:
    """Point a test-bed instance's qmgr service at the floor (before it starts)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(pf.daemon_dir, LAUNCHER)
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    with open(path, "w") as f:
        f.write(f"#!{sys.executable} -I\n"
                "import sys\n"
                "sys.modules['ssl'] = None\n"
                f"sys.path.insert(0, {repo!r})\n"
                "from benchmarks.floor_qmgr import main\n"
                "sys.exit(main(sys.argv))\n")
    os.chmod(path, 0o755)
    args = pf.postconf("-F", "qmgr/unix/command").partition(" = ")[2].split()[1:]
    pf.postconf("-F", "qmgr/unix/command=" + " ".join([LAUNCHER, *args]))
