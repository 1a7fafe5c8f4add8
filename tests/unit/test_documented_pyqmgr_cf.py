"""Every pyqmgr.cf shipped or shown in the documentation passes check's settings part.

An admin copies these word for word; a name in them that pyqmgr does not read would be
a feature that silently stays off (issue #43), and ``pyqmgr check`` would now refuse it.

What counts as a pyqmgr.cf example (the rule a doc writer follows):

- Markdown (README.md, docs/*.md, contrib/*.md): a fenced code block with no info
  string or the info string ``cf`` whose lines are all blank, comments (``#``),
  continuation lines (leading whitespace) or ``name = value`` lines, unless its first
  line is a comment that starts with main.cf's or master.cf's name (``#
  /etc/postfix/main.cf``). Blocks of other files carry their
  language (```` ```sh ````, ```` ```toml ````, ```` ```text ```` for a postfwd rule...).
  A commented-out setting (``#name = value``) is checked too: it is a name an admin
  will uncomment. Inline code spans are not read (they mix main.cf, TOML and log
  fields).
- TOML (```` ```toml ```` blocks that parse, compat/workloads/*.toml, scenarios/*.toml):
  every ``pyqmgr_cf`` table, at any depth.
- Manual pages (pyqmgr/man/*): each bold ``\\fBname = value\\fR`` span.

Each example is read as the daemon reads pyqmgr.cf (main.cf syntax) and judged by
check's names part with no master.cf (any transport form is taken). A value that holds
`` #``, a comment main.cf would keep as part of the value, fails too.
"""

from __future__ import annotations

import glob
import os
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from pyqmgr.pyqmgr_cf import MODULE_PREFIX, from_text
from pyqmgr.pyqmgr_cf_names import unknown_parameters
from pyqmgr.settings.policies import load

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SETTING = re.compile(r"[a-z][a-z0-9_]*\s*=")
COMMENTED = re.compile(r"#\s*([a-z][a-z0-9_]*\s*=.*)$")
FENCE = re.compile(r"^\s*```(\S*)\s*$")


@dataclass(frozen=True)
class Example:
    where: str
    text: str


def _relative(path: str) -> str:
    return os.path.relpath(path, ROOT)


def _blocks(path: str) -> Iterator[tuple[int, str, list[str]]]:
    """(line number, info string, lines) of each fenced block of a Markdown file."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    at = 0
    while at < len(lines):
        opened = FENCE.match(lines[at])
        if not opened:
            at += 1
            continue
        end = at + 1
        while end < len(lines) and not re.match(r"^\s*```\s*$", lines[end]):
            end += 1
        indent = len(lines[at]) - len(lines[at].lstrip())
        yield at + 1, opened.group(1), [ln[indent:] for ln in lines[at + 1:end]]
        at = end + 1


def _is_pyqmgr_cf(body: list[str]) -> bool:
    if not any(SETTING.match(ln) for ln in body):
        return False
    first = next((ln for ln in body if ln.strip()), "")
    if re.match(r"#\s*(\S*/)?(main|master)\.cf\b", first):
        return False
    return all(not ln.strip() or ln.startswith(("#", " ", "\t")) or SETTING.match(ln)
               for ln in body)


def _toml_examples(where: str, data: object) -> Iterator[Example]:
    if isinstance(data, dict):
        for key, value in data.items():
            if key == "pyqmgr_cf" and isinstance(value, dict):
                yield Example(where, "".join(f"{k} = {v}\n" for k, v in value.items()))
            else:
                yield from _toml_examples(where, value)
    elif isinstance(data, list):
        for item in data:
            yield from _toml_examples(where, item)


def examples() -> list[Example]:
    found: list[Example] = []
    markdown = [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md")),
                *glob.glob(os.path.join(ROOT, "contrib", "*.md"))]
    for path in sorted(markdown):
        for line, info, body in _blocks(path):
            where = f"{_relative(path)}:{line}"
            if info in ("", "cf") and _is_pyqmgr_cf(body):
                # A commented-out setting is one an admin will uncomment.
                text = "\n".join(COMMENTED.sub(r"\1", ln) for ln in body) + "\n"
                found.append(Example(where, text))
            elif info == "toml":
                try:
                    found += _toml_examples(where, tomllib.loads("\n".join(body)))
                except tomllib.TOMLDecodeError:
                    pass  # a fragment, not a file
    for pattern in ("compat/workloads/*.toml", "scenarios/*.toml"):
        for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
            with open(path, "rb") as f:
                found += _toml_examples(_relative(path), tomllib.load(f))
    for path in sorted(glob.glob(os.path.join(ROOT, "pyqmgr", "man", "*.[0-9]"))):
        with open(path, encoding="utf-8") as f:
            spans = re.findall(r"\\fB([a-z][a-z0-9_]*) = ([^\\]*)\\fR", f.read())
        found += [Example(_relative(path), f"{name} = {value}\n") for name, value in spans]
    return found


def _policies(cf_values: dict[str, str]) -> list[type]:
    """A module: policy the example names, when contrib/ ships a file of that name."""
    found = []
    for value in cf_values.values():
        if value.strip().startswith(MODULE_PREFIX):
            shipped = os.path.join(ROOT, "contrib", os.path.basename(value.strip()))
            if os.path.exists(shipped):
                found.append(load(f"{MODULE_PREFIX}{shipped}"))
    return found


EXAMPLES = examples()


def test_the_rule_finds_the_examples():
    """Without this, a change to the rule (or to the docs' layout) that found nothing
    would pass everything below."""
    where = {e.where.split(":")[0] for e in EXAMPLES}
    assert {"docs/policies.md", "docs/metrics.md", "docs/sites.md", "docs/fleet.md",
            "docs/priority.md", "docs/retry.md", "docs/shaping.md", "docs/delegation.md",
            "docs/compare.md", "scenarios/finch-big-envelopes.toml",
            "compat/workloads/priority.toml", "pyqmgr/man/pyqmgr.8",
            "pyqmgr/man/pyqmgr.1"} <= where, where
    assert len(EXAMPLES) >= 30


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.where for e in EXAMPLES])
def test_every_documented_pyqmgr_cf_passes_the_check(example):
    cf = from_text(example.text, example.where)
    assert cf.warnings == ()
    unknown = unknown_parameters(cf, None, _policies(dict(cf.values)))
    assert not unknown, [u.text(example.where) for u in unknown]
    comments = {name: value for name, value in cf.values.items()
                if re.search(r"\s#", value)}
    assert not comments, (f"{example.where}: main.cf syntax keeps a # after a value as "
                          f"part of it (a comment starts a line): {comments}")
