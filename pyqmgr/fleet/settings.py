"""pyqmgr.cf's fleet settings, checked at start-up (issue #23).

``shared_state`` turns the fleet on; without it nothing here matters and pyqmgr is one
server as before. Every mistake is a start-up error naming pyqmgr.cf and the
parameter, as for every other pyqmgr.cf setting.

=====================================  =========================================================
``shared_state``                       ``redis://HOST:PORT[/DB]``, ``rediss://HOST:PORT[/DB]``
                                       (TLS), ``unix:/PATH[?db=N]``,
                                       ``redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB]``
                                       (a Sentinel set's primary; ``rediss+sentinel`` with
                                       TLS) or ``redis+cluster://HOST:PORT[,HOST:PORT...]``
                                       (a Redis Cluster; ``rediss+cluster`` with TLS)
                                       (empty: off, the default)
``shared_state_user``                  an ACL user (default: Redis's ``default`` user)
``shared_state_password_file``         a file holding Redis's password (its first line); it
                                       must belong to root and be readable by root alone,
                                       and is read at start-up, before the chroot
``shared_state_sentinel_password_file`` the sentinels' own password (their ``requirepass``),
                                       read the same way
``shared_state_tls_ca_file``           the CA certificates (PEM) that the server's
                                       certificate is checked against (TLS: default the
                                       system's); read at start-up
``shared_state_tls_cert_file``         a client certificate (PEM), for a server with
                                       ``tls-auth-clients yes``
``shared_state_tls_key_file``          its private key (PEM; root's and readable by root
                                       alone, read at start-up as root, as Postfix reads
                                       its own TLS keys)
``shared_state_key_file``              a file holding the fleet's key (its first line, at
                                       least 32 characters: ``openssl rand -hex 32``), the
                                       same on every node, root's and readable by root
                                       alone, read at start-up: every notice of throttling
                                       and roster record is signed with it; a notice that
                                       is not, is stale or was heard before is refused, and
                                       another server's record is obeyed only when signed
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

import dataclasses
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pyqmgr.fleet.client import CLUSTER, SENTINEL, STANDALONE, UNIX, Endpoint
from pyqmgr.postfix.host_port import HostPortError, host_port
from pyqmgr.pyqmgr_cf import PyqmgrCf
from pyqmgr.scheduler.shaping import Rate, ShapingError, parse_duration, parse_rate

if TYPE_CHECKING:
    import ssl

SHARED_STATE = "shared_state"
PASSWORD_FILE = "shared_state_password_file"
USER = "shared_state_user"
SENTINEL_PASSWORD_FILE = "shared_state_sentinel_password_file"
TLS_CA_FILE = "shared_state_tls_ca_file"
TLS_CERT_FILE = "shared_state_tls_cert_file"
TLS_KEY_FILE = "shared_state_tls_key_file"
#: The parameters of how to reach Redis, besides the address.
CONNECTION_PARAMS = (USER, PASSWORD_FILE, SENTINEL_PASSWORD_FILE, TLS_CA_FILE, TLS_CERT_FILE,
                     TLS_KEY_FILE)
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
#: The lease times pyqmgr.cf allows (``shared_state_lease_time``), and so the only ones
#: read from another server's roster record.
MIN_LEASE, MAX_LEASE = 2.0, 3600.0

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


#: The address forms: scheme -> (kind, TLS).
SCHEMES = {"redis://": (STANDALONE, False), "rediss://": (STANDALONE, True),
           "redis+sentinel://": (SENTINEL, False), "rediss+sentinel://": (SENTINEL, True),
           "redis+cluster://": (CLUSTER, False), "rediss+cluster://": (CLUSTER, True)}
#: Sentinels or Cluster seed nodes named at most.
MAX_NODES = 32
_FORMS = ("redis://HOST:PORT[/DB], rediss://HOST:PORT[/DB], unix:/PATH[?db=N], "
          "redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB] or "
          "redis+cluster://HOST:PORT[,HOST:PORT...]")


def parse_shared_state(text: str) -> Endpoint:
    """An address of :data:`SCHEMES`' forms or ``unix:/PATH[?db=N]``; ValueError says
    what is off."""
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
        return Endpoint(path=path, db=db, kind=UNIX)
    scheme = next((s for s in SCHEMES if text.startswith(s)), None)
    if scheme is None:
        raise ValueError(f"{text!r}: expected {_FORMS}")
    kind, tls = SCHEMES[scheme]
    rest = text[len(scheme):]
    if "@" in rest:
        raise ValueError(f"{text!r}: no password in the address: use {PASSWORD_FILE}")
    address, _, tail = rest.partition("/")
    nodes = tuple(_node(part, text) for part in address.split(","))
    if len(nodes) > MAX_NODES:
        raise ValueError(f"{text!r}: more than {MAX_NODES} addresses")
    if kind == STANDALONE:
        if len(nodes) > 1:
            raise ValueError(f"{text!r}: one server (several: redis+sentinel:// or "
                             "redis+cluster://)")
        (host, port), = nodes
        return Endpoint(host=host, port=port, db=_db(tail, text) if tail else 0, tls=tls)
    if kind == CLUSTER:
        if tail:
            raise ValueError(f"{text!r}: a Redis Cluster has no database number or path")
        return Endpoint(kind=CLUSTER, nodes=nodes, tls=tls)
    service, _, db_text = tail.partition("/")
    if not service or not all(c.isalnum() or c in "-_." for c in service):
        raise ValueError(f"{text!r}: the Sentinel service name (sentinel monitor NAME) "
                         "is missing or not a name: redis+sentinel://HOST:PORT/NAME")
    return Endpoint(kind=SENTINEL, nodes=nodes, service=service,
                    db=_db(db_text, text) if db_text else 0, tls=tls)


def _node(address: str, text: str) -> tuple[str, int]:
    try:
        host, port_text = host_port(address)
    except HostPortError as exc:
        raise ValueError(f"{text!r}: " + {
            "bracket": "expected [ADDRESS]:PORT",
            "colon": "the port is missing (Redis's own is 6379, Sentinel's 26379)",
            "ipv6": "an IPv6 address must be in brackets", "host": "empty host"}[exc.kind]
        ) from None
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r}: bad port {port_text!r}")
    return host, int(port_text)


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
        _roots_alone(path, os.fstat(fd))
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
        for name in (*CONNECTION_PARAMS, KEY_FILE, FAILURE, TIMEOUT, LEASE_TIME, PREFIX,
                     NODE, *per_transport):
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
    endpoint = _connection(settings, endpoint)
    failure = (settings.get(FAILURE) or LOCAL).strip()
    if failure not in (LOCAL, HOLD):
        raise settings.error(FAILURE, f"expected {LOCAL} or {HOLD}, not {failure!r}")
    timeout = _duration(settings, TIMEOUT, "500ms", 0.01, 10.0)
    lease = _duration(settings, LEASE_TIME, "60s", MIN_LEASE, MAX_LEASE)
    prefix = settings.get(PREFIX)
    prefix = "pyqmgr:" if prefix is None else prefix.strip()
    if not prefix or any(c.isspace() or c in "{}" for c in prefix) or len(prefix) > 64:
        raise settings.error(PREFIX, f"a word of 1 to 64 characters without braces (the "
                                     f"keys' hash tags are in braces), not {prefix!r}")
    node = (settings.get(NODE) or myhostname).strip()
    if not node or any(c.isspace() or not c.isprintable() for c in node) or len(node) > 255:
        raise settings.error(NODE, f"a name without spaces, not {node!r}")
    return FleetSettings(endpoint, failure, timeout, lease, prefix, node, key, settings)


def _connection(settings: PyqmgrCf, endpoint: Endpoint) -> Endpoint:
    """The address with what it takes to speak to it: the ACL user, the passwords and
    the TLS context, all read now (as root, before the chroot)."""
    secrets: dict[str, str | None] = {}
    for name, field in ((PASSWORD_FILE, "password"),
                        (SENTINEL_PASSWORD_FILE, "sentinel_password")):
        path = (settings.get(name) or "").strip()
        if not path:
            continue
        if name == SENTINEL_PASSWORD_FILE and endpoint.kind != SENTINEL:
            raise settings.error(name, "has no effect without redis+sentinel://")
        try:
            secrets[field] = read_password(path)
        except ValueError as exc:
            raise settings.error(name, str(exc)) from None
    user = (settings.get(USER) or "").strip() or None
    if user is not None and (len(user) > 255 or any(
            c.isspace() or not c.isprintable() for c in user)):
        raise settings.error(USER, f"an ACL user name without spaces, not {user!r}")
    if user is not None and "password" not in secrets:
        raise settings.error(USER, f"an ACL user needs its password: {PASSWORD_FILE}")
    tls_files = {name: (settings.get(name) or "").strip()
                 for name in (TLS_CA_FILE, TLS_CERT_FILE, TLS_KEY_FILE)}
    context = None
    if endpoint.tls:
        context = _tls_context(settings, tls_files)
    else:
        for name, path in tls_files.items():
            if path:
                raise settings.error(name, "has no effect without TLS (rediss://, "
                                           "rediss+sentinel://, rediss+cluster://)")
    return dataclasses.replace(endpoint, user=user, ssl_context=context,
                               password=secrets.get("password"),
                               sentinel_password=secrets.get("sentinel_password"))


def _tls_context(settings: PyqmgrCf, files: dict[str, str]) -> ssl.SSLContext:
    """The TLS context every connection uses: the server's certificate checked against
    the CA file (or the system's), and its name against the address; a client
    certificate when one is set. Built once, as root."""
    from pyqmgr.libraries import allow_ssl

    allow_ssl()  # the launcher keeps ssl out of a daemon that has no use for it
    import ssl

    ca, cert, key = files[TLS_CA_FILE], files[TLS_CERT_FILE], files[TLS_KEY_FILE]
    if bool(cert) != bool(key):
        raise settings.error(TLS_CERT_FILE if key else TLS_KEY_FILE,
                             f"a client certificate needs both {TLS_CERT_FILE} and "
                             f"{TLS_KEY_FILE}")
    for name, path in files.items():
        if path and not os.path.isabs(path):
            raise settings.error(name, f"{path!r} is not an absolute path")
    if key:
        try:
            _owned_by_root(key)
        except ValueError as exc:
            raise settings.error(TLS_KEY_FILE, str(exc)) from None
    context = ssl.create_default_context(cafile=None)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        if ca:
            context.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise settings.error(TLS_CA_FILE, f"{ca}: {_ssl_reason(exc)}") from None
    try:
        if cert:
            context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise settings.error(TLS_CERT_FILE, f"{cert} with {key}: {_ssl_reason(exc)}"
                             ) from None
    return context


def _ssl_reason(exc: OSError) -> str:
    return exc.strerror or getattr(exc, "reason", None) or str(exc)


def _owned_by_root(path: str) -> None:
    """A private key is a secret as the password is: root's, and root's alone."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ValueError(f"cannot open {path}: {exc.strerror}") from None
    _roots_alone(path, st)


def _roots_alone(path: str, st: os.stat_result) -> None:
    """ValueError unless a regular file of root's that no one else may read."""
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a regular file")
    if st.st_uid != 0:
        raise ValueError(f"{path} must belong to root (uid {st.st_uid})")
    if st.st_mode & 0o077:
        raise ValueError(f"{path} must be readable by root alone "
                         f"(mode {stat.S_IMODE(st.st_mode):04o}; chmod 600)")


def import_redis(settings: PyqmgrCf, fleet: FleetSettings) -> None:
    """redis-py (and hiredis, where installed) imported now, as root and before the
    chroot, each file trusted first (:mod:`pyqmgr.libraries`): every module the
    client reaches later, connections and failovers included."""
    import importlib.util

    from pyqmgr.extras import install_command
    from pyqmgr.libraries import import_trusted

    def missing(why: object) -> Exception:
        return settings.error(SHARED_STATE, f"the redis library does not load ({why}); "
                                            f"install it ({install_command(['fleet'])})")

    packages = ["redis"]
    # hmac: the fleet key's notices are signed and checked with it, long after start-up.
    imports = ["hashlib", "hmac", "redis.asyncio", "redis.asyncio.connection",
               "redis.exceptions", "redis.utils", "redis._parsers", "redis._parsers.base"]
    if importlib.util.find_spec("hiredis") is not None:
        packages.append("hiredis")
        imports.append("hiredis")
    if fleet.endpoint.kind == SENTINEL:
        imports.append("redis.asyncio.sentinel")
    elif fleet.endpoint.kind == CLUSTER:
        imports.append("redis.asyncio.cluster")
    import_trusted(packages, imports, missing)


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

