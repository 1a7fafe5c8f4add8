"""A re-injecting content filter on loopback, as amavis runs beside Postfix.

FILTER_README's "advanced" content filter: Postfix's ``content_filter`` sends every
message received by smtpd to the filter over SMTP (a transport of its own, here
``scan``); the filter looks at it and hands it back to a second smtpd that has no
content filter, and only then answers the first SMTP session. The first message's
delivery line reads ``status=sent (250 2.0.0 Ok: queued as ID)``, ID being the
re-injected copy, which is then delivered as any message is. This is the hop a real
server's maillog shows and ``pyqmgr replay`` follows through ``queued as``.
"""

from __future__ import annotations

import random
import smtplib
import threading

from pyqmgr.postfix.maillog import QUEUED_AS
from pyqmgr.simulator.scenario import Latency
from pyqmgr.testbed.instance import free_port
from pyqmgr.testbed.sink import SinkServer

#: The filter's transport name in master.cf and content_filter.
TRANSPORT = "scan"


class ContentFilter:
    """The filter's SMTP server and the master.cf and main.cf lines that use it.

    ``latency`` draws how long the filter holds each message (its scan).
    """

    def __init__(self, latency: Latency, process_limit: int, seed: int = 1) -> None:
        rng = random.Random(f"{seed} content filter")
        self._lock = threading.Lock()

        def hold(_address: str) -> float:
            with self._lock:
                return latency.draw(rng)

        self.process_limit = process_limit
        #: The second smtpd's port: mail handed back lands there.
        self.reinject_port = free_port()
        self.reinjected = 0
        self.errors: list[str] = []
        self.sink = SinkServer(latency=hold, latency_at="data", forward=self._reinject)
        self.port = self.sink.port

    def main_cf(self) -> dict[str, str]:
        return {"content_filter": f"{TRANSPORT}:[127.0.0.1]:{self.port}"}

    def master_cf(self) -> list[str]:
        """The filter transport and the re-injection smtpd (no filter, no checks that
        the first smtpd made already), as FILTER_README sets them up."""
        listen = f"127.0.0.1:{self.reinject_port}"
        return [
            f"{TRANSPORT} unix - - n - {self.process_limit} smtp",
            "  -o smtp_send_xforward_command=yes",
            "  -o disable_mime_output_conversion=yes",
            f"{listen} inet n - n - - smtpd",
            "  -o content_filter=",
            "  -o receive_override_options=no_unknown_recipient_checks,"
            "no_header_body_checks,no_milters",
            "  -o smtpd_recipient_restrictions=permit_mynetworks,reject",
            "  -o mynetworks=127.0.0.0/8",
            "  -o smtpd_authorized_xforward_hosts=127.0.0.0/8",
        ]

    def _reinject(self, sender: str, recipients: list[str], data: bytes) -> str:
        """Hand the message back to Postfix; answer with the queue id it got there.

        A failure to re-inject is answered 451, so the first message stays queued and
        is tried again, as a real filter that cannot pass mail on does."""
        try:
            with smtplib.SMTP("127.0.0.1", self.reinject_port, timeout=60) as smtp:
                smtp.ehlo("filter.test.example")
                code, resp = smtp.mail(sender)
                if code == 250:
                    for rcpt in recipients:
                        code, resp = smtp.rcpt(rcpt)
                        if code >= 400:
                            break
                if code < 400:
                    code, resp = smtp.data(data)
        except (OSError, smtplib.SMTPException) as exc:
            return self._failed(str(exc))
        text = resp.decode(errors="replace")
        match = QUEUED_AS.search(text)
        if code != 250 or match is None:
            return self._failed(f"{code} {text}")
        with self._lock:
            self.reinjected += 1
        return f"250 2.0.0 Ok: queued as {match.group(1)}"

    def _failed(self, why: str) -> str:
        with self._lock:
            self.errors.append(why)
        return f"451 4.3.0 re-injection failed: {why}"[:200].replace("\r", " ").replace(
            "\n", " ")

    def start(self) -> None:
        self.sink.start()

    def stop(self) -> None:
        self.sink.stop()
