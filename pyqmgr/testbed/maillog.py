"""Reading the maillog that postlogd writes, the way admins' scripts read it."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

_LINE = re.compile(
    r"^(?P<time>\w{3} [ \d]\d \d\d:\d\d:\d\d) (?P<host>\S+) (?P<program>[^\[\s]+)\[(?P<pid>\d+)\]: "
    r"(?P<text>.*)$"
)
_QID = re.compile(r"^([0-9A-Za-z]{6,}): ")
_FIELDS = re.compile(r"(\w+)=(<[^>]*>|[^,]*?)(?:, |$| \()")


@dataclass
class LogLine:
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
    def status(self) -> str | None:
        return self.fields.get("status")

    @property
    def to(self) -> str | None:
        to = self.fields.get("to")
        return to[1:-1] if to else None


def parse_line(raw: str) -> LogLine | None:
    m = _LINE.match(raw)
    if m is None:
        return None
    text = m.group("text")
    severity = "info"
    for sev in ("warning", "error", "fatal", "panic"):
        if text.startswith(sev + ": "):
            severity = sev
            break
    q = _QID.match(text)
    fields: dict[str, str] = {}
    if q and ("to=" in text or "from=" in text):
        for name, value in _FIELDS.findall(text[q.end():]):
            fields.setdefault(name, value)
    return LogLine(raw, m.group("time"), m.group("host"), m.group("program"),
                   int(m.group("pid")), text, q.group(1) if q else None, severity, fields)


class Maillog:
    """Incremental reader: keeps every parsed line; ``refresh`` reads what is new."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._partial = ""
        self.all: list[LogLine] = []

    def refresh(self) -> list[LogLine]:
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                f.seek(self._offset)
                chunk = f.read()
                self._offset = f.tell()
        except FileNotFoundError:
            return []
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()
        new = [p for p in (parse_line(raw) for raw in lines) if p is not None]
        self.all.extend(new)
        return new

    def lines(self, program: str | None = None, queue_id: str | None = None,
              contains: str | None = None) -> list[LogLine]:
        self.refresh()
        return [
            ln for ln in self.all
            if (program is None or ln.program == program)
            and (queue_id is None or ln.queue_id == queue_id)
            and (contains is None or contains in ln.text)
        ]

    def wait_for(self, predicate: Callable[[LogLine], bool] | str, timeout: float,
                 count: int = 1, what: str | None = None) -> list[LogLine]:
        """Wait until ``count`` lines match; raise TimeoutError naming what was missing."""
        if isinstance(predicate, str):
            pattern = re.compile(predicate)

            def match(ln: LogLine) -> bool:
                return bool(pattern.search(ln.raw))
        else:
            match = predicate
        deadline = time.monotonic() + timeout
        while True:
            self.refresh()
            found = [ln for ln in self.all if match(ln)]
            if len(found) >= count:
                return found
            if time.monotonic() > deadline:
                tail = "\n".join(ln.raw for ln in self.all[-15:])
                raise TimeoutError(
                    f"timed out after {timeout:.0f}s waiting for {count} maillog lines "
                    f"matching {what or predicate!r} (found {len(found)}); last lines:\n{tail}"
                )
            time.sleep(0.05)
