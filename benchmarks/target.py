"""A benchmark's targets: each named once, compared once, printed the same way.

Issue #22: a benchmark that prints MISSED and exits 0 lets a CI run pass on a missed
target. Every benchmark declares its targets as ``Target`` values beside its figures,
checks each through ``Target.check`` (which prints ``target: ...: met`` or
``MISSED``, the figures themselves having been printed as before), and returns
``status(...)`` of the checks, so ``./dev bench NAME`` and ``.ci/run`` fail on a miss.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """One bar: ``text`` says what it asks in words (the value included), for the log."""

    text: str
    #: Why this target is missed today and what would settle it. A known miss is
    #: printed as one (``MISSED, known: ...``) in every run and does not fail it; the
    #: list is short and each entry says why (tests/unit/test_benchmark_targets.py),
    #: as tests/conftest.py's ALLOWED_SKIPS is for skips.
    known_miss: str = ""

    def check(self, met: bool, figure: str = "") -> bool:
        """Print the verdict with the figure it was decided on; whether the run passes."""
        verdict = ("met" if met else f"MISSED, known: {self.known_miss}" if self.known_miss
                   else "MISSED")
        print(f"target: {self.text}" + (f" ({figure})" if figure else "") + f": {verdict}",
              flush=True)
        return met or bool(self.known_miss)


def status(checks: Iterable[bool]) -> int:
    """The exit status of a benchmark: 1 if any of its targets was missed.

    Takes a list, not a generator, from callers that want every check printed: a
    generator's ``all`` would stop at the first miss.
    """
    return 0 if all(list(checks)) else 1
