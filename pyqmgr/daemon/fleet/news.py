"""News of throttling between a fleet's servers (issue #23), signed (issue #31).

A destination one server finds dead, or that a response rule throttles, is news for
the others: told on the fleet's throttling channel, signed with the fleet's key
(:class:`pyqmgr.fleet.shared.NoticeSeal`), and heard by the others, which apply it
with the core's ``learnt`` (which routes nothing). Without a key file there is no
news at all: the channel is anyone's who can reach Redis.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pyqmgr.fleet.client import RedisUnavailable
from pyqmgr.fleet.shared import NoticeSeal
from pyqmgr.postfix.policy_delegation import WarnGate
from pyqmgr.scheduler.decisions import DEAD

if TYPE_CHECKING:
    from pyqmgr.daemon.host import QmgrCore
    from pyqmgr.fleet.settings import FleetSettings
    from pyqmgr.fleet.shared import Shared
    from pyqmgr.scheduler.decisions import Throttling


class FleetNews:
    def __init__(self, host: QmgrCore, shared: Shared, settings: FleetSettings,
                 counters: dict[str, int], clock: Callable[[], float]) -> None:
        self.host, self.shared, self.settings = host, shared, settings
        self.counters, self.clock = counters, clock
        self.warn = WarnGate(60.0)
        #: Signs what this node tells and opens what it hears; None without a key file.
        self.seal = NoticeSeal(settings.key, settings.prefix) if settings.key else None

    def tell(self, found: tuple[Throttling, ...], shared: Callable[[str], bool]) -> None:
        """Destinations this server just found dead or throttled: news for the others
        (``shared``: whether the transport's throttling is the fleet's)."""
        if self.seal is None:
            return
        for news in found:
            if shared(news.transport):
                self.host.spawn(self._tell(self.seal.seal(
                    news, self.settings.node, self.shared.instance, time.time()), news))

    async def _tell(self, notice: str, news: Throttling) -> None:
        try:
            await self.shared.tell_throttling(notice)
            self.counters["throttling_told"] += 1
        except RedisUnavailable as exc:
            state = "dead" if news.kind == DEAD else "throttled"
            self.host.log.warning(
                f"shared state {self.settings.endpoint}: the fleet did not hear that "
                f"{news.nexthop} ({news.transport}) is {state}: {exc}")

    def heard(self, payload: bytes, shared: Callable[[str], bool]) -> None:
        """Another server found a destination dead or throttled: so it is here."""
        if self.seal is None:
            return
        try:
            notice = self.seal.open(payload, time.time())
        except ValueError as exc:
            self.counters["throttling_refused"] += 1
            held = self.warn.allow(self.clock())
            if held is not None:
                more = f" ({held} more since the last warning)" if held else ""
                self.host.log.warning(
                    f"shared state {self.settings.endpoint}: refused a notice of throttling: "
                    f"{exc}{more}; this warning at most once a minute")
            return
        news = notice.news
        if notice.instance == self.shared.instance or not shared(news.transport):
            return
        self.counters["throttling_heard"] += 1
        self.host.after_control(self.host.scheduler.learnt(news, notice.node, self.clock()))
