"""The scheduler core driven directly: bundling, windows, dead sites, retry rerouting."""

from pyqmgr.scheduler.core import RETRY, Route, Scheduler
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.queue import Dsn
from tests.unit.params import Params


def make(**kw):
    return Scheduler(lambda name: Params(**kw), min_backoff_time=300, transport_retry_time=60)


def routes(n, transport="smtp", queue="example.com"):
    return [Route(transport, queue, queue, Recipient(i, f"u{i}@{queue}")) for i in range(n)]


def test_recipients_bundle_up_to_the_recipient_limit():
    s = make(destination_recipient_limit=3)
    m = Message("Q1", 0.0)
    s.assign(m, routes(7))
    assert m.refcount == 3
    sizes = [len(e.recipients) for e in s.transport("smtp").queues["example.com"].todo]
    assert sizes == [3, 3, 1]


def test_window_limits_concurrency_and_grows_with_success():
    s = make(initial_destination_concurrency=2, destination_recipient_limit=1)
    m = Message("Q1", 0.0)
    s.assign(m, routes(10))
    picked = [s.select("smtp").deliver for _ in range(3)]
    assert picked[2] is None, "window of 2 admits two deliveries"
    s.done(picked[0], 0, None, False, 1.0)
    assert s.transport("smtp").queues["example.com"].window == 3
    assert s.select("smtp").deliver is not None and s.select("smtp").deliver is not None
    assert s.select("smtp").deliver is None


def test_hop_failure_kills_site_and_reroutes_todo_to_retry():
    s = make(initial_destination_concurrency=1, destination_recipient_limit=1)
    m = Message("Q1", 0.0)
    s.assign(m, routes(3))
    e = s.select("smtp").deliver
    s.done(e, -1, Dsn("4.4.1", "connect refused"), False, 10.0)
    q = s.transport("smtp").queues["example.com"]
    assert q.throttled and q.revive_at == 310.0 and q.status == "dead"
    retry = s.transport(RETRY)
    assert sum(len(q.todo) for q in retry.queues.values()) == 2
    (rq,) = retry.queues.values()
    assert rq.nexthop == "4.4.1 delivery temporarily suspended: connect refused"
    assert m.deferred and m.refcount == 2
    # New mail for the dead site goes straight to retry.
    m2 = Message("Q2", 0.0)
    s.assign(m2, routes(1))
    assert sum(len(q.todo) for q in retry.queues.values()) == 3
    s.tick(310.0)
    assert not q.throttled and q.status == "ready"


def test_dead_transport_and_dead_retry_means_synchronous_defer():
    s = make()
    m = Message("Q1", 0.0)
    s.throttle_transport(RETRY, Dsn("4.3.0", "mail transport unavailable"), 0.0)
    s.throttle_transport("smtp", Dsn("4.3.0", "mail transport unavailable"), 0.0)
    d = s.assign(m, routes(2))
    assert [d.recipient.address for d in d.deferrals] == ["u0@example.com", "u1@example.com"]
    assert m.deferred and m.refcount == 0


def test_finished_message_is_reported_once():
    s = make()
    m = Message("Q1", 0.0)
    s.assign(m, routes(2))
    e = s.select("smtp").deliver
    d = s.done(e, 0, None, False, 0.0)
    assert d.finished == (m,)


def test_destination_rate_delay_suspends_between_deliveries():
    s = make(destination_rate_delay=2, destination_concurrency_limit=1,
             initial_destination_concurrency=1, destination_recipient_limit=1)
    m = Message("Q1", 0.0)
    s.assign(m, routes(3))
    e = s.select("smtp").deliver
    assert s.select("smtp").deliver is None
    d = s.done(e, 0, None, False, 10.0)
    q = s.transport("smtp").queues["example.com"]
    assert q.paused and q.paused_until == 12.0 and d.timers == (12.0,)
    assert q.status == "paused"
    assert s.select("smtp").deliver is None and not s.has_work("smtp")
    s.tick(11.9)
    assert s.select("smtp").deliver is None
    s.tick(12.0)
    assert q.window == 1 and q.status == "ready" and s.select("smtp").deliver is not None


def test_send_failure_puts_the_entry_back_and_defers_the_transport():
    # qmgr_deliver: a request that cannot be written is unselected, the transport
    # is throttled, and its waiting entries (that one first in line again) move to
    # the retry transport; no agent is allocated until transport_retry_time passes.
    s = make(destination_recipient_limit=1)
    m = Message("Q1", 0.0)
    s.assign(m, routes(3))
    t = s.transport("smtp")
    q = t.queues["example.com"]
    e = s.select("smtp").deliver
    assert q.busy_count == 1 and e.busy
    d = s.send_failed(e, Dsn("4.3.0", "mail transport unavailable"), 5.0)
    assert q.busy_count == 0 and not e.busy
    assert t.revive_at == 65.0 and 65.0 in d.timers
    retry = s.transport(RETRY)
    waiting = sum(len(q.todo) for q in retry.queues.values())
    assert waiting == 3, "the unselected entry is deferred with the others"
    (rq,) = retry.queues.values()
    assert rq.nexthop == "4.3.0 mail transport unavailable"
    assert [r.address for entry in rq.todo for r in entry.recipients] == \
        ["u1@example.com", "u2@example.com", "u0@example.com"]
    assert m.refcount == 3 and not s.has_work("smtp")
    assert all(name != "smtp" for name in iter(s.allocate, None))
    s.tick(65.0)
    assert t.revive_at is None


def test_a_queue_with_more_out_than_its_window_holds_back_an_agent_for_the_next():
    # qmgr_transport_select sums min(window - busy, todo) over the live queues in list
    # order: a.example, with 3 deliveries out and its window cut to 1 by negative
    # feedback, counts -2; one message for b.example behind it is not work enough for
    # an agent until a.example's deliveries end.
    s = make(initial_destination_concurrency=3, destination_recipient_limit=1)
    s.assign(Message("Q1", 0.0), routes(5, queue="a.example"))
    picked = [s.select("smtp").deliver for _ in range(3)]
    t = s.transport("smtp")
    a = t.queues["a.example"]
    s.done(picked[0], -1, Dsn("4.7.0", "421 too many connections"), False, 1.0)
    assert a.window == 1 and a.busy_count == 2 and not a.throttled
    t.pending = 0
    assert s.allocate() is None, "a.example: todo 2, room -1; nothing else"
    s.assign(Message("Q2", 1.0), routes(1, queue="b.example"))
    assert t.queues["b.example"] in t.ready_queues
    assert s.allocate() is None, "-1 + 1 does not cover one agent"
    s.done(picked[1], 0, None, False, 2.0)
    # a.example: window 1 busy 1 (room 0), b.example: 1.
    assert s.allocate() == "smtp"
