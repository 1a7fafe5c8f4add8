"""The Postfix release pyqmgr runs beside, and what of qmgr's protocol follows from it.

A qmgr is built with its delivery agents; pyqmgr is not, so it asks the installed
Postfix (``postconf -dh mail_version``, the compiled-in value, which main.cf cannot
override) at start-up and speaks that release's dialect. What differs between 3.7
and 3.11, as read in Postfix's source (docs/postfix-versions.md has the references):

- the options attribute of delivery, bounce, defer and trace requests is
  ``smtputf8`` up to 3.9 and ``sendopts`` from 3.10; an agent accepts only its own
  name, and a mismatch defers every delivery with no per-recipient log line;
- the option bits qmgr passes on from the queue file's size record: every bit up to
  3.7.12, 3.8.7 and 3.9.1; masked to the four SMTPUTF8 bits (0x0F) from 3.7.13,
  3.8.8 and 3.9.2; masked to ``SOPT_FLAG_ALL`` (0x3F, the REQUIRETLS bits too) from
  3.10. Dropping 0x10/0x20 on 3.10+ would silently lose REQUIRETLS;
- the text qmgr logs when a VERP bounce request fails: ``verp failed`` up to 3.10,
  ``verp-bounce failed`` from 3.11;
- an agent crash defers the message and throttles its destination from 3.7.11, 3.8.6
  and 3.9.0; earlier patch levels throttled the whole transport. pyqmgr implements
  only the newer behaviour, so the older patch levels are refused by name.

A release outside what was read (3.7.11 to 3.11, stable releases; no snapshots) is a
fatal start-up error that names it, not a guess: the protocol may have moved.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

#: ``SMTPUTF8_FLAG_ALL``: the four SMTPUTF8 option bits.
SMTPUTF8_FLAG_ALL = 0x0F
#: ``SOPT_FLAG_ALL`` (3.10+): SMTPUTF8's four bits and REQUIRETLS's two.
SOPT_FLAG_ALL = 0x3F
#: No mask: every bit of the size record's sixth field reaches the agent.
NO_MASK = -1

#: The oldest patch level of each series that pyqmgr speaks for: where the agent-crash
#: handling it implements arrived (HISTORY 20240209), and the newest series read.
_OLDEST = {(3, 7): 11, (3, 8): 6, (3, 9): 0, (3, 10): 0, (3, 11): 0}
#: From which patch level each series masks the option bits to SMTPUTF8_FLAG_ALL
#: (HISTORY 20250111, "Forward compatibility: ignore new queue file flag bits").
_MASKED_FROM = {(3, 7): 13, (3, 8): 8, (3, 9): 2}

_STABLE = re.compile(r"^(\d{1,3})\.(\d{1,3})\.(\d{1,3})$")


class VersionError(Exception):
    """A Postfix release pyqmgr does not speak for; ``str()`` is the fatal line's text."""


@dataclass(frozen=True, slots=True, order=True)
class PostfixVersion:
    """A stable Postfix release, major.minor.patch."""

    major: int
    minor: int
    patch: int

    @classmethod
    def parse(cls, text: str) -> PostfixVersion:
        """The release ``mail_version`` names, or :class:`VersionError` saying why not."""
        value = text.strip()
        m = _STABLE.match(value)
        if m is None:
            if re.match(r"^\d+\.\d+-\d{8}", value):
                raise VersionError(
                    f"Postfix {value} is a snapshot; pyqmgr speaks for stable releases "
                    f"{supported()} only")
            raise VersionError(f"cannot read the Postfix version {value[:60]!r} "
                               f"(postconf -dh mail_version)")
        version = cls(int(m[1]), int(m[2]), int(m[3]))
        oldest = _OLDEST.get((version.major, version.minor))
        if oldest is None:
            raise VersionError(f"Postfix {value} is not a release pyqmgr knows; it speaks "
                               f"for {supported()}")
        if version.patch < oldest:
            raise VersionError(
                f"Postfix {value} is not a release pyqmgr knows; it speaks for "
                f"{supported()} (before {version.major}.{version.minor}.{oldest} a "
                f"crashed delivery agent throttled its whole transport)")
        return version

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"

    @property
    def options_attribute(self) -> str:
        """The name of the option bits in delivery, bounce, defer and trace requests."""
        return "sendopts" if (self.major, self.minor) >= (3, 10) else "smtputf8"

    @property
    def options_mask(self) -> int:
        """The mask qmgr applies to the size record's option bits (NO_MASK: none)."""
        series = (self.major, self.minor)
        if series >= (3, 10):
            return SOPT_FLAG_ALL
        masked_from = _MASKED_FROM.get(series)
        if masked_from is not None and self.patch >= masked_from:
            return SMTPUTF8_FLAG_ALL
        return NO_MASK

    def options(self, from_queue_file: int) -> int:
        """The option bits qmgr passes on, given the queue file's (``qmgr_message_read``)."""
        mask = self.options_mask
        return from_queue_file if mask == NO_MASK else from_queue_file & mask

    @property
    def verp_failed(self) -> str:
        """What qmgr logs when a VERP bounce request fails (``abounce_done``)."""
        return "verp-bounce failed" if (self.major, self.minor) >= (3, 11) else "verp failed"


#: What a daemon assumes when nobody asked Postfix (the simulator, unit tests): the
#: release pyqmgr was first written against.
DEFAULT = PostfixVersion(3, 7, 11)


def supported() -> str:
    """The releases pyqmgr speaks for, as a fatal line names them."""
    return ", ".join(f"{a}.{b}.{p}+" if p else f"{a}.{b}" for (a, b), p in _OLDEST.items())


def installed(command_directory: str, config_directory: str | None = None,
              timeout: float = 10.0) -> PostfixVersion:
    """The release of the Postfix installed in ``command_directory``.

    ``-d`` reads the compiled-in value: an admin's ``mail_version`` in main.cf changes
    what ``postconf -h`` prints, not what the agents speak.
    """
    postconf = os.path.join(command_directory, "postconf")
    env = dict(os.environ)
    if config_directory:
        env["MAIL_CONFIG"] = config_directory
    try:
        proc = subprocess.run([postconf, "-dh", "mail_version"], capture_output=True,
                              text=True, timeout=timeout, env=env, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VersionError(f"cannot ask {postconf} for the Postfix version: {exc}") from exc
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise VersionError(f"cannot ask {postconf} for the Postfix version: {why[:200]}")
    return PostfixVersion.parse(proc.stdout)
