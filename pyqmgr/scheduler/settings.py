"""pyqmgr.cf's scheduling settings, turned into one parsed setup by one function.

The daemon (at start-up, before the chroot), the simulator (a scenario's
``[pyqmgr_cf]``) and ``pyqmgr check`` read the same parameters, so they go through
the same :func:`scheduling_settings`: the policies with their knobs checked, the rates
and response rules, the deferred retry jitter and recovery. A value one of them
accepts the others accept, and a bad one is refused by each with the same text
(the daemon logs it as fatal, check lists it, the simulator says it of the scenario).

It does no I/O of its own except reading the response rules files the parameters
name (``read_rules``; the daemon's call happens as root, before the chroot) and
importing a ``module:`` policy.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from pyqmgr.pyqmgr_cf import PyqmgrCf, PyqmgrCfError
from pyqmgr.scheduler.policy import PolicyTable
from pyqmgr.scheduler.shaping import (
    Rate,
    Rule,
    ShapingError,
    ShapingTable,
    load_rules,
    parse_duration,
    parse_rate,
)

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


@dataclass(frozen=True)
class SchedulingSettings:
    """What pyqmgr.cf says about scheduling, checked; None: that part is stock's."""

    policies: PolicyTable
    shaping: ShapingTable | None
    retry: RetrySettings | None


def scheduling_settings(settings: PyqmgrCf,
                        read_rules: Callable[[str], list[Rule]] = load_rules
                        ) -> SchedulingSettings:
    """pyqmgr.cf's policies, shaping and retry settings; PyqmgrCfError if one is bad.

    The error names the file and the parameter in the one format of
    :meth:`PyqmgrCf.error`, whichever part refused it.
    """
    values = dict(settings.values)

    def setting(name: str, transport: str, default: str) -> str:
        value = settings.get(name, transport)
        return default if value is None else value

    table = PolicyTable.build(values, setting, settings.error)
    try:
        shaping = ShapingTable(values, setting, read_rules)
    except ShapingError as exc:
        raise PyqmgrCfError(f"{settings.path}: parameter {exc}") from None
    return SchedulingSettings(table, shaping if shaping.active else None,
                              retry_settings(settings))
