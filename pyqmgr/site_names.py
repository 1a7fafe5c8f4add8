"""A site's name from a domain's MX hosts, and the provider table (issue #33).

Two domains are at one site when their MX records name the same hosts: every
Google Workspace domain names ``aspmx.l.google.com`` and its four alternates. The
site is named by those hosts, factored by their common suffix, so that an admin
reads it: ``(alt1|alt2|alt3|alt4)?.aspmx.l.google.com`` (KumoMTA names sites the
same way). Some providers give each customer its own MX host
(``example-com.mail.protection.outlook.com``); a host name does not reveal they are
one site, so a provider table maps host suffixes to a provider's name: the one
shipped (``pyqmgr/site-providers``, commented) and the admin's own files after it,
a later line overriding an earlier one for the same suffix.

Pure functions on strings: the daemon calls them with what DNS answered, replay
with the ``relay=`` hosts of a log, the simulator with its scenario's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence

from pyqmgr.bounded import TooLarge
from pyqmgr.trust import RootFiles, file_reader

#: MX hosts a site's name is made of at most, by preference: a domain with 500 MX
#: records is named by its first 32 (and a name stays under about 2 KB).
MAX_MX = 32
#: A provider table file is read up to this size (the shipped one is a few KB).
MAX_TABLE = 1 << 20

SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site-providers")


class ProviderTableError(ValueError):
    """A provider table line that is not ``SUFFIX NAME``; the text says where."""


def normal_host(host: str) -> str:
    return host.strip().rstrip(".").lower()


def mx_site_name(hosts: Iterable[str]) -> str | None:
    """The site name of an MX host set; None for no host (or only a null MX ".")."""
    names = sorted({h for h in (normal_host(x) for x in hosts) if h})
    if not names:
        return None
    if len(names) == 1:
        return names[0]
    split = [n.split(".") for n in names]
    common = 0
    shortest = min(len(s) for s in split)
    while common < shortest and len({s[-1 - common] for s in split}) == 1:
        common += 1
    if common == 0:
        return "(" + "|".join(names) + ")"
    suffix = ".".join(split[0][-common:])
    prefixes = [".".join(s[:-common]) for s in split]
    alternatives = sorted(p for p in prefixes if p)
    optional = "?" if "" in prefixes else ""
    return f"({'|'.join(alternatives)}){optional}.{suffix}"


class Providers:
    """MX host suffix -> provider name; the longest matching suffix wins."""

    def __init__(self, entries: dict[str, str] | None = None,
                 gateways: frozenset[str] = frozenset()) -> None:
        self.by_suffix: dict[str, str] = dict(entries or {})
        self._longest = max((s.count(".") + 1 for s in self.by_suffix), default=0)
        #: Providers marked ``gateway``: a filtering service in front of its
        #: customers' own servers, whose replies may be the customer's (its server
        #: down, its own limits passed through), so no reply speaks for the site.
        self.gateways = gateways

    @classmethod
    def parse(cls, text: str, where: str, base: Providers | None = None) -> Providers:
        """A table's text: ``SUFFIX NAME [gateway]`` per line, ``#`` comments; later
        lines win."""
        entries = dict(base.by_suffix) if base is not None else {}
        gateways = set(base.gateways) if base is not None else set()
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            if len(fields) not in (2, 3) or fields[2:] not in ([], ["gateway"]):
                raise ProviderTableError(
                    f"{where}, line {number}: expected an MX host suffix, a site name "
                    f"and perhaps 'gateway', got {raw.strip()!r}")
            suffix, name = normal_host(fields[0]), fields[1]
            suffix = suffix[1:] if suffix.startswith(".") else suffix
            if not suffix or any(not label for label in suffix.split(".")):
                raise ProviderTableError(f"{where}, line {number}: {fields[0]!r} is no "
                                         "host name suffix")
            entries[suffix] = name
            if len(fields) == 3:
                gateways.add(name)
            else:
                gateways.discard(name)
        return cls(entries, frozenset(gateways))

    def provider(self, host: str) -> str | None:
        """The provider of one MX host, by its longest listed suffix."""
        labels = normal_host(host).split(".")
        for n in range(min(len(labels), self._longest), 0, -1):
            name = self.by_suffix.get(".".join(labels[-n:]))
            if name is not None:
                return name
        return None


def load_providers(paths: Sequence[str], files: RootFiles | None = None) -> Providers:
    """The shipped table (``builtin``) and the admin's files, in the order given.
    ``files``: the daemon's, as root: each admin's file judged first (the shipped one
    is part of the package, which the start-up check judges)."""
    table = Providers()
    for path in paths:
        where = SHIPPED if path == "builtin" else path
        table = Providers.parse(read_table(where, None if path == "builtin" else files),
                                where, table)
    return table


def read_table(path: str, files: RootFiles | None) -> str:
    """A provider or pin file's text, refused when larger than :data:`MAX_TABLE`: a
    file cut at the limit would name a partial line, or drop entries without a word.
    OSError, ProviderTableError; trust.UntrustedFile when ``files`` refuses it."""
    try:
        data = file_reader(files)(path, MAX_TABLE)
    except TooLarge as big:
        raise ProviderTableError(str(big)) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ProviderTableError(f"{path}: not UTF-8") from None


def site_name(mx: Sequence[tuple[int, str]], providers: Providers) -> str | None:
    """A domain's site from its MX records (preference, host): the provider's name
    when every one of its hosts is that provider's, else the factored host set (the
    MAX_MX most preferred, and how many more); None when there is no host (the domain
    is its own site).

    Every host, not the most preferred with a provider (issue #45): anyone can give
    a domain of their own ``MX 0 tarpit.example`` and ``MX 99 aspmx.l.google.com``.
    smtp(8) talks to the tarpit first, and with the provider's name the domain's
    deliveries held Google's sessions (0 of 300 Workspace messages delivered in 60 s
    on real Postfix). A domain that mixes its own hosts with a provider's is a site
    of its own making, on purpose. Beyond MAX_MX hosts the name says how many more,
    so that a set padded past the cut with a stranger's host is not the set it pads.
    """
    ranked = sorted((pref, normal_host(host)) for pref, host in mx)
    hosts = list(dict.fromkeys(host for _, host in ranked if host))  # each host once
    if not hosts:
        return None
    provider = providers.provider(hosts[0])
    if provider is not None and all(providers.provider(h) == provider for h in hosts[1:]):
        return provider
    name = mx_site_name(hosts[:MAX_MX])
    more = len(hosts) - MAX_MX
    return f"{name}+{more}" if name is not None and more > 0 else name


#: The host in smtp(8)'s text of a reply or failure: ``host NAME[ADDR] said: ...``,
#: ``host NAME[ADDR] refused to talk to me``, ``connect to NAME[ADDR]:25: ...``,
#: ``lost connection with NAME[ADDR]``, ``conversation with NAME[ADDR] timed out``.
_REPLY_HOST = re.compile(r"(?:^|\s)(?:host|to|with) ([^\s\[\]]+)\[[^\]\s]*\]")
_MORE = re.compile(r"(.*)\+\d+")


def reply_host(reason: str) -> str | None:
    """The host that gave a reply, from smtp(8)'s text of it; None: not said."""
    m = _REPLY_HOST.search(reason)
    return normal_host(m.group(1)) if m else None


def site_hosts(name: str) -> frozenset[str]:
    """The hosts a host-set site's name lists (:func:`mx_site_name` read backwards);
    a provider's name or a domain's own gives itself."""
    m = _MORE.fullmatch(name)
    base = m.group(1) if m else name
    close = base.find(")")
    if not base.startswith("(") or close < 0:
        return frozenset({base})
    alternatives, rest = base[1:close].split("|"), base[close + 1:]
    if not rest:
        return frozenset(alternatives)
    optional = rest.startswith("?")
    suffix = rest[2:] if optional else rest[1:]
    hosts = {f"{a}.{suffix}" for a in alternatives}
    return frozenset(hosts | {suffix} if optional else hosts)


def replied_from_site(site: str, reason: str, providers: Providers) -> bool:
    """Did this reply come from one of the site's own hosts (issue #45)?

    A site's members share its hosts when qmgr looked them up, but a domain's owner
    can change its MX records after that (an answer holds up to site_dns_max_ttl),
    and smtp(8) delivers to what DNS says then: a reply from a host that is not the
    site's is that domain's own business, and moves only its destination."""
    host = reply_host(reason)
    if host is None or site in providers.gateways:
        return False  # a gateway's reply may be its customer's: see Providers.gateways
    return providers.provider(host) == site or host in site_hosts(site)
