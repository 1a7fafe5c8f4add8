"""Delivery events assembled for the daemon: the writer thread, the reader, the categories.

Kept apart from :mod:`pyqmgr.daemon.qmgr` so that the daemon's part is one line that
makes it and the three calls that feed it (a request's flags, a reply, a message
leaving); everything the feature is made of stays in :mod:`pyqmgr.events`.
"""

from __future__ import annotations

import asyncio
import atexit
from typing import TYPE_CHECKING

from pyqmgr.events.stream import EventStream
from pyqmgr.events.tracker import DeliveryEvents, NoEvents
from pyqmgr.events.writer import EventWriter

if TYPE_CHECKING:
    from pyqmgr.events.settings import EventSetup
    from pyqmgr.postfix.config import QmgrConfig
    from pyqmgr.postfix.maillog_client import MailLog
    from pyqmgr.scheduler.core import Scheduler


def delivery_events(setup: EventSetup | None, cfg: QmgrConfig, log: MailLog,
                    loop: asyncio.AbstractEventLoop, scheduler: Scheduler) -> NoEvents:
    """The reader and its writer, started, with the start-up scan for trace logs of
    messages no longer queued done; :class:`NoEvents` when events are off.

    Made in the queue directory after the privilege drop (the trace logs are read
    there, the events file through the directory opened before). The writer is
    stopped at exit (atexit: what it still holds is written, for at most 5 s); were
    it not, nothing is lost: the trace logs stay until their events are written.
    """
    if setup is None:
        return NoEvents()
    found = setup.settings
    stream = _stream(setup, log)
    writer = EventWriter(setup.dir_fd, found.name, found.size_limit, found.keep,
                         log.warning, loop, stream.put if stream is not None else None)
    def class_name(rank: int) -> str:
        names = scheduler.class_names
        return names[rank] if 0 <= rank < len(names) else ""

    events = DeliveryEvents(writer, cfg.hash_queue_names, cfg.hash_queue_depth,
                            log.warning, log.info, setup.categorize, class_name,
                            stream.stats if stream is not None else None)
    if stream is not None:
        stream.start()
        atexit.register(stream.stop)  # registered first: runs after the writer's stop
    writer.start()
    atexit.register(writer.stop)
    events.leftovers()
    return events


def _stream(setup: EventSetup, log: MailLog) -> EventStream | None:
    """The Redis stream's thread (not started), with a client of its own for the
    fleet's endpoint: one connection, the fleet's timeout."""
    fleet = setup.fleet
    if fleet is None or not setup.settings.stream:
        return None
    from pyqmgr.fleet.client import make_redis

    endpoint, timeout = fleet.endpoint, fleet.timeout
    return EventStream(lambda: make_redis(endpoint, timeout, max_connections=1),
                       fleet.prefix + setup.settings.stream,
                       setup.settings.stream_max_length, timeout, log.warning)


__all__ = ["delivery_events"]
