"""Postfix lookup tables (``type:name``) as pyqmgr reads them (issue #34).

A message's class and tenant come from tables the admin writes as for any Postfix
daemon (DATABASE_README, postmap(1)). pyqmgr reads them at start-up (and so again at
``postfix reload``), whole, into memory: a lookup is then a dict or a short list
walk, with no I/O on the event loop, and a table that cannot be read is an error at
start-up, not a stall mid-delivery.

* **Text tables, parsed here**: ``texthash:/path`` (``key value`` lines, as postmap
  reads them: keys case-folded, a line starting with whitespace continues the one
  before, the first of two equal keys wins), ``inline:{ key=value, { key = text } }``,
  ``static:value`` and ``cidr:/path`` (``network/prefix value``, ``!`` to negate,
  first match wins).
* **Indexed tables, dumped by Postfix**: ``hash:``, ``btree:``, ``lmdb:``, ``cdb:``
  (and any type whose map postmap can list) are read with Postfix's own
  ``postmap -s``, so that their file formats stay Postfix's business.
* **Any other type, through proxymap(8)**: ``proxy:TYPE:NAME`` (``proxy:regexp:``,
  ``proxy:pcre:``, ``proxy:mysql:``...) is asked key by key, Postfix's own code
  answering (:mod:`pyqmgr.postfix.proxymap`: cached, bounded in time, silent for a
  while after a failure); main.cf's ``proxy_read_maps`` must list it, ``proxy:``
  prefix and all, as for any proxied table.
* Anything else (``regexp:``, ``pcre:``, ``ldap:``...) is refused with a message that
  says so, naming ``proxy:``: a pattern table's semantics (POSIX or PCRE syntax,
  ``$1``) are not Python's, and half-right matching would misclassify mail silently.

Every table answers :meth:`Table.get` for one literal key, as ``postmap -q`` does;
:func:`address_keys` gives the access(5)-style search order for an email address.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field

from pyqmgr.bounded import TooLarge
from pyqmgr.postfix.attr import AttrError
from pyqmgr.postfix.config import logical_lines
from pyqmgr.postfix.proxymap import ProxymapClient, ProxymapError, ProxyTable
from pyqmgr.trust import RootFiles, file_reader

#: The largest table file read (and the largest dump taken from postmap).
MAX_TABLE_BYTES = 64 << 20
#: How long ``postmap -s`` may take to list an indexed table. The tables are read at
#: start-up and at each ``postfix reload``, when no mail moves until qmgr is up: a
#: table whose file hangs (a FIFO, a stuck NFS mount) must cost seconds, not the
#: minute it once could. The largest table taken (a hash of 1.5 million entries,
#: 66 MB listed) lists in about 2 s on a 2-CPU test machine under load: 10 s is five
#: times that. ``pyqmgr check`` and ``install`` read the tables too, as long.
POSTMAP_TIMEOUT = 10.0
#: Types read through ``postmap -s``.
INDEXED = frozenset({"hash", "btree", "lmdb", "cdb", "dbm", "sdbm"})
#: Types parsed here.
TEXT = frozenset({"texthash", "inline", "static", "cidr"})

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class LookupTableError(ValueError):
    """A table that cannot be used: the text names the table and why."""


@dataclass
class Table:
    """One table, read whole. ``fixed``: its keys are literal strings (access(5)'s
    partial keys apply), as for Postfix's fixed-string tables; cidr and static are
    not."""

    spec: str
    fixed: bool = True
    entries: dict[str, str] = field(default_factory=dict)
    networks: list[tuple[Network, bool, str]] = field(default_factory=list)
    static: str | None = None
    #: What postmap would have warned of (a bad or duplicate line), one line each.
    warnings: list[str] = field(default_factory=list)
    #: A ``proxy:`` table: proxymap answers each key.
    proxy: ProxyTable | None = None

    def get(self, key: str) -> str | None:
        """The value for ``key``, or None: ``postmap -q key spec``."""
        if self.proxy is not None:
            return self.proxy.get(key)
        if self.static is not None:
            return self.static
        if self.networks:
            return self._cidr(key)
        return self.entries.get(key.lower())

    def _cidr(self, key: str) -> str | None:
        try:
            address = ipaddress.ip_address(key.strip("[]"))
        except ValueError:
            return None
        for net, negate, value in self.networks:
            # A rule is for its own address family, negated or not (as Postfix's).
            if address.version == net.version and (address in net) != negate:
                return value
        return None


def open_table(spec: str, config_dir: str | None = None,
               postmap: str = "postmap", timeout: float = POSTMAP_TIMEOUT,
               warn: Callable[[str], None] | None = None,
               proxymap: str = "private/proxymap", files: RootFiles | None = None) -> Table:
    """Read the table ``spec`` (``type:name``); LookupTableError says what is wrong.
    ``warn`` takes a ``proxy:`` table's later failures; ``proxymap``: its socket.
    ``files``: the daemon's (as root): a table's file is judged before it is read,
    trust.UntrustedFile (not a LookupTableError: start-up stops) for a FIFO, a device
    or a file others can change."""
    kind, sep, name = spec.partition(":")
    if not sep or not kind or not name:
        raise LookupTableError(f"{spec!r}: expected type:name (texthash:/etc/postfix/x)")
    if kind == "proxy":
        return _proxied(spec, name, warn or (lambda text: None), proxymap)
    if kind == "static":
        return Table(spec, fixed=False, static=_braced(name))
    if kind == "inline":
        return _inline(spec, name)
    if kind in ("texthash", "cidr"):
        text = _read(spec, name, files)
        return _texthash(spec, text) if kind == "texthash" else _cidr(spec, text)
    if kind in INDEXED:
        if files is not None:
            _judge_indexed(kind, name, files)
        return _dumped(spec, config_dir, postmap, timeout)
    raise LookupTableError(
        f"{spec}: {kind} tables are not supported as such (pyqmgr reads "
        f"{', '.join(sorted(TEXT | INDEXED))}); ask for proxy:{spec} instead, listed "
        "in main.cf's proxy_read_maps")


def _proxied(spec: str, name: str, warn: Callable[[str], None], path: str) -> Table:
    """A table proxymap answers, opened now so that a table it refuses is said at
    start-up."""
    kind, sep, rest = name.partition(":")
    if not sep or not kind or not rest or kind == "proxy":
        raise LookupTableError(f"{spec}: expected proxy:type:name "
                               "(proxy:regexp:/etc/postfix/classes)")
    proxy = ProxyTable(name, ProxymapClient(path), lambda text: warn(f"{spec}: {text}"))
    try:
        proxy.opened()
    except (ProxymapError, AttrError) as exc:
        proxy.client.close()
        raise LookupTableError(f"{spec}: {exc}") from None
    return Table(spec, fixed=proxy.fixed, proxy=proxy)


def _read(spec: str, path: str, files: RootFiles | None) -> str:
    if not os.path.isabs(path):
        raise LookupTableError(f"{spec}: the table's path must be absolute")
    try:
        data = file_reader(files)(path, MAX_TABLE_BYTES)
    except OSError as exc:
        raise LookupTableError(f"{spec}: cannot read {path}: {exc.strerror}") from None
    except TooLarge as big:
        raise LookupTableError(f"{spec}: {big}") from None
    return data.decode("utf-8", "replace")


def _lines(spec: str, text: str, warnings: list[str]) -> list[tuple[int, str]]:
    """Logical lines as Postfix's readllines makes them (config.logical_lines)."""
    return [(n, line.rstrip()) for n, line in logical_lines(text, spec, warnings)]


def _texthash(spec: str, text: str) -> Table:
    table = Table(spec)
    for number, line in _lines(spec, text, table.warnings):
        key, value = _split(line)
        if not key or not value:
            table.warnings.append(f"{spec}, line {number}: expected format: key "
                                  "whitespace value -- ignoring this line")
            continue
        folded = key.lower()
        if folded in table.entries:
            table.warnings.append(f"{spec}, line {number}: duplicate entry: {key!r}")
            continue
        table.entries[folded] = value
    return table


def _cidr(spec: str, text: str) -> Table:
    table = Table(spec, fixed=False)
    for number, line in _lines(spec, text, table.warnings):
        pattern, value = _split(line)
        negate = pattern.startswith("!")
        pattern = pattern[1:] if negate else pattern
        address, slash, bits = pattern.partition("/")
        try:
            net = ipaddress.ip_network(address.strip("[]") + slash + bits, strict=True)
        except ValueError as exc:
            # As Postfix's cidr table does: a warning, and the rule is skipped.
            table.warnings.append(f"{spec}, line {number}: bad network {pattern!r} "
                                  f"({exc}): skipping this rule")
            continue
        if not value:
            table.warnings.append(f"{spec}, line {number}: no value after {pattern!r}: "
                                  "skipping this rule")
            continue
        table.networks.append((net, negate, value))
    return table


def _split(line: str) -> tuple[str, str]:
    """A logical line's key (or pattern) and value, split at the first whitespace."""
    parts = line.strip().split(None, 1)
    return (parts[0], parts[1].strip()) if len(parts) == 2 else (parts[0], "")


def _braced(text: str) -> str:
    text = text.strip()
    if text.startswith("{") and text.endswith("}"):
        return text[1:-1].strip()
    return text


def _inline(spec: str, name: str) -> Table:
    body = name.strip()
    if not (body.startswith("{") and body.endswith("}")):
        raise LookupTableError(f"{spec}: expected inline:{{ key=value, ... }}")
    table = Table(spec)
    for item in _inline_items(spec, body[1:-1]):
        key, eq, value = _braced(item).partition("=")
        if not eq or not key.strip():
            raise LookupTableError(f"{spec}: expected key=value, not {item!r}")
        table.entries.setdefault(key.strip().lower(), value.strip())
    return table


def _inline_items(spec: str, text: str) -> list[str]:
    """Comma- or space-separated items, ``{ ... }`` kept whole (spaces, commas)."""
    items: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace() or c == ",":
            i += 1
        elif c == "{":
            end = text.find("}", i)
            if end < 0:
                raise LookupTableError(f"{spec}: a '{{' without its '}}'")
            items.append(text[i:end + 1])
            i = end + 1
        else:
            j = i
            while j < n and not text[j].isspace() and text[j] != ",":
                j += 1
            items.append(text[i:j])
            i = j
    return items


#: The files ``postmap -s`` opens for each indexed type (Postfix's dict_*.c suffixes).
INDEX_SUFFIXES = {"hash": (".db",), "btree": (".db",), "lmdb": (".lmdb",),
                  "cdb": (".cdb",), "dbm": (".dir", ".pag"), "sdbm": (".dir", ".pag")}


def _judge_indexed(kind: str, name: str, files: RootFiles) -> None:
    """postmap lists the table as root: its file is judged as a text table's is (a
    FIFO there held start-up for postmap's whole timeout). One that is missing or
    unreadable is left to postmap, whose error names it."""
    for suffix in INDEX_SUFFIXES.get(kind, ()):
        try:
            files.check(name + suffix)
        except OSError:
            continue


def _postmap(name: str) -> str:
    """postmap's path: master(8) gives its daemons no PATH (import_environment), and
    postmap lives in command_directory (/usr/sbin), outside the default search path.
    Its main.cf is the instance's: MAIL_CONFIG, which master does pass on."""
    if os.sep in name:
        return name
    search = os.pathsep.join([os.environ.get("PATH") or os.defpath,
                              "/usr/sbin", "/usr/local/sbin"])
    return shutil.which(name, path=search) or name


def _dumped(spec: str, config_dir: str | None, postmap: str, timeout: float) -> Table:
    """The table as ``postmap -s`` lists it. The listing goes to a file, not a pipe,
    so that an oversized table is refused by its size before it is read into memory."""
    # Here, not at the top: tempfile pulls in random and more, which a daemon with no
    # indexed table never needs (tests/unit/test_daemon_imports.py).
    import tempfile

    argv = [_postmap(postmap), *(("-c", config_dir) if config_dir else ()), "-s", spec]
    with tempfile.TemporaryFile() as out:
        try:
            proc = subprocess.run(argv, stdout=out, stderr=subprocess.PIPE,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise LookupTableError(f"{spec}: postmap -s did not finish in {timeout:g} s "
                                   "(a table file that blocks?)") from None
        except OSError as exc:
            raise LookupTableError(f"{spec}: postmap -s: {exc}") from None
        if proc.returncode != 0:
            said = proc.stderr.decode("utf-8", "replace").strip().splitlines()
            raise LookupTableError(f"{spec}: postmap -s: {said[-1] if said else 'failed'}")
        if out.tell() > MAX_TABLE_BYTES:
            raise LookupTableError(f"{spec}: larger than {MAX_TABLE_BYTES} bytes")
        out.seek(0)
        listing = out.read()
    table = Table(spec)
    for line in listing.decode("utf-8", "replace").splitlines():
        key, _, value = line.partition("\t")
        if key:
            table.entries.setdefault(key.lower(), value)
    return table


def address_keys(address: str, delimiter: str = "+") -> list[str]:
    """The keys an address is looked up by, first match wins, as access(5) orders
    them for a fixed-string table: the address, without its extension, the domain,
    each parent domain with a leading dot (``.example.com`` matches its
    subdomains), then ``user@`` (with, then without, the extension). The empty
    address (a bounce's sender) is looked up as itself alone."""
    address = address.strip()
    if not address:
        return [""]
    local, at, domain = address.rpartition("@")
    if not at:
        local, domain = address, ""
    domain = domain.lower().rstrip(".")
    base = local
    if delimiter and local:
        cut = min((i for i in (local.find(d) for d in delimiter) if i > 0), default=-1)
        if cut > 0:
            base = local[:cut]
    keys = [address]
    if base != local:
        keys.append(f"{base}@{domain}" if domain else base)
    if domain:
        keys.append(domain)
        labels = domain.split(".")
        keys.extend("." + ".".join(labels[k:]) for k in range(1, len(labels)))
    if local:
        keys.append(f"{local}@")
        if base != local:
            keys.append(f"{base}@")
    return keys


def table_specs(text: str) -> list[str]:
    """A ``*_maps`` value's tables, split at commas and whitespace outside braces, as
    Postfix splits them (``inline:{ a=b, c=d }, texthash:/x`` is two tables)."""
    specs: list[str] = []
    current: list[str] = []
    depth = 0
    for c in text:
        if depth == 0 and (c.isspace() or c == ","):
            if current:
                specs.append("".join(current))
                current = []
            continue
        depth += (c == "{") - (c == "}" and depth > 0)
        current.append(c)
    if current:
        specs.append("".join(current))
    return specs
