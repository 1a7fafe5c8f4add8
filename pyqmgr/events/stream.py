"""Delivery events to a Redis stream (``delivery_events_stream``): XADD with a bound.

Why a thread of its own, with an event loop of its own: the fleet's client is
redis-py's asyncio client, made for the fleet's endpoint (a server, TLS, Sentinel or
a Cluster: :func:`pyqmgr.fleet.client.make_redis`), and a stalled Redis must delay
neither the queue manager's loop (mail is never delayed by events) nor the events
file's writer (the file is the record that loses nothing; a message's trace log
goes only once its events are fsynced there). So the writer hands each batch it
wrote to :meth:`EventStream.put` (O(1) a line, under a lock) and this thread sends
what gathered, in pipelined XADDs of at most :data:`CHUNK` events, each call bounded
by the fleet's ``shared_state_timeout``.

What the stream holds: one entry per event with two fields, ``key`` (the event's
key, the same in the file: a consumer keeps each key once) and ``event`` (the JSON
line). ``XADD ... MAXLEN ~ N`` keeps the stream near ``N`` entries
(``delivery_events_stream_max_length``): a consumer that falls that far behind loses
the oldest, which the file still has.

When Redis cannot be reached or refuses (down, stalled, ``NOPERM`` for an ACL
without ``xadd``), the thread warns (the first time, then at most once a minute with
a count) and tries again every :data:`RETRY_DELAY` seconds; meanwhile events wait in
memory up to :data:`MAX_PENDING`, and past that the oldest are dropped from the
stream (counted in ``pyqmgr status`` and the metrics; the file has them).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyqmgr.events.writer import Paced

#: Events held for the stream at most while Redis does not take them.
MAX_PENDING = 100_000
#: Events a pipeline carries at most.
CHUNK = 500
#: Seconds between tries after a failure.
RETRY_DELAY = 1.0
#: The default bound on the stream's length (``MAXLEN ~``).
DEFAULT_MAX_LENGTH = 1_000_000


@dataclass
class StreamStats:
    #: The stream's key (the fleet's prefix and delivery_events_stream).
    key: str = ""
    sent: int = 0
    pending: int = 0
    #: Events dropped from the stream (not the file) while Redis did not take them.
    dropped: int = 0
    failures: int = 0
    last_error: str = ""

    def as_json(self) -> dict[str, object]:
        return {**self.__dict__, "last_error": self.last_error or None}


def event_key(line: bytes) -> bytes:
    """The key of an encoded event (``{"v":N,"key":"K",...``), without parsing the
    line: the encoder writes the key second, as a JSON string with nothing to escape
    (a queue id, hex digits and dots)."""
    start = line.find(b'"key":"')
    if start < 0:
        return b""
    start += 7
    end = line.find(b'"', start)
    return line[start:end] if end > 0 else b""


class _Refused(Exception):
    """Redis answered an XADD with an error."""


class EventStream:
    """The stream's thread. ``make_client`` is called in the thread, inside its own
    event loop (the asyncio client belongs to the loop it first runs in)."""

    def __init__(self, make_client: Callable[[], Any], key: str, max_length: int,
                 timeout: float, warn: Callable[[str], None],
                 max_pending: int = MAX_PENDING, retry_delay: float = RETRY_DELAY) -> None:
        self.make_client = make_client
        self.key = key
        self.max_length = max_length
        self.timeout = timeout
        self.max_pending = max_pending
        self.retry_delay = retry_delay
        self.stats = StreamStats(key)
        self.warn = Paced(warn)
        self._pending: deque[bytes] = deque()
        #: Lines ever taken off the front (sent or dropped): a chunk in flight is
        #: found again by it after put() dropped some meanwhile.
        self._gone = 0
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="pyqmgr-events-stream",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, lines: list[bytes]) -> None:
        """The writer's sink: queue lines for the stream, dropping the oldest past
        the bound. Never waits for Redis."""
        with self._cond:
            self._pending.extend(lines)
            over = len(self._pending) - self.max_pending
            for _ in range(max(0, over)):
                self._pending.popleft()
            if over > 0:
                self._gone += over
                self.stats.dropped += over
            self.stats.pending = len(self._pending)
            self._cond.notify()

    def stop(self, timeout: float = 2.0) -> None:
        """Send what is pending (for at most ``timeout`` seconds) and end the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            asyncio.set_event_loop(loop)
            client = self._client()
            while self._next():
                with self._cond:
                    chunk = [self._pending[i] for i in range(min(CHUNK, len(self._pending)))]
                    first = self._gone
                if self._send(loop, client, chunk):
                    with self._cond:
                        # put() may have dropped some of the chunk meanwhile (they were
                        # sent all the same): take off what is left of it.
                        done = max(0, first + len(chunk) - self._gone)
                        for _ in range(done):
                            self._pending.popleft()
                        self._gone += done
                        self.stats.pending = len(self._pending)
                    self.stats.sent += len(chunk)
                elif not self._wait_retry():
                    break
            if client is not None:
                with contextlib.suppress(Exception):
                    loop.run_until_complete(asyncio.wait_for(client.aclose(), self.timeout))
        finally:
            loop.close()

    def _client(self) -> Any:
        try:
            return self.make_client()
        except Exception as exc:  # a bad endpoint was refused at start-up already
            self._failed(exc)
            return None

    def _next(self) -> bool:
        """Wait for events; False once stopped with nothing left."""
        with self._cond:
            while not self._pending and not self._stop:
                self._cond.wait()
            return bool(self._pending)

    def _wait_retry(self) -> bool:
        """After a failure: wait the retry delay (less when stopping); False: stop."""
        deadline = time.monotonic() + self.retry_delay
        with self._cond:
            while not self._stop:
                left = deadline - time.monotonic()
                if left <= 0:
                    return True
                self._cond.wait(left)
        return False

    def _send(self, loop: asyncio.AbstractEventLoop, client: Any, chunk: list[bytes]) -> bool:
        if client is None:
            self._failed(RuntimeError("no client for the fleet's Redis"))
            return False
        try:
            loop.run_until_complete(asyncio.wait_for(self._xadd(client, chunk),
                                                     self.timeout))
        except Exception as exc:  # any failure of the library or of Redis
            self._failed(exc)
            return False
        return True

    async def _xadd(self, client: Any, chunk: list[bytes]) -> None:
        pipe = client.pipeline(transaction=False)
        for line in chunk:
            pipe.xadd(self.key, {b"key": event_key(line), b"event": line.rstrip(b"\n")},
                      maxlen=self.max_length, approximate=True)
        replies = await pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, Exception):
                # An error reply (NOPERM, OOM, WRONGTYPE...): said as Redis said it.
                from pyqmgr.fleet.client import error_text

                raise _Refused(error_text(reply))

    def _failed(self, exc: BaseException) -> None:
        self.stats.failures += 1
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if isinstance(exc, _Refused):
            why = str(exc)
        elif isinstance(exc, TimeoutError | asyncio.TimeoutError):
            why = f"no answer within {self.timeout:g}s"
        self.stats.last_error = why
        self.warn(f"delivery_events_stream {self.key}: {why}; {len(self._pending)} events "
                  "wait for the stream (the events file has them)")


__all__ = ["CHUNK", "DEFAULT_MAX_LENGTH", "MAX_PENDING", "EventStream", "StreamStats",
           "event_key"]
