"""A message's class and tenant, from pyqmgr.cf and the admin's tables (issue #34).

Off unless ``message_classes`` names the classes (highest priority first) or
``tenant_key`` names what a tenant is: then every message gets a class and a tenant
from its envelope as the queue file holds it (the sender, the SASL login, the
client) or from a header the admin names (read from the file's header section only,
at most 64 KiB of it: :mod:`pyqmgr.postfix.message_headers`), looked up in Postfix
lookup tables (:mod:`pyqmgr.postfix.lookup_table`), once, when its file is first
read.

=========================  ==============================================================
``message_classes``        class names, highest priority first (``transactional bulk``)
``message_class_maps``     tables answering a class name; the first that knows the key
                           wins, as for any Postfix ``*_maps``
``message_class_key``      what the class tables are asked: ``sender`` (access(5)
                           order: the address, the domain, its parents, ``user@``),
                           ``sasl_username``, ``client_address`` (cidr tables),
                           ``client_name`` or ``header:NAME`` (the first NAME:
                           header's value, unfolded and trimmed, any case of NAME;
                           none: the default class); default ``sender``
``default_message_class``  the class of mail no table names; default the last (lowest)
``tenant_key``             ``none`` (default), ``sender_domain``, ``sender``,
                           ``sasl_username``, ``client_address`` or ``header:NAME``
                           (as for the class; no such header: tenant ``-``)
``tenant_maps``            tables answering a tenant's name for the key (without: the
                           key itself is the tenant: each sender domain its own)
``tenant_weight_maps``     tables answering a tenant's weight (default 1): its
                           messages a round when tenants share a class's deliveries
``tenant_concurrency_``    each tenant's most deliveries (under way or waiting for an
``limit``                  agent) at one destination; transport forms too; 0: none
                           (read with the other tenant limits: :mod:`.tenants`)
``sender_keys_trusted_``   whose mail the sender-written keys (``sender``,
``clients``                ``sender_domain``, ``header:NAME``) count for: ``local``
                           (submitted on this host: no client address),
                           ``sasl_authenticated``, ``mynetworks`` (main.cf's), ``all``,
                           and addresses, networks, ``/file`` or ``type:table`` as in
                           mynetworks; default ``local, sasl_authenticated, mynetworks``.
                           Other mail takes the default class and tenant for such a
                           key, counted (status, metrics)
``unlisted_tenant_limit``  most tenants at once in the active queue named by the key
                           itself (no ``tenant_maps``); the mail of a new one past it
                           is tenant ``_other``, with a log line and a metric; 0: none
``message_class_active_``  percent of ``qmgr_message_active_limit`` each class below
``reserve``                the highest leaves to those above it (default 10): with
                           two classes bulk stops at 90% of the active queue, and
                           transactional mail always finds room
=========================  ==============================================================

Why the sender-written keys need a trusted client (issue #45): the sender address and
the headers are whatever the sending client wrote. Read from anyone's mail they let a
stranger make a newsletter "transactional", ahead of all bulk, or name a new tenant
per message to escape fair shares and caps, or another tenant to spend its share. The
SASL login, the client address and its verified name are the client's own.

Bad tables must not stop mail (issue #34): a table that cannot be read at start-up, a
class name a table answers that ``message_classes`` does not list, are a log line
each (the latter once per name, at most :data:`MAX_WARNED`), and the message takes
the default class and tenant. A mistake in the parameters themselves (an unknown key,
a default class not listed) is a start-up error, as every other pyqmgr.cf mistake.

The daemon (:mod:`pyqmgr.daemon.classes`: a queue file's envelope and headers), the
simulator (a scenario's senders) and ``pyqmgr check`` use the same classifier.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, partial

from pyqmgr.postfix.addr_match_list import AddrMatchList, addr_match_list
from pyqmgr.postfix.lookup_table import (
    LookupTableError,
    Table,
    address_keys,
    open_table,
    table_specs,
)
from pyqmgr.pyqmgr_cf import PyqmgrCf

CLASSES = "message_classes"
CLASS_MAPS = "message_class_maps"
CLASS_KEY = "message_class_key"
DEFAULT_CLASS = "default_message_class"
TENANT_KEY = "tenant_key"
TENANT_MAPS = "tenant_maps"
RESERVE = "message_class_active_reserve"
WEIGHT_MAPS = "tenant_weight_maps"
TRUSTED = "sender_keys_trusted_clients"
UNLISTED_LIMIT = "unlisted_tenant_limit"
#: The tenant of mail past unlisted_tenant_limit: all such new tenants share one turn.
OTHER_TENANT = "_other"
DEFAULT_TRUSTED = "local, sasl_authenticated, mynetworks"
#: The words of sender_keys_trusted_clients that are not address patterns.
TRUST_WORDS = ("local", "sasl_authenticated", "mynetworks", "all")
#: A tenant's weight at most (jobs a round).
MAX_WEIGHT = 1000
#: Tenants' weights remembered at most (then looked up each time).
MAX_WEIGHTS_KEPT = 100_000
DEFAULT_RESERVE = 10

CLASS_KEYS = ("sender", "sasl_username", "client_address", "client_name", "header:NAME")
TENANT_KEYS = ("none", "sender_domain", "sender", "sasl_username", "client_address",
               "header:NAME")
HEADER = "header:"
#: A header name as RFC 5322 allows one (printable ASCII but the colon), not too long.
HEADER_NAME = re.compile(r"[!-9;-~]{1,100}")
#: The tenant of mail whose key is empty (a bounce's null sender, no SASL login).
NO_TENANT = "-"
#: Unknown class names warned of, at most (a table full of typos stays a few lines).
MAX_WARNED = 100
#: Tenant and class names are kept at most this long (metrics labels, status).
MAX_NAME = 200


#: Folded messages' counts at which the cap's warning is logged again (1, 10, 100...).
_SAID = frozenset(10 ** k for k in range(12))


def sender_written(key: str) -> bool:
    """Whether the key is read from what the sending client wrote (issue #45)."""
    return key in ("sender", "sender_domain") or key.startswith(HEADER)


@dataclass
class ClientTrust:
    """sender_keys_trusted_clients: whose mail the sender-written keys count for."""

    everyone: bool = False
    local: bool = True
    authenticated: bool = True
    #: main.cf's mynetworks, and the admin's own addresses, as address match lists.
    lists: list[AddrMatchList] = field(default_factory=list)
    words: str = DEFAULT_TRUSTED

    def trusts(self, env: Envelope) -> bool:
        if self.everyone:
            return True
        if not env.client_address:
            # Submitted on this host (sendmail, postdrop, Postfix's own bounces):
            # local users, as Postfix's authorized_submit_users trusts them.
            return self.local
        if env.sasl_username and self.authenticated:
            return True
        return any(found.match(env.client_address) for found in self.lists)


@dataclass(frozen=True)
class Envelope:
    """What a message's class and tenant are looked up by, from its queue file."""

    sender: str = ""
    sasl_username: str = ""
    client_address: str = ""
    client_name: str = ""
    #: The values of the headers a key names (lower-case name -> value), when one does.
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Classifier:
    """Class (a rank: 0 is the highest) and tenant of each message."""

    classes: list[str]
    class_tables: list[Table]
    class_key: str
    default_rank: int
    tenant_key: str
    tenant_tables: list[Table]
    warn: Callable[[str], None]
    #: message_class_active_reserve: percent of the active queue per class step.
    reserve: int = DEFAULT_RESERVE
    #: tenant_weight_maps: each tenant's jobs a round (default 1).
    weight_tables: list[Table] = field(default_factory=list)
    warned: set[str] = field(default_factory=set)
    weights: dict[str, int] = field(default_factory=dict)
    #: sender_keys_trusted_clients (issue #45).
    trust: ClientTrust = field(default_factory=ClientTrust)
    #: Messages whose sender-written keys were set aside: their client is not trusted.
    untrusted: int = 0
    #: unlisted_tenant_limit (0: none), the messages in the active queue of each
    #: tenant it counts, and the messages made tenant _other for it (issue #45).
    unlisted_limit: int = 0
    live: dict[str, int] = field(default_factory=dict)
    folded: int = 0

    @cached_property
    def sender_keys(self) -> bool:
        """Whether a key is one the sender writes: only then is trust asked."""
        return ((bool(self.class_tables) and sender_written(self.class_key))
                or sender_written(self.tenant_key))

    @cached_property
    def header_names(self) -> frozenset[str]:
        """The headers the keys name (lower case): read from each message's content
        only when there are some (message_headers.py: a bounded read). Kept: every
        message loaded asks."""
        return frozenset(key[len(HEADER):].lower() for key in (self.class_key,
                         self.tenant_key) if key.startswith(HEADER))

    def caps(self, active_limit: int) -> list[int]:
        """Each rank's most messages in the active queue: the highest class has it
        all, each lower one ``reserve`` percent less than the one above (never < 1)."""
        step = active_limit * self.reserve // 100
        return [max(1, active_limit - rank * step) for rank in range(len(self.classes))]

    def trusts(self, env: Envelope) -> bool:
        """Whether the sender-written keys count for this message (headers are read
        only then)."""
        return not self.sender_keys or self.trust.trusts(env)

    def classify(self, env: Envelope, count: bool = True) -> tuple[int, str]:
        """The message's class rank and tenant. A key the sender writes, in mail from
        a client not trusted, gives the default (``count``: the message is counted;
        not when incoming/ is only looked into)."""
        trusted = self.trusts(env)
        if not trusted and count:
            self.untrusted += 1
        return self._rank(env, trusted), self._tenant(env, trusted)

    def admit(self, tenant: str) -> str:
        """A message of ``tenant`` enters the active queue: with unlisted_tenant_limit,
        counted, or, past the limit for a tenant not there yet, made tenant _other;
        :meth:`left` when it leaves. Without a cap, a sender naming a new tenant per
        message (a random sender domain, an X-Tenant header, a new IPv6 address)
        would get a fresh fair share each time. Called where the message enters (the
        daemon's event loop), never from the proxy: lookups' worker."""
        if not self.unlisted_limit or self.tenant_tables or tenant in ("", NO_TENANT):
            return tenant
        live = self.live
        if tenant not in live and len(live) >= self.unlisted_limit:
            self.folded += 1
            if self.folded in _SAID:
                self.warn(f"classes: {UNLISTED_LIMIT} ({self.unlisted_limit}) reached: "
                          f"the mail of new tenants such as {tenant[:MAX_NAME]!r} counts "
                          f"as tenant {OTHER_TENANT!r} ({self.folded} messages so far)")
            return OTHER_TENANT  # not counted: it is no new tenant
        live[tenant] = live.get(tenant, 0) + 1
        return tenant

    def left(self, tenant: str) -> None:
        """A message of ``tenant`` left the active queue (the cap's count)."""
        count = self.live.get(tenant)
        if count is None:
            return
        if count <= 1:
            del self.live[tenant]
        else:
            self.live[tenant] = count - 1

    def _rank(self, env: Envelope, trusted: bool = True) -> int:
        if not self.class_tables or (not trusted and sender_written(self.class_key)):
            return self.default_rank
        name = _lookup(self.class_tables, _keys(self.class_key, env))
        if name is None:
            return self.default_rank
        try:
            return self.classes.index(name)
        except ValueError:
            if name not in self.warned and len(self.warned) < MAX_WARNED:
                self.warned.add(name)
                self.warn(f"classes: a table answered class {name[:MAX_NAME]!r}, which "
                          f"{CLASSES} does not list: such mail is "
                          f"{self.classes[self.default_rank]!r} (this warning once)")
            return self.default_rank

    def weight(self, tenant: str) -> int:
        """The tenant's weight (``tenant_weight_maps``): its jobs a round; 1 unless a
        table says otherwise. A bad value is said once and counts as 1."""
        found = self.weights.get(tenant)
        if found is not None:
            return found
        weight = 1
        value = _lookup(self.weight_tables, [tenant]) if self.weight_tables else None
        if value is not None:
            if value.isdigit() and 1 <= int(value) <= MAX_WEIGHT:
                weight = int(value)
            elif len(self.warned) < MAX_WARNED and f"weight {tenant}" not in self.warned:
                self.warned.add(f"weight {tenant}")
                self.warn(f"classes: {WEIGHT_MAPS}: tenant {tenant[:MAX_NAME]!r} has weight "
                          f"{value[:MAX_NAME]!r}, not a whole number from 1 to "
                          f"{MAX_WEIGHT}: it counts as 1 (this warning once)")
        if len(self.weights) < MAX_WEIGHTS_KEPT:
            self.weights[tenant] = weight
        return weight

    def _tenant(self, env: Envelope, trusted: bool = True) -> str:
        if self.tenant_key == "none":
            return ""
        if not trusted and sender_written(self.tenant_key):
            return NO_TENANT
        keys = _keys(self.tenant_key, env)
        if not keys or not keys[0]:
            return NO_TENANT
        if self.tenant_tables:
            found = _lookup(self.tenant_tables, keys)
            return (found or NO_TENANT)[:MAX_NAME]
        return keys[0][:MAX_NAME]


def _keys(kind: str, env: Envelope) -> list[str]:
    if kind == "sender":
        return address_keys(env.sender)
    if kind.startswith(HEADER):
        value = env.headers.get(kind[len(HEADER):].lower(), "")
        return [value[:MAX_NAME]] if value else []
    if kind == "sender_domain":
        domain = env.sender.rpartition("@")[2].lower().rstrip(".")
        return [domain] if "@" in env.sender and domain else []
    value = getattr(env, kind)
    return [value] if value else []


def _lookup(tables: list[Table], keys: list[str]) -> str | None:
    """The first table that knows one of the keys, in table order, then key order (as
    Postfix's *_maps: each table is asked every partial key before the next table)."""
    for table in tables:
        for key in keys if table.fixed else keys[:1]:
            value = table.get(key)
            if value is not None:
                return value.split()[0] if value.split() else None
    return None


#: Told of a table that cannot be read: (its spec, the warning's text).
Unreadable = Callable[[str, str], None]


def classifier(settings: PyqmgrCf, warn: Callable[[str], None],
               config_dir: str | None = None, unreadable: Unreadable | None = None,
               proxymap: str | None = None, mynetworks: str | None = None
               ) -> Classifier | None:
    """pyqmgr.cf's classes and tenants; None when off (stock: one class, no tenant).
    PyqmgrCfError for a mistake in the parameters; a table that cannot be read is
    a warning and is left out (its mail takes the defaults). ``unreadable``, when
    given, is told of such a table instead of ``warn``: ``pyqmgr check`` counts it as
    a problem, since the daemon would not do what the file says. ``proxymap``: its
    socket, where the working directory is not the queue directory (check's).
    ``mynetworks``: main.cf's, as the daemon computes it (none: the word matches no
    client)."""
    names = (settings.get(CLASSES) or "").replace(",", " ").split()
    tenant_key = (settings.get(TENANT_KEY) or "none").strip()
    if not _known(tenant_key, TENANT_KEYS):
        raise settings.error(TENANT_KEY, f"expected one of {', '.join(TENANT_KEYS)}, "
                                         f"not {tenant_key!r}")
    if not names:
        for name in (CLASS_MAPS, CLASS_KEY, DEFAULT_CLASS):
            if settings.get(name) is not None:
                raise settings.error(name, f"has no effect without {CLASSES}")
    if len(set(names)) != len(names):
        raise settings.error(CLASSES, "a class is named twice")
    class_key = (settings.get(CLASS_KEY) or "sender").strip()
    if not _known(class_key, CLASS_KEYS):
        raise settings.error(CLASS_KEY, f"expected one of {', '.join(CLASS_KEYS)}, "
                                        f"not {class_key!r}")
    default = (settings.get(DEFAULT_CLASS) or (names[-1] if names else "")).strip()
    if names and default not in names:
        raise settings.error(DEFAULT_CLASS, f"{default!r} is not one of {CLASSES} "
                                            f"({' '.join(names)})")
    for name in (TENANT_MAPS, WEIGHT_MAPS):
        if settings.get(name) is not None and tenant_key == "none":
            raise settings.error(name, f"has no effect without {TENANT_KEY}")
    reserve = settings.get_int(RESERVE, None, DEFAULT_RESERVE, 0, 50)
    if not names and tenant_key == "none":
        if settings.get(RESERVE) is not None:
            raise settings.error(RESERVE, f"has no effect without {CLASSES}")
        return None
    opener = _Tables(settings, warn, config_dir,
                     unreadable or (lambda spec, text: warn(text)), proxymap)
    if (settings.get(TRUSTED) is not None and not (names and sender_written(class_key))
            and not sender_written(tenant_key)):
        raise settings.error(TRUSTED, f"has no effect: neither {CLASS_KEY} nor "
                                      f"{TENANT_KEY} is a key the sender writes")
    unlisted = settings.get_int(UNLISTED_LIMIT, None, 0, 0, 10_000_000)
    if settings.get(UNLISTED_LIMIT) is not None and tenant_key == "none":
        raise settings.error(UNLISTED_LIMIT, f"has no effect without {TENANT_KEY}")
    if settings.get(UNLISTED_LIMIT) is not None and settings.get(TENANT_MAPS) is not None:
        raise settings.error(UNLISTED_LIMIT, f"has no effect: {TENANT_MAPS} names the "
                                             "tenants")
    return Classifier(
        names or ["default"], opener.read(CLASS_MAPS), class_key,
        names.index(default) if names else 0, tenant_key, opener.read(TENANT_MAPS), warn,
        reserve, opener.read(WEIGHT_MAPS),
        trust=client_trust(settings, warn, config_dir, mynetworks), unlisted_limit=unlisted)


def client_trust(settings: PyqmgrCf, warn: Callable[[str], None],
                 config_dir: str | None = None, mynetworks: str | None = None
                 ) -> ClientTrust:
    """sender_keys_trusted_clients, read: its words, then the rest as an address match
    list. A pattern not understood is a warning and matches no client: a mistake
    trusts less, never more."""
    text = settings.get(TRUSTED)
    words = table_specs(DEFAULT_TRUSTED if text is None else text)
    flags = {word.lower() for word in words if word.lower() in TRUST_WORDS}
    rest = " ".join(word for word in words if word.lower() not in TRUST_WORDS)
    lists: list[AddrMatchList] = []
    files = settings.root_files()
    if "mynetworks" in flags and mynetworks is not None:
        lists.append(addr_match_list(mynetworks, "mynetworks", config_dir, files))
    if rest:
        lists.append(addr_match_list(rest, TRUSTED, config_dir, files))
    for found in lists:
        for line in found.warnings[:10]:
            warn(f"classes: {line}")
    return ClientTrust("all" in flags, "local" in flags, "sasl_authenticated" in flags,
                       lists, " ".join(words))


def _known(key: str, keys: tuple[str, ...]) -> bool:
    if key.startswith(HEADER):
        return HEADER_NAME.fullmatch(key[len(HEADER):]) is not None
    return key in keys


def _prefixed(warn: Callable[[str], None], prefix: str) -> Callable[[str], None]:
    return lambda text: warn(f"{prefix}: {text}")


@dataclass(frozen=True)
class _Tables:
    """Opens the tables a parameter names, each that cannot be read left out."""

    settings: PyqmgrCf
    warn: Callable[[str], None]
    config_dir: str | None
    refused: Unreadable
    proxymap: str | None

    def read(self, name: str) -> list[Table]:
        out: list[Table] = []
        opener = partial(open_table, proxymap=self.proxymap) if self.proxymap else open_table
        for spec in table_specs(self.settings.get(name) or ""):
            try:
                table = opener(spec, self.config_dir, files=self.settings.root_files(),
                               warn=_prefixed(self.warn, f"classes: {name}"))
            except LookupTableError as exc:
                self.refused(spec, f"classes: {name}: {exc}: left out, its mail takes the "
                                   "defaults")
                continue
            for text in table.warnings[:10]:
                self.warn(f"classes: {name}: {text}")
            out.append(table)
        return out

