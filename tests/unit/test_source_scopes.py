"""A source is a transport, so the per-transport machinery makes every limit per source
(issue #46): one test per claim docs/sources.md makes, on the scheduler core, and the
daemon's glue that counts a cold source's deliveries through the scope chain."""

from __future__ import annotations

from types import SimpleNamespace

from pyqmgr.daemon.sources import Sources, parse_state
from pyqmgr.fleet.shared import Shared
from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.queue import Dsn
from pyqmgr.scheduler.shaping import Shaping, parse_rules
from pyqmgr.scheduler.site import QUIT_GRACE
from pyqmgr.scheduler.source import DAY, WarmupPlan, source_kinds
from pyqmgr.scheduler.structures import SiteLimits, SiteTable
from pyqmgr.settings.sources import SourceSettings, parse_start
from tests.unit.params import Params

SOURCES = ("src1", "src2")
DOMAINS = [f"d{i}.example" for i in range(3)]
RULES = "/4\\.7\\.28/  throttle window=0.5 quiet=30s step=1 ttl=5m\n"
REPLY = Dsn("4.7.28", "host mx[192.0.2.1] said: 421 4.7.28 unusual rate of mail from "
                      "your IP address")


def sched(limit: int = 2) -> Scheduler:
    table = SiteTable(lambda t: SiteLimits(limit, f"{t}_site_concurrency_limit"),
                      pinned={d: "google" for d in DOMAINS})
    rules = parse_rules(RULES, "rules")
    return Scheduler(lambda n: Params(destination_recipient_limit=1,
                                      initial_destination_concurrency=5),
                     sites=table, shaping_for=lambda name: Shaping(rules=rules))


def mail(s: Scheduler, source: str, dest: str, n: int) -> Message:
    m = Message(f"Q{source}{dest}", 0.0)
    s.assign(m, [Route(source, dest, dest, Recipient(i, f"r{i}@{dest}")) for i in range(n)])
    return m


def drain(s: Scheduler, source: str, now: float = 1.0) -> list:
    out = []
    while (e := s.select(source, now).deliver) is not None:
        out.append(e)
    return out


def test_a_site_is_per_source_and_its_limit_counts_per_source() -> None:
    s = sched(limit=2)
    for source in SOURCES:
        for d in DOMAINS:
            mail(s, source, d, 5)
    assert len(drain(s, "src1")) == 2 and len(drain(s, "src2")) == 2
    assert set(s.sites.sites) == {("src1", "google"), ("src2", "google")}  # type: ignore[union-attr]


def test_a_throttling_reply_slows_that_source_at_that_site_only() -> None:
    s = sched(limit=8)
    for source in SOURCES:
        for d in DOMAINS:
            mail(s, source, d, 10)
    one, two = drain(s, "src1", 0.0), drain(s, "src2", 0.0)
    site1, site2 = one[0].queue.site, two[0].queue.site
    s.done(one[0], 1, REPLY, False, 1.0)
    s.tick(1.0 + QUIT_GRACE)
    assert site1.bound == 4, "src1 at google capped"
    assert site2.bound is None or site2.bound == 8, "src2 at google untouched"
    s.done(two[0], 0, None, False, 1.0)
    s.tick(1.0 + QUIT_GRACE)
    assert len(drain(s, "src2", 2.0)) == 1


def test_the_fleets_site_units_are_per_source() -> None:
    shared = SimpleNamespace(prefix="pyqmgr:")
    one = Shared.key(shared, "sessions", "src1", "site google")  # type: ignore[arg-type]
    two = Shared.key(shared, "sessions", "src2", "site google")  # type: ignore[arg-type]
    assert one != two and "src1" in one and "src2" in two


class _Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, text: str) -> None:
        self.lines.append(text)

    warning = info


def _sources(s: Scheduler, now: float) -> Sources:
    today = parse_start("2026-11-29")
    settings = SourceSettings({"bulk": (("src1", 1), ("src2", 1))}, [], frozenset({"smtp"}),
                              WarmupPlan(((0, 3),), DAY), {"src1": today})
    host = SimpleNamespace(scheduler=s, log=_Log())
    sources = Sources(host, settings, None, None, clock=lambda: now)  # type: ignore[arg-type]
    sources.settings = SimpleNamespace(pool_for=lambda tenant, cls: "bulk")  # type: ignore[assignment]
    return sources


def test_a_cold_sources_count_follows_its_deliveries_through_the_scope_chain() -> None:
    """Reserved at routing, kept when delivered, given back when the entry ends unsent
    (here: the source's transport is throttled, which defers its todo entries)."""
    now = parse_start("2026-11-29") + 3600
    s = sched(limit=8)
    sources = _sources(s, now)
    m = Message("Q1", 0.0)
    routes = []
    for i in range(8):
        r = Recipient(i, f"r{i}@d0.example")
        transport, nexthop = sources.route(m, r, "smtp", "d0.example")
        routes.append(Route(transport, nexthop, nexthop, r))
    routes.sort(key=lambda r: r.transport)
    assert [r.transport for r in routes].count("src1") == 3
    s.assign(m, routes)
    pair = ("src1", "google")
    assert sources.book.counts[pair] == 3 and sources.book.left.get(pair, 0) == 0
    first = drain(s, "src1", 1.0)
    assert sources.book.left[pair] == len(first) == 3
    s.done(first[0], 0, None, False, 2.0)
    assert sources.book.counts[pair] == 3, "delivered: stays counted"
    s.done(first[1], 1, REPLY, False, 2.0)
    assert sources.book.counts[pair] == 3, "its agent took it: stays counted"
    assert sources.book.snapshot()["counts"] == [["src1", "google", 3]]


def test_a_todo_entry_ending_unsent_gives_its_count_back() -> None:
    now = parse_start("2026-11-29") + 3600
    s = sched(limit=8)
    sources = _sources(s, now)
    m = Message("Q1", 0.0)
    r = Recipient(0, "r0@d0.example")
    assert sources.route(m, r, "smtp", "d0.example") == ("src1", "d0.example")
    s.assign(m, [Route("src1", "d0.example", "d0.example", r)])
    assert sources.book.counts[("src1", "google")] == 1
    # The source's agent is unreachable: its todo entry moves to the retry transport,
    # which defers it; the count comes back when that entry ends.
    s.throttle_transport("src1", Dsn("4.3.0", "agent unreachable"), 1.0)
    assert sources.book.counts[("src1", "google")] == 1
    retry = drain(s, "retry", 1.0)
    assert len(retry) == 1
    s.done(retry[0], 1, None, False, 1.5)
    assert sources.book.counts[("src1", "google")] == 0


def test_the_core_counts_a_cold_source_with_the_kinds_beside_its_book() -> None:
    """What drives the core without the daemon (the simulator) takes the same scope
    kinds from scheduler/source.py: reserved at choice, left when an agent takes it,
    kept when delivered, given back when a todo entry ends unsent at the retry
    transport; ``changed`` hears each count that a restart would keep."""
    now = parse_start("2026-11-29") + 3600
    s = sched(limit=8)
    today = parse_start("2026-11-29")
    book = SourceSettings({"bulk": (("src1", 1), ("src2", 1))}, [], frozenset({"smtp"}),
                          WarmupPlan(((0, 3),), DAY), {"src1": today}).book()
    changes: list[int] = []
    kind, retried = source_kinds(book, lambda: changes.append(1))
    s.transport("src1").chain += (kind,)
    s.transport("retry").chain += (retried,)
    m = Message("Q1", 0.0)
    chosen = [(book.choose("bulk", "google", now, r, []), r)
              for r in (Recipient(i, f"r{i}@d0.example") for i in range(4))]
    assert [c for c, _ in chosen] == ["src1", "src2", "src1", "src2"]
    s.assign(m, [Route(c, "d0.example", "d0.example", r) for c, r in chosen if c == "src1"])
    pair = ("src1", "google")
    first = s.select("src1", 1.0).deliver  # one agent: the other entry stays todo
    assert first is not None and book.left[pair] == 1 and changes == [1]
    s.done(first, 0, None, False, 2.0)
    assert book.counts[pair] == 2 and book.left[pair] == 1, "delivered: stays counted"
    s.throttle_transport("src1", Dsn("4.3.0", "agent unreachable"), 2.0)
    retry = drain(s, "retry", 2.0)
    assert len(retry) == 1
    s.done(retry[0], 1, None, False, 2.5)
    assert book.counts[pair] == 1 and book.left[pair] == 1, "the unsent one given back"


def test_a_site_not_known_goes_warm_and_the_state_keeps_known_sites() -> None:
    now = parse_start("2026-11-29") + 3600
    s = sched()
    sources = _sources(s, now)
    m = Message("Q1", 0.0)
    picks = {sources.route(m, Recipient(i, "r@new.example"), "smtp", "new.example")[0]
             for i in range(6)}
    assert picks == {"src2"}
    sources.route(m, Recipient(9, "r@d0.example"), "smtp", "d0.example")
    s.sites.known["x.example"] = ("google", now + 60)  # type: ignore[union-attr]
    sources.route(m, Recipient(10, "r@x.example"), "smtp", "x.example")
    assert sources.domain_sites == {"x.example": "google"}
    body = (b'{"version": 1, "window": 1, "window_seconds": 86400, "counts": [], '
            b'"sites": [["x.example", "google"]]}')
    assert parse_state(body)[3] == [("x.example", "google")]


def test_a_message_of_no_pool_and_other_transports_keep_their_route() -> None:
    s = sched()
    sources = _sources(s, parse_start("2026-11-29"))
    m = Message("Q1", 0.0)
    assert sources.route(m, Recipient(0, "r@a"), "relay", "a") == ("relay", "a")
    sources.settings = SimpleNamespace(pool_for=lambda tenant, cls: None)  # type: ignore[assignment]
    sources.pools.clear()
    assert sources.route(m, Recipient(0, "r@a"), "smtp", "a") == ("smtp", "a")


def test_a_dead_sources_share_goes_to_the_others_meanwhile() -> None:
    s = sched()
    sources = _sources(s, parse_start("2026-11-29") + DAY * 40)  # src1 warm by now
    m = Message("Q1", 0.0)
    pick = lambda i: sources.route(m, Recipient(i, "r@d0.example"), "smtp",  # noqa: E731
                                   "d0.example")[0]
    assert {pick(i) for i in range(4)} == {"src1", "src2"}
    s.throttle_transport("src1", Dsn("4.3.0", "agent unreachable"), 1.0)
    assert {pick(i) for i in range(4, 8)} == {"src2"}
    s.throttle_transport("src2", Dsn("4.3.0", "agent unreachable"), 1.0)
    assert {pick(i) for i in range(8, 12)} == {"src1", "src2"}, "all dead: as before"


def test_without_sites_for_the_cold_sources_each_domain_is_its_own_site() -> None:
    table = SiteTable(lambda t: SiteLimits(2, "x") if t == "src2" else None)
    s = Scheduler(lambda n: Params(destination_recipient_limit=1), sites=table)
    sources = _sources(s, parse_start("2026-11-29") + 3600)
    m = Message("Q1", 0.0)
    got = [sources.route(m, Recipient(i, "r@new.example"), "smtp", "new.example")[0]
           for i in range(8)]
    assert got.count("src1") == 3 and sources.book.counts == {("src1", "new.example"): 3}


def _with_state(tmp_path, body: bytes | None):  # type: ignore[no-untyped-def]
    import os

    from pyqmgr.daemon.suspensions import StateFile

    if body is not None:
        (tmp_path / "sources.json").write_bytes(body)
    state = StateFile(os.open(tmp_path, os.O_RDONLY), str(tmp_path))
    s = sched()
    now = parse_start("2026-11-29") + 3600
    sources = _sources(s, now)
    sources.state = state
    sources.restore()
    os.close(state.dir_fd)
    return sources, int(now // DAY)


def test_the_state_file_restores_this_windows_counts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    window = int((parse_start("2026-11-29") + 3600) // DAY)
    body = (f'{{"version": 1, "window": {window}, "window_seconds": 86400, '
            '"counts": [["src1", "google", 2], ["gone", "google", 5]], '
            '"sites": [["a.example", "google"]]}').encode()
    sources, _ = _with_state(tmp_path, body)
    assert sources.book.counts == {("src1", "google"): 2}
    assert sources.domain_sites == {"a.example": "google"}
    assert sources.host.log.lines == [  # type: ignore[attr-defined]
        f"sources: 1 counts of this day's warm-up restored from {tmp_path}/sources.json"]


def test_a_bad_state_file_is_a_warning_and_counts_start_from_zero(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for body, why in [(b"{not json", "not JSON"),
                      (b'{"version": 7}', "not a version 1 sources' state file"),
                      (b'{"version": 1, "window": 1, "window_seconds": 86400, '
                       b'"counts": [["src1", 3]]}', "a count that is not [source, site, n")]:
        sources, _ = _with_state(tmp_path, body)
        assert sources.book.counts == {}
        (line,) = sources.host.log.lines  # type: ignore[attr-defined]
        assert why in line and "start from zero" in line and "one more window's plan" in line
    sources, _ = _with_state(tmp_path, b'{"version": 1, "window": 3, "window_seconds": 86400, '
                                       b'"counts": [["src1", "google", 3]]}')
    assert sources.book.counts == {} and sources.host.log.lines == [], "another day's"  # type: ignore[attr-defined]


def test_the_state_file_is_written_atomically_and_read_back(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os

    from pyqmgr.daemon.suspensions import StateFile

    s = sched()
    now = parse_start("2026-11-29") + 3600
    sources = _sources(s, now)
    sources.state = StateFile(os.open(tmp_path, os.O_RDONLY), str(tmp_path))
    m = Message("Q1", 0.0)
    r = Recipient(0, "r@d0.example")
    sources.route(m, r, "smtp", "d0.example")
    sources.book.started(r)
    assert sources.save()
    assert os.listdir(tmp_path) == ["sources.json"]
    again = _sources(sched(), now + 60)
    again.state = sources.state
    again.restore()
    assert again.book.counts == {("src1", "google"): 1}
    os.close(sources.state.dir_fd)
