"""``pyqmgr explain QUEUE_ID`` for a message outside the scheduler's core.

The scheduler knows only the active queue; "why is this deferred, and when is it
tried again" is asked of mail in ``deferred/``, and of mail on hold or not yet read.
The answer is in the queue directory, which the daemon can read and the admin's
``pyqmgr`` (run by any user authorized_mailq_users allows) cannot: the queue files
are mail_owner's, mode 0700. So the daemon reads them, relative to the queue
directory it works in (chrooted or not), and answers on the control channel:

* **where the file is** (``incoming``, ``active``, ``deferred``, ``hold``,
  ``corrupt``), named as Postfix names it (``hash_queue_names``, ``hash_queue_depth``);
* **its envelope**: the sender, the arrival time (the ``T`` record), when it is
  returned if still undelivered (``create_time`` plus ``maximal_queue_lifetime``, or
  ``bounce_queue_lifetime`` for a bounce), and the recipients still to deliver;
* **each recipient's last reason**, from its entry in the defer log
  (:mod:`pyqmgr.postfix.bounce_log`), matched by the offset of its record;
* **the next try**: a deferred file's modification time is its retry time (qmgr sets
  it with ``utime`` as it defers the message, and the deferred scan skips files whose
  time has not come: queue_files_lifecycle.md 1.5); a held file's change time is when
  it was put on hold (``postsuper -h`` renames it and changes no time stamp, so the
  rename's change time is the hold's; a HOLD action writes the file there);
* **the destination's state** when it is in core: each recipient routed as the
  feeder would route it (its content filter, else trivial-rewrite), then
  :func:`pyqmgr.scheduler.explain.destination_state`.

Everything is bounded, as a reading command on the daemon's event loop must be: the
queue file is read through :class:`~pyqmgr.postfix.queue_file.FileWindow` (never its
content) up to :data:`MAX_READ` recipients, the defer log up to its reader's byte
limit, at most :data:`MAX_ROUTES` addresses are routed with a one-second budget on a
connection of its own to trivial-rewrite (one that does not answer ends the routing,
not the daemon), and the reply lists at most :data:`MAX_SHOWN` recipients.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pyqmgr.durations import ago, duration, until
from pyqmgr.postfix import bounce_log, mail_queue, queue_file
from pyqmgr.postfix.config import QmgrConfig
from pyqmgr.postfix.resolve import ResolveClient, ResolverFailure
from pyqmgr.scheduler import explain as scheduler_explain
from pyqmgr.scheduler.core import Scheduler
from pyqmgr.scheduler.policy import Reason, reason

#: The queues a message can be in, in the order they are looked at.
QUEUES = ("incoming", "active", "deferred", "hold", "corrupt")
#: Recipients read from the queue file (its first batch), and listed in the reply.
MAX_READ = 1000
MAX_SHOWN = 50
#: Addresses routed for one explain, and the seconds all of it may take.
MAX_ROUTES = 20
ROUTE_BUDGET = 1.0

#: Extra reasons for a destination from the daemon's other parts (deferred retry).
Extra = Callable[[str], list[Reason]]


@dataclass
class Found:
    """The queue file of a message: its queue, its path and its inode's times."""

    queue: str
    path: str
    st: os.stat_result


def find(cfg: QmgrConfig, qid: str) -> Found | None:
    """The message's file in one of :data:`QUEUES`, or None (no such message)."""
    if not mail_queue.mail_queue_id_ok(qid):
        return None
    for queue in QUEUES:
        path = mail_queue.mail_queue_path(queue, qid, cfg.hash_queue_names,
                                          cfg.hash_queue_depth)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            return Found(queue, path, st)
    return None


@dataclass
class Envelope:
    """What the explain shows of a queue file, read without its content."""

    msg: queue_file.Message
    recipients: list[queue_file.Recipient] = field(default_factory=list)
    #: More recipients to deliver than were read (the file has more).
    more: bool = False
    warnings: list[str] = field(default_factory=list)


def read_envelope(found: Found, qid: str, cfg: QmgrConfig) -> Envelope:
    """The sender, times and first recipients of the file; OSError if unreadable."""
    fd = os.open(found.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{found.path}: not a regular file")
        msg = queue_file.Message(queue_id=qid)
        batch = queue_file.read_batch(
            queue_file.FileWindow(fd, st.st_size), msg, MAX_READ, path=found.path,
            verp_filter=cfg.verp_delimiter_filter, count_check=False)
    finally:
        os.close(fd)
    return Envelope(msg, batch.recipients, msg.rcpt_offset > 0, batch.warnings)


class Router:
    """Routes recipients as the feeder does, within :data:`ROUTE_BUDGET` in all.

    A connection of its own to trivial-rewrite, closed at the end of the explain, with
    a one-second exchange and no waiting to reconnect: a rewrite service that does not
    answer costs the explain its destinations, never the daemon its mail.
    """

    def __init__(self, cfg: QmgrConfig, budget: float = ROUTE_BUDGET) -> None:
        self.cfg = cfg
        self.client = ResolveClient(f"private/{cfg.rewrite_service_name}",
                                    ipc_timeout=budget, give_up_after=0.0,
                                    sleep=lambda _seconds: None)
        self.deadline = time.monotonic() + budget
        self.asked = 0
        self.failure: str | None = None

    def route(self, msg: queue_file.Message, address: str) -> tuple[str, str] | None:
        """(transport, nexthop) for ``address``, or None once routing stopped."""
        if msg.filter:
            transport, _, nexthop = msg.filter.partition(":")
            domain = address.rpartition("@")[2] if "@" in address else ""
            return transport, nexthop or self.cfg.default_filter_nexthop or domain or (
                self.cfg.myhostname)
        if self.failure is not None:
            return None
        if self.asked >= MAX_ROUTES or time.monotonic() >= self.deadline:
            self.failure = f"only the first {self.asked} addresses routed"
            return None
        self.asked += 1
        try:
            res = self.client.resolve(msg.sender or "", address)
        except ResolverFailure as exc:
            self.failure = f"trivial-rewrite did not answer ({exc})"
            return None
        return res.transport, res.nexthop

    def close(self) -> None:
        self.client.close()


def explain(cfg: QmgrConfig, sched: Scheduler, qid: str, now: float, *,
            in_core: int = 0, extra: Extra | None = None,
            router: Router | None = None) -> dict[str, object] | None:
    """The explain reply for the queue file ``qid``; None when there is none.

    ``now`` is the scheduler's clock (for the in-core destinations), ``in_core`` the
    messages in the active queue (for incoming/'s wait), ``extra`` the daemon's
    other reasons for a destination (the deferred retry's recovery).
    """
    found = find(cfg, qid)
    if found is None:
        return None
    wall = time.time()
    reply: dict[str, object] = {"target": qid, "kind": "message", "queue": found.queue,
                                "in_core": False}
    try:
        env = read_envelope(found, qid, cfg)
    except OSError as exc:
        reply["reasons"] = [_where(found, cfg, qid, wall, in_core)]
        reply["warnings"] = [f"{found.path}: {exc.strerror or exc}"]
        return reply
    reply.update(_times(found, env.msg, cfg, wall))
    reply["sender"] = env.msg.sender or ""
    log = _defer_log(cfg, qid, reply)
    own = router is None
    router = router or Router(cfg)
    try:
        rows, routes = _recipients(env, log, router)
    finally:
        if own:
            router.close()
    reply["recipients"] = rows[:MAX_SHOWN]
    reply["recipients_pending"] = len(env.recipients)
    reply["recipients_more"] = env.more
    if router.failure is not None:
        reply["routing"] = router.failure
    reasons = [_where(found, cfg, qid, wall, in_core)]
    destinations = []
    for transport, nexthop in routes:
        state = scheduler_explain.destination_state(sched, transport, nexthop, now)
        reasons += _destination_reasons(state, cfg, transport, nexthop, extra)
        destinations.append(state)
    reply["destinations"] = destinations
    reply["reasons"] = reasons
    reply["warnings"] = env.warnings + (log.warnings if log is not None else [])
    return reply


def _times(found: Found, msg: queue_file.Message, cfg: QmgrConfig,
           wall: float) -> dict[str, object]:
    """Arrival, expiry, and the next try or the hold's start, as times and as
    seconds from now (negative: gone by)."""
    seconds, usec = msg.arrival_time
    arrival = seconds + usec / 1e6 if seconds else None
    out: dict[str, object] = {"arrival_time": arrival,
                              "arrived_ago": _round(wall - arrival) if arrival else None}
    created = msg.create_time or seconds
    lifetime = cfg.bounce_queue_lifetime if not msg.sender else cfg.maximal_queue_lifetime
    if created and lifetime:
        out["expires_time"] = created + lifetime
        out["expires_in"] = _round(created + lifetime - wall)
        out["lifetime_setting"] = ("bounce_queue_lifetime" if not msg.sender
                                   else "maximal_queue_lifetime")
    if found.queue in ("deferred", "incoming"):
        out["next_try_time"] = found.st.st_mtime
        out["next_try_in"] = _round(found.st.st_mtime - wall)
    if found.queue == "hold":
        out["held_since"] = found.st.st_ctime
        out["held_for"] = _round(wall - found.st.st_ctime)
    return out


def _round(seconds: float) -> float:
    return round(seconds, 3)


def _defer_log(cfg: QmgrConfig, qid: str,
               reply: dict[str, object]) -> bounce_log.BounceLog | None:
    """The message's defer log (None: there is none), summed up in ``reply``."""
    path = mail_queue.mail_queue_path("defer", qid, cfg.hash_queue_names,
                                      cfg.hash_queue_depth)
    try:
        log = bounce_log.read_log(path, "defer")
    except OSError as exc:
        reply["defer_log"] = {"path": path, "error": exc.strerror or str(exc)}
        return None
    if log is None:
        reply["defer_log"] = None
        return None
    reply["defer_log"] = {"path": path, "entries": len(log.entries), "size": log.size,
                          "read": log.read}
    return log


def _recipients(env: Envelope, log: bounce_log.BounceLog | None,
                router: Router) -> tuple[list[dict[str, object]], list[tuple[str, str]]]:
    """Each recipient still to deliver with its last reason and its route; and the
    routes, each once, in the order the recipients name them."""
    by_offset = log.last_by_offset() if log is not None else {}
    by_address = log.last_by_address() if log is not None else {}
    rows: list[dict[str, object]] = []
    routes: dict[tuple[str, str], None] = {}
    for rcpt in env.recipients[:MAX_SHOWN]:
        row: dict[str, object] = {"address": rcpt.address}
        if rcpt.orig_addr and rcpt.orig_addr != rcpt.address:
            row["original"] = rcpt.orig_addr
        entry = by_offset.get(rcpt.offset) or by_address.get(rcpt.address)
        if entry is not None:
            row.update(status=entry.status, action=entry.action, reason=entry.reason)
        route = router.route(env.msg, rcpt.address)
        if route is not None:
            row["transport"], row["nexthop"] = route
            routes[route] = None
        rows.append(row)
    return rows, list(routes)


def _where(found: Found, cfg: QmgrConfig, qid: str, wall: float,
           in_core: int) -> Reason:
    """Why the message waits, from the queue it is in."""
    queue = found.queue
    if queue == "deferred":
        due = found.st.st_mtime - wall
        scan = duration(cfg.queue_run_delay)
        when = (f"its retry time is {until(due)}; it is tried at the first deferred "
                f"queue scan after that (one every {scan}, queue_run_delay)"
                if due > 0 else
                f"its retry time passed {ago(-due)}; it is tried at the next deferred "
                f"queue scan (one every {scan}, queue_run_delay)")
        return reason("deferred", "minimal_backoff_time, maximal_backoff_time",
                      f"in the deferred queue after a failed delivery attempt: {when}; "
                      f"'postqueue -i {qid}' tries it now", next_try_in=_round(due))
    if queue == "hold":
        held = wall - found.st.st_ctime
        return reason("on hold", "postsuper -H",
                      f"on hold for {duration(held)} (postsuper -h, or a HOLD action): "
                      "no delivery is tried and it does not expire while held; "
                      f"'postsuper -H {qid}' releases it to the deferred queue",
                      held_for=_round(held))
    if queue == "incoming":
        later = found.st.st_mtime - wall
        text = (f"in the incoming queue, not yet read into the active queue "
                f"({in_core} of qmgr_message_active_limit {cfg.qmgr_message_active_limit} "
                "messages are in core): it is read as room allows")
        if later > 1:
            text += (f", not before its time {until(later)} (put back after a delivery "
                     "agent still held it)")
        return reason("not read yet", "qmgr_message_active_limit", text)
    if queue == "active":
        return reason("being moved", "",
                      "in the active queue but not in core: being read in, or finished "
                      "and on its way out of the active queue; ask again in a moment")
    return reason("corrupt", "",
                  "in the corrupt queue: Postfix found the file damaged and set it "
                  "aside; it is never delivered (the maillog says why)")


def _destination_reasons(state: dict[str, object], cfg: QmgrConfig, transport: str,
                         nexthop: str, extra: Extra | None) -> list[Reason]:
    """The in-core destination's reasons, and what holds its transport back."""
    reasons = state.get("reasons")
    out = list(reasons) if isinstance(reasons, list) else []
    if transport in cfg.defer_transports:
        out.append({**reason("deferred transport", "defer_transports",
                             f"transport {transport} is in defer_transports: its mail "
                             "waits in the deferred queue until 'postqueue -f' or "
                             "'sendmail -q'"), "destination": nexthop})
    if extra is not None:
        out += [{**r, "destination": nexthop} for r in extra(nexthop)]
    return out
