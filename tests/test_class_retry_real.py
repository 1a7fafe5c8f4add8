"""A higher class's deferred mail past the deferred scan, on real Postfix (issue #34).

Three password resets (transactional: from shop.example) meet a server that greets
with 421 and go to deferred/ with a retry time 6 s ahead (minimal and maximal
backoff 6 s). Their server then comes back, one reset is deleted (``postsuper -d``)
and another's retry time is moved 4 s later (its file's mtime, as a later deferral
or an operator would leave it). A newsletter of :data:`BULK` messages then arrives
for a server that takes 0.1 s a message two at a time: the active queue
(``qmgr_message_active_limit`` 100) stays full of it, and the deferred scan runs
every 60 s. Stock retries the resets at its next deferred scan, behind the
newsletter; pyqmgr with two classes feeds each when its retry time comes. Both runs
end with every message delivered (the newsletter's server made fast, and a flush).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from pyqmgr.daemon.class_retry import GRACE
from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.sink import SinkServer
from tests.test_control import cli

BULK = 600
BACKOFF = 6
MOVED = 4.0
CLASSES_CF = {"message_classes": "transactional bulk",
              "message_class_maps": "inline:{ shop.example=transactional }"}
RESETS = ["reset@shop-customer.example", "gone@shop-customer.example",
          "moved@shop-customer.example"]
#: How long stock is watched past the first reset's retry time.
STOCK_WINDOW = 6.0


def _arrival(srv: SinkServer, rcpt: str) -> float | None:
    """When the sink accepted ``rcpt``'s message (its DATA done), or None."""
    for m in srv.messages():
        if rcpt in m.recipients:
            return m.time
    return None


def _deferred_resets(pf: PostfixInstance, qids: list[str]) -> dict[str, float]:
    """Each reset's retry time, once qmgr has moved its file to deferred/."""
    def moved() -> bool:
        return all(pf.queue_path("deferred", q) for q in qids)
    pf.wait_until(moved, 20, "the three resets in deferred/ after the 421 greeting")
    return {q: os.stat(pf.queue_path("deferred", q) or "").st_mtime for q in qids}


@dataclass
class Run:
    """What one run saw (times are the wall clock's, as the files' mtimes)."""

    due: float  # the first reset's retry time
    queued: float  # when the newsletter was all queued
    at_retry: dict[str, int]  # the queues' files at the retry time
    reset: float | None  # when the first reset reached its server
    bulk_left: int  # newsletter messages not delivered then
    moved_due: float
    moved_got: float | None
    gone_got: float | None
    status: dict[str, Any]
    warnings: list[str]  # qmgr's warnings that name the deleted reset
    suspended: int  # the first reset's "suspended" lines after its first try


def _run(postfix_instance, sink, qmgr: str) -> Run:
    bulk_srv: SinkServer = sink(latency=0.1)
    shop: SinkServer = sink()
    shop.refuse_sessions("421 4.3.2 try again later")
    pf: PostfixInstance = postfix_instance(
        qmgr=qmgr,
        transports={"dest.example": f"smtp:[127.0.0.1]:{bulk_srv.port}",
                    "shop-customer.example": f"smtp:[127.0.0.1]:{shop.port}"},
        main_cf={"qmgr_message_active_limit": "100", "queue_run_delay": "60s",
                 "minimal_backoff_time": f"{BACKOFF}s",
                 "maximal_backoff_time": f"{BACKOFF}s", "in_flow_delay": "0",
                 "smtp_destination_concurrency_limit": "2"},
        pyqmgr_cf=CLASSES_CF if qmgr == "pyqmgr" else None)
    qids = pf.smtp_send([("resets@shop.example", [r]) for r in RESETS])
    due = _deferred_resets(pf, qids)
    # The 421s of this first try made the destination dead: whichever reset the agents
    # did not reach first was deferred "delivery temporarily suspended" then, and
    # which one that is varies. Counted below: only such lines after this point.
    mark = len(pf.maillog.lines())
    shop.refuse_sessions(None)
    reset, gone, moved = qids
    pf.postsuper("-d", gone, "deferred")
    moved_to = due[moved] + MOVED
    os.utime(pf.queue_path("deferred", moved) or "", (moved_to, moved_to))
    pf.smtp_send_many([("news@letters.example", [f"n{i}@dest.example"])
                       for i in range(BULK)])
    injected = time.time()
    pf.wait_until(lambda: time.time() >= due[reset], BACKOFF + 1, "the retry time")
    at_retry = pf.queue_counts()
    window = due[reset] + (STOCK_WINDOW if qmgr == "stock" else 20.0)
    pf.wait_until(lambda: _arrival(shop, RESETS[0]) is not None or time.time() > window,
                  window - time.time() + 5, "the reset delivered or the window over")
    got = _arrival(shop, RESETS[0])
    bulk_left = BULK - bulk_srv.delivered_count()
    if qmgr == "pyqmgr":
        pf.wait_until(lambda: _arrival(shop, RESETS[2]) is not None, MOVED + 10,
                      "the reset whose retry time was moved, delivered at that time")
    status = (json.loads(cli(pf, "status", "--json").stdout)["classes"]
              if qmgr == "pyqmgr" else {})
    # The end: every message delivered, nothing lost (the deleted reset excepted).
    bulk_srv.set_latency(0)
    pf.flush()
    pf.wait_until(lambda: bulk_srv.delivered_count() >= BULK
                  and _arrival(shop, RESETS[2]) is not None, 60,
                  f"the newsletter's {BULK} messages and the resets delivered")
    # The sink has the last message a moment before qmgr hears of it and removes it.
    pf.wait_queue_empty(30)
    return Run(due=due[reset], queued=injected, at_retry=at_retry, reset=got,
               bulk_left=bulk_left, moved_due=moved_to,
               moved_got=_arrival(shop, RESETS[2]), gone_got=_arrival(shop, RESETS[1]),
               status=status,
               warnings=[ln.text for ln in pf.maillog.lines(program="qmgr")
                         if "warning" in ln.text and gone in ln.text],
               suspended=len(pf.maillog.lines(queue_id=reset, contains="suspended",
                                             since=mark)))


def test_a_deferred_reset_comes_back_at_its_retry_time_past_a_newsletter(
        postfix_instance, sink):
    stock = _run(postfix_instance, sink, "stock")
    mine = _run(postfix_instance, sink, "pyqmgr")

    def say(name: str, r: Run) -> str:
        when = (f"{r.reset - r.due:+.1f} s from its retry time" if r.reset is not None
                else f"not delivered {STOCK_WINDOW:g} s past its retry time")
        return (f"{name}: the reset {when}, {r.bulk_left} newsletter messages to go "
                f"then (queue files at the retry time: {r.at_retry}; the newsletter "
                f"queued {r.due - r.queued:.1f} s before it)")
    lag = None if mine.moved_got is None else mine.moved_got - mine.moved_due
    print(f"\n{say('stock', stock)}\n{say('pyqmgr', mine)}\n"
          f"pyqmgr: the reset whose time was moved {MOVED:g} s later, "
          f"{'never' if lag is None else f'{lag:+.1f} s'} from that time; status "
          f"{mine.status}")
    # Stock: behind the newsletter, the reset waits for the next deferred scan.
    assert stock.reset is None
    # pyqmgr: at its retry time, with the newsletter still filling the active queue.
    assert mine.at_retry["active"] >= 90 and mine.at_retry["incoming"] > 0, \
        f"the newsletter did not fill the active queue by the retry time: {mine.at_retry}"
    assert mine.reset is not None, "pyqmgr's reset not delivered 20 s past its retry time"
    assert mine.suspended == 0, "fed before its destination revived"
    assert mine.reset - mine.due < GRACE + 2.0
    assert mine.bulk_left > 200, "the newsletter was still backlogged"
    assert lag is not None and GRACE - 0.5 < lag < GRACE + 2.0, \
        "the moved reset came at its moved time"
    assert mine.gone_got is None and stock.gone_got is None
    assert mine.status["deferred_fed_past_the_scan"] == 2
    assert mine.status["deferred_retimed"] == 1 and mine.status["deferred_watched"] == 0
    assert mine.warnings == [] and stock.warnings == [], "a deleted file is skipped quietly"
