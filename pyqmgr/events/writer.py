"""The events file: JSON lines appended by a thread of its own, rotated by size.

Why a thread: a write or an fsync can take long (a slow disk, a full one being
retried), and the queue manager's event loop must never wait for one: mail is never
delayed by events. The loop hands batches to :meth:`EventWriter.submit` (a bounded
queue, O(1)); the thread writes what has gathered, fsyncs once for all of it, and
then calls each batch's ``done`` back on the loop. The daemon removes a message's
trace log only in that callback, so a crash at any point leaves the trace log on
disk for the next qmgr to read again: events are repeated, never lost.

When the file cannot be written (disk full, permission, the directory gone), the
thread warns (the first time, then at most once a minute with a count), truncates
what it half wrote, and tries the same batch again every :data:`RETRY_DELAY` seconds;
new batches wait in the queue up to :data:`MAX_QUEUED` events, and past that are
dropped from memory (counted): their trace logs stay, unread again until the next
start-up's scan for left-over trace logs, so they are late, not lost.

Rotation is by size, as logrotate's ``size``: when a write would take the file past
``size_limit``, NAME.(k-1) becomes NAME.k for k down to 2, NAME becomes NAME.1, and
NAME.(keep+1) goes. The file is opened relative to a directory descriptor opened
before the chroot (:func:`open_directory`), so it lives outside the queue directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pyqmgr.postfix.policy_delegation import WarnGate

#: Events held in memory at most (about 500 bytes each).
MAX_QUEUED = 100_000
#: Seconds between tries to write after a failure.
RETRY_DELAY = 1.0
#: Seconds between repeated warnings of one kind.
WARN_EVERY = 60.0
#: Longest the thread gathers batches before it writes (the fsync's batching).
GATHER = 0.05


@dataclass
class WriterStats:
    """Counted for status and metrics."""

    written: int = 0
    batches: int = 0
    fsyncs: int = 0
    rotations: int = 0
    failures: int = 0
    #: Events dropped from memory because the queue was full (their trace logs stay).
    held_back: int = 0
    queued: int = 0
    last_error: str = ""

    def as_json(self) -> dict[str, object]:
        return {"written": self.written, "fsyncs": self.fsyncs, "rotations": self.rotations,
                "failures": self.failures, "held_back": self.held_back,
                "queued": self.queued, "last_error": self.last_error or None}


@dataclass
class _Batch:
    lines: list[bytes]
    done: Callable[[], None] | None
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = sum(len(line) for line in self.lines)


class Paced:
    """A warning said the first time and then at most once per ``every`` seconds, with
    how many were kept quiet: :class:`WarnGate`'s rule, as a callable."""

    def __init__(self, warn: Callable[[str], None], every: float = WARN_EVERY) -> None:
        self.warn = warn
        self.gate = WarnGate(every)

    def __call__(self, text: str) -> None:
        quiet = self.gate.allow(time.monotonic())
        if quiet is None:
            return
        more = f" ({quiet} more since the last such warning)" if quiet else ""
        self.warn(text + more)


def open_directory(path: str) -> int:
    """The events file's directory, opened (as root, before the chroot)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


class EventWriter:
    """The thread and its queue. ``sink`` (optional) also gets each batch's lines
    (the Redis stream); it must not raise and must bound its own time."""

    def __init__(self, dir_fd: int, name: str, size_limit: int, keep: int,
                 warn: Callable[[str], None], loop: asyncio.AbstractEventLoop | None,
                 sink: Callable[[list[bytes]], None] | None = None,
                 max_queued: int = MAX_QUEUED) -> None:
        self.dir_fd = dir_fd
        self.name = name
        self.size_limit = size_limit
        self.keep = keep
        self.loop = loop
        self.sink = sink
        self.max_queued = max_queued
        self.stats = WriterStats()
        self.warn = Paced(warn)
        self._queue: deque[_Batch] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._fd = -1
        self._size = 0
        self._thread = threading.Thread(target=self._run, name="pyqmgr-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- the loop's side ------------------------------------------------------------------

    def submit(self, lines: list[bytes], done: Callable[[], None] | None = None) -> bool:
        """Queue a batch; False (nothing queued, ``done`` never called) when full."""
        with self._cond:
            if self.stats.queued + len(lines) > self.max_queued:
                self.stats.held_back += len(lines)
                return False
            self._queue.append(_Batch(lines, done))
            self.stats.queued += len(lines)
            self._cond.notify()
        return True

    def stop(self, timeout: float = 5.0) -> None:
        """Write what is queued (for at most ``timeout`` seconds) and end the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def mtime(self) -> float:
        """When the events file last changed (0: there is none)."""
        try:
            return os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False).st_mtime
        except OSError:
            return 0.0

    def recent(self, qids: set[str],
               limit: int = 8 << 20) -> dict[str, dict[str, dict[str, object]]]:
        """The last event written of each of ``qids`` and of each of their recipients
        (``found[qid][recipient]``; ``found[qid][""]``: the message's last of all), from
        the file's last ``limit`` bytes (and the newest rotated file's): at start-up,
        before the thread runs, so that the events of a trace log left by a kill -9 get
        the keys they had, and each recipient its own request's transport."""
        found: dict[str, dict[str, dict[str, object]]] = {}
        needles = {qid: f'"queue_id":"{qid}"'.encode() for qid in qids}
        for name in (f"{self.name}.1", self.name):
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dir_fd)
            except OSError:
                continue
            try:
                size = os.fstat(fd).st_size
                data = os.pread(fd, limit, max(0, size - limit))
            finally:
                os.close(fd)
            for line in data.split(b"\n"):
                for qid, needle in needles.items():
                    if needle in line:
                        with contextlib.suppress(ValueError):
                            obj = json.loads(line)
                            if isinstance(obj, dict):
                                mine = found.setdefault(qid, {})
                                mine[""] = obj
                                rcpt = obj.get("recipient")
                                if isinstance(rcpt, str) and rcpt:
                                    mine[rcpt] = obj
        return found

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if not self._queue:
                    break
            if not self._stop:
                time.sleep(GATHER)
            with self._cond:
                batches = list(self._queue)
            if self._write(batches):
                with self._cond:
                    for _ in batches:
                        self._queue.popleft()
                    self.stats.queued -= sum(len(b.lines) for b in batches)
                self._done(batches)
            elif self._stop:
                break
            else:
                time.sleep(RETRY_DELAY)
        self._close()

    def _write(self, batches: list[_Batch]) -> bool:
        data = b"".join(line for b in batches for line in b.lines)
        start = -1
        try:
            if self._fd < 0:
                self._open()
            if self._size > 0 and self._size + len(data) > self.size_limit:
                self._rotate()
            start = self._size
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            os.fsync(self._fd)
        except OSError as exc:
            self._failed(exc, start)
            return False
        self._size += len(data)
        self.stats.written += sum(len(b.lines) for b in batches)
        self.stats.batches += len(batches)
        self.stats.fsyncs += 1
        if self.sink is not None:
            self.sink([line for b in batches for line in b.lines])
        return True

    def _failed(self, exc: OSError, start: int) -> None:
        self.stats.failures += 1
        why = exc.strerror or errno.errorcode.get(exc.errno or 0, str(exc))
        self.stats.last_error = why
        if start >= 0 and self._fd >= 0:
            # Cut what was half written, as the bounce daemon does with its logs.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)
        self._close()
        self.warn(f"delivery_events_file {self.name}: {why}; events wait in memory "
                  f"({self.stats.queued} now) and their trace logs are kept")

    def _open(self) -> None:
        self._fd = os.open(self.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                           | os.O_NOFOLLOW, 0o640, dir_fd=self.dir_fd)
        self._size = os.fstat(self._fd).st_size

    def _rotate(self) -> None:
        self._close()
        name, d = self.name, self.dir_fd
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{name}.{self.keep}", dir_fd=d)
        for k in range(self.keep - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.rename(f"{name}.{k}", f"{name}.{k + 1}", src_dir_fd=d, dst_dir_fd=d)
        if self.keep > 0:
            os.rename(name, f"{name}.1", src_dir_fd=d, dst_dir_fd=d)
        else:
            os.unlink(name, dir_fd=d)
        self.stats.rotations += 1
        self._open()

    def _close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1

    def _done(self, batches: list[_Batch]) -> None:
        calls = [b.done for b in batches if b.done is not None]
        if not calls:
            return
        if self.loop is None:
            for call in calls:
                call()
            return
        with contextlib.suppress(RuntimeError):  # the loop closed: the process ends
            self.loop.call_soon_threadsafe(_call_all, calls)


def _call_all(calls: list[Callable[[], None]]) -> None:
    for call in calls:
        call()


__all__ = ["GATHER", "MAX_QUEUED", "EventWriter", "Paced", "WriterStats", "open_directory"]
