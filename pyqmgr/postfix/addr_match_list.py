"""Postfix's address match lists (``mynetworks`` and its kind), as pyqmgr reads them.

Why pyqmgr needs one (issue #45): a sender address and a message's headers are written
by whoever sends the mail, so class and tenant keys read from them count only for mail
from clients the admin trusts. Postfix already names those clients in ``mynetworks``,
and the admin's list of more is written the same way; reading it as Postfix's
``addr_match_list`` does keeps one meaning for one syntax.

The list's words, separated by commas or white space, are tried in order; the first
that matches decides, and ``!`` before a word makes its match a refusal:

* an IPv4 or IPv6 address (``192.0.2.7``, ``[2001:db8::1]`` or bare ``2001:db8::1``);
* a network, ``address/prefix`` (``[2001:db8::]/32`` for IPv6): as Postfix, host bits
  set below the prefix are a warning and the network they belong to is used;
* ``/file/name``: its words, read once at start-up, stand in its place;
* ``type:table``: the client address looked up (``cidr:``, ``inline:``,
  ``texthash:``, the indexed types through ``postmap -s``); any answer matches.

A host name or domain is not an address pattern (Postfix's ``mynetworks`` has none
either): it is a warning and matches nothing, so a mistake narrows what is trusted
rather than widening it. A table or file that cannot be read likewise. Read as root
(``files``), a file or table anyone but root could change, a FIFO or a device is
refused as every file pyqmgr.cf names is (:class:`pyqmgr.trust.RootFiles`): it says
who is trusted.
"""

from __future__ import annotations

import ipaddress
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

from pyqmgr.bounded import TooLarge
from pyqmgr.postfix.lookup_table import LookupTableError, Table, open_table, table_specs
from pyqmgr.trust import RootFiles

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
#: The largest ``/file/name`` read for a list.
MAX_FILE_BYTES = 4 << 20
#: Files inside files followed at most (a file that names itself stops here).
MAX_DEPTH = 4


@dataclass(frozen=True)
class _Rule:
    negate: bool
    network: Network | None = None
    table: Table | None = None


@dataclass
class AddrMatchList:
    """One parsed list; :meth:`match` is Postfix's ``addr_match_list_match``."""

    text: str
    rules: list[_Rule] = field(default_factory=list)
    #: What was not understood, one line each (said once at start-up).
    warnings: list[str] = field(default_factory=list)

    def match(self, address: str) -> bool:
        """Whether ``address`` (as the queue file records it: bare, or bracketed for
        IPv6) is in the list. Not an address at all: no."""
        try:
            addr = ipaddress.ip_address(address.strip("[]").partition("%")[0])
        except ValueError:
            return False
        mapped = getattr(addr, "ipv4_mapped", None)
        if mapped is not None:
            addr = mapped  # ::ffff:192.0.2.1 is the IPv4 client it stands for
        for rule in self.rules:
            if rule.network is not None:
                hit = addr.version == rule.network.version and addr in rule.network
            else:
                assert rule.table is not None
                hit = rule.table.get(str(addr)) is not None
            if hit:
                return not rule.negate
        return False


def addr_match_list(text: str, what: str, config_dir: str | None = None,
                    files: RootFiles | None = None,
                    opener: Callable[..., Table] = open_table) -> AddrMatchList:
    """Parse ``text`` (the value of the parameter ``what``, for messages);
    UntrustedFile for a file root must not read."""
    found = AddrMatchList(text)
    _parse(found, text, what, _Reading(config_dir, files, opener), 0)
    return found


@dataclass(frozen=True)
class _Reading:
    config_dir: str | None
    files: RootFiles | None
    opener: Callable[..., Table]


def _parse(found: AddrMatchList, text: str, what: str, how: _Reading, depth: int) -> None:
    # Split as Postfix splits a list: at commas and white space outside braces.
    for word in table_specs(text):
        negate = word.startswith("!")
        pattern = word[1:] if negate else word
        if pattern.startswith("/"):
            if depth >= MAX_DEPTH:
                found.warnings.append(f"{what}: {pattern}: files nested more than "
                                      f"{MAX_DEPTH} deep: ignored")
                continue
            inner = (_file(found, pattern, what) if how.files is None
                     else _root_file(found, pattern, what, how.files))
            if negate and inner:
                found.warnings.append(f"{what}: !{pattern}: a file cannot be negated: "
                                      "ignored")
                continue
            _parse(found, inner, f"{what} ({pattern})", how, depth + 1)
            continue
        if ":" in pattern and not _looks_like_address(pattern):
            try:
                table = how.opener(pattern, how.config_dir, files=how.files)
            except LookupTableError as exc:
                found.warnings.append(f"{what}: {exc}: it matches no client")
                continue
            found.rules.append(_Rule(negate, table=table))
            continue
        network = _network(found, pattern, what)
        if network is not None:
            found.rules.append(_Rule(negate, network=network))


def _looks_like_address(pattern: str) -> bool:
    head = pattern.partition("/")[0]
    try:
        ipaddress.ip_address(head.strip("[]"))
    except ValueError:
        return head.startswith("[")
    return True


def _network(found: AddrMatchList, pattern: str, what: str) -> Network | None:
    address, slash, bits = pattern.partition("/")
    bare = address[1:-1] if address.startswith("[") and address.endswith("]") else address
    try:
        strict = ipaddress.ip_network(bare + slash + bits, strict=True)
    except ValueError:
        try:
            loose = ipaddress.ip_network(bare + slash + bits, strict=False)
        except ValueError:
            found.warnings.append(f"{what}: {pattern!r} is not an address or network "
                                  "(host names are not address patterns): it matches "
                                  "no client")
            return None
        found.warnings.append(f"{what}: non-null host address bits in {pattern!r}, "
                              f"perhaps you should use {loose.with_prefixlen!r} instead")
        return loose
    return strict


def _root_file(found: AddrMatchList, path: str, what: str, files: RootFiles) -> str:
    """A list file read as root: judged first (UntrustedFile goes up: start-up
    refuses, as for a table); missing or too large, a warning."""
    try:
        data = files.read(path, MAX_FILE_BYTES)
    except OSError as exc:
        found.warnings.append(f"{what}: cannot read {path}: {exc.strerror}: it matches "
                              "no client")
        return ""
    except TooLarge as exc:
        found.warnings.append(f"{what}: {exc}: it matches no client")
        return ""
    return _words(data)


def _words(data: bytes) -> str:
    lines = data.decode("utf-8", "replace").splitlines()
    return " ".join(line.partition("#")[0] for line in lines)


def _file(found: AddrMatchList, path: str, what: str) -> str:
    """A list file's text; unreadable, a FIFO, a device or too large: a warning, and
    nothing (opened without blocking: a FIFO there must not stop start-up)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        found.warnings.append(f"{what}: cannot read {path}: {exc.strerror}: it matches "
                              "no client")
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            found.warnings.append(f"{what}: {path} is not a regular file: it matches "
                                  "no client")
            return ""
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_FILE_BYTES:
                found.warnings.append(f"{what}: {path} is larger than {MAX_FILE_BYTES} "
                                      "bytes: it matches no client")
                return ""
    except OSError as exc:
        found.warnings.append(f"{what}: cannot read {path}: {exc.strerror}: it matches "
                              "no client")
        return ""
    finally:
        os.close(fd)
    return _words(b"".join(chunks))
