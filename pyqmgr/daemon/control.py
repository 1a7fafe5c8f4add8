"""The control channel's server in the running daemon: ``$queue_directory/pyqmgr/control``.

Why it looks the way it does:

* **Where**: a UNIX-domain socket in the queue directory, because that is the one
  directory the daemon still sees after a chroot into it, and after the privilege drop
  to mail_owner. The directory ``pyqmgr`` is made at start-up while still root (owned
  by mail_owner, mode 0755, so only the daemon can put names in it); the daemon binds
  ``pyqmgr/control`` relative to the queue directory it has already changed into, so
  the same path works chrooted or not. The socket is mode 0666: who may do what is
  decided per request from the peer's credentials, as postqueue(1) decides it.
* **Who**: the peer's uid and pid come from the kernel (``SO_PEERCRED``), never from
  the request. Reading commands are for the users ``authorized_mailq_users`` allows
  (:mod:`pyqmgr.postfix.user_acl`); control commands only for root and mail_owner.
* **Never stalling deliveries**: requests are parsed with :mod:`pyqmgr.control.protocol`
  in ``data_received`` callbacks, at most 64 KiB are buffered per client, at most
  :data:`MAX_CLIENTS` clients are served at once, a client has :data:`REQUEST_TIMEOUT`
  seconds to finish its request (and as long again to take its reply), and a reply is
  built synchronously from the scheduler's state in one event-loop turn, with no await
  in between, so the scheduler never waits on a client and no half-changed state is
  ever shown.
* **Waiting on nothing but the request**, with one exception: ``status --fleet`` reads
  the fleet's roster from Redis (:meth:`pyqmgr.daemon.fleet.roster.FleetRoster.report`,
  bounded by ``shared_state_timeout``); its reply is built when Redis has answered, in
  one turn as every other, and the connection stays counted and timed meanwhile.
* **Optional for mail**: failing to make the directory or the socket is a warning, not
  a fatal error; mail flows without the channel.

* **No local user can stop mail**: a user other than root and mail_owner is served
  :data:`MAX_PER_UID` connections at once, and all such users together
  :data:`MAX_CLIENTS` less :data:`RESERVED`, so root's ``pyqmgr`` commands always get
  through; a connection over its bound is answered "busy" and closed at once, so
  however many a user opens, the daemon holds at most :data:`MAX_CLIENTS` of them and
  its own files always open (issue #31: 1,100 idle connections once made its
  ``open()`` of a queue file fail with EMFILE).

Every refusal and every malformed request is logged as a warning naming the peer's
uid and pid; for users other than root and mail_owner at most one a minute for each
uid (with how many were held back): a user's flood of bad requests must not flood
the maillog.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import pwd
import socket
import stat
import struct
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pyqmgr.control import last_fatal
from pyqmgr.control.protocol import (
    CONTROL,
    MAX_REQUEST,
    ProtocolError,
    Request,
    RequestParser,
    error_reply,
    ok_reply,
)
from pyqmgr.daemon import queued
from pyqmgr.daemon.bounded_server import BoundedServer, OneReplyConnection
from pyqmgr.daemon.delegation import annotate
from pyqmgr.daemon.explain_sources import source_reasons
from pyqmgr.daemon.owned_dir import owned_directory
from pyqmgr.postfix.config import ConfigError, QmgrConfig
from pyqmgr.postfix.maillog_client import MailLog
from pyqmgr.postfix.policy_delegation import WarnGate
from pyqmgr.postfix.user_acl import UserAcl, UserAclError, configured_acl, login_name
from pyqmgr.scheduler import explain as scheduler_explain

if TYPE_CHECKING:
    from pyqmgr.daemon.qmgr import Qmgr

#: The socket's directory and path, relative to queue_directory (the daemon's cwd).
SOCKET_DIR = "pyqmgr"
SOCKET_PATH = os.path.join(SOCKET_DIR, "control")

#: Clients served at once; more are answered "busy" and closed at once.
MAX_CLIENTS = 16
#: The listening socket's queue of connections not yet accepted, and so the most
#: connections accepted in one event-loop pass (asyncio's accept loop takes that
#: many): deep enough that a flood leaves root room, shallow enough that the
#: descriptors a flood costs at once stay a few dozen.
LISTEN_BACKLOG = 64
#: Connections one user (not root, not mail_owner) is served at once.
MAX_PER_UID = 4
#: Connections kept for root and mail_owner whatever other users hold.
RESERVED = 4
#: Users whose warnings are paced separately; past it, the oldest is forgotten.
MAX_WARN_UIDS = 256

#: Seconds a client has to send its whole request (and then to read the reply).
REQUEST_TIMEOUT = 5.0

_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class Peer:
    """Who is on the other end, as the kernel says (struct ucred)."""

    pid: int
    uid: int
    gid: int

    def __str__(self) -> str:
        return f"uid={self.uid} pid={self.pid}"


#: What answers a request the access check let through: result members (or an
#: awaitable of them, for a reply that must ask Redis first), or raises
#: NotImplementedError (answered "not_implemented") or anything else ("internal").
Result = dict[str, object] | Awaitable[dict[str, object]]
Handler = Callable[[dict[str, object], Peer], Result]


def peer_credentials(sock: socket.socket) -> Peer:
    """SO_PEERCRED of a connected UNIX-domain socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return Peer(pid, uid, gid)


@dataclass
class Access:
    """Who may send which kind of command, settled before the chroot.

    ``acl`` is None when authorized_mailq_users cannot be evaluated (a lookup table):
    then only root and mail_owner may read, and the refusal says why. ``names`` maps
    the uids of the login names the ACL mentions, looked up before the chroot, where
    the password file may no longer be readable.
    """

    acl: UserAcl | None
    mail_owner_uid: int | None
    names: dict[int, str] = field(default_factory=dict)
    acl_error: str | None = None

    def privileged(self, peer: Peer | None) -> bool:
        """root or mail_owner: may send controls, and is never bounded as a user is."""
        return peer is not None and (peer.uid == 0 or peer.uid == self.mail_owner_uid)

    def refusal(self, request: Request, peer: Peer) -> str | None:
        """None if ``peer`` may send ``request``, else the text of the refusal."""
        privileged = self.privileged(peer)
        if request.kind == CONTROL:
            if privileged:
                return None
            return (f"permission denied: {request.command} is a control command, for "
                    "root and mail_owner only")
        if privileged:
            return None
        if self.acl is None:
            return (f"permission denied: uid {peer.uid} may not read the scheduler's "
                    f"state: {self.acl_error}")
        if self.acl.allows_uid(peer.uid, mail_owner_uid=self.mail_owner_uid,
                               name_of=self._name_of):
            return None
        name = self._name_of(peer.uid) or "unknown"
        return (f"permission denied: user {name}({peer.uid}) is not allowed to read the "
                f"scheduler's state ({self.acl.param})")

    def _name_of(self, uid: int) -> str | None:
        if uid in self.names:
            return self.names[uid]
        return login_name(uid)


#: Who may read a kept fatal error (:mod:`pyqmgr.control.last_fatal`): everyone
#: (authorized_mailq_users lets everyone read the scheduler's state), else the uids
#: of the login names it lists. Settled with the access rules, before the privilege
#: drop and the chroot, for a fatal after them; None: not settled yet.
_fatal_readers: tuple[bool, tuple[int, ...]] | None = None


def access_from_config(cfg: QmgrConfig, log: MailLog) -> Access:
    """Read authorized_mailq_users and resolve names while the password file is there."""
    global _fatal_readers
    mail_owner_uid = None
    with contextlib.suppress(KeyError):
        mail_owner_uid = pwd.getpwnam(cfg.mail_owner).pw_uid
    try:
        acl = configured_acl(cfg.lookup, cfg.get)
    except (UserAclError, ConfigError) as exc:
        log.warning(f"control socket: {exc}")
        _fatal_readers = (False, ())
        return Access(None, mail_owner_uid, acl_error=str(exc))
    for text in acl.warnings:
        log.warning(text)
    names: dict[int, str] = {}
    for name in acl.names():
        with contextlib.suppress(KeyError):
            pw = pwd.getpwnam(name)
            names[pw.pw_uid] = pw.pw_name
    _fatal_readers = (acl.anyone, tuple(uid for uid, name in names.items()
                                        if acl.allows_name(name)))
    return Access(acl, mail_owner_uid, names)


def keep_fatal(text: str, warnings: list[str]) -> bool:
    """Keep a fatal error for ``pyqmgr status`` (:mod:`pyqmgr.control.last_fatal`).

    For the users authorized_mailq_users lets read the scheduler's state: as settled
    before the privilege drop, or, for a fatal before that, as main.cf says if it can
    be read (else for root alone).
    """
    readers = _fatal_readers
    if readers is None:
        try:
            cfg = QmgrConfig.load(os.environ.get("MAIL_CONFIG", "/etc/postfix"),
                                  check_accounts=False)
            acl = configured_acl(cfg.lookup, cfg.get)
            uids = []
            for name in filter(acl.allows_name, acl.names()):
                with contextlib.suppress(KeyError):
                    uids.append(pwd.getpwnam(name).pw_uid)
            readers = (acl.anyone, tuple(uids))
        except Exception:  # noqa: BLE001 - on the way out of a fatal: keep it private
            readers = (False, ())
    try:
        return last_fatal.keep(text, warnings, public=readers[0], readers=readers[1])
    except Exception:  # noqa: BLE001 - the maillog has the line; this is a copy
        return False


def prepare_directory(cfg: QmgrConfig, log: MailLog) -> bool:
    """Make ``pyqmgr/`` in the queue directory (the cwd), owned by mail_owner, 0755.

    Runs as root before the privilege drop, so that mail_owner can later bind the
    socket in it. A name that is there but is not a directory (a symlink, a file) is
    left alone with a warning: root must not chown what someone else pointed it at.
    Returns whether the directory is usable.
    """
    unavailable = "pyqmgr status and explain are unavailable"
    try:
        os.close(owned_directory(SOCKET_DIR, cfg.mail_owner, 0o755))
    except KeyError:
        log.warning(f"control socket: unknown mail_owner {cfg.mail_owner}; {unavailable}")
        return False
    except NotADirectoryError:
        log.warning(f"control socket: {cfg.queue_directory}/{SOCKET_DIR} is not a "
                    f"directory; {unavailable}")
        return False
    except OSError as exc:
        log.warning(f"control socket: {cfg.queue_directory}/{SOCKET_DIR}: {exc.strerror}; "
                    f"{unavailable}")
        return False
    return True


class ControlServer(BoundedServer):
    """Accepts clients on a listening socket and answers one request each."""

    def __init__(self, handler: Handler, access: Access, log: MailLog, *,
                 max_clients: int = MAX_CLIENTS, timeout: float = REQUEST_TIMEOUT,
                 limit: int = MAX_REQUEST) -> None:
        super().__init__(log, max_clients, timeout, limit)
        self.handler = handler
        self.access = access
        self.path: str | None = None
        self._bound = (0, 0)
        self._server: asyncio.AbstractServer | None = None
        #: Connections served now per unprivileged uid, and in all.
        self.per_uid: dict[int, int] = {}
        self.unprivileged = 0
        self._warn_gates: dict[int | None, WarnGate] = {}

    def admit(self, conn: OneReplyConnection[Any]) -> bool:
        peer = conn.peer if isinstance(conn, _Connection) else None
        if self.access.privileged(peer):
            return super().admit(conn)
        uid = peer.uid if peer is not None else -1
        if self.per_uid.get(uid, 0) >= MAX_PER_UID:
            if isinstance(conn, _Connection):
                conn.busy = f"too many connections from uid {uid} ({MAX_PER_UID} at once)"
            return False
        if self.unprivileged >= self.max_clients - RESERVED or not super().admit(conn):
            return False
        self.per_uid[uid] = self.per_uid.get(uid, 0) + 1
        self.unprivileged += 1
        return True

    def release(self, conn: OneReplyConnection[Any]) -> None:
        super().release(conn)
        peer = conn.peer if isinstance(conn, _Connection) else None
        if self.access.privileged(peer):
            return
        uid = peer.uid if peer is not None else -1
        left = self.per_uid.get(uid, 1) - 1
        if left > 0:
            self.per_uid[uid] = left
        else:
            self.per_uid.pop(uid, None)
        self.unprivileged -= 1

    async def start(self, path: str = SOCKET_PATH) -> None:
        """Bind ``path`` (a stale socket there is removed), mode 0666, and serve."""
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, 0o666)
            # A deep queue: a local user's flood of connections must not leave root's
            # none (the client also retries a full one, EAGAIN, until its timeout).
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            self._server = await loop.create_unix_server(
                lambda: _Connection(self), sock=sock, backlog=LISTEN_BACKLOG)
        except BaseException:
            sock.close()
            raise
        self.path = path
        st = os.lstat(path)
        self._bound = (st.st_dev, st.st_ino)

    def close(self) -> None:
        """Stop listening and remove the socket (clients in progress are dropped)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.path is not None:
            # Only our own socket: after a reload the next qmgr may already have
            # bound the path while this one is on its way out.
            with contextlib.suppress(OSError):
                st = os.lstat(self.path)
                if (st.st_dev, st.st_ino) == self._bound:
                    os.unlink(self.path)
            self.path = None

    def warn(self, peer: Peer | None, text: str) -> None:
        """A warning; for users other than root and mail_owner at most one a minute
        for each uid (``time.monotonic``: this is the daemon's edge, not the core)."""
        who = str(peer) if peer is not None else "unknown peer"
        if self.access.privileged(peer):
            self.log.warning(f"control request from {who}: {text}")
            return
        key = peer.uid if peer is not None else None
        gate = self._warn_gates.pop(key, None)
        if gate is None:
            gate = WarnGate(60.0)
            while len(self._warn_gates) >= MAX_WARN_UIDS:
                del self._warn_gates[next(iter(self._warn_gates))]
        self._warn_gates[key] = gate  # the most recent last
        held = gate.allow(time.monotonic())
        if held is None:
            return
        more = f" ({held} more from this uid since the last warning)" if held else ""
        self.log.warning(f"control request from {who}: {text}{more}")

    def answer(self, request: Request, peer: Peer) -> bytes | Coroutine[Any, Any, bytes]:
        """The reply to a parsed request: refused, or the handler's result.

        Synchronous on purpose: the reply is the scheduler's state of this instant.
        Only a handler that must ask Redis first (``status --fleet``) gives an
        awaitable, and then so does this.
        """
        refusal = self.access.refusal(request, peer)
        if refusal is not None:
            self.warn(peer, f"{request.command}: {refusal}")
            return error_reply(refusal, "denied")
        try:
            result = self.handler(request.as_dict(), peer)
            if inspect.isawaitable(result):
                return self._later(result, request, peer)
            assert isinstance(result, dict)
            return ok_reply(result)
        except Exception as exc:  # noqa: BLE001 - every failure is an error reply
            return self._failed(exc, request, peer)

    async def _later(self, result: Awaitable[dict[str, object]], request: Request,
                     peer: Peer) -> bytes:
        try:
            return ok_reply(await result)
        except Exception as exc:  # noqa: BLE001 - every failure is an error reply
            return self._failed(exc, request, peer)

    def _failed(self, exc: Exception, request: Request, peer: Peer) -> bytes:
        """The error reply for what the handler raised."""
        if isinstance(exc, ProtocolError):
            # The handler's own check of the arguments (a bad target or ttl, a transport
            # not in core). A refused control is logged, as every control is; a reader's
            # typo is only answered.
            if request.kind == CONTROL:
                self.warn(peer, f"{request.command}: {exc}")
            return error_reply(str(exc), exc.code)
        if isinstance(exc, NotImplementedError):
            text = str(exc) or f"{request.command} is not yet implemented"
            return error_reply(text, "not_implemented")
        # A bug must not take the daemon down.
        self.warn(peer, f"{request.command}: internal error: {type(exc).__name__}: {exc}")
        return error_reply(f"internal error: {type(exc).__name__}", "internal")


class _Connection(OneReplyConnection[ControlServer]):
    """One client: one request, one reply, then closed; bounded in bytes and time."""

    def __init__(self, server: ControlServer) -> None:
        super().__init__(server)
        self.parser = RequestParser(server.limit)
        self.peer: Peer | None = None
        self.discarded = 0
        #: Why it is not served, when it is not.
        self.busy = f"too many clients ({server.max_clients})"
        #: The reply being made, when it waits for Redis (status --fleet).
        self.waiting: asyncio.Task[bytes] | None = None

    def _accepted(self, transport: asyncio.Transport) -> None:
        sock = transport.get_extra_info("socket")
        with contextlib.suppress(OSError, AttributeError):
            self.peer = peer_credentials(sock)

    def _busy_reply(self) -> bytes:
        text = f"{self.busy}; try again later"
        self.server.warn(self.peer, text)
        return error_reply(text, "busy")

    def data_received(self, data: bytes) -> None:
        if self.answered:
            # Read and drop what follows the request (closing with unread data would
            # reset the connection before the client reads its reply), but only so much.
            self.discarded += len(data)
            if self.discarded > self.server.limit:
                self._abort()
            return
        try:
            request = self.parser.feed(data)
        except ProtocolError as exc:
            self._refuse(exc)
            return
        if request is None:
            return
        if self.peer is None:
            self._reply(error_reply("no peer credentials on the socket", "denied"))
            self.server.warn(None, "no peer credentials on the socket")
            return
        reply = self.server.answer(request, self.peer)
        if isinstance(reply, bytes):
            self._reply(reply)
            return
        # Answered when Redis has (status --fleet): the request's timer still runs.
        self.waiting = asyncio.get_running_loop().create_task(reply)
        self.waiting.add_done_callback(self._answered_later)

    def _answered_later(self, task: asyncio.Task[bytes]) -> None:
        self.waiting = None
        if task.cancelled() or self.answered or self.transport is None or (
                self.transport.is_closing()):
            return
        self._reply(task.result())

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiting is not None:
            self.waiting.cancel()
            self.waiting = None
        super().connection_lost(exc)

    def eof_received(self) -> bool:
        if not self.answered:
            try:
                self.parser.eof()
            except ProtocolError as exc:
                self._refuse(exc)
        # The client is done: the transport closes once the reply has been written.
        return False

    def _refuse(self, exc: ProtocolError) -> None:
        self.server.warn(self.peer, f"malformed request: {exc}")
        self._reply(error_reply(str(exc), exc.code))

    def _end_reply(self, transport: asyncio.Transport) -> None:
        # Half-close: the client reads the reply up to our end of file and closes, and
        # its close (eof_received) closes ours. A client that never reads the reply
        # or never closes is cut off by the timer, armed until the connection is gone.
        transport.write_eof()

    def _timeout_reply(self) -> bytes:
        if self.waiting is not None:
            self.waiting.cancel()
            return error_reply(f"no answer within {self.server.timeout:g} s", "timeout")
        what = ("request not finished" if self.parser.pending else "no request")
        text = f"{what} within {self.server.timeout:g} s"
        self.server.warn(self.peer, text)
        return error_reply(text, "timeout")


def scheduler_handler(qmgr: Qmgr, access: Access | None = None,
                      mail_owner: str = "postfix") -> Handler:
    """The daemon's handler: reading from ``qmgr.scheduler`` now, and the controls.

    The controls' "who" is the peer as the kernel gave it, named as the access check
    knows it (only root and mail_owner get that far).
    """

    def who(peer: Peer) -> str:
        name = ("root" if peer.uid == 0 else mail_owner
                if access is not None and peer.uid == access.mail_owner_uid else "uid")
        return f"{name} ({peer})"

    def handle(request: dict[str, object], peer: Peer) -> Result:
        command = request["command"]
        now = time.monotonic()
        if command == "status" and request.get("fleet"):
            if qmgr.fleet is None:
                raise ProtocolError("--fleet needs a fleet: set shared_state in pyqmgr.cf")
            return qmgr.fleet.roster.report()
        if command == "status":
            return status_reply(qmgr, now)
        if command == "explain":
            return explain_reply(qmgr, str(request["target"]), now)
        if command == "jobs":
            return jobs_reply(qmgr, request, now)
        controls = qmgr.suspensions
        target = str(request.get("target", ""))
        fleet = qmgr.fleet if request.get("fleet") else None
        if request.get("fleet") and fleet is None:
            raise ProtocolError("--fleet needs a fleet: set shared_state in pyqmgr.cf")
        if command == "suspend":
            ttl = request["ttl"]
            assert isinstance(ttl, int | float)
            reason = str(request.get("reason", ""))
            reply = controls.suspend(target, reason, float(ttl), who(peer))
            if fleet is not None:
                fleet.suspensions.share(controls.parse(target).spec, reason, float(ttl),
                                        who(peer))
                reply["fleet"] = True
            return reply
        if command == "resume":
            if fleet is not None:
                fleet.suspensions.end(controls.parse(target).spec, who(peer))
                try:
                    reply = controls.resume(target, who(peer))
                except ProtocolError:
                    # Not in force here (made elsewhere, not yet heard): the fleet's is.
                    reply = {"target": target, "saved": False}
                reply["fleet"] = True
                return reply
            return controls.resume(target, who(peer))
        if command == "retry":
            return controls.retry(target, who(peer))
        raise NotImplementedError(f"{command} is not yet implemented")

    return handle


def status_reply(qmgr: Qmgr, now: float) -> dict[str, object]:
    """``status``: the core's view, and each feature's own part when it is on."""
    reply = annotate(scheduler_explain.status(qmgr.scheduler, now), qmgr.delegation)
    if qmgr.retry is not None:
        reply["deferred_retry"] = qmgr.retry.status(now)
    if qmgr.fleet is not None:
        reply["fleet"] = qmgr.fleet.status()
    if qmgr.memory is not None:
        reply["memory"] = qmgr.memory.status()
    if qmgr.sites is not None:  # MX lookups: counts, the helper process
        reply["site_lookups"] = qmgr.sites.status()
    if qmgr.active.sources is not None:  # source pools and warm-up (#46)
        reply["sources"] = qmgr.active.sources.status()
    events = qmgr.events.status()
    if events is not None:  # delivery events (#46): read, written, streamed
        reply["delivery_events"] = events
    if qmgr.classifier is not None and qmgr.classifier.sender_keys:
        reply["sender_keys"] = {
            "trusted_clients": qmgr.classifier.trust.words,
            "untrusted_messages": qmgr.classifier.untrusted}
    if qmgr.classifier is not None and qmgr.classifier.unlisted_limit:
        reply["unlisted_tenants"] = {
            "limit": qmgr.classifier.unlisted_limit,
            "in_active_queue": len(qmgr.classifier.live),
            "folded_messages": qmgr.classifier.folded}
    if qmgr.feeder.classes is not None:
        reply["classes"] = qmgr.feeder.classes.describe(
            m.sched.rank for m in qmgr.active.messages.values())
    return reply


def explain_reply(qmgr: Qmgr, target: str, now: float) -> dict[str, object]:
    """``explain``: a destination or a message in core, else a message's queue file
    (deferred, on hold, not yet read: :mod:`pyqmgr.daemon.queued`)."""
    reply = scheduler_explain.explain(qmgr.scheduler, target, now, busy=qmgr.in_flight())
    retry = qmgr.retry
    if reply.get("kind") == "unknown":
        queued_reply = queued.explain(
            qmgr.cfg, qmgr.scheduler, target, now, in_core=qmgr.message_count,
            extra=retry.explain if retry is not None else None)
        if queued_reply is not None:
            return queued_reply
    if retry is not None:
        extra = retry.explain(target)
        reasons = reply.get("reasons")
        if extra and isinstance(reasons, list):
            reasons.extend(extra)
    sources = qmgr.active.sources
    if sources is not None:  # a pool member's share or warm-up (#46)
        reply = source_reasons(sources.book, target, reply, sources.clock(),
                               sources.site_of)
    return reply


def jobs_reply(qmgr: Qmgr, request: dict[str, object], now: float) -> dict[str, object]:
    """``jobs``: the transport's policy's list, or a refusal that says what exists."""
    name = str(request["transport"])
    limit = request.get("limit")
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise ProtocolError(f"jobs: limit must be a whole number, 0 or more, not {limit}")
    reply = scheduler_explain.jobs(qmgr.scheduler, name, now,
                                   limit if isinstance(limit, int) else None)
    if reply is None:
        known = ", ".join(sorted(qmgr.scheduler.transports)) or "none yet"
        shown = json.dumps(name[:64] + ("..." if len(name) > 64 else ""))
        raise ProtocolError(f"jobs: no transport {shown} in core (in core: "
                            f"{known}); a transport appears when mail for it first "
                            "reaches the active queue", "not_found")
    if qmgr.classifier is not None and isinstance(jobs := reply.get("jobs"), list):
        names = qmgr.classifier.classes
        for job in jobs:
            if isinstance(job, dict) and isinstance(rank := job.get("class_rank"), int):
                job["class"] = names[rank] if rank < len(names) else str(rank)
    return reply


async def start(qmgr: Qmgr, access: Access, log: MailLog,
                mail_owner: str = "postfix") -> ControlServer | None:
    """Serve the channel for ``qmgr``; on failure log a warning and return None.

    Called once the daemon has started: a fatal error kept from an earlier start no
    longer says why there is no daemon, and goes.
    """
    last_fatal.clear()
    server = ControlServer(scheduler_handler(qmgr, access, mail_owner), access, log)
    try:
        await server.start(SOCKET_PATH)
    except OSError as exc:
        log.warning(f"control socket {SOCKET_PATH}: {exc.strerror or exc}; "
                    "pyqmgr status and explain are unavailable")
        return None
    return server
