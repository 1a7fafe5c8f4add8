"""Putting mail into a test-bed instance (a part of PostfixInstance).

Through ``sendmail`` (maildrop and pickup) or SMTP (smtpd, one or several sessions),
and, to start a queue manager on a full queue, by preloading incoming/ while no qmgr
runs.
"""

from __future__ import annotations

import os
import smtplib
import threading
from collections.abc import Callable, Iterable, Sequence
from email.message import EmailMessage

from pyqmgr.testbed.instance_base import LOCAL_USER, SENDMAIL, Message, TestbedError
from pyqmgr.testbed.instance_processes import InstanceProcesses
from pyqmgr.testbed.instance_queue import InstanceQueue


class InstanceInjection(InstanceQueue, InstanceProcesses):
    """Submission, the mailbox local(8) writes, and preloading with qmgr off."""

    _disabled_qmgr_line: str | None
    _saved_in_flow_delay: str | None

    def sendmail(self, sender: str, recipients: list[str], subject: str = "test",
                 body: str = "hello\n", extra_args: Iterable[str] = ()) -> None:
        """Submit through ``sendmail -C DIR`` (maildrop, then pickup); waits for it."""
        text = (f"From: {sender}\nTo: {', '.join(recipients)}\nSubject: {subject}\n\n"
                f"{body}")
        self.run([SENDMAIL, "-C", self.config_dir, "-i", "-f", sender, *extra_args, "--",
              *recipients], input=text)

    def smtp_send(self, messages: Iterable[Message], subject: str = "test",
                  body: str | None = None) -> list[str]:
        """Send (sender, recipients) pairs in one SMTP session; return the queue ids.

        smtpd has the message in the queue (incoming) when it answers 250 to DATA.
        """
        qids = []
        with smtplib.SMTP("127.0.0.1", self.smtpd_port, timeout=60) as smtp:
            smtp.ehlo()
            for i, (sender, rcpts) in enumerate(messages):
                msg = EmailMessage()
                msg["From"] = sender
                msg["To"] = ", ".join(rcpts[:3])
                msg["Subject"] = f"{subject} {i}"
                msg.set_content(body if body is not None else f"message {i}\n")
                code, resp = smtp.mail(sender)
                if code != 250:
                    raise TestbedError(f"smtpd refused sender {sender}: {code} {resp!r}")
                for r in rcpts:
                    code, resp = smtp.rcpt(r)
                    if code >= 400:
                        raise TestbedError(f"smtpd refused {r}: {code} {resp!r}")
                code, resp = smtp.data(msg.as_bytes())
                if code != 250:
                    raise TestbedError(f"smtpd refused data: {code} {resp!r}")
                qids.append(resp.decode().rsplit(" ", 1)[-1])
        return qids

    def smtp_send_many(self, messages: Sequence[Message], sessions: int = 4,
                       subject: str = "test") -> list[str]:
        """Like :meth:`smtp_send`, over several parallel sessions; ids in input order."""
        sessions = max(1, min(sessions, len(messages)))
        if sessions == 1:
            return self.smtp_send(messages, subject)
        size = -(-len(messages) // sessions)
        chunks = [messages[i:i + size] for i in range(0, len(messages), size)]
        results: list[list[str] | BaseException] = [[] for _ in chunks]

        def send(k: int) -> None:
            try:
                results[k] = self.smtp_send(chunks[k], subject)
            except BaseException as exc:
                results[k] = exc

        threads = [threading.Thread(target=send, args=(k,)) for k in range(len(chunks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        qids: list[str] = []
        for r in results:
            if isinstance(r, BaseException):
                raise r
            qids.extend(r)
        return qids

    def mailbox(self, user: str = LOCAL_USER) -> str:
        """Path of a local user's mailbox file (may not exist yet)."""
        return os.path.join(self.mail_dir, user)

    # -- preloading the incoming queue ------------------------------------------------

    def disable_qmgr(self) -> str:
        """Comment the qmgr service out and wait for qmgr to exit; return its line."""
        line = self.postconf("-M", "qmgr/unix").strip()
        if not line:
            raise TestbedError("master.cf has no active qmgr/unix service")
        self.postconf("-M#", "qmgr/unix")
        self._disabled_qmgr_line = line
        if self.started:
            self.reload()
            self.wait_until(lambda: not self.pids("qmgr"), 10, "qmgr to exit")
        return line

    def enable_qmgr(self, line: str | None = None) -> None:
        """Restore the qmgr service line saved by :meth:`disable_qmgr` and reload."""
        line = line or self._disabled_qmgr_line
        if line is None:
            raise TestbedError("enable_qmgr: no saved qmgr line (disable_qmgr not called)")
        self.postconf("-Me", f"qmgr/unix={line}")
        self._disabled_qmgr_line = None
        if self.started:
            mark = self.maillog.mark()
            self.reload()
            # master(8) handles the reload in its own time: until it has, the qmgr
            # service has no listener, and a trigger sent at once (postkick, postqueue
            # -f) fails with "Cannot contact class public service qmgr" (seen under
            # load in the parity suite's W and I test). Its wakeup starts qmgr at once;
            # a qmgr that cannot start shows as master's line about its exit.
            self.wait_until(lambda: bool(self.pids("qmgr")) or bool(self.maillog.lines(
                "postfix/master", contains="qmgr pid", since=mark)), 20,
                "qmgr to start again")

    def preload(self, messages: int | Sequence[Message],
                recipients: Callable[[int], list[str]] | None = None,
                sender: str = "sender@test.example", sessions: int = 4,
                timeout: float = 300) -> list[str]:
        """Fill incoming/ while no qmgr runs; return the queue ids. Then :meth:`release_preload`.

        ``messages`` is a list of (sender, recipients) or a count, with ``recipients(i)``
        giving message i's recipients. The qmgr service is commented out and
        ``in_flow_delay`` is 0 while injecting: with no qmgr there are no flow-control
        tokens, and cleanup would otherwise wait 1 s per message. Returns when every
        message is a file in incoming/.
        """
        if not self.started:
            raise TestbedError("preload needs a started instance")
        if isinstance(messages, int):
            if recipients is None:
                raise TypeError("preload(n) needs recipients=lambda i: [...]")
            messages = [(sender, recipients(i)) for i in range(messages)]
        before = len(self.queue_files("incoming"))
        saved = self.postconf("-n", "in_flow_delay").partition(" = ")[2].strip()
        self._saved_in_flow_delay = saved or None
        self.set_main(in_flow_delay="0")
        self.disable_qmgr()  # its reload also gives cleanup the new in_flow_delay
        qids = self.smtp_send_many(messages, sessions=sessions)
        want = before + len(messages)
        self.wait_until(lambda: len(self.queue_files("incoming")) >= want, timeout,
                        f"{len(messages)} new files in incoming/")
        if self._saved_in_flow_delay is None:
            self.postconf("-X", "in_flow_delay")
        else:
            self.set_main(in_flow_delay=self._saved_in_flow_delay)
        return qids

    def release_preload(self) -> None:
        """Bring qmgr back after :meth:`preload`; it starts on the reload."""
        self.enable_qmgr()
