"""Log lines in Postfix's own format, through postlogd or syslog (``maillog_client.c``).

Admins' scripts and pflogsumm parse these lines, so the format is stock's to the byte:
``Mmm dd HH:MM:SS host postfix/qmgr[pid]: [severity: ]text``. With ``maillog_file`` set,
each line is one datagram to ``public/postlog`` (connected before any chroot and kept for
the life of the process); otherwise it goes to syslog with ident ``postfix/qmgr`` and the
pid option, as Postfix's ``openlog(LOG_PID|LOG_NDELAY, LOG_MAIL)`` does.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import syslog
import time

INFO = "info"
WARNING = "warning"
ERROR = "error"
FATAL = "fatal"
PANIC = "panic"

#: Postfix cuts log text at this many characters.
_TEXT_LIMIT = 2000

#: A run of non-printable bytes or of UTF-8 (lead byte + continuation bytes).
_UNPRINTABLE = re.compile(rb"[\xc2-\xfe][\x80-\xbf]+|[^\x20-\x7e]")


def printable(text: str, utf8: bool = True) -> str:
    """Stock's ``printable(text, '?')`` applied to every logged line (msg_output.c).

    Control characters and bytes that are neither ASCII nor (with smtputf8_enable)
    a UTF-8 lead byte followed by continuation bytes become ``?``, so a hostile
    address cannot forge or split log lines.
    """
    if text.isascii() and text.isprintable():
        return text
    raw = text.encode("utf-8", "surrogateescape")

    def fix(m: re.Match[bytes]) -> bytes:
        run = m.group(0)
        if utf8 and len(run) > 1:
            return run
        return b"?" * (1 if len(run) == 1 else len(run))

    return _UNPRINTABLE.sub(fix, raw).decode("utf-8", "surrogateescape")

_SYSLOG_LEVEL = {
    INFO: syslog.LOG_INFO,
    WARNING: syslog.LOG_WARNING,
    ERROR: syslog.LOG_ERR,
    FATAL: syslog.LOG_CRIT,
    PANIC: syslog.LOG_CRIT,
}

_FACILITIES = {
    "auth": syslog.LOG_AUTH,
    "authpriv": getattr(syslog, "LOG_AUTHPRIV", syslog.LOG_AUTH),
    "cron": syslog.LOG_CRON,
    "daemon": syslog.LOG_DAEMON,
    "ftp": getattr(syslog, "LOG_FTP", syslog.LOG_DAEMON),
    "kern": syslog.LOG_KERN,
    "lpr": syslog.LOG_LPR,
    "mail": syslog.LOG_MAIL,
    "news": syslog.LOG_NEWS,
    "security": syslog.LOG_AUTH,
    "syslog": syslog.LOG_SYSLOG,
    "user": syslog.LOG_USER,
    "uucp": syslog.LOG_UUCP,
    **{f"local{i}": getattr(syslog, f"LOG_LOCAL{i}") for i in range(8)},
}


class MailLog:
    """The process-wide logger; created early, re-pointed once main.cf is known."""

    def __init__(self, tag: str, pid: int | None = None) -> None:
        self.tag = tag
        self.pid = pid if pid is not None else os.getpid()
        self.hostname = "amnesiac"
        self._sock: socket.socket | None = None
        self._syslog = False
        self.stderr = False
        #: smtputf8_enable: UTF-8 text is printable (stock's util_utf8_enable).
        self.utf8 = True
        # The line prefix changes once a second; formatting it per line costs.
        self._stamp_time = -1
        self._prefix = ""

    def use_postlog(self, socket_path: str, hostname: str) -> None:
        """Send lines as datagrams to postlogd; connect now, before chroot."""
        self._close()
        self._stamp_time = -1
        self.hostname = hostname.split(".", 1)[0] or "amnesiac"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.connect(socket_path)
        except OSError:
            # Daemons have no fallback: like Postfix, drop lines silently.
            sock.close()
            sock = None  # type: ignore[assignment]
        self._sock = sock
        self._syslog = False

    def use_syslog(self, facility: str = "mail") -> None:
        self._close()
        syslog.openlog(
            self.tag, syslog.LOG_PID | syslog.LOG_NDELAY, _FACILITIES.get(facility, syslog.LOG_MAIL)
        )
        self._syslog = True

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._syslog:
            syslog.closelog()
            self._syslog = False

    def log(self, severity: str, text: str) -> None:
        if severity != INFO:
            text = f"{severity}: {text}"
        text = printable(text[:_TEXT_LIMIT], self.utf8)
        if self.stderr:
            print(f"{self.tag}: {text}", file=sys.stderr, flush=True)
        if self._syslog:
            syslog.syslog(_SYSLOG_LEVEL[severity], text)
            return
        sock = self._sock
        if sock is None:
            return
        now = int(time.time())
        if now != self._stamp_time:
            self._stamp_time = now
            self._prefix = (f"{time.strftime('%b %d %H:%M:%S', time.localtime(now))} "
                            f"{self.hostname} {self.tag}[{self.pid}]: ")
        line = self._prefix + text
        with contextlib.suppress(OSError):
            sock.send(line.encode("utf-8", "surrogateescape"))

    def info(self, text: str) -> None:
        self.log(INFO, text)

    def warning(self, text: str) -> None:
        self.log(WARNING, text)

    def error(self, text: str) -> None:
        self.log(ERROR, text)

    def fatal(self, text: str) -> None:
        self.log(FATAL, text)
