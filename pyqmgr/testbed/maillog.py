"""Reading the maillog that postlogd writes, the way admins' scripts read it.

postlogd appends each datagram it receives verbatim plus a newline, so every line is
``Mmm dd HH:MM:SS host program[pid]: [severity: ]text`` (no year, day zero-padded).
Tests assert on these lines rather than on internal state because the maillog is the
contract pyqmgr shares with stock qmgr: the same scenario must log the same lines.

The reader is incremental (it remembers a byte offset) because tests poll it many times
a second while mail flows; re-parsing a growing file on every poll would make waits
quadratic.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

_LINE = re.compile(
    r"^(?P<time>[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d) (?P<host>\S+) "
    r"(?P<program>[^\[\s]+)\[(?P<pid>\d+)\]: (?P<text>.*)$"
)
_SEVERITIES = ("warning", "error", "fatal", "panic")
# Short ids are upper-case hex; long ids are time and inode in Postfix's 52-character
# alphabet (digits and consonants) around a "z". Being this strict matters: a loose
# "[0-9A-Za-z]+: " would take "warning: " or "statistics: " for a queue id.
_LONG_ALPHABET = "0-9B-DF-HJ-NP-TV-Zb-df-hj-np-tv-y"
_QID = re.compile(
    rf"^(?P<qid>[0-9A-F]{{6,}}|[{_LONG_ALPHABET}]{{10,}}z[{_LONG_ALPHABET}]+): "
)
# name=value pairs of delivery and qmgr lines: values are <address>, or run up to the
# next ", " / " (" / end of line.
_FIELDS = re.compile(r"(?:^|, )(\w+)=(<[^>]*>|[^,(]*?)(?=, |$| \()")
_DETAIL = re.compile(r"status=\w+ \((?P<detail>.*)\)$")

Matcher = Callable[["LogLine"], bool]


@dataclass
class LogLine:
    """One maillog line, split into the parts tests filter on.

    ``text`` is everything after ``program[pid]: `` including any ``warning: `` prefix,
    exactly as Postfix wrote it, so comparisons with stock stay byte-exact;
    ``severity`` says which prefix (if any) was there.
    """

    raw: str
    time: str
    host: str
    program: str
    pid: int
    text: str
    queue_id: str | None
    severity: str
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def program_name(self) -> str:
        """The last part of the tag (``qmgr`` for ``postfix/qmgr``)."""
        return self.program.rpartition("/")[2]

    @property
    def to(self) -> str | None:
        """The recipient of a delivery line, without angle brackets."""
        return _unbracket(self.fields.get("to"))

    @property
    def orig_to(self) -> str | None:
        return _unbracket(self.fields.get("orig_to"))

    @property
    def sender(self) -> str | None:
        """``from=`` of a qmgr/cleanup line, without angle brackets ("" for <>)."""
        return _unbracket(self.fields.get("from"))

    @property
    def relay(self) -> str | None:
        return self.fields.get("relay")

    @property
    def dsn(self) -> str | None:
        return self.fields.get("dsn")

    @property
    def status(self) -> str | None:
        """``sent``, ``deferred``, ``bounced``, ``expired``... of a delivery line."""
        return self.fields.get("status")

    @property
    def detail(self) -> str | None:
        """The parenthesised reason after ``status=...``, e.g. the remote reply."""
        m = _DETAIL.search(self.text)
        return m.group("detail") if m else None


def _unbracket(value: str | None) -> str | None:
    if value is not None and value.startswith("<") and value.endswith(">"):
        return value[1:-1]
    return value


def parse_line(raw: str) -> LogLine | None:
    """Parse one line; None for anything not in postlogd's format (e.g. a torn line)."""
    m = _LINE.match(raw)
    if m is None:
        return None
    text = m.group("text")
    body = text
    severity = "info"
    for sev in _SEVERITIES:
        if text.startswith(sev + ": "):
            severity = sev
            body = text[len(sev) + 2:]
            break
    q = _QID.match(body)
    fields: dict[str, str] = {}
    if q is not None:
        rest = body[q.end():]
        if "=" in rest:
            for name, value in _FIELDS.findall(rest):
                fields.setdefault(name, value)
    return LogLine(
        raw=raw,
        time=m.group("time"),
        host=m.group("host"),
        program=m.group("program"),
        pid=int(m.group("pid")),
        text=text,
        queue_id=q.group("qid") if q else None,
        severity=severity,
        fields=fields,
    )


def _program_matches(line: LogLine, program: str) -> bool:
    # "postfix/qmgr" must match exactly; a bare "qmgr" matches any tag ending in it, so
    # tests need not care about syslog_name.
    if "/" in program:
        return line.program == program
    return line.program_name == program


class Maillog:
    """Incremental reader of one maillog file; ``all`` holds every line parsed so far.

    The file may not exist yet (postlogd creates it on the first line) and may be
    truncated or replaced by a test; both are handled by starting over.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._inode: int | None = None
        self._partial = b""
        self.all: list[LogLine] = []
        #: Lines that did not parse (should stay empty; kept to diagnose surprises).
        self.unparsed: list[str] = []

    def refresh(self) -> list[LogLine]:
        """Read and parse what was appended since the last call; return the new lines."""
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self._inode or st.st_size < self._offset:
                    self._inode = st.st_ino
                    self._offset = 0
                    self._partial = b""
                f.seek(self._offset)
                chunk = f.read()
                self._offset = f.tell()
        except FileNotFoundError:
            return []
        data = self._partial + chunk
        *complete, self._partial = data.split(b"\n")
        new: list[LogLine] = []
        for raw in complete:
            text = raw.decode("utf-8", errors="replace")
            parsed = parse_line(text)
            if parsed is None:
                if text:
                    self.unparsed.append(text)
            else:
                new.append(parsed)
        self.all.extend(new)
        return new

    def mark(self) -> int:
        """A position to pass as ``since`` so later queries ignore older lines."""
        self.refresh()
        return len(self.all)

    def lines(self, program: str | None = None, queue_id: str | None = None,
              contains: str | None = None, since: int = 0) -> list[LogLine]:
        """Lines so far, filtered by program tag, queue id and substring of the text."""
        self.refresh()
        return [
            ln for ln in self.all[since:]
            if (program is None or _program_matches(ln, program))
            and (queue_id is None or ln.queue_id == queue_id)
            and (contains is None or contains in ln.text)
        ]

    def tail(self, n: int = 20) -> str:
        """The last ``n`` raw lines, for error messages."""
        self.refresh()
        return "\n".join(ln.raw for ln in self.all[-n:])

    def wait_for(self, predicate: Matcher | str | re.Pattern[str], timeout: float,
                 count: int = 1, what: str | None = None, since: int = 0) -> list[LogLine]:
        """Wait until ``count`` lines match; return all matching lines.

        ``predicate`` is a callable on :class:`LogLine` or a regular expression searched
        in the raw line. On timeout the error names what was awaited, how many matched
        and the last lines of the log, which is usually all one needs to see why.
        """
        match = _matcher(predicate)
        deadline = time.monotonic() + timeout
        found: list[LogLine] = []
        scanned = since
        while True:
            self.refresh()
            found.extend(ln for ln in self.all[scanned:] if match(ln))
            scanned = max(scanned, len(self.all))
            if len(found) >= count:
                return found
            if time.monotonic() > deadline:
                label = what or getattr(predicate, "pattern", None) or repr(predicate)
                raise TimeoutError(
                    f"timed out after {timeout:g}s waiting for {count} maillog line(s) "
                    f"matching {label} (found {len(found)}); last maillog lines:\n"
                    f"{self.tail(20)}"
                )
            time.sleep(0.02)


def _matcher(predicate: Matcher | str | re.Pattern[str]) -> Matcher:
    if isinstance(predicate, str | re.Pattern):
        pattern = re.compile(predicate)
        return lambda ln: pattern.search(ln.raw) is not None
    return predicate
