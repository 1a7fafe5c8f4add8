"""Deferred mail's retry: pyqmgr.cf's jitter and recovery settings, and the registry
of which deferred files wait for which destination.

Both drivers use them: the daemon (:mod:`pyqmgr.daemon.retry`, which touches and feeds
the files) and the simulator (:mod:`pyqmgr.simulator.deferred`, which replays the same
decisions on its virtual deferred queue). Neither part does I/O, so they live here,
where the simulator can take them without loading the daemon.
"""

from __future__ import annotations

import random
import re
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from pyqmgr.pyqmgr_cf import PyqmgrCf
from pyqmgr.scheduler.shaping import Rate, ShapingError, parse_duration, parse_rate

JITTER = "deferred_retry_jitter"
RECOVERY_RATE = "deferred_recovery_rate"
RECOVERY_LIMIT = "deferred_recovery_limit"

#: Queue ids remembered at most by default: about 4 MB (see the README's figure).
DEFAULT_RECOVERY_LIMIT = 20_000
MAX_RECOVERY_LIMIT = 1_000_000
#: The largest jitter as a duration: beyond a day it is a typo (maximal_backoff_time
#: is 4000 s by default).
MAX_JITTER = 86400.0
_PERCENT_RE = re.compile(r"(\d+(?:\.\d+)?)\s*%$")


@dataclass(frozen=True)
class RetrySettings:
    """pyqmgr.cf's retry settings, checked. Zero and None: that part is off."""

    #: The jitter as seconds, or as a share of each deferral's backoff (one of them).
    jitter: float = 0.0
    jitter_share: float = 0.0
    #: The value as written, for status and logs.
    jitter_text: str = ""
    recovery_rate: Rate | None = None
    recovery_limit: int = DEFAULT_RECOVERY_LIMIT

    def jitter_for(self, backoff: float, rng: random.Random) -> float:
        """Seconds to add to a retry time whose backoff was ``backoff``: [0, width)."""
        width = self.jitter or self.jitter_share * backoff
        return rng.random() * width if width > 0 else 0.0


def parse_jitter(text: str, what: str) -> tuple[float, float]:
    """``10m``, ``90s`` (seconds) or ``20%`` (of the backoff); ``0`` or empty: none.

    Returns (seconds, share); ShapingError says what is wrong.
    """
    text = text.strip()
    if text in ("", "0"):
        return 0.0, 0.0
    m = _PERCENT_RE.match(text)
    if m is not None:
        share = float(m.group(1)) / 100
        if not 0 < share <= 1:
            raise ShapingError(f"{what}: a percentage must be more than 0% and at most "
                               f"100%, not {text!r}")
        return 0.0, share
    seconds = parse_duration(text, what)
    if seconds > MAX_JITTER:
        raise ShapingError(f"{what}: {text!r} is more than a day")
    return seconds, 0.0


def retry_settings(settings: PyqmgrCf) -> RetrySettings | None:
    """pyqmgr.cf's retry settings; None when jitter and recovery are both off.

    A bad value raises PyqmgrCfError naming the file and the parameter (a start-up
    error, like every pyqmgr.cf mistake).
    """
    jitter_text = (settings.get(JITTER) or "").strip()
    try:
        jitter, share = parse_jitter(jitter_text, JITTER)
        rate = parse_rate(settings.get(RECOVERY_RATE) or "", RECOVERY_RATE)
    except ShapingError as exc:
        name, _, text = str(exc).partition(": ")
        raise settings.error(name, text) from None
    limit = settings.get_int(RECOVERY_LIMIT, None, DEFAULT_RECOVERY_LIMIT, 1,
                             MAX_RECOVERY_LIMIT)
    if not jitter and not share and rate is None:
        return None
    return RetrySettings(jitter, share, jitter_text if jitter or share else "", rate, limit)


#: (transport, queue name): a destination as the core names it.
Key = tuple[str, str]


class Registry:
    """Which deferred queue files wait for which destination: bounded, in memory.

    A message is remembered under each destination it waited for when it was deferred,
    and forgotten when it leaves deferred/ (fed into the active queue) or when room is
    needed: past ``limit`` messages, the one deferred longest ago goes first (it is the
    closest to being retried at its normal time anyway). Every operation is O(1) per
    (message, destination) pair, so neither a dead destination with 100,000 deferred
    messages nor a recovery costs more than its own mail. Destination keys are shared
    between messages, so a message costs its queue id and two dictionary slots.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        #: Per queue id, the destinations it waits for; least recently deferred first.
        self.of: OrderedDict[str, tuple[Key, ...]] = OrderedDict()
        #: Per destination, its queue ids in the order they were deferred.
        self.by_dest: dict[Key, dict[str, None]] = {}
        #: One tuple per destination, shared by every message that waits for it.
        self._keys: dict[Key, Key] = {}
        #: Messages forgotten for room, since start.
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.of)

    def remember(self, qid: str, keys: Iterable[Key]) -> None:
        self.forget(qid)
        mine = tuple(self._keys.setdefault(k, k) for k in dict.fromkeys(keys))
        if not mine:
            return
        self.of[qid] = mine
        for key in mine:
            self.by_dest.setdefault(key, {})[qid] = None
        while len(self.of) > self.limit:
            old, keys = self.of.popitem(last=False)
            for key in keys:
                self._unlist(key, old)
            self.evicted += 1

    def forget(self, qid: str) -> None:
        """The file left deferred/, or room is needed: it waits for nothing now."""
        keys = self.of.pop(qid, None)
        if keys is None:
            return
        for key in keys:
            self._unlist(key, qid)

    def _unlist(self, key: Key, qid: str) -> None:
        ids = self.by_dest[key]
        del ids[qid]
        if not ids:
            del self.by_dest[key]
            del self._keys[key]

    def take(self, key: Key) -> list[str]:
        """The queue ids waiting for ``key``, oldest deferral first; forgotten here.

        A message that waits for other destinations too stays remembered for those.
        """
        ids = self.by_dest.pop(key, None)
        if ids is None:
            return []
        self._keys.pop(key, None)
        for qid in ids:
            rest = tuple(k for k in self.of[qid] if k != key)
            if rest:
                self.of[qid] = rest
            else:
                del self.of[qid]
        return list(ids)

    def count(self, key: Key) -> int:
        ids = self.by_dest.get(key)
        return len(ids) if ids is not None else 0
