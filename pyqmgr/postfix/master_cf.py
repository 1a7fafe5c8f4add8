"""master.cf as master(8) reads it, and the ``-o`` overrides a service's processes get.

qmgr itself never reads master.cf; this exists for the two places that need what
master would do with it: the simulator (a transport's process limit, with ``-``
meaning master's default_process_limit) and the daemon (the ``-o name=value``
options on its own command line, which master copies from its master.cf line).
The line reader is main.cf's (comment and blank lines dropped, indentation
continues), and fields follow ``get_master_ent()``: whitespace-separated, with
``{ ... }`` keeping an argument together and losing its braces.

:func:`locate_entries` serves a third place, ``pyqmgr install``/``uninstall``: where
an entry and its command column lie in the file's text, so that the one word can be
replaced and every other byte (the admin's alignment, comments, line breaks) stays.
``postconf -F`` rewrites the whole entry in its own layout and may move it past the
comment lines that follow it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pyqmgr.postfix.config import (
    ConfigError,
    logical_lines,
    option_nameval,
    split_list,
    split_nameval,
)
from pyqmgr.postfix.expand import C_SPACE, compat_level_from_string, is_digit, strtol
from pyqmgr.postfix.getopt import SERVER_OPTIONS, GetOpt

#: ``CHARS_SPACE``: the field separators of master.cf.
BLANKS = " \t\r\n"
SERVICE_TYPES = ("inet", "unix", "unix-dgram", "fifo", "pass")


@dataclass(frozen=True)
class MasterService:
    """One master.cf entry, with master's defaults applied."""

    service: str
    type: str
    private: bool
    unprivileged: bool
    chroot: bool
    wakeup: int
    wakeup_conditional: bool
    process_limit: int
    command: str
    args: tuple[str, ...]
    overrides: tuple[tuple[str, str], ...]
    line: int
    #: The columns as written (``-`` kept), under postconf -F's names.
    fields: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def endpoint(self) -> str:
        """Master's identity for the entry: ``private/x``, ``public/x``, or the inet name."""
        if self.type == "inet":
            return self.service
        return f"{'private' if self.private else 'public'}/{self.service}"

    def override(self, name: str) -> str | None:
        """The raw value ``-o name=...`` gives this service's processes (last one wins)."""
        found = None
        for key, value in self.overrides:
            if key == name:
                found = value
        return found

    def override_dict(self) -> dict[str, str]:
        return dict(self.overrides)


@dataclass
class MasterCf:
    """The entries master would run, and the warnings it would log reading them."""

    services: list[MasterService]
    warnings: list[str]

    def find(self, service: str, type_: str = "unix") -> MasterService | None:
        for entry in self.services:
            if entry.service == service and entry.type == type_:
                return entry
        return None

    def process_limit(self, service: str, type_: str = "unix") -> int | None:
        """maxproc of ``service/type`` (0 = no limit), None if there is no such entry."""
        entry = self.find(service, type_)
        return None if entry is None else entry.process_limit


def tokens_with_braces(text: str) -> list[str]:
    """``mystrtokq(.., CHARS_SPACE, "{}")``: whitespace splits only outside braces."""
    tokens: list[str] = []
    i = 0
    n = len(text)
    while True:
        while i < n and text[i] in BLANKS:
            i += 1
        if i >= n:
            return tokens
        start = i
        level = 0
        while i < n:
            ch = text[i]
            if ch == "{":
                level += 1
            elif level > 0 and ch == "}":
                level -= 1
            elif level == 0 and ch in BLANKS:
                break
            i += 1
        tokens.append(text[start:i])


def strip_braces(token: str) -> str:
    """``extpar(.., "{}", EXTPAR_FLAG_STRIP)`` on a token that starts with ``{``.

    Raises ValueError with stock's complaint for unbalanced braces or text after
    the closing brace.
    """
    level = 0
    for i, ch in enumerate(token):
        if ch == "{":
            level += 1
        elif ch == "}":
            level -= 1
            if level == 0:
                if i + 1 != len(token):
                    raise ValueError(f"syntax error after '}}' in \"{token}\"")
                return token[1:i].strip(" \t\n\v\f\r")
    raise ValueError(f"missing '}}' in \"{token}\"")


def extract_overrides(args: Sequence[str], optstring: str = SERVER_OPTIONS
                      ) -> list[tuple[str, str]]:
    """The ``-o`` options a server skeleton's getopt("+...") finds in ``args``.

    ``args`` are the words after the command (braces already stripped). Parsing
    stops at the first word that is not an option, as on Linux; ``-oname=value``
    and ``-o name=value`` are the same; unknown letters are skipped here (the
    daemon itself refuses them).
    """
    found: list[tuple[str, str]] = []
    for letter, value in GetOpt(args, optstring):
        if letter == "o" and value is not None:
            found.append(option_nameval(value))
    return found


def _disabled(patterns: list[str], name_type: str) -> bool:
    """``match_service_match()``: first matching pattern wins, ``!`` negates."""
    type_ = name_type.rpartition("/")[2]
    for pattern in patterns:
        match = True
        while pattern.startswith("!"):
            pattern = pattern[1:]
            match = not match
        subject = name_type if "/" in pattern else type_
        if subject.lower() == pattern.lower():
            return match
    return False


def parse_master_cf(text: str, *, default_process_limit: int = 100,
                    compatibility_level: str = "0", service_disable: str = "",
                    path: str = "/etc/postfix/master.cf") -> MasterCf:
    """Entries as ``get_master_ent()`` builds them; later duplicates replace earlier ones.

    ``default_process_limit`` resolves a ``-`` maxproc, and ``compatibility_level``
    the ``-`` chroot default (y below level 1), both as master reads them from
    main.cf. Errors raise ConfigError with master's fatal text.
    """
    warnings: list[str] = []
    level = compat_level_from_string(compatibility_level)
    chroot_default = "y" if level is None or level < (1 << 20) else "n"
    disabled = split_list(service_disable)
    services: list[MasterService] = []
    where: dict[tuple[str, str], int] = {}
    for lineno, line in logical_lines(text, path, warnings):
        def fatal(message: str, lineno: int = lineno) -> ConfigError:
            return ConfigError(f"{path}: line {lineno}: {message}", warnings)

        fields = _Fields(line)
        name = fields.next()
        if name is None:
            continue
        transport = fields.text("transport type", None, fatal)
        if _disabled(disabled, f"{name}/{transport}"):
            continue
        if transport not in SERVICE_TYPES:
            raise fatal(f"bad transport type: {transport}")
        private = fields.flag("private", "y", fatal)
        if transport == "inet" and private:
            raise fatal("inet service cannot be private")
        unprivileged = fields.flag("unprivileged", "y", fatal)
        chroot = fields.flag("chroot", chroot_default, fatal)
        wakeup_text = fields.text("wakeup_time", "0", fatal)
        wakeup = fields.number("wakeup_time", wakeup_text, 0, fatal)
        maxproc_text = fields.text("max_proc", str(default_process_limit), fatal)
        maxproc = fields.number("max_proc", maxproc_text, 0, fatal)
        command = fields.text("command", None, fatal)
        args: list[str] = []
        for token in tokens_with_braces(fields.rest()):
            if token.startswith("{"):
                try:
                    token = strip_braces(token)
                except ValueError as exc:
                    raise fatal(str(exc)) from None
            args.append(token)
        entry = MasterService(
            service=name, type=transport, private=private, unprivileged=unprivileged,
            chroot=chroot, wakeup=wakeup,
            wakeup_conditional=wakeup > 0 and wakeup_text.endswith("?"),
            process_limit=maxproc, command=command, args=tuple(args),
            overrides=tuple(extract_overrides(args)), line=lineno,
            fields={"private": fields.raw["private"],
                    "unprivileged": fields.raw["unprivileged"],
                    "chroot": fields.raw["chroot"], "wakeup": fields.raw["wakeup_time"],
                    "process_limit": fields.raw["max_proc"]})
        key = (entry.endpoint, transport)
        if key in where:
            old = services[where[key]]
            warnings.append(f'duplicate master.cf entry for service "{old.service}" '
                            f"({old.endpoint}) -- using the last entry")
            services[where[key]] = entry
        else:
            where[key] = len(services)
            services.append(entry)
    return MasterCf(services, warnings)


def load_master_cf(config_dir: str, *, default_process_limit: int = 100,
                   compatibility_level: str = "0",
                   service_disable: str = "") -> MasterCf:
    """Read ``config_dir/master.cf``; pass the main.cf values master would use."""
    path = os.path.join(config_dir, "master.cf")
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", "surrogateescape")
    except OSError as exc:
        raise ConfigError(f"open {path}: {exc.strerror}") from None
    return parse_master_cf(text, default_process_limit=default_process_limit,
                           compatibility_level=compatibility_level,
                           service_disable=service_disable, path=path)


@dataclass(frozen=True)
class EntryText:
    """Where one master.cf entry lies in the file's text (character offsets).

    ``start``/``end`` cover its physical lines, from its first line's first
    character to just past its last line's newline (comment lines between its
    continuation lines included); ``command`` is the command column's span.
    ``columns`` are its whitespace-separated words up to the command, and ``args``
    its arguments as master passes them (braces stripped): what the entry means,
    whatever its layout.
    """

    service: str
    type: str
    start: int
    end: int
    command: tuple[int, int]
    columns: tuple[str, ...]
    args: tuple[str, ...]
    #: (offset, length) of each of its physical lines that is not a comment or blank.
    lines: tuple[tuple[int, int], ...] = ()

    def meaning(self) -> tuple[str, ...]:
        """Its columns and arguments, with each ``-o`` value as ``name=value``:
        ``postconf -F`` writes ``-o { a = b }`` back as ``-o {a=b}``, the same entry."""
        out = list(self.columns)
        after_o = False
        for arg in self.args:
            if after_o:
                try:
                    arg = "=".join(split_nameval(arg))
                except ValueError:
                    pass
            out.append(arg)
            after_o = arg == "-o"
        return tuple(out)


def _line_starts(text: str) -> list[int]:
    starts = [0]
    starts += [i + 1 for i, ch in enumerate(text) if ch == "\n"]
    return starts


def _pieces(text: str, starts: list[int], first: int, buf: str) -> list[tuple[int, int]]:
    """The (offset, length) of each physical line ``logical_lines`` glued into ``buf``.

    It glues the lines from line ``first`` on that are neither blank nor comments,
    as they are; so walking them from there and matching each against ``buf``
    finds them without a second copy of its loop.
    """
    found: list[tuple[int, int]] = []
    used = 0
    index = first - 1
    while used < len(buf) and index < len(starts):
        offset = starts[index]
        end = text.find("\n", offset)
        line = text[offset:] if end < 0 else text[offset:end]
        index += 1
        content = line.lstrip(C_SPACE)
        if not content or content[0] == "#":
            continue
        if buf[used:used + len(line)] != line:
            break  # cannot happen: logical_lines glued exactly these lines
        found.append((offset, len(line)))
        used += len(line)
    return found


def locate_entries(text: str) -> list[EntryText]:
    """Every entry with at least a command column, in file order, with its place.

    Entries master would refuse (a bad field value) are located all the same: the
    caller edits a file that ``postconf`` has already read without complaint. An
    entry whose command word would straddle two physical lines (a continuation line
    starting with a vertical tab or form feed) is left out: no span to replace.
    """
    starts = _line_starts(text)
    found: list[EntryText] = []
    for first, buf in logical_lines(text, "master.cf", []):
        pieces = _pieces(text, starts, first, buf)
        origin: list[int] = []
        for offset, length in pieces:
            origin.extend(range(offset, offset + length))
        words = [(m.start(), m.end()) for m in re.finditer(f"[^{BLANKS}]+", buf)]
        if len(words) < 8 or len(origin) != len(buf):
            continue
        begin, stop = words[7]
        command = (origin[begin], origin[stop - 1] + 1)
        if command[1] - command[0] != stop - begin:
            continue
        last_offset, last_length = pieces[-1]
        end = min(len(text), last_offset + last_length + 1)
        args = []
        for token in tokens_with_braces(buf[stop:]):
            if token.startswith("{"):
                try:
                    token = strip_braces(token)
                except ValueError:
                    pass  # compared as written
            args.append(token)
        found.append(EntryText(
            service=buf[words[0][0]:words[0][1]], type=buf[words[1][0]:words[1][1]],
            start=pieces[0][0], end=end, command=command,
            columns=tuple(buf[a:b] for a, b in words[:8]), args=tuple(args),
            lines=tuple(pieces)))
    return found


def locate_entry(text: str, service: str, type_: str) -> EntryText | None:
    """The entry master would use for ``service/type`` (the last, as it keeps the
    last of duplicates), or None."""
    found = None
    for entry in locate_entries(text):
        if entry.service == service and entry.type == type_:
            found = entry
    return found


def replace_command(text: str, entry: EntryText, word: str) -> str:
    """``text`` with ``entry``'s command column replaced by ``word``, all else as is."""
    begin, stop = entry.command
    return text[:begin] + word + text[stop:]


_Fatal = Callable[[str], ConfigError]


class _Fields:
    """Sequential ``mystrtok()`` over the fixed fields of one entry."""

    def __init__(self, line: str) -> None:
        self.line = line
        self.pos = 0
        self.raw: dict[str, str] = {}

    def next(self) -> str | None:
        n = len(self.line)
        while self.pos < n and self.line[self.pos] in BLANKS:
            self.pos += 1
        if self.pos >= n:
            return None
        start = self.pos
        while self.pos < n and self.line[self.pos] not in BLANKS:
            self.pos += 1
        token = self.line[start:self.pos]
        if self.pos < n:
            self.pos += 1  # mystrtok consumes exactly one separator
        return token

    def rest(self) -> str:
        return self.line[self.pos:]

    def text(self, name: str, default: str | None, fatal: _Fatal) -> str:
        value = self.next()
        if value is None:
            raise fatal(f'missing "{name}" field')
        self.raw[name] = value
        if value == "-":
            if default is None:
                raise fatal(f'field "{name}" has no default value')
            return default
        return value

    def flag(self, name: str, default: str, fatal: _Fatal) -> bool:
        value = self.text(name, default, fatal)
        if value == "y":
            return True
        if value == "n":
            return False
        raise fatal(f'field "{name}": bad value: "{value}"')

    @staticmethod
    def number(name: str, value: str, minimum: int, fatal: _Fatal) -> int:
        number, _end, _erange = strtol(value, 0)
        if not value or not is_digit(value[0]) or number < minimum:
            raise fatal(f'field "{name}": bad value: "{value}"')
        return number

