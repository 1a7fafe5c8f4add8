"""A real DNS server on loopback for the sites' tests (issue #33): Debian's unbound.

The test zones' records (MX records naming the sink's host, A records, a CNAME loop,
a domain with 500 MX records) are served by unbound from ``local-data`` lines, on
port 53 of an address of 127/8 of its own (resolv.conf names no port, and smtp(8)
and pyqmgr both read resolv.conf). Names outside the test zones are refused, so no
query leaves the machine. A Postfix instance resolves through it when started with
:meth:`DnsServer.start_prefix`: its daemons run in a private mount namespace where
``/etc/resolv.conf`` is this server's file; nothing changes outside.

:class:`BlackHole` is the server that never answers: UDP and TCP on port 53 of its
own address, reading and dropping. Both are always stopped: :meth:`stop` (the
context managers' exit) ends the process or closes the sockets and removes the
directory.
"""

from __future__ import annotations

import os
import random
import select
import shlex
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from typing import Self

from pyqmgr.testbed.instance_base import TestbedError, file_tail, wait_until

UNBOUND = "/usr/sbin/unbound"


def available() -> bool:
    return os.access(UNBOUND, os.X_OK)


def _free_address() -> str:
    """An address of 127.53/16 whose port 53 nobody uses (UDP and TCP)."""
    rng = random.Random()
    for _ in range(200):
        addr = f"127.53.{rng.randrange(1, 255)}.{rng.randrange(1, 255)}"
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u, \
                    socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
                u.bind((addr, 53))
                t.bind((addr, 53))
            return addr
        except OSError:
            continue
    raise TestbedError("no free port 53 on 127.53/16")


class _Resolvable:
    """A server's resolv.conf and the shell words that make a command use it."""

    dir: str
    address: str

    @property
    def resolv_conf(self) -> str:
        path = os.path.join(self.dir, "resolv.conf")
        if not os.path.exists(path):
            with open(path, "w") as f:
                f.write(f"nameserver {self.address}\noptions timeout:2 attempts:1\n")
            os.chmod(path, 0o644)
        return path

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start_prefix(self) -> str:
        """Shell words to put before ``postfix start``: its daemons resolve here."""
        return (f"unshare -m --propagation private sh -c "
                f"'mount --bind {shlex.quote(self.resolv_conf)} /etc/resolv.conf && "
                f"exec \"$0\" \"$@\"' ")


class DnsServer(_Resolvable):
    """unbound on ``address``:53 serving ``records`` (zone-file lines) in ``zones``."""

    __test__ = False

    def __init__(self, zones: Sequence[str], records: Sequence[str],
                 servfail: Sequence[str] = ()) -> None:
        self.zones = [z.rstrip(".") + "." for z in zones]
        self.records = list(records)
        #: Zones answered SERVFAIL: delegated to a port where nothing listens.
        self.servfail = [z.rstrip(".") + "." for z in servfail]
        self.address = _free_address()
        self.dir = tempfile.mkdtemp(prefix="pyqmgr-dns-")
        os.chmod(self.dir, 0o755)
        self.log_path = os.path.join(self.dir, "unbound.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def _config(self) -> str:
        lines = ["server:", f"  interface: {self.address}", "  port: 53",
                 "  do-daemonize: no", '  username: ""', '  chroot: ""',
                 f'  directory: "{self.dir}"', f'  pidfile: "{self.dir}/unbound.pid"',
                 "  use-syslog: no", f'  logfile: "{self.log_path}"', "  verbosity: 1",
                 "  do-ip6: no", "  access-control: 127.0.0.0/8 allow",
                 '  module-config: "iterator"', '  auto-trust-anchor-file: ""',
                 "  msg-buffer-size: 65552", "  max-udp-size: 1232",
                 '  local-zone: "." refuse']
        lines += [f'  local-zone: "{z}" static' for z in self.zones]
        lines += [f'  local-data: "{r}"' for r in self.records]
        for z in self.servfail:
            lines += [f'  local-zone: "{z}" transparent', "stub-zone:", f'  name: "{z}"',
                      "  stub-addr: 127.0.0.1@1", "server:"]
        lines += ["remote-control:", "  control-enable: no"]
        return "\n".join(lines) + "\n"

    def start(self, timeout: float = 20) -> Self:
        if self.proc is not None and self.proc.poll() is None:
            raise TestbedError(f"unbound on {self.address} runs already")
        conf = os.path.join(self.dir, "unbound.conf")
        with open(conf, "w") as f:
            f.write(self._config())
        check = subprocess.run(["unbound-checkconf", conf], capture_output=True, text=True,
                               timeout=30, check=False)
        if check.returncode != 0:
            raise TestbedError(f"unbound-checkconf: {check.stdout}{check.stderr}")
        self.proc = subprocess.Popen([UNBOUND, "-d", "-c", conf], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)

        def answers() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise TestbedError(f"unbound exited {self.proc.returncode}: "
                                   f"{file_tail(self.log_path)}")
            return self.query_ok()

        wait_until(answers, timeout, f"unbound on {self.address}:53 to answer",
                   detail=lambda: f"; its log:\n{file_tail(self.log_path)}")
        return self

    def serve(self, records: Sequence[str]) -> None:
        """Serve these records from now on, at the same address: a domain's owner
        changing its MX records (unbound restarted: nothing cached survives)."""
        self._end_unbound()
        self.records = list(records)
        self.start()  # its directory, and the resolv.conf mounted from it, stay

    def query_ok(self) -> bool:
        """Does the server answer (anything) on UDP now?"""
        query = bytes.fromhex("abcd01000001000000000000") + b"\x04test\x00\x00\x06\x00\x01"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(0.5)
            try:
                s.sendto(query, (self.address, 53))
                return s.recv(4096)[:2] == b"\xab\xcd"
            except OSError:
                return False

    def _end_unbound(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if proc is not None and proc.stderr is not None:
            proc.stderr.close()

    def stop(self) -> None:
        self._end_unbound()
        shutil.rmtree(self.dir, ignore_errors=True)



class BlackHole(_Resolvable):
    """A DNS server that never answers: reads every query on UDP and TCP, drops it."""

    __test__ = False

    def __init__(self) -> None:
        self.address = _free_address()
        self.dir = tempfile.mkdtemp(prefix="pyqmgr-dns-")
        os.chmod(self.dir, 0o755)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._stop = threading.Event()
        self._held: list[socket.socket] = []
        self.queries = 0
        self._thread: threading.Thread | None = None

    def start(self) -> Self:
        self.udp.bind((self.address, 53))
        self.tcp.bind((self.address, 53))
        self.tcp.listen(16)
        self.udp.settimeout(0.2)
        self.tcp.settimeout(0.2)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.udp, self.tcp], [], [], 0.2)
            for sock in ready:
                try:
                    if sock is self.udp:
                        self.udp.recv(65536)
                    else:
                        self._held.append(self.tcp.accept()[0])
                    self.queries += 1
                except OSError:
                    pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        for s in [self.udp, self.tcp, *self._held]:
            s.close()
        shutil.rmtree(self.dir, ignore_errors=True)

