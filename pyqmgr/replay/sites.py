"""Sites learnt from a maillog's ``relay=`` hosts, without DNS (issue #33).

The daemon groups destinations by the MX hosts DNS names for them; a log already says
where each delivery went, ``relay=NAME[ADDR]:PORT`` on smtp(8)'s and lmtp(8)'s status
lines, so ``replay --sites`` groups the replayed destinations by the servers they
really reached, and the derived workload gives the destinations of one group one
server (``mx = "HOST"``, pyqmgr/simulator/sites.py): a replay with ``site_grouping =
mx`` then sees them as one site, as the daemon would have.

The rule for a server's key (``relay_host``):

* a host name is the server, lowercased, its port left out: MX records name hosts,
  not ports, and the daemon names its sites by those hosts;
* an address, a localhost name (``localhost``, ``localhost.localdomain``,
  ``*.localhost``) or a name that resolved to a loopback address is keyed by address
  and port (``127.0.0.1:2525``, ``[::1]:10024``): such servers are local services
  told apart only by their ports (a test bed's sinks all listen on 127.0.0.1);
* anything else (``none``, ``local``, a unix socket, a field cut short or garbled)
  is no server.

What is kept while reading is a count per destination and server, for at most
``HOSTS_KEPT`` servers a destination, never a line: a day's log of millions of lines
costs what its destinations do.
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter
from collections.abc import Collection, Mapping

#: A relay= field longer than this is garbage (a host name is at most 253 bytes).
RELAY_MAX = 330
#: Servers counted per destination; a destination that met more (a provider's
#: pool) is grouped by those it met first, which carry its traffic anyway.
HOSTS_KEPT = 16
#: A destination joins the servers it used for at least this share of its tries into
#: one group (mx1 and mx2 of one MX set); a host it met now and then (a backup MX,
#: one failover) does not tie its group to that host's.
SHARE = 0.2
#: Relay keys remembered (a log names few servers, each thousands of times).
CACHE = 4096

_FIELD = re.compile(r"(?P<name>[A-Za-z0-9._:-]{1,253})\[(?P<addr>[0-9A-Fa-f.:]{1,64})\]"
                    r"(?::(?P<port>[0-9]{1,5}))?")
#: A try that found no server logs relay=none and says which it could not reach.
_CONNECT = re.compile(r"connect to ([^\s\[\]]{1,253}\[[^\s\[\]]{1,64}\](?::[0-9]{1,5})?): ")
_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
_NEXTHOP = re.compile(r"\[(?P<addr>[^\]]{1,64})\](?::(?P<port>[0-9]{1,5}))?")


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _localhost(name: str) -> bool:
    labels = name.split(".")
    return labels[0] == "localhost" or labels[-1] == "localhost"


def _hostname(name: str) -> bool:
    return 0 < len(name) <= 253 and all(_LABEL.fullmatch(x) for x in name.split("."))


def _by_address(addr: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> str:
    return f"[{addr.compressed}]:{port}" if addr.version == 6 else f"{addr}:{port}"


def relay_host(relay: str) -> str | None:
    """The server a ``relay=`` field names, by the module's rule; None: no server."""
    if len(relay) > RELAY_MAX:
        return None
    m = _FIELD.fullmatch(relay)
    if m is None:
        return None
    port = int(m["port"]) if m["port"] else 25
    if not 0 < port < 65536:
        return None
    name = m["name"].rstrip(".").lower()
    addr = _address(m["addr"])
    if _address(name) is not None or _localhost(name) or (
            addr is not None and (addr.is_loopback or addr.is_unspecified)):
        return _by_address(addr, port) if addr is not None else None
    return name if _hostname(name) else None


def connect_host(detail: str) -> str | None:
    """The server a failed connection names (``connect to NAME[ADDR]:PORT: ...``)."""
    m = _CONNECT.match(detail)
    return relay_host(m[1]) if m is not None else None


def nexthop_host(nexthop: str) -> str | None:
    """A bracketed next hop's server (a content filter's ``[127.0.0.1]:10024``), keyed
    as ``relay_host`` keys the deliveries to it."""
    m = _NEXTHOP.fullmatch(nexthop)
    if m is None:
        return None
    addr = _address(m["addr"])
    port = int(m["port"]) if m["port"] else 25
    if addr is not None:
        return _by_address(addr, port)
    return relay_host(f"{m['addr']}[192.0.2.1]:{port}")


class Relays:
    """Per destination, the tries each server took: at a session (the relay= field
    names a server), or only at its connection (``relay=none`` and the server it could
    not reach). Bounded as the module says."""

    __slots__ = ("tried", "failed", "unread", "_keys")

    def __init__(self) -> None:
        self.tried: dict[str, Counter[str]] = {}
        self.failed: dict[str, Counter[str]] = {}
        #: relay= fields that name no server and are not none: what was not read.
        self.unread = 0
        self._keys: dict[str, str | None] = {}

    def _key(self, relay: str) -> str | None:
        key = self._keys.get(relay, "")
        if key == "":
            if len(self._keys) >= CACHE:
                self._keys.clear()
            key = self._keys[relay] = relay_host(relay)
        return key

    def seen(self, domain: str, relay: str, detail: str) -> None:
        """One status line of smtp(8) or lmtp(8) for a recipient of ``domain``."""
        if relay == "none":
            host = connect_host(detail) if detail.startswith("connect to ") else None
            kept = self.failed
        else:
            host = self._key(relay)
            kept = self.tried
        if host is None:
            if relay != "none":
                self.unread += 1
            return
        hosts = kept.get(domain)
        if hosts is None:
            hosts = kept[domain] = Counter()
        if host in hosts or len(hosts) < HOSTS_KEPT:
            hosts[host] += 1


def group(relays: Relays, excluded: Collection[str] = ()) -> dict[str, str]:
    """Destination -> its group's server.

    A destination goes with the server that took most of its tries at a session (only
    where it reached none: most of its failed connections); the servers that took at
    least ``SHARE`` of one destination's tries are one group (mx1 and mx2 of one MX
    set, used in turns), named by its server with the most tries in all. ``excluded``
    servers (content filters) group nothing.
    """
    counts: dict[str, dict[str, int]] = {}
    for domain in sorted(set(relays.tried) | set(relays.failed)):
        mine = _kept(relays.tried.get(domain), excluded) or _kept(
            relays.failed.get(domain), excluded)
        if mine:
            counts[domain] = mine
    parent: dict[str, str] = {}

    def find(host: str) -> str:
        parent.setdefault(host, host)
        while parent[host] != host:
            parent[host] = parent[parent[host]]
            host = parent[host]
        return host

    main: dict[str, str] = {}
    weight: Counter[str] = Counter()
    for domain, mine in counts.items():
        first = main[domain] = min(mine, key=lambda h: (-mine[h], h))
        total = sum(mine.values())
        root = find(first)
        for host, n in mine.items():
            weight[host] += n
            if host != first and n >= SHARE * total:
                other = find(host)
                if other != root:
                    # The smaller name is the root: the same groups whatever the order.
                    root, other = min(root, other), max(root, other)
                    parent[other] = root
    named: dict[str, str] = {}
    for host in parent:
        root = find(host)
        best = named.get(root)
        if best is None or (-weight[host], host) < (-weight[best], best):
            named[root] = host
    return {domain: named[find(first)] for domain, first in main.items()}


def _kept(hosts: Mapping[str, int] | None, excluded: Collection[str]) -> dict[str, int]:
    return {h: n for h, n in (hosts or {}).items() if h not in excluded}
