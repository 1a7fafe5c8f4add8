"""Looking into a test-bed instance's queue (a part of PostfixInstance).

Tests judge a queue manager by what is left in the queue and what was removed, so the
queue directories are read directly (hashed subdirectories included) besides asking
``postqueue``, and the waits say what is still queued when they time out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from pyqmgr.testbed.instance_base import QUEUES, InstanceBase, wait_until


class InstanceQueue(InstanceBase):
    """Queue files, queue waits and the ``postqueue``/``postsuper`` commands."""

    def queue_files(self, queue: str) -> list[str]:
        """Queue ids of the files in one queue directory, hashed subdirectories included.

        Names with anything but letters and digits (cleanup's ``usec.pid`` temporary
        files, for one) are not queue files yet and are left out.
        """
        found: list[str] = []
        for _dirpath, _dirs, files in os.walk(os.path.join(self.queue_dir, queue)):
            found.extend(f for f in files if f.isalnum())
        return found

    def queue_path(self, queue: str, qid: str) -> str | None:
        """Where a queue file is, or None."""
        for dirpath, _dirs, files in os.walk(os.path.join(self.queue_dir, queue)):
            if qid in files:
                return os.path.join(dirpath, qid)
        return None

    def queue_counts(self) -> dict[str, int]:
        return {q: len(self.queue_files(q)) for q in QUEUES}

    def queue_empty(self) -> bool:
        """No message in maildrop, incoming, active or deferred (hold is not counted)."""
        return not any(self.queue_files(q) for q in ("maildrop", "incoming", "active",
                                                      "deferred"))

    def wait_queue_empty(self, timeout: float) -> None:
        """Wait until :meth:`queue_empty`; the error lists what is still queued."""
        wait_until(self.queue_empty, timeout, "an empty queue", detail=lambda: (
            f" (still queued: {self.queue_counts()}); last maillog lines:\n"
            f"{self.maillog.tail(20)}"))

    def wait_removed(self, qids: Iterable[str], timeout: float = 10) -> None:
        """Wait for qmgr's ``removed`` line of every message in ``qids``.

        The queue file goes before its log line reaches the maillog (syslog or
        postlogd writes it a moment later), so an empty queue is not yet proof.
        """
        want = set(qids)

        def missing() -> set[str]:
            return want - {ln.queue_id for ln in self.maillog.lines()
                           if ln.text.endswith(": removed")}

        wait_until(lambda: not missing(), timeout, "a removed line for every message",
                   detail=lambda: f" (missing: {sorted(missing())})")

    def postqueue(self, *args: str) -> str:
        return self.run(["postqueue", "-c", self.config_dir, *args]).stdout

    def postsuper(self, *args: str) -> str:
        """``postsuper`` prints its reports on stderr; both streams are returned."""
        proc = self.run(["postsuper", "-c", self.config_dir, *args])
        return proc.stdout + proc.stderr

    def queue_json(self) -> list[dict[str, object]]:
        """``postqueue -j``: one dict per queued message (showq's view, no hold)."""
        out = self.postqueue("-j")
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def flush(self) -> None:
        """``postqueue -f``: deliver deferred mail now."""
        self.postqueue("-f")
