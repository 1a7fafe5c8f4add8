"""Contenders: which queue manager runs a workload, and with which pyqmgr.cf settings.

``stock`` is Postfix's qmgr, ``oqmgr`` Postfix's own old queue manager, and
``pyqmgr[:POLICY][,name=value...]`` pyqmgr with the workload's ``[pyqmgr_cf]``, its
``scheduler_policy`` set to POLICY, and each ``name=value`` over that (pyqmgr.cf
parameters, transport forms too: ``pyqmgr:finch,smtp_finch_max_message_concurrency=5``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from pyqmgr.scheduler.shaping import RULES
from pyqmgr.simulator.scenario import Scenario

BUILTIN_POLICIES = ("nqmgr", "oqmgr", "finch", "zmailer")
_PARAM = re.compile(r"^[a-z][a-z0-9_]*$")


class ContenderError(ValueError):
    """A --with value that names no contender; the text says what is accepted."""


@dataclass(frozen=True)
class Contender:
    #: As the user wrote it: the contender's name in the report.
    label: str
    #: What the qmgr service runs: "stock", "oqmgr" or "pyqmgr".
    qmgr: str
    policy: str | None = None
    settings: dict[str, str] = field(default_factory=dict)

    def pyqmgr_cf(self, sc: Scenario) -> dict[str, str] | None:
        """pyqmgr.cf for the run (None for Postfix's own queue managers).

        Relative response_rules paths start at the workload file's directory, as in
        the simulator; the daemon needs them absolute.
        """
        if self.qmgr != "pyqmgr":
            return None
        values = dict(sc.pyqmgr_cf)
        if self.policy is not None:
            values["scheduler_policy"] = self.policy
        values.update(self.settings)
        for name, value in values.items():
            if name.endswith(RULES) and value.strip() and not os.path.isabs(value.strip()):
                values[name] = os.path.normpath(os.path.join(sc.base_dir, value.strip()))
        return values

    def simulator_policy(self, sc: Scenario) -> dict[str, str]:
        """The pyqmgr.cf the simulator runs to predict this contender's run."""
        if self.qmgr == "stock":
            return {k: v for k, v in sc.pyqmgr_cf.items() if "policy" not in k} | {
                "scheduler_policy": "nqmgr"}
        if self.qmgr == "oqmgr":
            return {"scheduler_policy": "oqmgr"}
        return self.pyqmgr_cf(sc) or {}

    @property
    def slug(self) -> str:
        """A file name for the run's directory."""
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.label).strip("_") or "run"


def parse_contender(text: str, base: str | None = None) -> Contender:
    """A contender from its text; relative response_rules and warm-up plan paths in
    its settings start at ``base`` (the workload's directory, for contenders the file
    names) or here."""
    text = text.strip()
    head, sep, rest = text.partition(":")
    if head in ("stock", "oqmgr"):
        if sep:
            raise ContenderError(f"{text!r}: {head} takes no policy or settings (they are "
                                 "pyqmgr.cf's; stock and oqmgr read main.cf only)")
        return Contender(text, head)
    if head != "pyqmgr":
        raise ContenderError(f"{text!r}: a contender is stock, oqmgr, pyqmgr or "
                             "pyqmgr:POLICY[,name=value...]")
    if not sep:
        return Contender(text, "pyqmgr")
    # A module path may hold commas only if it is the last item; keep it simple: no.
    policy, *pairs = rest.split(",")
    policy = policy.strip()
    if policy and policy not in BUILTIN_POLICIES and not policy.startswith("module:/"):
        raise ContenderError(f"{text!r}: unknown policy {policy!r} (built in: "
                             f"{', '.join(BUILTIN_POLICIES)}; or module:/absolute/path.py)")
    settings = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        name = name.strip()
        if not eq or not _PARAM.match(name):
            raise ContenderError(f"{text!r}: {pair.strip()!r} is not name=value (a "
                                 "pyqmgr.cf parameter and its value)")
        value = value.strip()
        if (name.endswith(RULES) or name == "source_warmup_plan") and value \
                and not os.path.isabs(value):
            value = os.path.normpath(os.path.join(base or os.getcwd(), value))
        settings[name] = value
    return Contender(text, "pyqmgr", policy or None, settings)


def parse_contenders(texts: list[str], base: str | None = None) -> list[Contender]:
    out = [parse_contender(t, base) for t in texts]
    labels = [c.label for c in out]
    for label in labels:
        if labels.count(label) > 1:
            raise ContenderError(f"{label!r} is given twice")
    slugs = [c.slug for c in out]
    if len(set(slugs)) != len(slugs):
        raise ContenderError("two contenders would share a run directory: "
                             f"{', '.join(labels)}")
    return out
