"""The client side of the control channel: one request, one reply, bounded in time.

Used by ``pyqmgr status`` and ``pyqmgr explain``; the errors say what an admin can do
about them (start Postfix, ask for authorized_mailq_users, wait).
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import time

from pyqmgr.control.protocol import MAX_REPLY, ProtocolError, decode_reply, encode_request

#: The socket, relative to queue_directory (as the daemon binds it).
SOCKET_PATH = os.path.join("pyqmgr", "control")

#: Seconds the client waits for the whole exchange.
CLIENT_TIMEOUT = 10.0


class ClientError(Exception):
    """Why there is no reply; ``kind`` is "unavailable", "timeout" or "protocol"."""

    def __init__(self, text: str, kind: str) -> None:
        super().__init__(text)
        self.kind = kind


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
                              "(or this instance does not run pyqmgr)", "unavailable") from None
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
