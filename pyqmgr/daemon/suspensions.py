"""Operator suspensions in the daemon: the state file that outlives the process.

``postfix reload`` and a crash both end this qmgr and start a new one; a suspension
an admin put in for an hour must still be in force in the new one and end on time.
So every change is written to ``$data_directory/pyqmgr/suspensions.json``, and each
start reads it back, with the times kept as wall-clock (Unix) times in the file and
turned into the scheduler's monotonic clock when loaded.

Why it looks the way it does:

* **data_directory**, as the issue asks and as Postfix keeps its own state there
  (tlsmgr's PRNG seed, the verify and postscreen caches): it is mail_owner's and
  outside the queue. The daemon may run chrooted in the queue directory, so the
  directory ``pyqmgr`` is made and opened as root before the chroot, and every later
  access goes through that directory descriptor (``dir_fd``), chroot or not.
* **Atomic**: written to a temporary name, flushed, then renamed over the old file,
  so a crash half-way leaves the previous state, never a torn one.
* **Untrusting**: the file is read with a size cap and every record is checked; a
  record that does not check out is skipped with a warning naming why, and a file
  that does not parse is moved aside (``suspensions.json.corrupt``) with a warning.
  Either way mail flows: losing a suspension sends mail sooner, it loses none.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

from pyqmgr.control.protocol import ProtocolError
from pyqmgr.daemon.host import QmgrCore
from pyqmgr.daemon.owned_dir import owned_directory
from pyqmgr.postfix.config import QmgrConfig
from pyqmgr.postfix.maillog_client import MailLog
from pyqmgr.scheduler.suspension import (
    MAX_TARGET,
    Suspension,
    Target,
    TargetError,
    parse_target,
)

STATE_DIR = "pyqmgr"
STATE_FILE = "suspensions.json"
FORMAT_VERSION = 1

#: Largest state file read; 1,000 suspensions of the longest targets and reasons fit.
MAX_STATE_BYTES = 1 << 20
#: Most suspensions in force at once (the control refuses more).
MAX_SUSPENSIONS = 1000
#: Longest reason kept (it is logged and shown by status).
MAX_REASON = 200
#: Longest suspension: a forgotten one ends by itself within this.
MAX_TTL = 30 * 86400


class StateError(Exception):
    """A suspension record that does not check out."""


def check_reason(text: str) -> str:
    """The reason as logged: printable, one line, at most MAX_REASON characters."""
    if len(text) > MAX_REASON:
        raise StateError(f"reason longer than {MAX_REASON} characters")
    if any(not ch.isprintable() for ch in text):
        raise StateError("reason has control characters")
    return text.strip()


def check_ttl(ttl: float) -> float:
    if not ttl > 0:
        raise StateError("ttl must be more than 0 seconds")
    if ttl > MAX_TTL:
        raise StateError(f"ttl longer than {MAX_TTL // 86400} days")
    return float(ttl)


def format_duration(seconds: float) -> str:
    """A TTL as an admin writes it: 90s, 15m, 2h, 1d (exact units only), else seconds."""
    s = int(round(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size and s % size == 0:
            return f"{s // size}{unit}"
    return f"{s}s"


def format_time(wall: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(wall))


@dataclass
class StateFile:
    """``$data_directory/pyqmgr/suspensions.json``, reached through a directory fd."""

    dir_fd: int
    path: str

    def _log_path(self, name: str = STATE_FILE) -> str:
        return os.path.join(self.path, name)

    def load(self, log: MailLog, mono_now: float, wall_now: float) -> list[Suspension]:
        """The suspensions still in force; those that ended meanwhile are logged."""
        try:
            fd = os.open(STATE_FILE, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=self.dir_fd)
            with os.fdopen(fd, "rb") as f:
                data = f.read(MAX_STATE_BYTES + 1)
        except FileNotFoundError:
            return []
        except OSError as exc:
            log.warning(f"{self._log_path()}: {exc.strerror}; starting without the "
                        "operator suspensions it keeps")
            return []
        try:
            records = parse_state(data)
        except StateError as exc:
            log.warning(f"{self._log_path()}: {exc}; moved aside to {STATE_FILE}.corrupt, "
                        "starting without operator suspensions")
            with contextlib.suppress(OSError):
                os.replace(STATE_FILE, STATE_FILE + ".corrupt", src_dir_fd=self.dir_fd,
                           dst_dir_fd=self.dir_fd)
            return []
        out = []
        for i, obj in enumerate(records):
            try:
                s = suspension_from_record(obj, mono_now, wall_now)
            except StateError as exc:
                log.warning(f"{self._log_path()}: record {i + 1}: {exc}; skipped")
                continue
            if s is None:
                log.info(f"control: suspension of {record_target(obj)} ended while no "
                         "qmgr was running (its ttl ran out)")
                continue
            out.append(s)
        return out[:MAX_SUSPENSIONS]

    def save(self, suspensions: Iterable[Suspension], log: MailLog) -> bool:
        """Write the suspensions in force, atomically; a failure is a warning."""
        body = json.dumps({"version": FORMAT_VERSION,
                           # A response rule's are the rule's (made again if the
                           # replies come again), not an operator's to keep.
                           "suspensions": [to_record(s) for s in suspensions
                                           if not s.who.startswith("response rule")]},
                          indent=1).encode() + b"\n"
        try:
            self.write(STATE_FILE, body)
        except OSError as exc:
            log.warning(f"{self._log_path()}: cannot save operator suspensions: "
                        f"{exc.strerror}; they are in force until this qmgr exits")
            return False
        return True

    def write(self, name: str, body: bytes) -> None:
        """Write ``name`` in the directory atomically (a temporary name, flushed, then
        renamed over it): a crash half-way leaves the old file. Also the sources'
        counts' file (:mod:`.sources`). OSError when it could not."""
        tmp = f"{name}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600,
                         dir_fd=self.dir_fd)
            try:
                os.write(fd, body)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.dir_fd)
            raise


def open_state(cfg: QmgrConfig, log: MailLog) -> StateFile | None:
    """Make and open ``$data_directory/pyqmgr`` (as root, before the chroot).

    Owned by mail_owner, mode 0700: only the daemon reads or writes it. A name there
    that is not a directory is left alone with a warning (root must not chown what
    someone pointed it at), and suspensions then last only as long as this process.
    """
    path = os.path.join(cfg.data_directory, STATE_DIR)
    try:
        fd = owned_directory(path, cfg.mail_owner, 0o700)
    except KeyError:
        log.warning(f"{path}: unknown mail_owner {cfg.mail_owner}; operator suspensions "
                    "will not survive a reload")
        return None
    except OSError as exc:
        log.warning(f"{path}: {exc.strerror}; operator suspensions will not survive a "
                    "reload")
        return None
    return StateFile(fd, path)


# -- the file's records ------------------------------------------------------------------


def to_record(s: Suspension) -> dict[str, object]:
    return {"transport": s.target.transport, "destination": s.target.destination,
            **({"site": s.target.site} if s.target.site is not None else {}),
            **({"tenant": s.target.tenant} if s.target.tenant is not None else {}),
            "reason": s.reason, "by": s.who,
            "since": round(s.wall_until - s.ttl, 3), "until": round(s.wall_until, 3)}


def record_target(obj: object) -> str:
    if isinstance(obj, dict):
        with contextlib.suppress(StateError):
            return str(_target(obj))
    return "an unknown target"


def parse_state(data: bytes) -> list[object]:
    if len(data) > MAX_STATE_BYTES:
        raise StateError(f"larger than {MAX_STATE_BYTES} bytes")
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise StateError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict) or obj.get("version") != FORMAT_VERSION:
        raise StateError(f"not a version {FORMAT_VERSION} suspension file")
    records = obj.get("suspensions")
    if not isinstance(records, list):
        raise StateError('no "suspensions" list')
    return records


def _opt_str(obj: dict[str, object], name: str, limit: int) -> str | None:
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > limit or any(
            not ch.isprintable() or ch.isspace() for ch in value):
        raise StateError(f"bad {name}")
    return value


def _target(obj: dict[str, object]) -> Target:
    transport = _opt_str(obj, "transport", MAX_TARGET)
    destination = _opt_str(obj, "destination", MAX_TARGET)
    site = _opt_str(obj, "site", MAX_TARGET)
    # A tenant's suspension must come back as the tenant's: without it, it would
    # hold everyone's mail there (issue #34's records lacked it until issue #46).
    tenant = _opt_str(obj, "tenant", MAX_TARGET)
    if site is not None:
        # With a transport: that transport's site alone (out11:site:google).
        return Target(transport, None, site=site.lower(), tenant=tenant)
    if transport is None and destination is None and tenant is None:
        raise StateError("neither transport nor destination")
    return Target(transport, destination.lower() if destination else None, tenant=tenant)


def _number(obj: dict[str, object], name: str) -> float:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise StateError(f"bad {name}")
    return float(value)


def suspension_from_record(obj: object, mono_now: float,
                           wall_now: float) -> Suspension | None:
    """A record as a suspension on the scheduler clock; None if it has ended."""
    if not isinstance(obj, dict):
        raise StateError("not an object")
    target = _target(obj)
    reason = obj.get("reason", "")
    who = obj.get("by")
    if not isinstance(reason, str) or not isinstance(who, str) or not who:
        raise StateError("bad reason or by")
    reason = check_reason(reason)
    if len(who) > 100 or not who.isprintable():
        raise StateError("bad by")
    since, until = _number(obj, "since"), _number(obj, "until")
    if until <= since or until - since > MAX_TTL:
        raise StateError("bad since/until")
    if until <= wall_now:
        return None
    return Suspension(target, reason, who, mono_now - (wall_now - since),
                      mono_now + (until - wall_now), until)


# -- the controls ---------------------------------------------------------------------


class Suspensions:
    """``pyqmgr suspend``, ``resume`` and ``retry`` in the running daemon.

    Turns a control request into core events (:meth:`Scheduler.suspend` and
    friends), logs each control in the maillog (who, what, reason, TTL), and keeps
    the state file current. ``scheduler`` is looked up through ``qmgr`` at each call:
    the daemon replaces its scheduler once at start-up when pyqmgr.cf names policies.
    """

    def __init__(self, qmgr: QmgrCore, state: StateFile | None,
                 transports: Iterable[str] = (), tenants: bool = False) -> None:
        self.qmgr = qmgr
        self.state = state
        #: pyqmgr.cf names tenants (tenant_key): ``tenant:`` targets mean something.
        self.tenants = tenants
        #: Names a bare target may mean as a transport: master.cf's services.
        self.known = set(transports)

    @property
    def log(self) -> MailLog:
        return self.qmgr.log

    def restore(self) -> None:
        """At start-up: put the state file's suspensions back in force."""
        if self.state is None:
            return
        sched = self.qmgr.scheduler
        for s in self.state.load(self.log, time.monotonic(), time.time()):
            self.qmgr.after_control(sched.suspend(s))
            self.log.info(f"control: {s.target} stays suspended (by {s.who}"
                          f"{_why(s.reason)}) until {format_time(s.wall_until)}")

    def parse(self, text: str) -> Target:
        """A control's TARGET as every control reads it (ProtocolError if bad)."""
        return self._target(text)

    def _target(self, text: str) -> Target:
        try:
            return parse_target(text, self.known | set(self.qmgr.scheduler.transports))
        except TargetError as exc:
            raise ProtocolError(f"bad target {text[:64]!r}: {exc}") from None

    def _save(self) -> bool:
        if self.state is None:
            return False
        return self.state.save(self.qmgr.scheduler.suspensions, self.log)

    def suspend(self, target_text: str, reason: str, ttl: float,
                who: str) -> dict[str, object]:
        target = self._target(target_text)
        if target.tenant is not None and not self.tenants:
            raise ProtocolError("no tenants: pyqmgr.cf sets no tenant_key, so no mail "
                                "has a tenant to suspend")
        sites = self.qmgr.scheduler.sites
        if target.site is not None and target.transport is not None and (
                sites is None or sites.limits(target.transport) is None):
            raise ProtocolError(f"{target.transport} has no sites: pyqmgr.cf's "
                                "site_grouping is off or site_transports leaves it out, "
                                f"so {target.spec} would hold nothing")
        try:
            reason = check_reason(reason)
            ttl = check_ttl(ttl)
        except StateError as exc:
            raise ProtocolError(str(exc)) from None
        sched = self.qmgr.scheduler
        if (len(sched.suspensions) >= MAX_SUSPENSIONS
                and target.key not in sched.suspensions.by_key):
            raise ProtocolError(f"already {MAX_SUSPENSIONS} suspensions in force; "
                                "resume some first")
        now, wall = time.monotonic(), time.time()
        s = Suspension(target, reason, who, now, now + ttl, wall + ttl)
        replaced = sched.suspensions.by_key.get(target.key)
        decisions = sched.suspend(s)
        saved = self._save()
        self.log.info(f"control: suspend {target} by {who} for {format_duration(ttl)}, "
                      f"until {format_time(s.wall_until)}{_why(reason)}")
        self.qmgr.after_control(decisions)
        return {"target": str(target), "in_core": list(decisions.affected), "ttl": ttl,
                "until": round(s.wall_until), "replaced": replaced is not None,
                "saved": saved}

    def resume(self, target_text: str, who: str) -> dict[str, object]:
        target = self._target(target_text)
        sched = self.qmgr.scheduler
        decisions = sched.resume(target)
        s = decisions.resumed
        if s is None:
            now = [str(x.target) for x in sched.suspensions]
            raise ProtocolError(f"{target} is not suspended (in force: "
                                f"{', '.join(now) or 'none'})", "not_found")
        saved = self._save()
        self.log.info(f"control: resume {target} by {who} (suspended by {s.who}"
                      f"{_why(s.reason)})")
        self.qmgr.after_control(decisions)
        return {"target": str(target), "saved": saved}

    def retry(self, target_text: str, who: str) -> dict[str, object]:
        target = self._target(target_text)
        decisions = self.qmgr.scheduler.retry(target)
        revived = list(decisions.affected)
        self.log.info(f"control: retry {target} by {who}: "
                      + (f"revived {', '.join(revived)}" if revived else "nothing was dead"))
        self.qmgr.after_control(decisions)
        return {"target": str(target), "revived": revived}

    def ended(self, done: list[Suspension]) -> None:
        """Suspensions whose TTL ran out (from the core's tick): log them, save."""
        for s in done:
            self.log.info(f"control: suspension of {s.target} ended: its ttl of "
                          f"{format_duration(s.ttl)} ran out (suspended by {s.who}"
                          f"{_why(s.reason)})")
        self._save()


def _why(reason: str) -> str:
    return f": reason: {reason}" if reason else ", no reason given"
