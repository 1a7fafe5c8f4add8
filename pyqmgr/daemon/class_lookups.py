"""Classes and tenants asked of proxymap(8), off the event loop (issue #45, item 4).

A ``proxy:`` table is asked key by key (:mod:`pyqmgr.postfix.proxymap`), and each ask
is a blocking exchange with proxymap. Asked while qmgr loads a message, on the event
loop, a slow table stalled every delivery, reply and scan: a 120-label sender domain
made 122 asks for one message, about 250 ms at 2 ms an ask. With a ``proxy:`` table
among the class, tenant or weight tables, the daemon now classifies each message in
one worker thread: the loop hands the envelope over and goes on serving; the answer
comes back as a callback on the loop, which then routes the message as before.

Each message's asks are capped (proxymap.Budget: 16 asks and 0.1 s, parent-domain
keys past ten labels not asked): what was not asked takes the defaults, as a
table's miss does, and a paced warning says how many messages were cut so. One
thread, so the asks keep their order and share one proxymap connection; messages
whose answers are cached are as quick as before, only a thread hop later.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from pyqmgr.postfix.proxymap import MESSAGE_ASKS, MESSAGE_SECONDS, Budget, ProxyTable
from pyqmgr.settings.classes import NO_TENANT, Classifier, Envelope

#: Seconds between two warnings of messages cut short by their budget.
WARN_EVERY = 60.0

#: Told the message's class rank, tenant and weight.
Classified = Callable[[int, str, int], None]


def proxied(classifier: Classifier) -> list[ProxyTable]:
    """The classifier's ``proxy:`` tables (none: it never leaves the loop)."""
    tables = [*classifier.class_tables, *classifier.tenant_tables, *classifier.weight_tables]
    return [t.proxy for t in tables if t.proxy is not None]


class ClassLookups:
    """One worker thread that classifies messages whose tables include ``proxy:``."""

    def __init__(self, classifier: Classifier, warn: Callable[[str], None],
                 loop: asyncio.AbstractEventLoop) -> None:
        self.classifier = classifier
        self.loop = loop
        self.warn = warn
        self.tables = proxied(classifier)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="pyqmgr-classes",
                                       initializer=self._own)
        # What the worker says is logged by the loop: the log is not the thread's.
        classifier.warn = self._from_worker(classifier.warn)
        for table in self.tables:
            table.warn = self._from_worker(table.warn)
        #: Messages whose budget ran out (for the paced warning and status).
        self.cut = 0
        self._cut_unsaid = 0
        self._said_at = -WARN_EVERY

    def _from_worker(self, warn: Callable[[str], None]) -> Callable[[str], None]:
        def said(text: str) -> None:
            self.loop.call_soon_threadsafe(warn, text)
        return said

    def _own(self) -> None:
        """The worker's first act: the tables answer from the cache to anyone else
        (the loop's look into incoming/ asks too: it must not wait on proxymap)."""
        for table in self.tables:
            table.owner = threading.current_thread()

    def submit(self, env: Envelope, done: Classified) -> None:
        """Classify ``env`` in the worker; ``done`` is called on the loop."""
        future = self.pool.submit(self._classify, env)
        future.add_done_callback(
            lambda f: self.loop.call_soon_threadsafe(self._done, f, done))

    def _classify(self, env: Envelope) -> tuple[int, str, int, bool]:
        budget = Budget(time.monotonic(), MESSAGE_ASKS, MESSAGE_SECONDS)
        for table in self.tables:
            table.budget = budget
        rank, tenant = self.classifier.classify(env)
        weight = self.classifier.weight(tenant) if tenant else 1
        return rank, tenant, weight, budget.cut

    def _done(self, future: Future[tuple[int, str, int, bool]], done: Classified) -> None:
        if future.cancelled():
            return  # shutting down: the message stays in active/ for the next start
        try:
            rank, tenant, weight, cut = future.result()
        except Exception as exc:  # noqa: BLE001 - a defect must not lose the message
            self.warn(f"classes: lookup failed: {type(exc).__name__}: {exc}: the "
                      "message takes the default class and tenant")
            rank, tenant, weight, cut = self.classifier.default_rank, NO_TENANT, 1, False
        if cut:
            self._note_cut()
        done(rank, tenant, weight)

    def _note_cut(self) -> None:
        self.cut += 1
        self._cut_unsaid += 1
        now = time.monotonic()
        if now - self._said_at < WARN_EVERY:
            return
        self.warn(f"classes: {self._cut_unsaid} message(s) asked proxymap more than "
                  f"{MESSAGE_ASKS} keys or {MESSAGE_SECONDS:g} s (a sender domain of "
                  "many labels, or a slow table): the keys not asked took the defaults")
        self._said_at = now
        self._cut_unsaid = 0

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
