"""The MX lookup helper: a process of its own that asks DNS for qmgr (issue #44).

Postfix's qmgr does no DNS; its delivery agents do. With ``site_grouping = mx``
pyqmgr must know each new domain's MX hosts, and a lookup inside qmgr cost it
150-210 us of CPU (socket, event-loop turn, dnspython reading the answer): with
3,000 domains and 1,000 messages nearly one lookup a message, qmgr's CPU a message
was twice that of the same mail with sites off. So start-up spawns this helper
(before the privilege drop and the chroot, while the interpreter's files are in
reach) and qmgr writes it domain names and reads back raw MX records; qmgr names
the site itself (:func:`pyqmgr.site_names.site_name`, with its provider table, which
may be root's alone).

The helper imports dnspython and reads /etc/resolv.conf as root, then becomes
mail_owner (setgid, initgroups, setuid: the daemon's own order) before it reads any
answer. It is started with ``-I`` (no PYTHON* variables, no user site, not the
current directory), a minimal environment (``MAIL_CONFIG`` kept: it is how tools
find an instance's processes) and the root directory as its working directory. It
exits when its input ends: qmgr gone, however it went.

The protocol, one line each way, UTF-8, strictly bounded:

- qmgr -> helper: ``DOMAIN\\n``; a domain is 1-255 bytes with no whitespace or
  control character and does not start with ``!`` (:func:`valid_domain`).
- helper -> qmgr: ``!ready\\n`` once it can look up (the queries written before then
  go now: qmgr gives their domains their ``site_dns_wait`` from here);
  ``!fatal TEXT\\n`` when it cannot start, and it exits; and an answer a domain,
  ``DOMAIN TAB TTL TAB WHY-or-- TAB PREF HOST PREF HOST ...\\n`` (no records: no MX,
  or the lookup failed and WHY says why), at most :data:`MAX_LINE` bytes.

qmgr's side (:class:`LookupHelper`) batches the names it writes in a loop turn into
one write and reads answers in its event loop's reader callback. A line that is
malformed, oversized or answers a domain nobody asked for is ignored with a warning
(ten a minute). A domain not answered within ``site_dns_timeout`` plus
:data:`SLACK` fails as "the lookup helper did not answer"; if nothing at all came
back meanwhile the helper is taken for hung and killed. When the helper is gone (it
exited, was killed, hung, its pipe broke) qmgr says so once and looks domains up
itself with dnspython for the rest of its life (it cannot start another helper: it
may be chrooted and is no longer root); the lookups in flight are asked again there.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import subprocess
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from pyqmgr.site_names import site_name

if TYPE_CHECKING:
    from pyqmgr.daemon.mx_lookup import MxFound, MxLookup, Records
    from pyqmgr.postfix.policy_delegation import WarnGate
    from pyqmgr.settings.sites import SiteSettings

#: An answer line's most bytes: an MX answer is at most 64 KiB on the wire.
MAX_LINE = 65_536
#: Records in one answer at most (more: the lookup fails as too large).
MAX_RECORDS = 4_096
#: A host's text at most: 255 bytes, each escaped as \\DDD at worst.
MAX_HOST = 1_024
#: A failure's text at most.
MAX_WHY = 512
#: Lookups the helper runs at once at most; qmgr itself runs site_dns_lookups.
MAX_RUNNING = 1_024
#: Seconds the names asked go unwritten, so that a burst of new domains (a message
#: read a loop turn) is one write and one wake-up of the helper, not one each: 974
#: writes for 1,000 new domains with a write a loop turn. Next to site_dns_wait
#: (200 ms) and a local resolver's answer (about a millisecond) it is nothing.
FLUSH_DELAY = 0.002
#: Site names kept by MX record set: a provider's thousands of domains answer the
#: same records, named once (site_names.site_name sorts and matches every host).
MAX_NAMES = 4_096
#: Seconds past site_dns_timeout qmgr waits for an answer: the helper's own
#: lookups end by the timeout, so past this the helper is at fault.
SLACK = 2.0
#: The helper's process name in ps: qmgr's, and what it is.
HELPER_ARGV0 = "pyqmgr-site-lookupd"

_DOMAIN = re.compile(r"[^\x00-\x20\x7f!][^\x00-\x20\x7f]{0,254}\Z")
_HOST = re.compile(rb"[\x21-\x7e]{1,%d}\Z" % MAX_HOST)
_WHY = re.compile(rb"[\x20-\x7e]{1,%d}\Z" % MAX_WHY)
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")

#: What qmgr's lookups answer (sites.Found): the site, how long, why it failed.
Found = tuple[str | None, float, str | None]
Lookup = Callable[[str], Awaitable[Found]]


def valid_domain(domain: str) -> bool:
    """May this name go to the helper? Recipient domains are whatever a sender
    wrote; one with a newline or tab would be two lines or a forged answer."""
    return _DOMAIN.match(domain) is not None and len(domain.encode("utf-8", "replace")) <= 255


def answer_line(domain: str, found: MxFound, negative_ttl: float) -> bytes:
    """The helper's answer for one domain (:func:`parse_answer` reads it)."""
    records, ttl, why = found
    if records is not None and len(records) > MAX_RECORDS:
        why = f"{len(records)} MX records, over {MAX_RECORDS}"
        records, ttl = None, negative_ttl
    text = "-" if why is None else _UNPRINTABLE.sub("?", why)[:MAX_WHY] or "?"
    recs = " ".join(f"{pref} {host}" for pref, host in records) if records else ""
    line = f"{domain}\t{float(ttl)!r}\t{text}\t{recs}\n".encode()
    if len(line) > MAX_LINE:
        return answer_line(domain, (None, negative_ttl, "answer too large"), negative_ttl)
    return line


def parse_answer(line: bytes) -> tuple[str, float, str | None, Records]:
    """One answer line (without its newline), or ValueError saying what is wrong."""
    fields = line.split(b"\t")
    if len(fields) != 4:
        raise ValueError(f"{len(fields)} fields, not 4")
    domain = fields[0].decode("utf-8")
    if not valid_domain(domain):
        raise ValueError("not a domain name")
    ttl = float(fields[1])
    if not math.isfinite(ttl) or not 0 <= ttl <= 2.0 ** 32:
        raise ValueError(f"a TTL of {ttl}")
    why: str | None = None
    if fields[2] != b"-":
        if _WHY.match(fields[2]) is None:
            raise ValueError("an unprintable or overlong reason")
        why = fields[2].decode("ascii")
    tokens = fields[3].split(b" ") if fields[3] else []
    if len(tokens) % 2 or len(tokens) > 2 * MAX_RECORDS:
        raise ValueError(f"{len(tokens)} record fields")
    records: Records = []
    for i in range(0, len(tokens), 2):
        pref, host = tokens[i], tokens[i + 1]
        if not pref.isdigit() or len(pref) > 5 or int(pref) > 65535:
            raise ValueError("a preference that is not 0-65535")
        if _HOST.match(host) is None:
            raise ValueError("a host that is not printable ASCII")
        records.append((int(pref), host.decode("ascii")))
    return domain, ttl, why, records


def command(settings: SiteSettings, user: str) -> list[str]:
    """The helper's command line: this interpreter, isolated, OpenSSL kept out as
    the launcher keeps it out of qmgr."""
    code = ("import sys; sys.modules['ssl'] = None\n"
            "from pyqmgr.daemon.site_lookupd import main\n"
            "sys.exit(main(sys.argv[1:]))")
    return [sys.executable, "-I", "-c", code, "--user", user, "--timeout",
            repr(settings.timeout), "--negative-ttl", repr(settings.negative_ttl)]


def spawn(settings: SiteSettings, user: str, config_dir: str,
          prefix: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """Start the helper (as root: it drops to ``user`` itself once set up).
    ``prefix``: words run before it that exec it (a test's own resolv.conf)."""
    return subprocess.Popen(
        [*prefix, *command(settings, user)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        cwd="/", close_fds=True,
        env={"PATH": "/usr/bin:/bin", "MAIL_CONFIG": config_dir, "LANG": "C"})


class Asked:
    """One lookup in flight at the helper: its zone (the resolver's, handed back),
    when it is due, whether it is over."""

    __slots__ = ("zone", "deadline", "over")

    def __init__(self, zone: str, deadline: float) -> None:
        self.zone = zone
        self.deadline = deadline
        self.over = False


#: How an answer reaches the resolver: (zone, domain, found); found None: the helper
#: went with this lookup in flight, ask it in qmgr.
Answer = Callable[[str, str, "Found | None"], None]


class LookupHelper:
    """qmgr's side of the helper, for :class:`SiteResolver`, which keeps its zone
    fairness and its count of lookups at once: this writes the names, reads the
    answers and hands each to the resolver by callback (no future or task a lookup:
    the helper's point is qmgr's CPU). ``fallback`` is dnspython in qmgr, for when
    the helper is gone."""

    def __init__(self, proc: subprocess.Popen[bytes], fallback: Lookup,
                 settings: SiteSettings) -> None:
        self.proc = proc
        self.fallback = fallback
        self.providers = settings.providers
        self.negative_ttl = settings.negative_ttl
        #: Seconds an answer may take before the lookup fails.
        self.patience = settings.timeout + SLACK
        #: Lookups waiting for each domain's answer, oldest first.
        self.pending: dict[str, list[Asked]] = {}
        #: (domain, lookup) in the order written: deadlines ascend.
        self.order: deque[tuple[str, Asked]] = deque()
        self.out: list[bytes] = []
        self.unsent = b""
        self.inbuf = b""
        self.skipping = False
        self.ready = False
        #: When the helper last sent anything (never yet: -inf).
        self.heard = -math.inf
        #: Why the helper is gone (None: it runs), and its last words (!fatal).
        self.gone: str | None = None
        self.last_words = ""
        self.answered = 0
        #: Site names by record set (MAX_NAMES at most; emptied when full).
        self.names: dict[tuple[tuple[int, str], ...], str | None] = {}
        self.clock: Callable[[], float] = time.monotonic
        self.loop: asyncio.AbstractEventLoop | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.flushing = False
        self.writing = False
        self.warn: Callable[[str], None] = lambda text: None
        self.went: Callable[[tuple[str, ...]], None] = lambda domains: None
        self.answer: Answer = lambda zone, domain, found: None
        self.gate: WarnGate | None = None

    def attach(self, answer: Answer, warn: Callable[[str], None],
               went: Callable[[tuple[str, ...]], None], clock: Callable[[], float]) -> None:
        """Start reading answers on the running loop. ``answer``: where each goes;
        ``went``: these domains' queries go now (the helper is ready); ``warn``: the
        maillog's warning."""
        from pyqmgr.postfix.policy_delegation import WarnGate

        self.answer, self.warn, self.went, self.clock = answer, warn, went, clock
        self.gate = WarnGate(60.0, 10)
        self.loop = asyncio.get_running_loop()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        os.set_blocking(self.proc.stdin.fileno(), False)
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.loop.add_reader(self.proc.stdout.fileno(), self._readable)

    def ask(self, zone: str, domain: str) -> None:
        """Ask the helper; the answer comes by ``answer`` in a later loop turn. Only
        while the helper runs (``gone`` None) and after :meth:`attach`."""
        assert self.loop is not None and self.gone is None
        if not valid_domain(domain):
            self.loop.call_soon(self.answer, zone, domain, (
                None, self.negative_ttl, "not a domain name the helper takes"))
            return
        asked = Asked(zone, self.clock() + self.patience)
        self.pending.setdefault(domain, []).append(asked)
        self.order.append((domain, asked))
        if self.timer is None:
            self.timer = self.loop.call_at(self.loop.time() + self.patience, self._expire)
        self.out.append(domain.encode() + b"\n")
        if not self.flushing:
            # One write for every name asked in the next FLUSH_DELAY.
            self.flushing = True
            self.loop.call_later(FLUSH_DELAY, self._flush)

    def _flush(self) -> None:
        self.flushing = False
        if self.gone is not None or self.proc.stdin is None:
            return
        data = self.unsent + b"".join(self.out)
        self.out.clear()
        try:
            written = os.write(self.proc.stdin.fileno(), data)
        except BlockingIOError:
            written = 0
        except OSError as exc:
            self._lost(f"writing to it failed: {exc.strerror}")
            return
        self.unsent = data[written:]
        assert self.loop is not None
        if self.unsent and not self.writing:
            self.writing = True
            self.loop.add_writer(self.proc.stdin.fileno(), self._flush)
        elif not self.unsent and self.writing:
            self.writing = False
            self.loop.remove_writer(self.proc.stdin.fileno())

    def _readable(self) -> None:
        assert self.proc.stdout is not None
        try:
            data = os.read(self.proc.stdout.fileno(), MAX_LINE)
        except BlockingIOError:
            return
        except OSError as exc:
            self._lost(f"reading from it failed: {exc.strerror}")
            return
        if not data:
            self._lost("it ended")
            return
        self.heard = self.clock()
        lines = (self.inbuf + data).split(b"\n")
        self.inbuf = lines.pop()
        for line in lines:
            if self.skipping:
                self.skipping = False  # the end of an oversized line
            elif len(line) > MAX_LINE:
                self._bad(f"an answer of {len(line)} bytes, over {MAX_LINE}")
            else:
                self._line(line)
        if len(self.inbuf) > MAX_LINE:
            if not self.skipping:
                self._bad(f"an answer over {MAX_LINE} bytes")
            self.skipping = True
            self.inbuf = b""
        while self.order and self.order[0][1].over:
            self.order.popleft()

    def _line(self, line: bytes) -> None:
        if line.startswith(b"!"):
            if line == b"!ready":
                self.ready = True
                self.went(tuple(self.pending))
            elif line.startswith(b"!fatal "):
                self.last_words = _UNPRINTABLE.sub("?", line[7:519].decode("utf-8",
                                                                           "replace"))
            else:
                self._bad("a line it has no business sending")
            return
        try:
            domain, ttl, why, records = parse_answer(line)
        except ValueError as exc:
            self._bad(f"a malformed answer ({exc})")
            return
        waiting = self.pending.get(domain)
        if not waiting:
            self._bad(f"an answer for {domain}, not asked for (or past its time)")
            return
        asked = waiting.pop(0)
        if not waiting:
            del self.pending[domain]
        asked.over = True
        self.answered += 1
        self.answer(asked.zone, domain, (self._name(records), ttl, why))

    def _name(self, records: Records) -> str | None:
        if not records:
            return None
        key = tuple(records)
        if key in self.names:
            return self.names[key]
        if len(self.names) >= MAX_NAMES:
            self.names.clear()
        name = self.names[key] = site_name(records, self.providers)
        return name

    def _bad(self, what: str) -> None:
        held = self.gate.allow(self.clock()) if self.gate is not None else 0
        if held is not None:
            more = f" ({held} more such lines in the last minute)" if held else ""
            self.warn(f"sites: the MX lookup helper (pid {self.proc.pid}) sent {what}; "
                      f"ignored{more}")

    def _expire(self) -> None:
        """Lookups past their time fail; a helper that said nothing meanwhile is hung."""
        self.timer = None
        now = self.clock()
        while self.order and self.order[0][1].deadline <= now:
            domain, asked = self.order.popleft()
            if asked.over:
                continue
            if self.heard < asked.deadline - self.patience:  # nothing since it was asked
                self._lost(f"it answered nothing in {self.patience:g}s")
                return
            waiting = self.pending.get(domain, [])
            if asked in waiting:
                waiting.remove(asked)
                if not waiting:
                    del self.pending[domain]
            asked.over = True
            self.answer(asked.zone, domain, (
                None, self.negative_ttl,
                f"the lookup helper did not answer within {self.patience:g}s"))
        while self.order and self.order[0][1].over:
            self.order.popleft()
        if self.order and self.loop is not None:
            self.timer = self.loop.call_at(
                self.loop.time() + max(0.0, self.order[0][1].deadline - now), self._expire)

    def _lost(self, why: str) -> None:
        """The helper is gone: said once; every lookup from now on is qmgr's own."""
        if self.gone is not None:
            return
        self.gone = why
        self._unhook()
        status = _ended(self.proc)
        words = f"; it said: {self.last_words}" if self.last_words else ""
        self.warn(f"sites: the MX lookup helper (pid {self.proc.pid}) is gone ({why}, "
                  f"{status}{words}): qmgr looks MX records up itself from now on")
        pending, self.pending = self.pending, {}
        self.order.clear()
        self.out.clear()
        self.unsent = b""
        for domain, waiting in pending.items():
            for asked in waiting:
                asked.over = True
                self.answer(asked.zone, domain, None)

    def close(self) -> None:
        """qmgr's way out: the helper reads the end of its input and exits."""
        if self.gone is None:
            self.gone = "closed"
            self._unhook()

    def _unhook(self) -> None:
        """The pipes out of the loop and closed: a helper still alive then exits."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is None:
                continue
            if self.loop is not None:
                self.loop.remove_reader(pipe.fileno())
                self.loop.remove_writer(pipe.fileno())
            try:
                pipe.close()
            except OSError:
                pass

    def status(self) -> dict[str, object]:
        if self.gone is not None:
            return {"pid": self.proc.pid, "gone": self.gone, "lookups": "in qmgr"}
        return {"pid": self.proc.pid, "ready": self.ready, "answered": self.answered,
                "in_flight": sum(len(w) for w in self.pending.values())}


def _ended(proc: subprocess.Popen[bytes]) -> str:
    """How the helper ended, killed now if it has not (hung, or its pipe broke).
    Once in qmgr's life: waiting up to half a second here is affordable."""
    code = proc.poll()
    if code is None:
        try:
            code = proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                code = proc.wait(timeout=0.3)
            except subprocess.TimeoutExpired:
                return "killed, not yet reaped"
            return "killed"
    return f"killed by signal {-code}" if code < 0 else f"exit status {code}"


# -- the helper process --------------------------------------------------------------


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog=HELPER_ARGV0, description="pyqmgr's MX lookup "
                                 "helper; started by pyqmgr's qmgr, not by hand")
    ap.add_argument("--user", default="")
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--negative-ttl", type=float, default=300.0)
    args = ap.parse_args(argv)
    try:
        from pyqmgr.daemon.mx_lookup import MxLookup

        lookup = MxLookup(args.timeout, args.negative_ttl)
        if args.user and os.geteuid() == 0:
            _become(args.user)
    except Exception as exc:  # noqa: BLE001 - said to qmgr, which logs it
        text = _UNPRINTABLE.sub("?", f"{type(exc).__name__}: {exc}")[:500]
        os.write(1, f"!fatal {text}\n".encode())
        return 1
    asyncio.run(_serve(lookup))
    return 0


def _become(user: str) -> None:
    import pwd

    pw = pwd.getpwnam(user)
    os.setgid(pw.pw_gid)
    os.initgroups(pw.pw_name, pw.pw_gid)
    os.setuid(pw.pw_uid)


async def _serve(lookup: MxLookup) -> None:
    """Read names, look each up at once, write each answer when it comes."""
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()
    out: list[bytes] = [b"!ready\n"]
    tasks: set[asyncio.Task[None]] = set()
    inbuf = b""

    def flush() -> None:
        data = b"".join(out)
        out.clear()
        try:
            while data:  # stdout blocks: qmgr reading slowly holds the helper back
                data = data[os.write(1, data):]
        except OSError:
            if not ended.done():
                ended.set_result(None)

    def emit(line: bytes) -> None:
        if not out:
            loop.call_soon(flush)
        out.append(line)

    async def one(domain: str) -> None:
        try:
            found = await lookup.mx(domain)
        except Exception as exc:  # noqa: BLE001 - a resolver bug must not stop the rest
            found = None, lookup.negative_ttl, f"error: {exc!r}"
        emit(answer_line(domain, found, lookup.negative_ttl))

    def readable() -> None:
        nonlocal inbuf
        try:
            data = os.read(0, 65_536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # qmgr is gone
            if not ended.done():
                ended.set_result(None)
            return
        lines = (inbuf + data).split(b"\n")
        inbuf = lines.pop()[-1024:]  # a name is 255 bytes: the rest is no name
        for raw in lines:
            try:
                domain = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if not valid_domain(domain):
                continue
            if len(tasks) >= MAX_RUNNING:
                emit(answer_line(domain, (None, lookup.negative_ttl, "too many lookups"),
                                 lookup.negative_ttl))
                continue
            task = loop.create_task(one(domain))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    os.set_blocking(0, False)
    flush()
    loop.add_reader(0, readable)
    await ended
    # In-flight lookups are of no use to anyone now.
    os._exit(0)
