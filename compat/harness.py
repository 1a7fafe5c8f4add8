"""Pieces shared by side-by-side scenarios: log lines compared without ids, pids, times."""

from __future__ import annotations

import re

from pyqmgr.testbed.maillog import LogLine

_DELAYS = re.compile(r"delay=[\d.]+, delays=[\d./]+")
_RELAY_PORT = re.compile(r"(relay=\S+\]):\d+")


def normalize(line: LogLine, queue_ids: dict[str, str]) -> str:
    """``program: text`` with queue ids renamed in order of appearance, delays blanked.

    ``queue_ids`` maps real ids to stable names (Q1, Q2, ...) and is filled as lines
    are seen, so two runs that handle messages in the same order normalise alike.
    """
    text = line.text
    for qid in re.findall(r"\b[0-9A-F]{10,12}\b", text):
        if qid not in queue_ids:
            queue_ids[qid] = f"Q{len(queue_ids) + 1}"
        text = text.replace(qid, queue_ids[qid])
    text = _DELAYS.sub("delay=*, delays=*", text)
    text = _RELAY_PORT.sub(r"\1:*", text)
    return f"{line.program}: {text}"
