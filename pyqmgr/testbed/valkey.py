"""A throwaway Valkey server on loopback: Debian 13's ``valkey-server``, run from the
test bed's trixie root (issue #35).

Operators increasingly run Valkey, the fork of Redis, where they ran Redis; the fleet
is tested on the one Debian ships. Debian 12 has no Valkey, so the server comes from
the Debian 13 root :mod:`pyqmgr.testbed.release` keeps for Postfix 3.10 (``./dev root
3.10`` makes it, with ``valkey-server`` among its packages), and runs as the root's
Postfix does: :meth:`ReleaseRoot.command` starts it in a mount namespace of its own,
chrooted into the root, with the server's directory bound at the same path, so its
unix socket and log are where the host looks for them. The shell and ``chroot`` exec
into the server, so the process the test bed signals is ``valkey-server`` itself,
and the namespace ends with it.

:class:`ValkeyServer` is :class:`~pyqmgr.testbed.redis.RedisServer` with another
binary: the same interface (url, start/stop, freeze/thaw, key_file, command), so a
fleet test takes either.
"""

from __future__ import annotations

from pyqmgr.testbed.redis import RedisServer
from pyqmgr.testbed.release import ReleaseRoot

#: The release whose root holds Valkey (Debian 13, trixie).
RELEASE = "3.10"
VALKEY_SERVER = "/usr/bin/valkey-server"


class ValkeyServer(RedisServer):
    """``valkey-server`` from the Debian 13 root, on 127.0.0.1 and a unix socket."""

    name = "valkey-server"

    def __init__(self, password: str | None = None) -> None:
        # The root is made (or given Valkey) here, before the command line names it.
        self.root = ReleaseRoot(RELEASE).ensure()
        super().__init__(password)

    def argv(self) -> list[str]:
        args = super().argv()
        return self.root.command([VALKEY_SERVER, *args[1:]], binds=[self.dir])

    def version(self) -> str:
        """The server's own ``valkey_version`` (INFO server)."""
        reply = self.command("INFO", "server")
        text = reply.decode() if isinstance(reply, bytes) else str(reply)
        for line in text.splitlines():
            if line.startswith("valkey_version:"):
                return line.split(":", 1)[1].strip()
        return ""
