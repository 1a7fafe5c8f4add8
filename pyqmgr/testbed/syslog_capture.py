"""Capture what Postfix daemons send to syslog, without touching a real syslogd.

When the machine has no ``/dev/log``, a datagram listener is created there for the
test's duration. When it has one, the listener lives in a temp dir and the instance is
started inside a private mount namespace where it is bind-mounted over ``/dev/log``, so
only that instance's daemons talk to it.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
import threading

DEV_LOG = "/dev/log"
_PAYLOAD = re.compile(r"^<(\d+)>(\w{3} [ \d]\d \d\d:\d\d:\d\d) ([^\[\s]+)\[(\d+)\]: (.*)$", re.S)


class SyslogCapture:
    def __init__(self) -> None:
        self.own_dev_log = not os.path.exists(DEV_LOG)
        if self.own_dev_log:
            self.path = DEV_LOG
        else:
            self._dir = tempfile.mkdtemp(prefix="pyqmgr-syslog-")
            self.path = os.path.join(self._dir, "log")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        os.chmod(self.path, 0o666)
        self.sock.settimeout(0.2)
        self.records: list[tuple[int, str, str, int, str]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def start_prefix(self) -> str:
        """Shell words to put before ``postfix start`` so the instance logs to us."""
        if self.own_dev_log:
            return ""
        return (f"unshare -m --propagation private sh -c "
                f"'mount --bind {self.path} {DEV_LOG} && exec \"$0\" \"$@\"' ")

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            m = _PAYLOAD.match(data.decode("utf-8", "replace"))
            if m:
                self.records.append((int(m.group(1)), m.group(2), m.group(3),
                                     int(m.group(4)), m.group(5)))

    def lines(self, program: str) -> list[tuple[int, str]]:
        """(priority, text) of each record from ``program``, e.g. ``postfix/qmgr``."""
        return [(pri, text) for pri, _t, prog, _pid, text in list(self.records)
                if prog == program]

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close()
        os.unlink(self.path)
        if not self.own_dev_log:
            os.rmdir(self._dir)

    def __enter__(self) -> SyslogCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
