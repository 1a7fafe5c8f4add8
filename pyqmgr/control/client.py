"""The client side of the control channel: one request, one reply, bounded in time.

Used by ``pyqmgr status`` and ``pyqmgr explain``; the errors say what an admin can do
about them (start Postfix, ask for authorized_mailq_users, wait). When no daemon
answers, :func:`not_running` says why as far as this user can see it: the daemon's
last fatal error kept by :mod:`pyqmgr.control.last_fatal`, master(8)'s wait before
it starts the service again and how to end it, or that Postfix is not running.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import time
from dataclasses import dataclass, field

from pyqmgr.control import last_fatal
from pyqmgr.control.protocol import MAX_REPLY, ProtocolError, decode_reply, encode_request
from pyqmgr.control.render import clock
from pyqmgr.durations import ago, duration
from pyqmgr.postfix.config import conv_time

#: The socket, relative to queue_directory (as the daemon binds it).
SOCKET_PATH = os.path.join("pyqmgr", "control")

#: Seconds the client waits for the whole exchange.
CLIENT_TIMEOUT = 10.0


class ClientError(Exception):
    """Why there is no reply; ``kind`` is "unavailable", "timeout" or "protocol";
    ``down``: no daemon listens (no socket, or nobody accepts on it)."""

    def __init__(self, text: str, kind: str, down: bool = False) -> None:
        super().__init__(text)
        self.kind = kind
        self.down = down


def queue_directory(config_dir: str) -> str:
    """``postconf -c DIR -h queue_directory``: the instance's queue directory.

    postconf is Postfix's own answer (it expands $names and knows the built-in
    default), and it is what every Postfix tool uses.
    """
    try:
        proc = subprocess.run(["postconf", "-c", config_dir, "-h", "queue_directory"],
                              capture_output=True, text=True, timeout=30, check=False)
    except FileNotFoundError:
        raise ClientError("postconf not found: is Postfix installed?", "unavailable") from None
    except subprocess.TimeoutExpired:
        raise ClientError("postconf did not answer within 30 s", "timeout") from None
    if proc.returncode != 0 or not proc.stdout.strip():
        text = proc.stderr.strip() or f"postconf -c {config_dir} failed"
        raise ClientError(text, "unavailable")
    return proc.stdout.strip()


def socket_path(config_dir: str) -> str:
    return os.path.join(queue_directory(config_dir), SOCKET_PATH)


def _connect(sock: socket.socket, path: str, deadline: float) -> None:
    """connect(), again while the socket's listen queue is full (EAGAIN) and time is
    left: another user's flood of connections can fill it for moments at a time, and
    the daemon empties it fast (issue #31)."""
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() + 0.02 >= deadline:
                raise
            time.sleep(0.02)


def request(path: str, command: str, args: dict[str, object] | None = None, *,
            timeout: float = CLIENT_TIMEOUT) -> dict[str, object]:
    """Send one request to the daemon at ``path``; return its decoded reply.

    A failed reply (``"ok": false``) is returned, not raised: the caller prints its
    text. Raises ClientError when there is no usable reply at all.
    """
    line = encode_request(command, **(args or {}))
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            _connect(sock, path, deadline)
        except (FileNotFoundError, NotADirectoryError, ConnectionRefusedError):
            raise ClientError(f"cannot connect to {path}: the pyqmgr daemon is not running "
                              "(or this instance does not run pyqmgr)", "unavailable",
                              down=True) from None
        except PermissionError:
            raise ClientError(f"cannot connect to {path}: permission denied",
                              "unavailable") from None
        except OSError as exc:
            if exc.errno == errno.ENOTSOCK:
                raise ClientError(f"{path} is not a socket", "unavailable") from None
            raise ClientError(f"cannot connect to {path}: {exc.strerror}",
                              "unavailable") from None
        data = bytearray()
        try:
            sock.sendall(line)
            while not data.endswith(b"\n"):
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
                if len(data) > MAX_REPLY:
                    raise ClientError(f"reply longer than {MAX_REPLY} bytes", "protocol")
        except TimeoutError:
            raise ClientError(f"no reply from {path} within {timeout:g} s",
                              "timeout") from None
        except OSError as exc:
            if not data:
                raise ClientError(f"{path}: {exc.strerror}", "unavailable") from None
    finally:
        sock.close()
    if not data:
        raise ClientError(f"{path}: the daemon closed the connection without a reply",
                          "protocol")
    try:
        return decode_reply(bytes(data))
    except ProtocolError as exc:
        raise ClientError(str(exc), "protocol") from None


#: master(8)'s wait after a failed start when postconf does not say (its default).
DEFAULT_THROTTLE = 60


@dataclass
class NotRunning:
    """Why no daemon answers, as far as this user can see: lines for a person, and
    the same for ``--json``."""

    lines: list[str] = field(default_factory=list)
    data: dict[str, object] = field(default_factory=dict)


def _postfix(config_dir: str, verb: str) -> str:
    """``postfix VERB`` as the admin types it for this instance."""
    if os.path.normpath(config_dir) == "/etc/postfix":
        return f"postfix {verb}"
    return f"postfix -c {config_dir} {verb}"


def master_running(queue_dir: str) -> bool | None:
    """Whether the instance's master(8) runs (its pid file names a live process);
    None when this user cannot tell."""
    try:
        with open(os.path.join(queue_dir, "pid", "master.pid"), "rb") as f:
            text = f.read(64)
        pid = int(text.split()[0])
    except FileNotFoundError:
        return False
    except (OSError, ValueError, IndexError):
        return None
    if pid <= 1:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # root's process, alive
    return True


def throttle_time(config_dir: str) -> int:
    """``service_throttle_time`` in seconds: master(8)'s wait after a failed start."""
    try:
        proc = subprocess.run(["postconf", "-c", config_dir, "-h", "service_throttle_time"],
                              capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return DEFAULT_THROTTLE
    value = conv_time(proc.stdout.strip(), "s") if proc.returncode == 0 else None
    return value if value else DEFAULT_THROTTLE


def not_running(queue_dir: str, config_dir: str, now: float | None = None) -> NotRunning:
    """What to tell the admin when no daemon answers on the control socket."""
    now = time.time() if now is None else now
    out = NotRunning()
    restart = f"'{_postfix(config_dir, 'stop')}; {_postfix(config_dir, 'start')}'"
    try:
        kept = last_fatal.read(queue_dir)
    except PermissionError:
        path = os.path.join(queue_dir, last_fatal.PATH)
        out.lines.append(f"the daemon's last fatal error is kept in {path}, for the users "
                         "authorized_mailq_users lets read the scheduler's state: ask "
                         "root, or look for 'fatal:' in the maillog")
        out.data["last_fatal"] = {"path": path, "error": "permission denied"}
        return out
    if kept is not None:
        wait = throttle_time(config_dir)
        out.data["last_fatal"] = {**kept.as_dict(), "ago": round(now - kept.time, 3),
                                  "service_throttle_time": wait}
        out.lines.append(f"its last start failed at {clock(kept.time)} "
                         f"({ago(now - kept.time)}):")
        out.lines += [f"  warning: {text}" for text in kept.warnings]
        out.lines.append(f"  fatal: {kept.text}")
        out.lines.append(
            f"master(8) starts the qmgr service again {duration(wait)} after each failed "
            f"start (service_throttle_time); once what the fatal line names is fixed, "
            f"{restart} starts it at once ('postfix reload' does not end master's wait)")
        return out
    running = master_running(queue_dir)
    out.data["master_running"] = running
    if running is False:
        out.lines.append(f"Postfix is not running: '{_postfix(config_dir, 'start')}' "
                         "starts it")
    elif running:
        out.lines.append("master(8) runs, but no pyqmgr answers: the qmgr service may be "
                         "stock's ('postconf -Mf qmgr/unix' shows its command; 'pyqmgr "
                         "install' makes it pyqmgr), or it is starting (try again in a "
                         "moment); a 'fatal:' line in the maillog says why it did not start")
    return out
