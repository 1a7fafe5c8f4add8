"""Concurrency feedback values: ``N``, ``N/M`` and ``N/concurrency`` (``qmgr_feedback.c``).

Parsed once per transport. Stock parses with ``sscanf("%lf %1[/] %30s%c")``, which is
lenient in odd ways (trailing junk after a plain number is ignored, hex floats work); the
regular expressions below reproduce those rules, and anything that stock rejects falls
back to constant feedback 1 with stock's warning text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

IDX_NONE = 0
IDX_WIN = 1

#: How a window step is rounded. ``stock`` is qmgr_queue.c since postfix-2.5-20071129:
#: a step is taken once the counter is within half a feedback of the hysteresis
#: boundary (slack against floating-point error), and a destination dies when its
#: failed pseudo-cohorts reach the limit (>=). ``pseudocode`` is the seed document's
#: November 2007 pseudocode, the rules its measured tables came from (the code before
#: 2.5-20071129): no slack, and, as the pseudocode writes it (the code said >=), death
#: only beyond the limit (>). They agree when 1/feedback is a whole number of steps,
#: except for negative feedback above 2/3: with feedback 1, stock drops the window by
#: two on the first failure after a success, which is why stock defers about 1/3 of the
#: mail against a 421 limiter where the seed measured 1/2. Other feedback (0.3, say)
#: makes stock step one feedback early.
ROUNDINGS = ("stock", "pseudocode")


def rounding_rules(rounding: str) -> tuple[float, bool]:
    """(slack, dies only beyond the cohort limit) for a rule in ROUNDINGS.

    The slack is the fraction of a feedback step that counts as reaching the
    hysteresis boundary. Raises ValueError for an unknown rule.
    """
    if rounding not in ROUNDINGS:
        raise ValueError(f"feedback rounding must be one of {', '.join(ROUNDINGS)}")
    return (0.5, False) if rounding == "stock" else (0.0, True)


_INT_MAX = 2**31 - 1
# A C strtod number: decimal with optional exponent, hex float, inf/nan.
_NUMBER = (
    r"[+-]?(?:0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?\d+)?"
    r"|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf(?:inity)?|nan)"
)
_LEADING = re.compile(r"\s*(" + _NUMBER + r")", re.IGNORECASE)
_FULL_NUMBER = re.compile(r"\s*(" + _NUMBER + r")$", re.IGNORECASE)


def _strtod(text: str) -> float:
    if text.lower().startswith(("0x", "+0x", "-0x")):
        return float.fromhex(text)
    return float(text)


@dataclass(frozen=True, slots=True)
class Feedback:
    """One direction of feedback: a constant, or ``base / window``."""

    index: int
    base: float
    hysteresis: int = 1

    def value(self, window: int) -> float:
        return self.base if self.index == IDX_NONE else self.base / window


def parse(value: str) -> Feedback | None:
    """Return the feedback stock would use, or None where stock warns and uses 1."""
    m = _LEADING.match(value)
    if m is None:
        return None
    base = _strtod(m.group(1))
    rest = value[m.end():]
    if rest.lstrip()[:1] != "/":
        # One conversion: a constant; trailing text is ignored, as sscanf ignores it.
        fb = Feedback(IDX_NONE, base)
    else:
        # "%1[/] %30s%c": a denominator of at most 30 non-space characters with nothing
        # at all after it (a fourth conversion, even a space, makes stock reject it).
        slash = re.fullmatch(r"\s*/\s*(\S{1,30})", rest)
        if slash is None:
            return None
        denom = slash.group(1)
        if denom.lower() == "concurrency":
            fb = Feedback(IDX_WIN, base)
        elif (0 <= base <= _INT_MAX and _FULL_NUMBER.match(denom)
              and 1.0 / _INT_MAX <= _strtod(denom) <= _INT_MAX):
            fb = Feedback(IDX_NONE, base / _strtod(denom))
        else:
            return None
    if not 0 <= fb.base <= 1:
        return None
    return fb


def parse_or_warn(value: str, name: str) -> tuple[Feedback, str | None]:
    """Parse, falling back like stock; returns the warning stock would log, if any."""
    fb = parse(value)
    if fb is None:
        return Feedback(IDX_NONE, 1.0), (
            f"{name}: ignoring malformed or unreasonable feedback: {value}"
        )
    return fb, None
