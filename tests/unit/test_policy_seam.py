"""The policy seam in the core: per-transport policies, their caps, and their failures.

A policy is user code running inside the queue manager; whatever it does wrong, the
core must keep every recipient accounted for (in an entry, or deferred) and say which
policy misbehaved. These tests drive the core directly with small policies.
"""

from __future__ import annotations

from pyqmgr.scheduler.core import POLICY_DSN, RETRY, Route, Scheduler
from pyqmgr.scheduler.entry import Entry, entry_select
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.nqmgr import Nqmgr
from pyqmgr.scheduler.oqmgr import Oqmgr
from pyqmgr.scheduler.policy import Policy, PolicyTable
from pyqmgr.scheduler.zmailer import Zmailer
from pyqmgr.settings.policies import load
from tests.unit.params import Params


class Fifo(Policy):
    """The plainest policy: the oldest todo entry of the first queue that has room."""

    name = "fifo"

    def select(self) -> Entry | None:
        for queue in self.transport.queues.values():
            if queue.window > queue.busy_count and queue.todo:
                first = queue.todo.first()
                assert first is not None
                return entry_select(first, self.ctx.clock)
        return None


class RaisesOnSelect(Fifo):
    name = "raises-on-select"
    calls = 0

    def select(self) -> Entry | None:
        type(self).calls += 1
        if type(self).calls > 2:
            raise RuntimeError("policy bug")
        return super().select()


class RaisesOnAdd(Fifo):
    name = "raises-on-add"

    def add(self, message, queue, recipient, last):
        if recipient.address.startswith("bad"):
            raise ValueError("cannot file " + recipient.address)
        return super().add(message, queue, recipient, last)


def make(policy: type[Policy], **kw) -> Scheduler:
    return Scheduler(lambda name: Params(**kw), transport_retry_time=60,
                     policies=PolicyTable(policy))


def routes(n: int, dests: int = 1, prefix: str = "u") -> list[Route]:
    return [Route("smtp", f"d{i % dests}", f"d{i % dests}",
                  Recipient(i, f"{prefix}{i}@d{i % dests}")) for i in range(n)]


def sorted_routes(n: int, dests: int, prefix: str = "u") -> list[Route]:
    return sorted(routes(n, dests, prefix), key=lambda r: r.queue_name)


def in_core(s: Scheduler) -> int:
    return sum(len(e.recipients) for t in s.transports.values() for q in t.queues.values()
               for e in q.todo)


def test_the_default_table_is_nqmgr_and_retry_stays_nqmgr():
    s = Scheduler(lambda name: Params())
    assert isinstance(s.policy("smtp"), Nqmgr)
    s = make(Oqmgr)
    assert isinstance(s.policy("smtp"), Oqmgr)
    assert isinstance(s.policy(RETRY), Nqmgr), "retry and error always run stock's"


def test_a_raising_select_defers_everything_waiting_and_names_the_policy():
    RaisesOnSelect.calls = 0
    s = make(RaisesOnSelect, destination_recipient_limit=1)
    m = Message("Q1", 0.0)
    ds = [s.assign(m, sorted_routes(6, 2), now=0.0)]
    ds += [s.select("smtp", 1.0), s.select("smtp", 1.0)]
    busy = [ds[1].deliver, ds[2].deliver]
    assert all(busy)
    ds.append(s.select("smtp", 1.0))
    assert ds[3].deliver is None
    warnings = [text for d in ds for sev, text in d.log if sev == "warning"]
    assert warnings == ["transport smtp: scheduler policy raises-on-select: select: "
                        "RuntimeError: policy bug"]
    t = s.transport("smtp")
    assert t.throttled and t.dsn == POLICY_DSN and t.broken
    # The four waiting recipients went to the retry transport; two are still out.
    retry = [e for q in s.transport(RETRY).queues.values() for e in q.todo]
    assert sum(len(e.recipients) for e in retry) == 4
    assert not any(q.todo for q in t.queues.values())
    for entry in busy:
        assert entry is not None
        s.done(entry, 0, None, False, 2.0)
    assert m.refcount == 4, "only the retry entries remain"
    # After transport_retry_time the transport comes back with a fresh policy.
    s.tick(70.0)
    assert not t.throttled and not t.broken
    assert isinstance(t.policy, RaisesOnSelect)


def test_a_raising_add_defers_that_recipient_and_routes_the_rest_to_retry():
    s = make(RaisesOnAdd)
    m = Message("Q1", 0.0)
    rs = [Route("smtp", "d0", "d0", Recipient(0, "good0@d0")),
          Route("smtp", "d0", "d0", Recipient(1, "bad1@d0")),
          Route("smtp", "d0", "d0", Recipient(2, "good2@d0"))]
    d = s.assign(m, rs, now=0.0)
    assert [d.recipient.address for d in d.deferrals] == ["bad1@d0"]
    assert d.deferrals[0].dsn == POLICY_DSN and m.deferred
    retry = [e for q in s.transport(RETRY).queues.values() for e in q.todo]
    assert sorted(r.address for e in retry for r in e.recipients) == ["good0@d0", "good2@d0"]
    assert "scheduler policy raises-on-add: add: ValueError" in d.log[0][1]


def test_oqmgr_serves_destinations_round_robin_oldest_entry_first():
    s = make(Oqmgr, destination_recipient_limit=1, initial_destination_concurrency=10)
    m = Message("Q1", 0.0)
    # d0 holds six recipients, d1 and d2 two each, in that queue order.
    rs = ([Route("smtp", "d0", "d0", Recipient(i, f"a{i}@d0")) for i in range(6)]
          + [Route("smtp", "d1", "d1", Recipient(10 + i, f"b{i}@d1")) for i in range(2)]
          + [Route("smtp", "d2", "d2", Recipient(20 + i, f"c{i}@d2")) for i in range(2)])
    s.assign(m, rs, now=0.0)
    order = []
    while (e := s.select("smtp", 1.0).deliver) is not None:
        order.append(e.recipients[0].address)
    assert order == ["a0@d0", "b0@d1", "c0@d2", "a1@d0", "b1@d1", "c1@d2",
                     "a2@d0", "a3@d0", "a4@d0", "a5@d0"]


def test_oqmgr_fills_only_the_previous_recipients_entry():
    """nqmgr tops up the peer's last entry across batches; oqmgr starts a new one."""
    s = make(Oqmgr, destination_recipient_limit=10)
    m = Message("Q1", 0.0)
    m.more = True
    s.assign(m, routes(3), now=0.0)
    m.more = False
    s.assign(m, routes(2, prefix="v"), now=0.0)
    sizes = [len(e.recipients) for e in s.transport("smtp").queues["d0"].todo]
    assert sizes == [3, 2]
    n = Scheduler(lambda name: Params(destination_recipient_limit=10))
    m2 = Message("Q2", 0.0)
    m2.more = True
    n.assign(m2, routes(3), now=0.0)
    m2.more = False
    n.assign(m2, routes(2, prefix="v"), now=0.0)
    assert [len(e.recipients) for e in n.transport("smtp").queues["d0"].todo] == [5]


def test_oqmgr_reading_stops_feeding_at_the_in_core_recipient_limit():
    s = Scheduler(lambda name: Params(), rcpt_limit=100, active_limit=50,
                  policies=PolicyTable(Oqmgr), fudge_factor=50)
    assert s.bounded_reading and s.fudge_limit == 50
    assert s.first_read_limit() == 50
    m = Message("Q1", 0.0)
    m.more = True
    s.assign(m, routes(100, 5), now=0.0)
    assert not s.may_feed(), "100 recipients in core: no more queue files"
    assert s.read_limit(m) == 50, "oqmgr's batches do not depend on slots"
    plain = Scheduler(lambda name: Params(), rcpt_limit=100, active_limit=50)
    plain.assign(Message("Q2", 0.0), routes(100, 5), now=0.0)
    assert plain.may_feed(), "stock qmgr opens files whatever the recipient count"


def test_zmailer_caps_each_destination_at_one_delivery_for_allocation_too():
    s = make(Zmailer, destination_recipient_limit=1, initial_destination_concurrency=5)
    m = Message("Q1", 0.0)
    s.assign(m, sorted_routes(9, 3), now=0.0)
    picked = []
    while s.allocate() is not None:
        entry = s.select("smtp", 1.0).deliver
        assert entry is not None
        picked.append(entry.queue.name)
    assert sorted(picked) == ["d0", "d1", "d2"], "one agent per destination"
    assert s.select("smtp", 1.0).deliver is None


def test_a_module_policy_loads_from_its_file(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("from pyqmgr.scheduler.oqmgr import Oqmgr\n"
                    "class Mine(Oqmgr):\n    name = 'mine'\n")
    cls = load(f"module:{path}")
    s = make(cls)
    s.assign(Message("Q1", 0.0), routes(3), now=0.0)
    assert s.policy("smtp").name == "mine"
    entry = s.select("smtp", 1.0).deliver
    assert entry is not None and len(entry.recipients) == 3
    assert in_core(s) == 0


def test_simulate_takes_a_policy_on_the_command_line(capsys):
    from pyqmgr.cli import main

    assert main(["simulate", "--quiet", "--policy", "oqmgr", "scenarios/preemption.toml"]) == 0
    out = capsys.readouterr().out
    assert "(scheduler_policy = oqmgr)" in out
    assert main(["simulate", "--quiet", "--policy", "nosuch", "scenarios/preemption.toml"]) == 1
    err = capsys.readouterr().err
    assert 'unknown scheduler policy "nosuch"' in err


def test_mixed_policies_in_one_message_keep_every_count():
    """One message, recipients on an nqmgr, an oqmgr and a zmailer transport at once.

    nqmgr's job slots and the slotless policies' reading must share the message's
    counts: everything is selected once, and at the end nothing is left in core.
    """
    table = PolicyTable(Nqmgr, {"bulk": Oqmgr, "relay": Zmailer})
    s = Scheduler(lambda name: Params(destination_recipient_limit=2), policies=table,
                  rcpt_limit=1000)
    m = Message("Q1", 0.0)
    rs = [Route(t, f"{t}{i % 3}", f"{t}{i % 3}", Recipient(n, f"r{n}@{t}{i % 3}"))
          for n, (t, i) in enumerate((t, i) for t in ("bulk", "relay", "smtp")
                                     for i in range(12))]
    rs.sort(key=lambda r: (r.transport, r.queue_name))
    s.assign(m, rs, now=0.0)
    assert set(m.jobs) == {"smtp"}, "only nqmgr keeps jobs"
    delivered = []
    finished = []
    for _ in range(100):
        busy = [e for t in ("bulk", "relay", "smtp") if (e := s.select(t, 1.0).deliver) is not None]
        if not busy:
            break
        for e in busy:
            delivered += [r.address for r in e.recipients]
            finished += s.done(e, 0, None, False, 1.0).finished
    assert sorted(delivered) == sorted(r.recipient.address for r in rs)
    assert m.refcount == 0 and m.rcpt_count == 0 and s.rcpt_count == 0
    assert finished == [m] and not m.jobs


def test_a_bad_qmgr_fudge_factor_only_matters_to_the_policies_that_read_it(tmp_path):
    """Stock qmgr never reads qmgr_fudge_factor: with nqmgr a bad value must not stop it."""
    import pytest

    from pyqmgr.daemon.policies import policy_setup
    from pyqmgr.postfix.config import ConfigError, QmgrConfig
    from pyqmgr.pyqmgr_cf import from_text

    (tmp_path / "master.cf").write_text("smtp unix - - n - - smtp\n")
    cfg = QmgrConfig.from_text("qmgr_fudge_factor = 5\n", config_dir=str(tmp_path),
                               hostname="h.example")
    stock = policy_setup(from_text(""), cfg)
    assert stock.table.stock and stock.fudge_factor == 100
    with pytest.raises(ConfigError, match="qmgr_fudge_factor parameter value 5 < 10"):
        policy_setup(from_text("scheduler_policy = oqmgr\n"), cfg)
