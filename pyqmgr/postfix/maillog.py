"""Reading the maillog: Postfix's log lines as syslog or postlogd(8) wrote them.

Two time stamp forms are read. The traditional syslog one (``Nov 24 00:51:12 host
postfix/qmgr[29414]: text``), which postlogd's ``maillog_file`` also writes, has no
year. The RFC 3339 one of rsyslog's high-precision template and journald exports
(``2026-11-24T00:51:12.123456+00:00 host ...``) has one. Files may be plain or gzip,
rotated (``mail.log.2.gz``, ``mail.log.1``, ``mail.log``, or ``mail.log-20261124``),
and read oldest first so that a year carries over New Year.

A log is read as it is, not trusted. Every line that is not a Postfix line with a
readable time stamp is skipped and counted by reason, never an error: other
programs' lines, garbage, lines going back in time, a gzip file cut short.
The reader yields plain tuples because a busy server's day is millions of lines.

The tag of a Postfix line is ``syslog_name/program``. A syslog_name may itself hold
slashes (``postfix/submission/smtpd``, or Debian's ``postfix/relay/smtp`` for a
transport named relay), so the instance is the tag's first part, the program its
last, and a delivery agent's transport the part before the program when there is one.
"""

from __future__ import annotations

import calendar
import datetime as dt
import gzip
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from typing import IO, NamedTuple

MONTHS = {m: i for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul",
                                      "Aug", "Sep", "Oct", "Nov", "Dec"), 1)}
#: How far a line may go back in time before it is out of order (syslog writes
#: lines from several processes slightly out of order).
BACKWARDS = 3600.0
#: Lines longer than this are skipped (syslog's own limits are 1-8 KB); a line is
#: never held whole past this, however long it is (a 60 MB line once cost 120 MB).
MAX_LINE = 16384
#: A gzip file that expands more than this many times over is not a maillog (those
#: expand 10-30x): reading stops there, with a reason (issue #31).
MAX_GZIP_RATIO = 200
#: ... counted after this much text, so that a small file's ratio is not judged.
GZIP_GRACE = 1 << 20


class GzipBomb(ValueError):
    """A gzip file that expands past MAX_GZIP_RATIO."""


def _bounded_lines(f: IO[str], compressed: Callable[[], int] | None) -> Iterator[str]:
    """The file's lines, each at most MAX_LINE + 1 characters long (a longer line is
    yielded as its first MAX_LINE + 1 characters, the rest read and dropped), and
    for gzip, GzipBomb past MAX_GZIP_RATIO."""
    text = 0
    limit = GZIP_GRACE if compressed is not None else -1
    while True:
        raw = f.readline(MAX_LINE + 1)
        if not raw:
            return
        text += len(raw)
        if len(raw) > MAX_LINE and not raw.endswith("\n"):
            # The rest of an endless line, dropped; a bomb with no newline at all is
            # stopped here too.
            while True:
                rest = f.readline(MAX_LINE)
                text += len(rest)
                if 0 <= limit < text:
                    limit = _ratio_check(text, compressed)
                if not rest or rest.endswith("\n"):
                    break
        if 0 <= limit < text:
            limit = _ratio_check(text, compressed)
        yield raw


def _ratio_check(text: int, compressed: Callable[[], int] | None) -> int:
    """GzipBomb past MAX_GZIP_RATIO; else how much text to read before the next check
    (every 64 KiB of text, not every line)."""
    assert compressed is not None
    if text > MAX_GZIP_RATIO * max(1, compressed()):
        raise GzipBomb(f"expands more than {MAX_GZIP_RATIO} times over")
    return text + 65536

_TRADITIONAL = re.compile(
    r"^(?P<mon>[A-Z][a-z]{2}) (?P<day>[ \d]\d) (?P<h>\d\d):(?P<m>\d\d):(?P<s>\d\d)"
    r"(?P<frac>\.\d{1,6})? (?P<host>\S+) (?P<tag>[^\s\[\]:]+)\[(?P<pid>\d{1,10})\]: "
    r"(?P<text>.*)$")
_ISO = re.compile(
    r"^(?P<stamp>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,9})?(?:Z|[+-]\d\d:?\d\d)?) "
    r"(?P<host>\S+) (?P<tag>[^\s\[\]:]+)\[(?P<pid>\d{1,10})\]: (?P<text>.*)$")
_NANOS = re.compile(r"(\.\d{6})\d+")
_ROTATED = re.compile(r"^(?P<base>.*?)(?:\.(?P<n>\d{1,4}))?(?:\.gz)?$")
_DATEEXT = re.compile(r"^(?P<base>.*?)-(?P<date>\d{8}(?:\d{2})?)(?:\.gz)?$")


class Line(NamedTuple):
    """One Postfix line: epoch seconds, host, instance, program, transport, pid, text."""

    time: float
    host: str
    instance: str
    program: str
    #: The service when the tag names one (``relay`` in ``postfix/relay/smtp``), else
    #: the program: a delivery agent's transport as master.cf names it.
    service: str
    pid: int
    text: str


class Skipped(Counter[str]):
    """Lines and files not read, by reason: the report's account of the input."""


def _rotation(path: str) -> tuple[str, int, str]:
    """(the log's name without rotation suffixes, its rank, its date suffix)."""
    name = os.path.basename(path)
    d = _DATEEXT.match(name)
    if d is not None:
        return (os.path.join(os.path.dirname(path), d["base"]), 0, d["date"])
    r = _ROTATED.match(name)
    assert r is not None
    base = os.path.join(os.path.dirname(path), r["base"])
    return (base, -int(r["n"]), "") if r["n"] is not None else (base, 1, "")


def order_files(paths: list[str]) -> list[str]:
    """Oldest first: rotated files of one log by their number or date, then the log.

    Logs of different names (two instances' files) are each read in one piece.
    """
    return sorted(paths, key=_rotation)


def _open(path: str) -> IO[str]:
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _compressed_position(f: IO[str]) -> Callable[[], int] | None:
    """How far into the compressed file a gzip text stream has read; None for plain."""
    buffer = getattr(f, "buffer", None)
    raw = getattr(buffer, "fileobj", None)
    if not isinstance(buffer, gzip.GzipFile) or raw is None:
        return None
    return raw.tell


def _first_month_day(path: str) -> tuple[int, int] | None:
    """(month, day) of the first traditional line of a file, if it starts with one."""
    try:
        with _open(path) as f:
            for _, raw in zip(range(50), f, strict=False):
                m = _TRADITIONAL.match(raw)
                if m is not None:
                    return MONTHS.get(m["mon"], 0), int(m["day"])
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    return None


def start_year(path: str) -> int:
    """The year of a file's first yearless line: its last change's year, or the one
    before when the first line's date is later in the year than that change."""
    mtime = dt.datetime.fromtimestamp(os.stat(path).st_mtime)
    first = _first_month_day(path)
    if first is not None and first > (mtime.month, mtime.day):
        return mtime.year - 1
    return mtime.year


class Reader:
    """Lines of several maillog files in order, with what was skipped and why."""

    def __init__(self, paths: list[str], year: int | None = None) -> None:
        self.paths = order_files(paths)
        self.year = year
        self.skipped = Skipped()
        self.lines = 0
        self.files = 0
        self.first: float | None = None
        self.last: float | None = None

    def __iter__(self) -> Iterator[Line]:
        base = None
        stream = _Stream(self.year)
        for path in self.paths:
            name_base = _rotation(path)[0]
            if name_base != base:
                base = name_base
                try:
                    year = self.year if self.year is not None else start_year(path)
                except OSError:
                    year = dt.date.today().year
                stream = _Stream(year)
            yield from self._file(path, stream)

    def _file(self, path: str, stream: _Stream) -> Iterator[Line]:
        skipped = self.skipped
        try:
            f = _open(path)
        except OSError as exc:
            skipped[f"file not readable ({exc.strerror})"] += 1
            return
        self.files += 1
        try:
            with f:
                for raw in _bounded_lines(f, _compressed_position(f)):
                    self.lines += 1
                    if len(raw) > MAX_LINE:
                        skipped["line too long"] += 1
                        continue
                    text = raw.rstrip("\n")
                    if not text.strip():
                        continue  # blank: nothing to skip
                    line = stream.parse(text, skipped)
                    if line is None:
                        continue
                    if self.first is None or line.time < self.first:
                        self.first = line.time
                    if self.last is None or line.time > self.last:
                        self.last = line.time
                    yield line
        except GzipBomb as exc:
            skipped[f"gzip file {exc} (read up to there)"] += 1
        except (EOFError, gzip.BadGzipFile, OSError, ValueError):
            # A gzip file cut short (a rotation caught mid-write) or not gzip at all.
            skipped["file cut short or not gzip (read up to the damage)"] += 1


class _Stream:
    """The time line of one log: the year of yearless stamps, and going back in time."""

    def __init__(self, year: int | None) -> None:
        self.year = year if year is not None else dt.date.today().year
        self.month = 0
        self.latest = float("-inf")
        self._stamp = ""
        self._epoch = 0.0

    def parse(self, raw: str, skipped: Counter[str]) -> Line | None:
        m = _TRADITIONAL.match(raw)
        if m is not None:
            stamp = raw[:15]
            if stamp != self._stamp:
                month = MONTHS.get(m["mon"])
                if month is None:
                    skipped["garbage"] += 1
                    return None
                if self.month >= 11 and month <= 2:
                    self.year += 1  # December's log went on into January
                try:
                    epoch = calendar.timegm((self.year, month, int(m["day"]), int(m["h"]),
                                             int(m["m"]), int(m["s"]), 0, 0, 0))
                    dt.date(self.year, month, int(m["day"]))
                except ValueError:
                    skipped["garbage"] += 1
                    return None
                self.month = month
                self._stamp, self._epoch = stamp, float(epoch)
            when = self._epoch + (float(m["frac"]) if m["frac"] else 0.0)
        else:
            m = _ISO.match(raw)
            if m is None:
                skipped["syslog lines of another form (no program[pid])"
                        if _looks_syslog(raw) else "garbage"] += 1
                return None
            try:
                # fromisoformat takes at most microseconds: cut nanoseconds.
                stamp_dt = dt.datetime.fromisoformat(_NANOS.sub(r"\1", m["stamp"]))
            except ValueError:
                skipped["garbage"] += 1
                return None
            if stamp_dt.tzinfo is None:
                stamp_dt = stamp_dt.replace(tzinfo=dt.UTC)
            when = stamp_dt.timestamp()
        if when < self.latest - BACKWARDS:
            skipped["out of order (back in time: another year's line?)"] += 1
            return None
        if when > self.latest:
            self.latest = when
        tag = m["tag"]
        if "/" not in tag or not tag.startswith("postfix"):
            skipped["other programs' lines"] += 1
            return None
        parts = tag.split("/")
        program = parts[-1]
        service = parts[-2] if len(parts) > 2 else program
        return Line(when, m["host"], parts[0], program, service, int(m["pid"]), m["text"])


def _looks_syslog(raw: str) -> bool:
    """A syslog line of some program, not noise: it starts with a time stamp."""
    return bool(re.match(r"^(?:[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d|\d{4}-\d\d-\d\dT)", raw))


# -- the texts of the lines a replay reads ------------------------------------------------

_DELIVERY = re.compile(
    r"^(?P<qid>[0-9A-Za-z]{5,20}): to=<(?P<to>[^>]*)>, (?:orig_to=<[^>]*>, )?"
    r"relay=(?P<relay>[^,]*), (?:conn_use=\d+, )?delay=(?P<delay>\d+(?:\.\d+)?), "
    r"delays=(?P<a>[\d.]+)/(?P<b>[\d.]+)/(?P<c>[\d.]+)/(?P<d>[\d.]+), "
    # Fields later releases add before dsn= (3.11's tls=) are passed over.
    r"(?:[a-z_]{1,20}=[^,]*, ){0,4}"
    r"dsn=(?P<dsn>\d\.\d{1,3}\.\d{1,3}), status=(?P<status>[a-z]+)(?: \((?P<detail>.*))?$")
_ACTIVE = re.compile(r"^(?P<qid>[0-9A-Za-z]{5,20}): from=<(?P<sender>[^>]*)>, "
                     r"size=(?P<size>\d+), nrcpt=(?P<nrcpt>\d+) \(queue active\)$")
_QID = re.compile(r"^(?P<qid>[0-9A-Za-z]{5,20}): (?P<rest>.*)$")
#: The queue id a receiving server gave the message, quoted in a delivery's detail
#: (``250 2.0.0 Ok: queued as 4F2A1C0D3E``); a content filter's hop names its copy so.
QUEUED_AS = re.compile(r"queued as ([0-9A-Za-z]{5,20})\b")
STATUSES = ("sent", "deferred", "bounced", "expired", "undeliverable", "deliverable")


class Delivery(NamedTuple):
    """A ``to=<...>, relay=..., delay=..., status=...`` line's fields."""

    qid: str
    to: str
    relay: str
    delay: float
    #: ``delays=a/b/c/d``: before the active queue (the last time it entered),
    #: waiting in it, connection set-up, transmission.
    a: float
    b: float
    c: float
    d: float
    dsn: str
    status: str
    detail: str


def delivery(text: str) -> Delivery | None:
    m = _DELIVERY.match(text)
    if m is None or m["status"] not in STATUSES:
        return None
    return Delivery(m["qid"], m["to"], m["relay"], float(m["delay"]), float(m["a"]),
                    float(m["b"]), float(m["c"]),
                    float(m["d"]), m["dsn"], m["status"], _unwrap(m["detail"] or ""))


def _unwrap(detail: str) -> str:
    """The text inside ``status=... (TEXT)``: only the wrapper's closing parenthesis
    goes; the reply's own ``(in reply to RCPT TO command)`` stays whole."""
    return detail[:-1] if detail.endswith(")") else detail


def split(raw: str) -> tuple[str, int, str] | None:
    """(tag, pid, text) of a traditional syslog line, without reading its time."""
    m = _TRADITIONAL.match(raw)
    if m is None:
        return None
    return m["tag"], int(m["pid"]), m["text"]


def active(text: str) -> tuple[str, str, int, int] | None:
    """qmgr's ``from=<S>, size=N, nrcpt=M (queue active)``: (qid, sender, size, nrcpt)."""
    m = _ACTIVE.match(text)
    if m is None:
        return None
    return m["qid"], m["sender"], int(m["size"]), int(m["nrcpt"])


def queue_id(text: str) -> tuple[str, str] | None:
    """(queue id, the rest) of a line about one message."""
    m = _QID.match(text)
    if m is None:
        return None
    return m["qid"], m["rest"]


def delay_quantum(value: float) -> float:
    """The resolution Postfix printed a delay with (two significant digits, at most
    two decimals): what a logged delay may be off by, twice over."""
    if value < 1:
        return 0.01
    if value < 10:
        return 0.1
    return 10.0 ** (len(str(int(value))) - 2)
