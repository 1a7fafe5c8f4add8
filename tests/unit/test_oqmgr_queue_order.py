"""oqmgr's round-robin list holds queues in the order its resolver created them.

Postfix's oqmgr sorts a batch's recipients by domain and address, resolves them (each
new queue joins the end of the transport's queue list, ``qmgr_queue_create``), sorts
again by queue name and only then makes entries. The core hands the policy recipients
in that second order, so the oqmgr policy must place the batch's new queues itself.
Found side by side with Postfix's oqmgr (tests/test_oqmgr_side_by_side.py): with
recipient limit 1 and one sink per destination, queue names are
``u@[127.0.0.1]:PORT`` and sort by port, not by domain.
"""

from __future__ import annotations

from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.oqmgr import Oqmgr
from pyqmgr.scheduler.policy import PolicyTable
from tests.unit.params import Params

#: Queue names that sort differently from their domains d0..d4.
QNAMES = ["u@[127.0.0.1]:4", "u@[127.0.0.1]:2", "u@[127.0.0.1]:5", "u@[127.0.0.1]:1",
          "u@[127.0.0.1]:3"]


def make() -> Scheduler:
    return Scheduler(lambda name: Params(destination_recipient_limit=1,
                                         initial_destination_concurrency=10),
                     transport_retry_time=60, policies=PolicyTable(Oqmgr))


def batch(tag: str, per_dest: list[int], offset: int = 0) -> list[Route]:
    """Recipients u+<tag>N@dK.example, sorted by queue name as the daemon hands them."""
    rs = [Route("smtp", QNAMES[d], QNAMES[d],
                Recipient(offset + 10 * d + j, f"u+{tag}{j}@d{d}.example"))
          for d, n in enumerate(per_dest) for j in range(n)]
    return sorted(rs, key=lambda r: r.queue_name)


def domains(s: Scheduler) -> str:
    order = []
    while (e := s.select("smtp", 1.0).deliver) is not None:
        order.append(e.recipients[0].address.rsplit("@d", 1)[1][0])
    return "".join(order)


def test_new_queues_take_their_place_in_domain_order_not_queue_name_order():
    s = make()
    s.assign(Message("Q1", 0.0), batch("w", [1, 1, 1, 1, 1]), now=0.0)
    s.assign(Message("Q2", 0.0), batch("m", [3, 2, 1, 1, 2], offset=100), now=0.0)
    # oqmgr: d0 d1 d2 d3 d4 round robin; queue-name order would be d3 d1 d4 d0 d2.
    assert domains(s) == "01234" "01234" "014" "0"


def test_a_later_batchs_queues_go_after_the_earlier_ones():
    s = make()
    s.assign(Message("Q1", 0.0), batch("w", [0, 0, 1, 0, 1]), now=0.0)  # d2, d4
    s.assign(Message("Q2", 0.0), batch("m", [1, 1, 0, 1, 0], offset=100), now=0.0)
    assert domains(s) == "24013"


def test_a_queue_is_placed_by_its_first_recipient_in_domain_order():
    s = make()
    # qa holds @d1; qb holds @d3 and, later in queue order, @d0: resolve meets qb first.
    rs = sorted([Route("smtp", "qb", "qb", Recipient(1, "z@d3.example")),
                 Route("smtp", "qa", "qa", Recipient(2, "a@d1.example")),
                 Route("smtp", "qb", "qb", Recipient(3, "y@d0.example"))],
                key=lambda r: r.queue_name)
    s.assign(Message("Q1", 0.0), rs, now=0.0)
    first = s.select("smtp", 1.0).deliver
    second = s.select("smtp", 1.0).deliver
    assert first is not None and second is not None
    assert (first.queue.name, second.queue.name) == ("qb", "qa")
