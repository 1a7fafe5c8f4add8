"""pyqmgr.cf's fleet settings, checked at start-up (issue #23).

``shared_state`` turns the fleet on; without it nothing here matters and pyqmgr is one
server as before. Every mistake is a start-up error naming pyqmgr.cf and the
parameter, as for every other pyqmgr.cf setting.

=====================================  =========================================================
``shared_state``                       ``redis://HOST:PORT[/DB]`` or ``unix:/PATH[?db=N]``
                                       (empty: off, the default)
``shared_state_password_file``         a file holding Redis's password (its first line); it
                                       must belong to root and be readable by root alone,
                                       and is read at start-up, before the chroot
``shared_state_key_file``              a file holding the fleet's key (its first line, at
                                       least 32 characters: ``openssl rand -hex 32``), the
                                       same on every node, root's and readable by root
                                       alone, read at start-up: every notice of throttling
                                       is signed with it, and a notice that is not, is
                                       stale or was heard before is refused
``shared_state_failure``               ``local`` (Redis slow or gone: each node keeps to its
                                       own limits, with a warning a minute) or ``hold`` (no
                                       new delivery to a shared destination until Redis is
                                       back); default ``local``
``shared_state_timeout``               each Redis call's deadline (default 500ms, 10ms-10s)
``shared_state_lease_time``            how long a delivery's lease on a fleet session lasts
                                       unless renewed (default 60s, 2s-1h): a dead node's
                                       sessions come back to the fleet after this
``shared_state_prefix``                the keys' prefix, so fleets can share one Redis
                                       (default ``pyqmgr:``)
``shared_state_node``                  this node's name in the fleet and in every node's
                                       maillog (default ``$myhostname``)
``fleet_destination_concurrency_limit``
                                       deliveries under way to one destination across the
                                       fleet (0: no fleet limit, the default); on top of
                                       each node's own window and limits
``fleet_destination_rate``             delivery starts to one destination across the fleet,
                                       ``N/PERIOD`` (0: none, the default)
``fleet_destination_rate_burst``       starts the rate lets through at once (default 1)
``fleet_site_concurrency_limit``       deliveries under way to one site across the fleet
                                       (issue #33; 0: none, the default): with sites on
                                       for the transport (``site_grouping = mx``), a
                                       destination at a site counts at its site's fleet
                                       keys instead of its own; one at no site (``[host]``,
                                       the relay host) keeps the destination limits
``fleet_site_rate``                    delivery starts to one site across the fleet,
                                       ``N/PERIOD`` (0: none, the default)
``fleet_site_rate_burst``              starts the site rate lets through at once (default 1)
``fleet_throttling``                   ``yes``: a destination this node finds dead, or that
                                       a response rule throttles, is dead or throttled on
                                       every node at once, and news of the same from the
                                       others holds here; ``no``: each node learns alone.
                                       The default is ``yes`` with a key file, ``no``
                                       without: anyone who can reach Redis could publish
                                       news, so only signed news is ever read
=====================================  =========================================================

The ``fleet_*`` parameters follow Postfix's naming rule: ``smtp_fleet_destination_rate``
for the smtp transport wins over ``fleet_destination_rate``. A destination is shared
by name (transport and queue name), a site by its transport and site name, so every
node must call them the same (the same provider table and pins).

The unix socket must be reachable from inside the queue manager's chroot when
master.cf chroots qmgr; a TCP address always is.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass

from pyqmgr.fleet.client import Endpoint
from pyqmgr.postfix.host_port import HostPortError, host_port
from pyqmgr.pyqmgr_cf import PyqmgrCf
from pyqmgr.scheduler.shaping import Rate, ShapingError, parse_duration, parse_rate

SHARED_STATE = "shared_state"
PASSWORD_FILE = "shared_state_password_file"
KEY_FILE = "shared_state_key_file"
FAILURE = "shared_state_failure"
TIMEOUT = "shared_state_timeout"
LEASE_TIME = "shared_state_lease_time"
PREFIX = "shared_state_prefix"
NODE = "shared_state_node"
FLEET_LIMIT = "fleet_destination_concurrency_limit"
FLEET_RATE = "fleet_destination_rate"
FLEET_BURST = "fleet_destination_rate_burst"
FLEET_THROTTLING = "fleet_throttling"
FLEET_SITE_LIMIT = "fleet_site_concurrency_limit"
FLEET_SITE_RATE = "fleet_site_rate"
FLEET_SITE_BURST = "fleet_site_rate_burst"
#: The per-transport parameters, longest first (a suffix test picks the right one).
PER_TRANSPORT = (FLEET_BURST, FLEET_LIMIT, FLEET_RATE, FLEET_THROTTLING, FLEET_SITE_BURST,
                 FLEET_SITE_LIMIT, FLEET_SITE_RATE)
#: The parameters of the destinations' limits, and of the sites' (issue #33).
DESTINATION_PARAMS = (FLEET_LIMIT, FLEET_RATE, FLEET_BURST)
SITE_PARAMS = (FLEET_SITE_LIMIT, FLEET_SITE_RATE, FLEET_SITE_BURST)
MAX_FLEET_LIMIT = 100_000

#: What a node does while Redis is slow or gone.
LOCAL, HOLD = "local", "hold"
#: The longest password file read (a password is a line).
MAX_PASSWORD_FILE = 4096
#: The shortest fleet key: 128 bits of hex is 32 characters.
MIN_KEY = 32
#: Redis's own SUN path limit is the kernel's.
_SUN_PATH_MAX = 107


@dataclass(frozen=True)
class Limits:
    """One transport's fleet-wide limits on each of its destinations."""

    #: Deliveries under way across the fleet (0: none).
    sessions: int = 0
    rate: Rate | None = None
    burst: int = 1

    @property
    def active(self) -> bool:
        return self.sessions > 0 or self.rate is not None


@dataclass(frozen=True)
class FleetSettings:
    endpoint: Endpoint
    failure: str = LOCAL
    timeout: float = 0.5
    lease_time: float = 60.0
    prefix: str = "pyqmgr:"
    node: str = ""
    #: The fleet's key (the key file's first line), which signs notices of throttling;
    #: empty: no key file, so no throttling is shared.
    key: bytes = b""
    #: pyqmgr.cf, for the per-transport limits (every form checked at start-up).
    settings: PyqmgrCf | None = None

    def limits_for(self, transport: str) -> Limits:
        """The transport's fleet limits (all-zero when none applies)."""
        if self.settings is None:
            return Limits()
        return _limits(self.settings, transport)

    def site_limits_for(self, transport: str) -> Limits:
        """The transport's fleet limits per site (all-zero when none applies)."""
        if self.settings is None:
            return Limits()
        return _limits(self.settings, transport, SITE_PARAMS)

    def shares_throttling(self, transport: str) -> bool:
        """Whether the transport's dead sites and throttled destinations are the
        fleet's (told to the others, and taken from them)."""
        if not self.key:
            return False
        if self.settings is None:
            return True
        return self.settings.get_bool(FLEET_THROTTLING, transport, True)


def _limits(settings: PyqmgrCf, transport: str | None,
            params: tuple[str, str, str] = DESTINATION_PARAMS) -> Limits:
    limit, rate_name, burst_name = params
    sessions = settings.get_int(limit, transport, 0, 0, MAX_FLEET_LIMIT)
    used = settings.which(rate_name, transport) or rate_name
    try:
        rate = parse_rate(settings.get(rate_name, transport) or "", used)
    except ShapingError as exc:
        raise settings.error(used, str(exc).partition(": ")[2]) from None
    burst = settings.get_int(burst_name, transport, 1, 1, 100_000)
    return Limits(sessions, rate, burst)


def check_site_limits(settings: PyqmgrCf, grouped: Callable[[str], bool] | None) -> None:
    """``fleet_site_*`` parameters that could never apply are start-up errors, as
    every other mistake in pyqmgr.cf: any of them with sites off (``grouped`` None),
    and a transport's own (``relay_fleet_site_rate``) for a transport whose
    destinations are not grouped. The bare parameters apply to the grouped
    transports, whichever they are."""
    for param in settings.values:
        name = next((n for n in SITE_PARAMS
                     if param == n or param.endswith("_" + n)), None)
        if name is None:
            continue
        transport = param[:-len(name) - 1] or None
        if grouped is None:
            raise settings.error(param, "has no effect without site_grouping = mx")
        if transport is not None and not grouped(transport):
            raise settings.error(param, f"has no effect: the {transport} transport's "
                                        "destinations are not grouped into sites "
                                        "(site_transports)")


def parse_shared_state(text: str) -> Endpoint:
    """``redis://HOST:PORT[/DB]`` or ``unix:/PATH[?db=N]``; ValueError says what is off."""
    text = text.strip()
    if text.startswith("unix:"):
        path, _, query = text[5:].partition("?")
        db = 0
        if query:
            name, eq, value = query.partition("=")
            if name != "db" or not eq:
                raise ValueError(f"{text!r}: after '?' only db=N")
            db = _db(value, text)
        if not path.startswith("/"):
            raise ValueError(f"{text!r}: the socket path must be absolute")
        if "\0" in path or len(os.fsencode(path)) > _SUN_PATH_MAX:
            raise ValueError(f"{text!r}: not a usable socket path")
        return Endpoint(path=path, db=db)
    if not text.startswith("redis://"):
        raise ValueError(f"{text!r}: expected redis://HOST:PORT[/DB] or unix:/PATH[?db=N]")
    rest = text[8:]
    if "@" in rest:
        raise ValueError(f"{text!r}: no password in the address: use {PASSWORD_FILE}")
    address, _, db_text = rest.partition("/")
    try:
        host, port_text = host_port(address)
    except HostPortError as exc:
        raise ValueError(f"{text!r}: " + {
            "bracket": "expected redis://[ADDRESS]:PORT",
            "colon": "the port is missing (Redis's own is 6379)",
            "ipv6": "an IPv6 address must be in brackets", "host": "empty host"}[exc.kind]
        ) from None
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r}: bad port {port_text!r}")
    return Endpoint(host=host, port=int(port_text), db=_db(db_text, text) if db_text else 0)


def _db(value: str, text: str) -> int:
    if not value.isdigit() or int(value) > 1_000_000:
        raise ValueError(f"{text!r}: bad database number {value!r}")
    return int(value)


def read_password(path: str) -> str:
    """The password file's first line; ValueError unless root's alone and small.

    The key file is read the same way: both are secrets that a local user who can
    read or replace them would use against the fleet."""
    if not os.path.isabs(path):
        raise ValueError(f"{path!r} is not an absolute path")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ValueError(f"cannot open {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if st.st_uid != 0:
            raise ValueError(f"{path} must belong to root (uid {st.st_uid})")
        if st.st_mode & 0o077:
            raise ValueError(f"{path} must be readable by root alone "
                             f"(mode {stat.S_IMODE(st.st_mode):04o}; chmod 600)")
        data = os.read(fd, MAX_PASSWORD_FILE + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_PASSWORD_FILE:
        raise ValueError(f"{path} is larger than {MAX_PASSWORD_FILE} bytes")
    password = data.decode("utf-8", "replace").split("\n", 1)[0].rstrip("\r")
    if not password:
        raise ValueError(f"{path}: the first line is empty")
    return password


def fleet_settings(settings: PyqmgrCf, myhostname: str,
                   key: bytes | None = None) -> FleetSettings | None:
    """pyqmgr.cf's fleet settings; None when ``shared_state`` is unset or empty.

    ``key``: the fleet's key given, not read from ``shared_state_key_file`` (the
    simulator's fleet, whose news never leaves the process)."""
    text = (settings.get(SHARED_STATE) or "").strip()
    per_transport = [k for k in settings.values if k.endswith(PER_TRANSPORT)]
    if not text:
        for name in (PASSWORD_FILE, KEY_FILE, FAILURE, TIMEOUT, LEASE_TIME, PREFIX, NODE,
                     *per_transport):
            if settings.get(name) is not None:
                raise settings.error(name, f"has no effect without {SHARED_STATE}")
        return None
    key = _key(settings) if key is None else key
    for param in per_transport:
        name = next(n for n in PER_TRANSPORT if param.endswith(n))
        transport = param[:-len(name) - 1] or None
        if name == FLEET_THROTTLING:
            if settings.get_bool(FLEET_THROTTLING, transport, True) and not key:
                raise settings.error(param, f"yes needs {KEY_FILE}: news of throttling is "
                                            "read only when signed with the fleet's key")
        else:
            _limits(settings, transport,
                    SITE_PARAMS if name in SITE_PARAMS else DESTINATION_PARAMS)
    try:
        endpoint = parse_shared_state(text)
    except ValueError as exc:
        raise settings.error(SHARED_STATE, str(exc)) from None
    password_file = (settings.get(PASSWORD_FILE) or "").strip()
    if password_file:
        try:
            endpoint = Endpoint(endpoint.host, endpoint.port, endpoint.path, endpoint.db,
                                read_password(password_file))
        except ValueError as exc:
            raise settings.error(PASSWORD_FILE, str(exc)) from None
    failure = (settings.get(FAILURE) or LOCAL).strip()
    if failure not in (LOCAL, HOLD):
        raise settings.error(FAILURE, f"expected {LOCAL} or {HOLD}, not {failure!r}")
    timeout = _duration(settings, TIMEOUT, "500ms", 0.01, 10.0)
    lease = _duration(settings, LEASE_TIME, "60s", 2.0, 3600.0)
    prefix = settings.get(PREFIX)
    prefix = "pyqmgr:" if prefix is None else prefix.strip()
    if not prefix or any(c.isspace() for c in prefix) or len(prefix) > 64:
        raise settings.error(PREFIX, f"a word of 1 to 64 characters, not {prefix!r}")
    node = (settings.get(NODE) or myhostname).strip()
    if not node or any(c.isspace() or not c.isprintable() for c in node) or len(node) > 255:
        raise settings.error(NODE, f"a name without spaces, not {node!r}")
    return FleetSettings(endpoint, failure, timeout, lease, prefix, node, key, settings)


def _key(settings: PyqmgrCf) -> bytes:
    """The key file's first line, or b"" when there is none."""
    path = (settings.get(KEY_FILE) or "").strip()
    if not path:
        return b""
    try:
        key = read_password(path)
    except ValueError as exc:
        raise settings.error(KEY_FILE, str(exc)) from None
    if len(key) < MIN_KEY:
        raise settings.error(KEY_FILE, f"{path}: the key is {len(key)} characters, fewer "
                                       f"than {MIN_KEY} (openssl rand -hex 32 makes one)")
    return key.encode()


def _duration(settings: PyqmgrCf, name: str, default: str, lo: float, hi: float) -> float:
    text = (settings.get(name) or default).strip()
    try:
        seconds = parse_duration(text, name)
    except ShapingError as exc:
        raise settings.error(name, str(exc).partition(": ")[2]) from None
    if not lo <= seconds <= hi:
        raise settings.error(name, f"{text!r} is outside {lo:g}s to {hi:g}s")
    return seconds

