"""Looking into a test-bed instance's queue (a part of PostfixInstance).

Tests judge a queue manager by what is left in the queue and what was removed, so the
queue directories are read directly (hashed subdirectories included) besides asking
``postqueue``, and the waits say what is still queued when they time out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

from pyqmgr.postfix import mail_queue
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

    def queue_file_bytes(self, queue: str) -> list[bytes]:
        """The complete files of one queue, as this instance's cleanup wrote them."""
        out = []
        for dirpath, _dirs, files in os.walk(os.path.join(self.queue_dir, queue)):
            for name in sorted(f for f in files if f.isalnum()):
                with open(os.path.join(dirpath, name), "rb") as f:
                    out.append(f.read())
        return out

    def clone_queue_files(self, templates: Sequence[bytes], count: int,
                          queue: str = "incoming", mtime: float | None = None
                          ) -> list[str]:
        """Write ``count`` copies of real queue files into ``queue`` under new ids.

        Field-sized benchmarks need 20,000 to 200,000 queued messages; cleanup writes a
        few thousand a minute here, so a few hundred real ones (:meth:`preload` and
        :meth:`queue_file_bytes`, or another instance's) are copied round-robin
        instead: the queue id is only the file's name, and the copies are what
        cleanup wrote, byte for byte. Names are short (hexadecimal) ids spread over
        the hash directories like real ones, and each ends in its file's inode number
        as Postfix's own do (``postfix start`` renames any that does not, under a
        running qmgr). Files are the mail owner's, mode 0700 (complete), with ``mtime``
        (default now): in deferred/, a past time is due at the next scan. Call it
        while no qmgr runs (after :meth:`preload` or :meth:`disable_qmgr`, before
        :meth:`release_preload`), as cleanup's own files would be.
        """
        if not templates:
            raise ValueError("clone_queue_files needs at least one template")
        uid, gid = self.mail_owner_ids()
        names = self.postconf("-h", "hash_queue_names")
        depth = int(self.postconf("-h", "hash_queue_depth"))
        qids = []
        for i in range(count):
            temp = os.path.join(self.queue_dir, queue, f"clone.{os.getpid()}.{i}")
            with open(temp, "xb") as f:
                f.write(templates[i % len(templates)])
                os.fchown(f.fileno(), uid, gid)
                os.fchmod(f.fileno(), 0o700)
                inode = os.fstat(f.fileno()).st_ino
            # A short id: five hex digits of microseconds, then the inode number.
            qid = f"{(i * 7919) % 1_000_000:05X}{inode:X}"
            relative = mail_queue.mail_queue_path(queue, qid, names, depth)
            where = os.path.join(self.queue_dir, queue)
            for level in os.path.dirname(relative).split("/")[1:]:
                where = os.path.join(where, level)
                if not os.path.isdir(where):  # as Postfix makes them: the owner's, 0700
                    os.mkdir(where, 0o700)
                    os.chown(where, uid, gid)
            path = os.path.join(self.queue_dir, relative)
            os.rename(temp, path)
            if mtime is not None:
                os.utime(path, (mtime, mtime))
            qids.append(qid)
        return qids

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
