"""Durations and times as an admin reads them: ``9m58s``, ``2h5m``, ``3d4h``.

Postfix writes times in its units (``300s``, ``5d``, ``1h``), and an admin reads
``in 9m58s`` at a glance where ``in 597.943s`` must be worked out. Every text pyqmgr
prints for a person (``status``, ``explain``, ``top``, the controls' replies,
``jobs``) says its durations through :func:`duration`; ``--json`` keeps plain
seconds, as numbers, for scripts.

Two units at most, the larger first, the smaller rounded: a reader wants the order
of magnitude and one refinement, not ``2h4m59.6s``. Under ten seconds a tenth is
kept (a rate delay of ``2.5s`` matters), under one second milliseconds are shown.

Pure arithmetic, no clock and no I/O: the scheduler's explanations use it too.
"""

from __future__ import annotations

import math

#: Postfix's time units from the largest, and their seconds (``conv_time``'s d, h, m, s).
_UNITS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))


def duration(seconds: float | None) -> str:
    """``seconds`` in at most two units: 250ms, 2.5s, 58s, 9m58s, 2h5m, 3d4h; None: -."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 0:
        return "-" + duration(-seconds)
    if seconds < 1:
        ms = round(seconds * 1000)
        return "0s" if ms == 0 else f"{ms}ms" if ms < 1000 else "1s"
    if seconds < 10:
        return f"{seconds:.1f}".removesuffix(".0") + "s"
    n = round(seconds)
    for i, (unit, size) in enumerate(_UNITS[:-1]):
        if n < size:
            continue
        small_unit, small = _UNITS[i + 1]
        big, rest = divmod(round(n / small), size // small)
        if i > 0 and big * size >= _UNITS[i - 1][1]:
            # Rounding carried into the larger unit: 23h59m40s is 1d, not 24h.
            return duration(big * size)
        return f"{big}{unit}" + (f"{rest}{small_unit}" if rest else "")
    return f"{n}s"


def until(seconds: float | None) -> str:
    """A time to come: ``in 9m58s``, ``now`` when it is due, ``never`` for None."""
    if seconds is None:
        return "never"
    return f"in {duration(seconds)}" if seconds >= 0.5 else "now"


def ago(seconds: float | None) -> str:
    """A time gone by: ``9m58s ago``; None: ``never``."""
    return "never" if seconds is None else f"{duration(seconds)} ago"

