"""Retry jitter and deferred-mail recovery, without Postfix.

The jitter runs through the daemon's own ``ActiveQueue.defer()`` on real files in a
temporary queue directory, with the clock held still so that 1,000 messages are
deferred at the same moment; the retry times are read back from the files' mtimes.
Then the registry's bookkeeping and bounds, the core's half (which mail waits for
which dead or throttled destination, and when one delivers again), the paced
recovery against real deferred files, the settings and the status text.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import weakref
from collections import Counter
from types import SimpleNamespace

import pytest

from pyqmgr.control.render import status_lines
from pyqmgr.daemon import active as active_module
from pyqmgr.daemon.active import ActiveQueue
from pyqmgr.daemon.retry import RetryControl
from pyqmgr.postfix import mail_queue
from pyqmgr.postfix.config import QmgrConfig
from pyqmgr.pyqmgr_cf import PyqmgrCfError, from_text
from pyqmgr.scheduler.core import RETRY, Route, Scheduler
from pyqmgr.scheduler.decisions import Decisions
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.policy import PolicyTable
from pyqmgr.scheduler.queue import Dsn
from pyqmgr.scheduler.shaping import Rate, Shaping, parse_rules
from pyqmgr.settings.policies import load
from pyqmgr.settings.retry import Registry, RetrySettings, parse_jitter, retry_settings
from tests.unit.params import Params

PATH = "/etc/postfix/pyqmgr.cf"
REFUSED = Dsn("4.4.1", "connect to mx[192.0.2.1]:25: Connection refused")
T0 = 1_800_000_000.0


def qid(i: int) -> str:
    """A short queue id, hashed like a real one (5 hex digits of microseconds first)."""
    return f"{0xA0000 + i:05X}20E{i % 10}"


class FakeQmgr:
    """What ActiveQueue.defer() and RetryControl use of the daemon."""

    def __init__(self, cfg: QmgrConfig, settings: RetrySettings | None) -> None:
        self.cfg = cfg
        self.log = SimpleNamespace(lines=[])
        self.log.info = self.log.lines.append
        self.log.warning = self.log.lines.append
        self.scheduler = SimpleNamespace(recovery_watch={})
        self.retry = RetryControl(self, settings) if settings is not None else None  # type: ignore[arg-type]
        self.fed: list[tuple[float, str, float]] = []
        self.room = True
        self.tasks: list[asyncio.Task[None]] = []

    def spawn(self, coro) -> None:
        self.tasks.append(asyncio.get_running_loop().create_task(coro))

    def may_feed(self) -> bool:
        return self.room

    def deferred(self, am, when: float) -> None:
        """As the daemon (Qmgr.deferred), without classes: recovery remembers it."""
        if self.retry is not None:
            self.retry.deferred(am)

    def feed_deferred(self, qid: str) -> bool:
        """As the daemon: the file leaves deferred/ (its mtime as we found it noted)."""
        path = mail_queue.queue_path("deferred", qid, self.cfg.hash_queue_names,
                                     self.cfg.hash_queue_depth)
        try:
            mtime = os.stat(path).st_mtime
            os.rename(path, f"active/{qid}")
        except FileNotFoundError:
            return False
        self.fed.append((time.monotonic(), qid, mtime))
        return True


def queue_dir(tmp_path, monkeypatch) -> QmgrConfig:
    for d in ("active", "deferred"):
        (tmp_path / d).mkdir()
    monkeypatch.chdir(tmp_path)
    return QmgrConfig.from_text("minimal_backoff_time = 300s\nmaximal_backoff_time = 4000s\n",
                                hostname="test.example")


def defer_many(tmp_path, monkeypatch, settings: RetrySettings | None, n: int,
               age: float = 0.0) -> tuple[FakeQmgr, list[float]]:
    """Defer ``n`` messages of age ``age`` at the same instant T0; their mtimes."""
    cfg = queue_dir(tmp_path, monkeypatch)
    qmgr = FakeQmgr(cfg, settings)
    if qmgr.retry is not None:
        qmgr.retry.rng = random.Random(13)
    aq = ActiveQueue(qmgr)  # type: ignore[arg-type]
    ids = [qid(i) for i in range(n)]
    with monkeypatch.context() as m:
        m.setattr(active_module.time, "time", lambda: T0)
        for q in ids:
            (tmp_path / "active" / q).write_bytes(b"x")
            am = SimpleNamespace(queue_id=q, path=f"active/{q}", waits=None,
                                 qf=SimpleNamespace(create_time=T0 - age))
            aq.defer(am)  # type: ignore[arg-type]
    mtimes = [os.stat(mail_queue.queue_path("deferred", q, cfg.hash_queue_names,
                                            cfg.hash_queue_depth)).st_mtime for q in ids]
    return qmgr, mtimes


def busiest_second(offsets: list[float]) -> int:
    return max(Counter(int(o) for o in offsets).values())


def test_no_jitter_is_exactly_stocks_retry_time(tmp_path, monkeypatch):
    _, mtimes = defer_many(tmp_path, monkeypatch, None, 50)
    assert set(mtimes) == {T0 + 300}


@pytest.mark.parametrize("window", [20, 60])
def test_jitter_spreads_1000_simultaneous_deferrals_over_the_window(tmp_path, monkeypatch,
                                                                    window):
    _, mtimes = defer_many(tmp_path, monkeypatch, RetrySettings(jitter=window,
                                                                jitter_text=f"{window}s"),
                           1000)
    stock = T0 + 300
    offsets = [m - stock for m in mtimes]
    assert min(offsets) >= 0, "never earlier than stock's retry time"
    assert max(offsets) < window
    fair = 1000 / window
    busiest = busiest_second(offsets)
    seconds = len({int(o) for o in offsets})
    print(f"jitter {window}s, 1000 messages deferred at once: {seconds} distinct seconds, "
          f"busiest second {busiest} (fair share {fair:.1f}, limit {2 * fair:.0f})")
    assert seconds == window, "every second of the window gets some"
    assert busiest <= 2 * fair


def test_a_percentage_is_of_each_deferrals_backoff(tmp_path, monkeypatch):
    # An hour-old message backs off 3600 s: 10% of that is a 360 s window.
    _, mtimes = defer_many(tmp_path, monkeypatch, RetrySettings(jitter_share=0.1,
                                                                jitter_text="10%"),
                           1000, age=3600)
    offsets = [m - (T0 + 3600) for m in mtimes]
    assert 0 <= min(offsets) and max(offsets) < 360
    assert max(offsets) > 340 and min(offsets) < 20
    # 360 one-second buckets with ~2.8 each: judge in 10-second buckets (fair 27.8).
    assert max(Counter(int(o // 10) for o in offsets).values()) <= 2 * 1000 / 36


def test_deferral_remembers_what_the_message_waited_for(tmp_path, monkeypatch):
    cfg = queue_dir(tmp_path, monkeypatch)
    qmgr = FakeQmgr(cfg, RetrySettings(recovery_rate=Rate(10, 1)))
    aq = ActiveQueue(qmgr)  # type: ignore[arg-type]
    (tmp_path / "active" / qid(1)).write_bytes(b"x")
    am = SimpleNamespace(queue_id=qid(1), path=f"active/{qid(1)}",
                         waits={("smtp", "a.example"), ("smtp", "b.example")},
                         qf=SimpleNamespace(create_time=time.time()))
    aq.defer(am)  # type: ignore[arg-type]
    assert qmgr.retry is not None
    reg = qmgr.retry.registry
    assert reg.count(("smtp", "a.example")) == reg.count(("smtp", "b.example")) == 1
    qmgr.retry.fed(qid(1))
    assert len(reg) == 0 and not reg.of and not reg.by_dest


# -- the registry ------------------------------------------------------------------------


def test_registry_takes_a_destinations_ids_in_deferral_order():
    reg = Registry(100)
    a, b = ("smtp", "a.example"), ("smtp", "b.example")
    reg.remember("Q1", [a])
    reg.remember("Q2", [a, b])
    reg.remember("Q3", [b])
    reg.remember("Q1", [a])  # deferred again: now the most recent
    assert reg.take(a) == ["Q2", "Q1"]
    assert reg.take(a) == []
    assert reg.count(b) == 2 and len(reg) == 2
    reg.forget("Q2")
    assert reg.take(b) == ["Q3"]
    assert len(reg) == 0 and not reg.of and not reg.by_dest and not reg._keys


def test_registry_is_bounded_and_forgets_the_longest_deferred_first():
    reg = Registry(1000)
    a, b = ("smtp", "a.example"), ("smtp", "b.example")
    for i in range(3000):
        reg.remember(f"A{i}", [a])
        reg.remember(f"B{i}", [b])
    assert len(reg) == 1000 and reg.evicted == 5000
    ids = reg.take(a)
    assert ids == [f"A{i}" for i in range(2500, 3000)]
    assert len(reg.of) == 500


def test_registry_memory_per_remembered_message():
    """What deferred_recovery_limit costs: the README's figure comes from here."""
    import tracemalloc

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    reg = Registry(20_000)
    for i in range(20_000):
        # Fresh key tuples and id strings per message, as the daemon makes them.
        reg.remember(f"{0x10000 + i:05X}20E{i % 10}", [("smtp", f"d{i % 50}.example")])
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    print(f"registry: {used / 20_000:.0f} bytes a remembered message, "
          f"{used / 2**20:.1f} MiB for 20,000")
    assert used / 20_000 < 400


# -- the core's half -----------------------------------------------------------------------


#: What each scheduler's events decided about recovery, in order (the core returns
#: its decisions per event; these tests read them across several events).
_NOTED: weakref.WeakKeyDictionary[Scheduler, tuple[list, list]] = weakref.WeakKeyDictionary()


def note(s: Scheduler, d: Decisions) -> Decisions:
    waits_, recovered_ = _NOTED.setdefault(s, ([], []))
    waits_ += d.waits
    recovered_ += d.recovered
    return d


def recovered(s: Scheduler) -> list:
    return _NOTED.setdefault(s, ([], []))[1]


def sched(shaping: Shaping | None = None, **params: int) -> Scheduler:
    p = {"destination_recipient_limit": 1, "initial_destination_concurrency": 2,
         "destination_concurrency_limit": 20, "failed_cohort_limit": 1, **params}
    s = Scheduler(lambda n: Params(**p), policies=PolicyTable(load("nqmgr")),
                  shaping_for=(lambda name: shaping) if shaping else None,
                  min_backoff_time=300)
    s.watch_recovery()
    return s


def send(s: Scheduler, name: str, dest: str = "d.example", now: float = 0.0) -> Message:
    m = Message(name, now)
    note(s, s.assign(m, [Route("smtp", dest, dest, Recipient(0, f"r@{dest}"))], now=now))
    return m


def deliver_all(s: Scheduler, status: int, hop: Dsn | None, now: float) -> list[str]:
    """Every entry agents would take now, answered with (status, hop)."""
    done = []
    while (name := s.allocate()) is not None:
        e = note(s, s.select(name, now)).deliver
        if e is None:
            continue
        done.append((e, e.queue.transport.name))
    for e, transport in done:
        note(s, s.done(e, status if transport != RETRY else 1,
                       hop if transport != RETRY else Dsn("4.4.1", "retry"), False, now))
    return [e.message.queue_id for e, _ in done]


def waits(s: Scheduler) -> set[tuple[str, str, str]]:
    waits_ = _NOTED.setdefault(s, ([], []))[0]
    got = {(m.queue_id, t, q) for m, t, q in waits_}
    waits_.clear()
    return got


def test_a_dead_destination_is_watched_and_its_mail_noted():
    s = sched()
    for i in range(4):
        send(s, f"M{i}")
    deliver_all(s, 1, REFUSED, 1.0)  # two in flight fail: the site dies
    assert ("smtp", "d.example") in (s.recovery_watch or {})
    assert "Connection refused" in s.recovery_watch[("smtp", "d.example")]
    # The two that failed and the two moved to the retry transport all wait for it.
    assert waits(s) == {(f"M{i}", "smtp", "d.example") for i in range(4)}
    send(s, "M9", now=2.0)  # new mail for the dead site goes to retry: noted too
    assert waits(s) == {("M9", "smtp", "d.example")}
    assert not recovered(s)


def test_delivering_again_after_revival_reports_the_recovery():
    s = sched()
    send(s, "M0")
    send(s, "M1")
    deliver_all(s, 1, REFUSED, 1.0)
    s.tick(400.0)  # minimal_backoff_time passed: the site is alive again
    send(s, "M2", now=400.0)
    deliver_all(s, 0, None, 401.0)
    (rec,) = recovered(s)
    assert rec[:3] == ("smtp", "d.example", "d.example")
    assert rec[3].startswith("it was dead (4.4.1 connect to")
    assert not s.recovery_watch, "watched until it delivers, then no more"
    recovered(s).clear()
    send(s, "M3", now=402.0)
    deliver_all(s, 0, None, 403.0)
    assert not recovered(s), "one recovery per death"


def test_a_hop_failure_that_kills_nothing_watches_nothing():
    s = sched(failed_cohort_limit=5, initial_destination_concurrency=5)
    send(s, "M0")
    deliver_all(s, 1, REFUSED, 1.0)
    assert waits(s) == {("M0", "smtp", "d.example")}, "the message still notes the site"
    assert not s.recovery_watch
    send(s, "M1", now=2.0)
    deliver_all(s, 0, None, 3.0)
    assert not recovered(s)


def test_a_throttled_destination_recovers_only_once_the_throttling_is_over():
    rules = tuple(parse_rules("/4\\.7\\.28/ throttle window=0.5 quiet=10s ttl=1m\n", "rules"))
    s = sched(Shaping(rules=rules), initial_destination_concurrency=4)
    throttled = Dsn("4.7.28", "host mx said: 421 4.7.28 unusual rate")
    for i in range(4):
        send(s, f"M{i}")
    got = []
    while (name := s.allocate()) is not None:
        e = note(s, s.select(name, 1.0)).deliver
        if e is not None:
            got.append(e)
    note(s, s.done(got[0], 1, throttled, False, 1.0))
    assert "matched rules, line 1" in s.recovery_watch[("smtp", "d.example")]
    assert waits(s) == {("M0", "smtp", "d.example")}
    note(s, s.done(got[1], 0, None, False, 1.5))
    assert not recovered(s), "a success while the rule holds the window down"
    for when in (12.0, 23.0, 34.0, 45.0, 56.0, 67.0, 78.0):
        note(s, s.open_gates(when))
    assert s.transports["smtp"].queues["d.example"].shape.rule is None
    note(s, s.done(got[2], 0, None, False, 80.0))
    assert [r[:2] for r in recovered(s)] == [("smtp", "d.example")]


def test_a_dead_transport_watches_every_destination_it_held():
    s = sched()
    send(s, "A", "a.example")
    send(s, "B", "b.example")
    s.allocate()
    note(s, s.allocation_failed("smtp", Dsn("4.3.0", "mail transport unavailable"), 1.0))
    assert set(s.recovery_watch or {}) == {("smtp", "a.example"), ("smtp", "b.example")}
    send(s, "C", "c.example", now=2.0)
    assert ("C", "smtp", "c.example") in waits(s)
    assert ("smtp", "c.example") in (s.recovery_watch or {})


def test_recovery_off_notes_nothing():
    s = Scheduler(lambda n: Params(initial_destination_concurrency=2),
                  policies=PolicyTable(load("nqmgr")), min_backoff_time=300)
    send(s, "M0")
    send(s, "M1")
    deliver_all(s, 1, REFUSED, 1.0)
    note(s, s.tick(400.0))
    send(s, "M2", now=400.0)
    deliver_all(s, 0, None, 401.0)
    assert s.recovery_watch is None and not waits(s) and not recovered(s)


# -- the paced recovery -------------------------------------------------------------------


def deferred_files(tmp_path, cfg: QmgrConfig, ids: list[str], mtime: float) -> None:
    for q in ids:
        path = tmp_path / mail_queue.queue_path("deferred", q, cfg.hash_queue_names,
                                                cfg.hash_queue_depth)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
        os.utime(path, (mtime, mtime))


def test_recovery_brings_files_forward_at_the_rate(tmp_path, monkeypatch):
    cfg = queue_dir(tmp_path, monkeypatch)
    qmgr = FakeQmgr(cfg, RetrySettings(recovery_rate=Rate(50, 1)))
    retry = qmgr.retry
    assert retry is not None
    key = ("smtp", "d.example")
    ids = [qid(i) for i in range(40)]
    later = time.time() + 3600
    deferred_files(tmp_path, cfg, ids, later)
    for q in ids:
        retry.registry.remember(q, [key])
    os.unlink(mail_queue.queue_path("deferred", ids[5], cfg.hash_queue_names,
                                    cfg.hash_queue_depth))  # retried meanwhile

    async def run() -> float:
        t0 = time.monotonic()
        retry.recover("smtp", "d.example", "d.example", "it was dead (4.4.1 refused)")
        assert retry.status(time.monotonic())["recovering"]
        await asyncio.gather(*qmgr.tasks)
        return t0

    t0 = asyncio.run(run())
    times = [t for t, _, _ in qmgr.fed]
    assert [q for _, q, _ in qmgr.fed] == ids[:5] + ids[6:], "oldest deferral first"
    assert all(m <= time.time() for _, _, m in qmgr.fed), "mtime set to now before feeding"
    span = times[-1] - t0
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    print(f"recovery at 50/1s: 39 files in {span:.3f} s, smallest gap {min(gaps) * 1000:.1f} "
          "ms")
    assert 39 / 50 * 0.9 <= span <= 39 / 50 + 0.5
    assert sum(1 for g in gaps if g < 0.01) <= 2, "paced, not a burst"
    first, last = qmgr.log.lines[0], qmgr.log.lines[-1]
    assert first.startswith("deferred recovery: d.example (smtp) delivers again after it "
                            "was dead (4.4.1 refused): bringing 40 deferred messages "
                            "forward at 50/s (deferred_recovery_rate)")
    assert last.startswith("deferred recovery: d.example (smtp): 39 deferred messages "
                           "brought forward in ")
    assert last.endswith(", 1 no longer in deferred/")
    st = retry.status(time.monotonic())
    assert (st["recoveries"], st["brought_forward"], st["recovering"]) == (1, 39, [])


def test_recovery_waits_for_room_in_the_active_queue(tmp_path, monkeypatch):
    cfg = queue_dir(tmp_path, monkeypatch)
    qmgr = FakeQmgr(cfg, RetrySettings(recovery_rate=Rate(100, 1)))
    retry = qmgr.retry
    assert retry is not None
    ids = [qid(i) for i in range(5)]
    deferred_files(tmp_path, cfg, ids, time.time() + 3600)
    for q in ids:
        retry.registry.remember(q, [("smtp", "d.example")])
    qmgr.room = False

    async def run() -> None:
        retry.recover("smtp", "d.example", "d.example", "why")
        await asyncio.sleep(0.2)
        assert not qmgr.fed
        assert all(os.stat(mail_queue.queue_path("deferred", q, cfg.hash_queue_names,
                                                  cfg.hash_queue_depth)).st_mtime
                   > time.time() for q in ids), "nothing touched while there is no room"
        qmgr.room = True
        await asyncio.gather(*qmgr.tasks)

    asyncio.run(run())
    assert len(qmgr.fed) == 5


# -- settings and status ------------------------------------------------------------------


def settings(text: str):
    return retry_settings(from_text(text, PATH))


def test_off_unless_set():
    assert settings("") is None
    assert settings("deferred_retry_jitter = 0\ndeferred_recovery_rate = 0\n") is None
    assert settings("deferred_recovery_limit = 5\n") is None


def test_settings_parse():
    s = settings("deferred_retry_jitter = 10m\n")
    assert s is not None and (s.jitter, s.jitter_share, s.recovery_rate) == (600, 0, None)
    s = settings("deferred_retry_jitter = 25%\ndeferred_recovery_rate = 20/1s\n"
                 "deferred_recovery_limit = 1000\n")
    assert s is not None and s.jitter_share == 0.25 and s.recovery_rate == Rate(20, 1)
    assert s.recovery_limit == 1000
    assert parse_jitter("90", "x") == (90, 0)


@pytest.mark.parametrize("text, error", [
    ("deferred_retry_jitter = soon", "parameter deferred_retry_jitter: bad duration"),
    ("deferred_retry_jitter = 150%", "parameter deferred_retry_jitter: a percentage"),
    ("deferred_retry_jitter = 2d", "parameter deferred_retry_jitter: '2d' is more than a day"),
    ("deferred_recovery_rate = 20", "parameter deferred_recovery_rate: bad rate"),
    ("deferred_recovery_rate = 1/1s\ndeferred_recovery_limit = 0",
     "parameter deferred_recovery_limit: value 0 is out of range"),
])
def test_bad_settings_name_the_file_and_parameter(text, error):
    with pytest.raises(PyqmgrCfError) as exc:
        settings(text + "\n")
    assert str(exc.value).startswith(f"{PATH}: {error}")


def test_status_text():
    reply = {"messages": 0, "recipients": 0, "transports": [], "destinations": [],
             "deferred_retry": {
                 "jitter": "10m", "jittered": 12, "recovery_rate": "20/s",
                 "remembered": 30, "remembered_destinations": 2, "remembered_limit": 20000,
                 "recoveries": 1, "brought_forward": 7,
                 "recovering": [{"destination": "[127.0.0.1]:2525", "transport": "smtp",
                                 "why": "it was dead (4.4.1 refused)", "total": 10,
                                 "brought_forward": 7, "gone": 1, "left": 2, "for": 0.4}]}}
    text = "\n".join(status_lines(reply))
    assert ("deferred retry: jitter 10m (12 retry times jittered); recovery at 20/s: 30 "
            "deferred messages remembered for 2 destinations (limit 20000), 1 recoveries "
            "brought 7 forward") in text
    assert "[127.0.0.1]:2525  smtp       7/10" in text
    assert "it was dead (4.4.1 refused)" in text


def test_start_says_what_is_on_and_explain_names_the_remembered_mail(tmp_path, monkeypatch):
    cfg = queue_dir(tmp_path, monkeypatch)
    qmgr = FakeQmgr(cfg, RetrySettings(jitter=900, jitter_text="15m",
                                       recovery_rate=Rate(20, 1)))
    qmgr.scheduler = SimpleNamespace(recovery_watch=None,
                                     watch_recovery=lambda: setattr(
                                         qmgr.scheduler, "recovery_watch", {}))
    retry = qmgr.retry
    assert retry is not None
    retry.start()
    assert qmgr.scheduler.recovery_watch == {}
    assert qmgr.log.lines == [
        "deferred retry: deferred_retry_jitter = 15m: up to 15m added to each deferred "
        "message's retry time",
        "deferred retry: deferred_recovery_rate = 20/s: deferred mail of a dead or "
        "throttled destination is brought forward when it delivers again (at most 20000 "
        "queue ids remembered)"]
    key = ("smtp", "[10.0.0.5]:25")
    qmgr.scheduler.recovery_watch[key] = "it was dead (4.4.1 refused)"
    retry.registry.remember("Q1", [key])
    retry.registry.remember("Q2", [key])
    (reason,) = retry.explain("[10.0.0.5]:25")
    assert reason["setting"] == "deferred_recovery_rate"
    assert reason["text"] == (
        "2 deferred messages for [10.0.0.5]:25 (smtp) wait for their retry time; they are "
        "brought forward when it delivers again after it was dead (4.4.1 refused), at "
        "20/s")
    assert retry.explain("other.example") == []
