"""The scheduler side by side with stock qmgr on real Postfix: preemption order, 421 limiter.

Both tests run one workload under stock qmgr and under pyqmgr, each on a fresh
instance, and compare. The first needs nqmgr's exact preemption (slots, loans,
candidate scores); the second the 2.5 concurrency feedback against a server that
answers 421 above five sessions.
"""

from __future__ import annotations

import time

import pytest

from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.sink import SinkServer

SMALL_SIZES = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]


def _wait_second_start() -> None:
    """Sleep to just after a second boundary: stock's scores count whole seconds."""
    frac = time.time() % 1.0
    time.sleep((1.05 - frac) % 1.0)


def _delivery_order(make, sink, qmgr: str) -> str:
    """One 40-recipient message, then ten of 1-3 recipients; which one each delivery served.

    One delivery process, one recipient per delivery, slot cost 2. The big message's
    first delivery is slow (3 s), so the small ones are all in the active queue,
    queued within one second, before its second delivery is chosen.
    """
    srv: SinkServer = sink(latency=lambda a: 3.0 if a == "a0@big.example" else 0.03)
    nexthop = f"slow:[127.0.0.1]:{srv.port}"
    pf: PostfixInstance = make(
        qmgr=qmgr,
        transports={"big.example": nexthop, "small.example": nexthop},
        master_cf_extra=["slow unix - - n - 1 smtp"],
        main_cf={"slow_destination_recipient_limit": "1",
                 "slow_delivery_slot_cost": "2"},
    )
    owner: dict[str, str] = {}
    (big,) = pf.smtp_send([("s@test.example", [f"a{i}@big.example" for i in range(40)])])
    for i in range(40):
        owner[f"a{i}@big.example"] = "A"
    pf.maillog.wait_for(lambda ln: ln.queue_id == big and "(queue active)" in ln.text,
                        timeout=20, what="the big message in the active queue")
    time.sleep(0.5)  # its first delivery is under way (3 s at the sink)
    _wait_second_start()
    small = []
    for k, n in enumerate(SMALL_SIZES):
        rcpts = [f"m{k}r{j}@small.example" for j in range(n)]
        small.append(("s@test.example", rcpts))
        for r in rcpts:
            owner[r] = "abcdefghij"[k]
    pf.smtp_send(small)
    total = 40 + sum(SMALL_SIZES)
    pf.wait_until(lambda: len(srv.messages()) >= total, 60,
                  f"{total} deliveries at the sink")
    order = "".join(owner[m.recipients[0]] for m in srv.messages())
    assert len(order) == total
    return order


def test_preemption_gives_stocks_delivery_order(postfix_instance, sink):
    orders = {q: _delivery_order(postfix_instance, sink, q) for q in ("stock", "pyqmgr")}
    stock = orders["stock"]
    print(f"delivery order: {stock}")
    # Stock's order shows preemption at work: small mail slips in between the big
    # message's deliveries, not after them.
    assert stock.rstrip("A") != stock and stock.index("a") < stock.rindex("A"), stock
    assert orders["pyqmgr"] == stock, (
        f"\nstock : {stock}\npyqmgr: {orders['pyqmgr']}")


def _deferral_rate(make, sink, qmgr: str, feedback: str) -> tuple[float, int]:
    """First-pass deferral rate against a server that allows five sessions."""
    srv: SinkServer = sink(latency=0.02, client_limit=5)
    pf: PostfixInstance = make(
        qmgr=qmgr,
        transports={"limited.example": f"smtp:[127.0.0.1]:{srv.port}"},
        main_cf={"smtp_destination_recipient_limit": "2",
                 "smtp_destination_concurrency_limit": "20",
                 "initial_destination_concurrency": "5",
                 "default_destination_concurrency_positive_feedback": feedback,
                 "default_destination_concurrency_negative_feedback": feedback},
    )
    n = 400
    (qid,) = pf.smtp_send([("s@test.example", [f"r{i}@limited.example" for i in range(n)])])
    lines = pf.maillog.wait_for(
        lambda ln: ln.queue_id == qid and ln.program_name == "smtp"
        and ln.status in ("sent", "deferred"),
        timeout=120, count=n, what=f"a first attempt for all {n} recipients")
    deferred = sum(1 for ln in lines if ln.status == "deferred")
    return deferred / n, deferred


@pytest.mark.parametrize("feedback, low, high, apart", [
    # Theory 1/(1 + 5) at concurrency 5. Real runs do not vary: six of each qmgr on
    # 2026-11-27 gave 16.0% but one (15.5%).
    ("1/concurrency", 0.05, 0.30, 0.03),
    # Stock 3.7's rounding drops the window by two on the first failure after a
    # success: about 1/3, where the seed's 2007 scheduler deferred 1/2 (see
    # scenarios/limiter-421-feedback-1-stock.toml, which simulates this run). Here
    # the runs vary with the sessions' timing: six of stock on 2026-11-27 gave 27.5%
    # to 35.0%, six of pyqmgr 28.5% to 34.5%, and a pair differed by up to 5 points
    # (a 3-point bar failed four pairs of six by chance alone). So 10 points apart at
    # most, both inside the band: a qmgr deferring half would be outside it.
    ("1", 0.25, 0.45, 0.10),
])
def test_421_limiter_deferral_rate_matches_stock(postfix_instance, sink, feedback, low, high,
                                                 apart):
    rates = {q: _deferral_rate(postfix_instance, sink, q, feedback)
             for q in ("stock", "pyqmgr")}
    (stock, _), (ours, _) = rates["stock"], rates["pyqmgr"]
    print(f"feedback {feedback}: first-pass deferral rate: stock {stock:.1%}, "
          f"pyqmgr {ours:.1%}")
    assert low < stock < high, rates
    assert low < ours < high, rates
    assert abs(stock - ours) <= apart, rates
