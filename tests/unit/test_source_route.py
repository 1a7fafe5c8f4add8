"""The choice at routing shared by the daemon and the simulator
(pyqmgr/scheduler/source_route.py): a pool with no warm member asks for the site it
waits for."""

from __future__ import annotations

from types import SimpleNamespace

from pyqmgr.scheduler.core import RETRY, Route, Scheduler
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.source import DAY, Pool, SourceBook, WarmupPlan
from pyqmgr.scheduler.source_route import SourceRouter
from pyqmgr.scheduler.structures import SiteLimits, SiteTable
from pyqmgr.settings.sources import parse_start
from tests.unit.params import Params

TODAY = parse_start("2026-11-29")


def router(cold: tuple[str, ...]) -> tuple[Scheduler, SourceRouter]:
    s = Scheduler(lambda n: Params(destination_recipient_limit=1),
                  sites=SiteTable(lambda t: SiteLimits(10, f"{t}_site_concurrency_limit")))
    book = SourceBook({"bulk": Pool("bulk", ("src1", "src2"), (1, 1))},
                      WarmupPlan(((0, 3),), DAY), dict.fromkeys(cold, TODAY))
    maps = SimpleNamespace(transports=frozenset({"smtp"}),
                           pool_for=lambda tenant, cls: "bulk")
    return s, SourceRouter(book, maps, None, s, lambda: TODAY + 3600, lambda: None)


def test_a_pool_of_cold_sources_asks_for_the_site_it_waits_for() -> None:
    s, r = router(("src1", "src2"))
    m = Message("Q1", 0.0)
    rcpt = Recipient(0, "a@d0.example")
    transport, why = r.route(m, rcpt, "smtp", "d0.example")
    assert transport == RETRY and "for a site not known yet" in why
    d = s.assign(m, [Route(transport, why, why, rcpt)], now=1.0)
    assert d.resolve == ("d0.example",), "the lookup no queue of this mail would ask"
    again = r.route(Message("Q2", 0.0), Recipient(0, "b@d0.example"), "smtp", "d0.example")
    assert again[0] == RETRY
    assert s.assign(Message("Q2", 0.0), [], now=1.0).resolve == (), "asked once"
    s.site_learnt("d0.example", "google", 1e12, 2.0)
    assert r.route(Message("Q3", 0.0), Recipient(0, "c@d0.example"), "smtp",
                   "d0.example")[0] in ("src1", "src2")


def test_a_warm_member_takes_the_mail_of_a_site_not_known_yet_without_a_lookup() -> None:
    s, r = router(("src1",))
    transport, nexthop = r.route(Message("Q1", 0.0), Recipient(0, "a@d0.example"), "smtp",
                                 "d0.example")
    assert (transport, nexthop) == ("src2", "d0.example")
    assert s.out.take().resolve == ()
