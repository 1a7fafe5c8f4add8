"""The proxymap(8) client: any Postfix lookup table, answered by Postfix (issue #34).

Class and tenant tables are read whole at start-up when pyqmgr can (lookup_table.py);
``proxy:TYPE:NAME`` asks proxymap(8) instead, key by key, so that every table type
Postfix knows (regexp, pcre, mysql, pgsql, ldap...) answers with Postfix's own
semantics. proxymap serves only the tables main.cf's ``proxy_read_maps`` lists with
their ``proxy:`` prefix (``proxy_read_maps = $proxy_read_maps
proxy:regexp:/etc/postfix/classes``).

The protocol (``src/global/dict_proxy.c``, ``src/proxymap/proxymap.c``): on
``$queue_directory/private/proxymap`` the server announces ``proxymap_protocol``;
``request=open, table, flags`` is answered by ``status, flags`` (the table's
properties: fixed keys or patterns), ``request=lookup, table, flags, key`` by
``status, value``. Status 0 is an answer, 1 no such key, 2 try again, 3 a bad
request, 4 a table not in proxy_read_maps, 5 a table configuration error.

Each lookup is a blocking exchange, bounded by :data:`TIMEOUT` (the kernel's receive
timeout, no extra poll), and answers are cached (:data:`CACHE_TTL`,
:data:`CACHE_MAX`), so a relay's steady stream of the same senders costs a dict hit.
The daemon asks from one worker thread, never from its event loop
(:mod:`pyqmgr.daemon.class_lookups`): once a table has an :attr:`ProxyTable.owner`,
any other thread gets answers from the cache only. A message's asks are capped
(:class:`Budget`: a number and a time), and a parent-domain key deeper than
:data:`MAX_PARENT_LABELS` is not asked: a 120-label sender domain made 122 asks for
one message (about 250 ms at 2 ms each), where it now makes at most 16.
A failure (no server, a timeout, a malformed or oversized reply, status 2 or 5) makes
the table answer nothing for :data:`BACKOFF` seconds, so that a stuck database costs
one timeout per episode, not one per message; the caller logs one line per episode.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from pyqmgr.postfix.attr import AttrError, AttrParser, check_announcement, encode, expect, to_int

PROTOCOL = "proxymap_protocol"
STAT_OK, STAT_NOKEY, STAT_RETRY, STAT_BAD, STAT_DENY, STAT_CONFIG = range(6)
#: dict.h: the table's keys are fixed strings / patterns (the open reply's flags).
DICT_FLAG_FIXED = 1 << 4
DICT_FLAG_PATTERN = 1 << 5
#: What a lookup asks for, as Postfix's own maps do: a shared lock while reading, and
#: fixed-string keys case-folded.
DICT_FLAG_LOCK = 1 << 6
DICT_FLAG_FOLD_FIX = 1 << 14
REQUEST_FLAGS = DICT_FLAG_LOCK | DICT_FLAG_FOLD_FIX
#: Seconds a lookup (connect, send, reply) may take.
TIMEOUT = 1.0
#: Answers (and misses) kept this long: a table edited takes effect within a minute,
#: as after a ``postfix reload`` (proxymap itself reopens changed tables).
CACHE_TTL = 60.0
CACHE_MAX = 10_000
#: After a failure the table answers nothing for this long, then is asked again.
BACKOFF = 30.0
#: The largest reply read (a class or tenant name is a few bytes).
MAX_REPLY = 64 << 10
#: A key longer than this is not asked (proxymap's own limit is far above; the
#: classifier's keys are addresses and header values).
MAX_KEY = 4096
#: access(5)'s parent-domain keys (``.example.com``) deeper than this many labels are
#: not asked. Postfix's own walks (smtpd_check.c's check_domain_access, match_list's
#: parent matching) ask every parent, but each of its asks is one message's own
#: client; here anyone who sends mail chooses the depth. Ten labels covers any
#: parent a table plausibly lists (``.mail.eu.corp.example.co.uk`` is seven).
MAX_PARENT_LABELS = 10
#: A message's asks of proxymap at most, and the time they may take together: beyond
#: either the remaining keys are not asked (they take the defaults). Sixteen covers an
#: address's keys with a ten-label parent walk and its extension.
MESSAGE_ASKS = 16
MESSAGE_SECONDS = 0.1


class ProxymapError(Exception):
    """proxymap did not answer: the text says why (for the one log line)."""


class ProxymapClient:
    """One persistent connection to proxymap, lock-step requests."""

    def __init__(self, path: str = "private/proxymap", timeout: float = TIMEOUT) -> None:
        self.path = path
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._parser = AttrParser(MAX_REPLY)

    def open(self, table: str) -> int:
        """The table's flags (:data:`DICT_FLAG_FIXED`, :data:`DICT_FLAG_PATTERN`)."""
        attrs = self._exchange(encode([("request", "open"), ("table", table),
                                       ("flags", 0)]))
        try:
            status, flags = expect(attrs, ("status", "flags"), "proxymap open reply")
            code, value = to_int(status, "status"), to_int(flags, "flags")
        except AttrError as exc:
            self.close()
            raise ProxymapError(str(exc)) from None
        self._status(code, table)
        return value

    def lookup(self, table: str, key: str) -> str | None:
        attrs = self._exchange(encode([("request", "lookup"), ("table", table),
                                       ("flags", REQUEST_FLAGS), ("key", key)]))
        try:
            status, value = expect(attrs, ("status", "value"), "proxymap lookup reply")
            code = to_int(status, "status")
        except AttrError as exc:
            self.close()  # what follows on this connection cannot be trusted
            raise ProxymapError(str(exc)) from None
        return value if self._status(code, table) else None

    @staticmethod
    def _status(status: int, table: str) -> bool:
        if status == STAT_OK:
            return True
        if status == STAT_NOKEY:
            return False
        if status == STAT_DENY:
            raise ProxymapError(f"proxymap refuses table {table}: add proxy:{table} to "
                                "main.cf's proxy_read_maps (then postfix reload)")
        why = {STAT_RETRY: "the table cannot answer now (status 2: try again)",
               STAT_BAD: "a request it calls invalid (status 3)",
               STAT_CONFIG: "the table's configuration is in error (status 5)"}
        raise ProxymapError(f"proxymap, table {table}: "
                            f"{why.get(status, f'unexpected status {status}')}")

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # The kernel's own timeouts (as resolve.py): no poll() before each call.
        seconds = int(self.timeout)
        timeval = struct.pack("ll", seconds, int((self.timeout - seconds) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        try:
            sock.connect(self.path)
            self._sock = sock
            self._parser = AttrParser(MAX_REPLY)
            check_announcement(self._read(), PROTOCOL)
        except BaseException:
            self.close()
            sock.close()
            raise
        return sock

    def _read(self) -> list[tuple[str, str]]:
        assert self._sock is not None
        deadline = time.monotonic() + self.timeout
        while (attrs := self._parser.pop()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError("no whole reply in time")
            data = self._sock.recv(4096)
            if not data:
                raise ConnectionError("proxymap closed the connection")
            self._parser.feed(data)
        return attrs

    def _exchange(self, payload: bytes) -> list[tuple[str, str]]:
        """One request and its reply; a stale connection (proxymap restarted after
        its idle time) is tried again once on a new one."""
        for attempt in (1, 2):
            try:
                sock = self._sock or self._connect()
                sock.sendall(payload)
                return self._read()
            except (OSError, ConnectionError, AttrError) as exc:
                self.close()
                stale = isinstance(exc, (BrokenPipeError, ConnectionError)) and \
                    not isinstance(exc, (ConnectionRefusedError, FileNotFoundError))
                if attempt == 2 or not stale:
                    why = "no answer in time" if isinstance(
                        exc, (TimeoutError, BlockingIOError)) else \
                        (str(exc) or type(exc).__name__)
                    raise ProxymapError(f"proxymap ({self.path}): {why}") from None
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class Budget:
    """One message's asks of proxymap: at most ``asks``, until ``deadline``. ``cut``
    says a key went unasked for it (the caller warns, paced)."""

    __slots__ = ("asks", "cut", "deadline")

    def __init__(self, now: float, asks: int = MESSAGE_ASKS,
                 seconds: float = MESSAGE_SECONDS) -> None:
        self.asks = asks
        self.deadline = now + seconds
        self.cut = False

    def spend(self, now: float) -> bool:
        """May one more ask go? (Counted when it may.)"""
        if self.asks <= 0 or now >= self.deadline:
            self.cut = True
            return False
        self.asks -= 1
        return True


def too_deep(key: str) -> bool:
    """A parent-domain key past :data:`MAX_PARENT_LABELS` (not asked)."""
    return key.startswith(".") and key.count(".") > MAX_PARENT_LABELS


class ProxyTable:
    """A ``proxy:TYPE:NAME`` table's answers: cached, and silent after a failure for
    :data:`BACKOFF` seconds (``warn`` gets one line per failure episode)."""

    def __init__(self, table: str, client: ProxymapClient, warn: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.table = table
        self.client = client
        self.warn = warn
        self.clock = clock
        self.cache: OrderedDict[str, tuple[float, str | None]] = OrderedDict()
        self.down_until = 0.0
        #: Postfix asks a pattern table the whole key only (access(5)'s partial keys
        #: are for fixed-string tables); known after the first open.
        self.fixed = True
        #: The one thread that may ask proxymap (None: any); others get the cache.
        self.owner: threading.Thread | None = None
        #: The message being classified's budget (None: no cap, as at start-up).
        self.budget: Budget | None = None

    def opened(self) -> None:
        """Ask proxymap to open the table now (start-up): a table it refuses is said
        at once. Raises ProxymapError."""
        flags = self.client.open(self.table)
        self.fixed = not flags & DICT_FLAG_PATTERN

    def get(self, key: str) -> str | None:
        now = self.clock()
        hit = self.cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        if now < self.down_until or len(key) > MAX_KEY or "\0" in key or too_deep(key):
            return None
        if self.owner is not None and threading.current_thread() is not self.owner:
            return None  # the event loop: a miss is not asked there
        if self.budget is not None and not self.budget.spend(now):
            return None
        try:
            value = self.client.lookup(self.table, key)
        except (ProxymapError, AttrError) as exc:
            self.down_until = now + BACKOFF
            self.warn(f"{exc}: such mail takes the defaults; asked again in {BACKOFF:g} s")
            return None
        self.cache[key] = (now + CACHE_TTL, value)
        self.cache.move_to_end(key)
        if len(self.cache) > CACHE_MAX:
            self.cache.popitem(last=False)
        return value
