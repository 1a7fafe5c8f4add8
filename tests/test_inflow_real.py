"""in_flow_delay's back-pressure with message classes (issue #45, item 4), on real Postfix.

cleanup(8) takes a flow-control token from the queue manager for each message it
accepts (Postfix's multi_server.c, for cleanup alone of the daemons) and, when none is
there, waits ``in_flow_delay`` (1 s) before it reads the request: smtpd and pickup,
whose every message goes through cleanup, slow down to the pace at which the queue
manager takes mail in. With classes pyqmgr also hands tokens out while the highest
class has room, so that a password reset is not held back a second behind a
newsletter; until this change it did so under a flood too, and incoming/ grew as fast
as smtpd could take mail.

The flood: ``FLOOD`` newsletter messages (bulk) sent at once by ``CLIENTS`` SMTP
sessions, each as fast as it is answered, to one destination whose server takes
``LATENCY`` s a recipient (20 sessions: about 40 messages a second), with an active
queue of 200. incoming/ is counted every 0.2 s. Stock, then pyqmgr with two classes,
on fresh instances: pyqmgr's largest incoming/ may be at most ``MARGIN`` larger than
stock's. Before the change it was about twice stock's (figures in benchmarks/README.md,
also at 20,000 messages: ``PYQMGR_INFLOW_FLOOD=20000``).

When nine tenths have been sent the destination stops answering, so that nothing
leaves the active queue (stock's tokens for mail taken in then stop too). The flood
over, password resets arrive one every 0.3 s: under pyqmgr each is queued (smtpd's
answer to DATA) without in_flow_delay's second, though the newsletter fills incoming/
and the active queue; under stock each waits it.
"""

from __future__ import annotations

import itertools
import json
import os
import smtplib
import threading
import time
from collections.abc import Callable
from email.message import EmailMessage

from pyqmgr.daemon.class_feed import FLOOD_HOLD
from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.sink import SinkServer
from tests.test_control import cli

FLOOD = int(os.environ.get("PYQMGR_INFLOW_FLOOD", "2000"))
CLIENTS = 50
LATENCY = 0.5
RESETS = 5
#: pyqmgr's largest incoming/ against stock's: at most 10% more, plus 30 messages
#: (a sample's timing: 0.2 s of stock's own pace under this flood is about 20).
MARGIN = (1.10, 30)
CLASSES_CF = {"message_classes": "transactional bulk",
              "message_class_maps": "inline:{ shop.example=transactional }"}


class Flood:
    """``CLIENTS`` sessions sending ``count`` messages between them, each as fast as
    smtpd answers, while a thread counts incoming/ every 0.2 s."""

    def __init__(self, pf: PostfixInstance, count: int, stall: Callable[[], None]
                 ) -> None:
        self.pf = pf
        self.stall = stall
        self.next = itertools.count()
        self.count = count
        self.lock = threading.Lock()
        self.errors: list[BaseException] = []
        self.sizes: list[int] = []
        self.done = threading.Event()
        self.took = 0.0

    def _client(self) -> None:
        try:
            with smtplib.SMTP("127.0.0.1", self.pf.smtpd_port, timeout=120) as smtp:
                smtp.ehlo()
                while not self.done.is_set():
                    with self.lock:
                        i = next(self.next)
                    if i >= self.count:
                        return
                    if i == self.count * 9 // 10:
                        self.stall()
                    msg = EmailMessage()
                    msg["From"] = "news@letters.example"
                    msg["To"] = f"n{i}@dest.example"
                    msg["Subject"] = f"newsletter {i}"
                    msg.set_content(f"issue {i}\n")
                    smtp.send_message(msg, "news@letters.example", [f"n{i}@dest.example"])
        except BaseException as exc:  # noqa: BLE001 - raised by run()
            self.errors.append(exc)

    def _sample(self) -> None:
        incoming = os.path.join(self.pf.queue_dir, "incoming")
        while not self.done.wait(0.2):
            with os.scandir(incoming) as it:
                self.sizes.append(sum(1 for _ in it))

    def run(self, timeout: float) -> None:
        clients = [threading.Thread(target=self._client) for _ in range(CLIENTS)]
        sampler = threading.Thread(target=self._sample)
        began = time.monotonic()
        sampler.start()
        for t in clients:
            t.start()
        try:
            for t in clients:
                t.join(max(0.0, began + timeout - time.monotonic()))
            late = sum(t.is_alive() for t in clients)
        finally:
            self.done.set()
            for t in clients:
                t.join(130)
            sampler.join(10)
        self.took = time.monotonic() - began
        if self.errors:
            raise self.errors[0]
        assert not late, (f"{late} of {CLIENTS} clients still sending after {timeout:.0f} s "
                          f"(at message {next(self.next)} of {self.count})")


def _resets(pf: PostfixInstance) -> list[float]:
    """Seconds smtpd took to queue each reset (MAIL FROM to the answer to DATA): in
    that time cleanup takes a token, or waits in_flow_delay for want of one."""
    took = []
    for i in range(RESETS):
        began = time.monotonic()
        pf.smtp_send([("resets@shop.example", [f"reset{i}@dest.example"])])
        took.append(time.monotonic() - began)
        time.sleep(0.3)
    return took


def _run(postfix_instance, sink, qmgr: str, pyqmgr_cf: dict[str, str] | None
         ) -> tuple[Flood, list[float], PostfixInstance]:
    srv: SinkServer = sink(latency=LATENCY)
    pf: PostfixInstance = postfix_instance(
        qmgr=qmgr, transports={"dest.example": f"smtp:[127.0.0.1]:{srv.port}"},
        main_cf={"qmgr_message_active_limit": "200", "in_flow_delay": "1s"},
        pyqmgr_cf=pyqmgr_cf)
    flood = Flood(pf, FLOOD, lambda: srv.set_latency(3600))
    flood.run(timeout=max(120.0, FLOOD / 15))
    # The flood is over: once pyqmgr has seen a quiet FLOOD_HOLD, resets take no
    # token's wait, though the newsletter still fills incoming/ and the active queue.
    time.sleep(FLOOD_HOLD + 1.5)
    return flood, _resets(pf), pf


def _p95(sizes: list[int]) -> int:
    s = sorted(sizes)
    return s[max(0, round(0.95 * len(s)) - 1)]


def test_a_flood_meets_in_flow_delay_as_under_stock_and_resets_after_it_do_not(
        postfix_instance, sink):
    stock, stock_resets, _ = _run(postfix_instance, sink, "stock", None)
    mine, mine_resets, pf = _run(postfix_instance, sink, "pyqmgr", CLASSES_CF)
    classes = json.loads(cli(pf, "status", "--json").stdout)["classes"]
    left = len(pf.queue_files("incoming"))
    print(f"\n{FLOOD} newsletter messages from {CLIENTS} SMTP sessions, a sink at "
          f"{LATENCY} s a recipient, active queue 200:\n"
          f"  stock:  sent in {stock.took:.1f} s, incoming/ max {max(stock.sizes)}, "
          f"p95 {_p95(stock.sizes)}; resets queued in "
          f"{', '.join(f'{t:.2f}' for t in stock_resets)} s\n"
          f"  pyqmgr: sent in {mine.took:.1f} s, incoming/ max {max(mine.sizes)}, "
          f"p95 {_p95(mine.sizes)}; resets queued in "
          f"{', '.join(f'{t:.2f}' for t in mine_resets)} s "
          f"({left} newsletter messages still in incoming/)\n"
          f"  pyqmgr's in_flow_delay: {classes.get('in_flow')}")
    factor, extra = MARGIN
    assert max(mine.sizes) <= max(stock.sizes) * factor + extra, (
        f"incoming/ grew to {max(mine.sizes)} under pyqmgr, {max(stock.sizes)} under stock")
    # The comparison means something: stock's back-pressure held the flood back, the
    # newsletter was still queued when the resets came, and stock's resets waited.
    assert stock.took > 0.8 * FLOOD / (CLIENTS + 20 / LATENCY), stock.took
    assert left > 200, left
    assert min(stock_resets) > 0.9, stock_resets
    assert max(mine_resets) < 0.5, mine_resets
    said = [ln.text for ln in pf.maillog.lines() if "new mail floods in" in ln.text]
    print("\n".join(said))
    assert len(said) == 1 and classes["in_flow"]["floods"] == 1, (said, classes)
