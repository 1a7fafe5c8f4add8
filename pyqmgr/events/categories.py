"""Reply categories: what a delivery's DSN status and reply text mean, in one word.

Bounce handling, list hygiene and deliverability dashboards sort replies into a few
kinds (the recipient does not exist, the mailbox is full, the sender is throttled...);
every delivery event carries one, so that a consumer need not parse replies itself.
The set is fixed (:data:`CATEGORIES`), because consumers key on its names; which reply
falls where is data: an ordered rules file shipped with pyqmgr
(``pyqmgr/events/reply-categories``), and an admin's own file tried before it.

Both use Postfix's regexp_table(5) line syntax, so that an admin already knows it::

    # comment
    /pattern/flags   category
    !/pattern/flags  category      # the rule matches when the pattern does not
        continued on lines that start with white space

Each pattern is searched in ``"STATUS TEXT"``: the DSN status, one space, then the
reply as Postfix logs it (``5.1.1 host mx.example.com[192.0.2.1] said: 550 5.1.1
<a@example.com>: Recipient address rejected: User unknown (in reply to RCPT TO
command)``); so ``/^5\\.2\\.2 /`` tests the status alone. The first rule that matches
names the category; when none does, the category is ``other``. Patterns are Python
regular expressions (:mod:`re`), not POSIX ERE: they are case-insensitive unless the
flags say ``i`` (which toggles it, as in Postfix); ``x`` allows white space and
comments inside the pattern (Postfix: extended syntax), ``m`` is accepted and changes
nothing (a reply is one line). Postfix's ``if``/``endif`` blocks are not supported.

Bounds, so that a rule can never stall the writer of events:

* the text is cut at :data:`REPLY_LIMIT` characters before matching: Postfix itself
  keeps a server's reply to ``line_length_limit`` (2048) plus at most one more line;
* a rules file is at most :data:`MAX_FILE_BYTES`, read whole at start-up;
* an admin's pattern with a repetition inside an unbounded repetition (``(a+)+``,
  ``(\\w+\\s?)*``), the classic catastrophic backtracking, is refused with its file and
  line; every other pattern is then timed on texts made of its own characters, longer
  and longer up to the limit, and refused if one match takes more than
  :data:`PROBE_BUDGET` seconds (a pattern that is slow only on other texts is bounded
  by the cut alone).

Matching is cheap, and gives what searching every rule in order would: for an ASCII
text (nearly every reply), each case-insensitive pattern with no upper-case letter is
compiled case-sensitive and searched in the text lowered once, which lets :mod:`re` use
its fast literal scan; of a pattern of the form ``\\b(?:word one|word two)``, only the
alternatives that begin with the first three characters of some word of the text are
searched (one pass over the text collects them; an index from those three characters to
the alternatives finds them), without the ``\\b`` first, so that :mod:`re` scans for their
first characters; a pattern every match of which holds a character that is not ASCII
(words in other scripts) is skipped for an ASCII text; a pattern that starts with ``^`` is
matched at the start only. The shipped file is written so. Over the corpus (838 texts):
28 us of CPU a text for the 85 shipped rules on the project's shared two-core machine
(tests/unit/test_reply_categories.py prints it), where the 51 rules before the structural
ones took 21 us with a prefilter by rule only.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from re import _constants as sre_constants  # type: ignore[attr-defined]
from re import _parser as sre_parser  # type: ignore[attr-defined]
from typing import TYPE_CHECKING, Any

from pyqmgr.bounded import TooLarge
from pyqmgr.trust import file_reader

if TYPE_CHECKING:
    from pyqmgr.trust import RootFiles

#: The categories, in the order the docs list them, with what each means.
CATEGORIES: dict[str, str] = {
    "delivered": "the server accepted the message (a 2.x.x status)",
    "invalid_recipient": "the address does not exist (unknown user, no such mailbox)",
    "bad_domain": "the recipient's domain takes no mail: no such domain, no MX or A "
                  "record, a null MX",
    "inactive_mailbox": "the mailbox exists but is disabled, suspended or inactive",
    "mailbox_full": "the mailbox is over its quota or out of storage",
    "message_too_large": "the message, an attachment or a header is over a size limit",
    "rate_limited": "the receiver throttles the sender: too fast, too many connections, "
                    "messages or recipients, try later, greylisting, Gmail's 4.7.28",
    "policy": "refused for spam, content, reputation, a blocklist, missing reverse DNS, "
              "a malformed message or the receiver's rules on the sender",
    "authentication": "SPF, DKIM or DMARC failed, or the sender is not authenticated",
    "relay_denied": "the server does not relay for this sender or client",
    "tls": "TLS was required and failed, or was missing",
    "network": "no connection or a lost one: refused, timed out, unreachable, a "
               "temporary DNS failure",
    "protocol": "the SMTP dialogue went wrong: syntax, command sequence, unexpected reply",
    "remote_error": "the receiving server's own trouble: a temporary system problem, "
                    "no storage, service not available",
    "config": "this system's own setup: mail loops back to myself, a transport "
              "unavailable, a local delivery that failed",
    "expired": "the message was too long in a queue (here or at a relay)",
    "other": "none of the above",
}

#: Characters of reply text that are matched; the rest is ignored (see the docstring).
REPLY_LIMIT = 4096
#: The largest rules file read.
MAX_FILE_BYTES = 256 * 1024
#: Seconds of the thread's CPU one probe match may take before an admin's pattern is
#: refused: CPU time, not wall time, so that a busy machine does not refuse a pattern.
PROBE_BUDGET = 0.05

#: The shipped rules, package data beside this module.
SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reply-categories")

_RULE_RE = re.compile(r"(!?)/((?:[^/\\]|\\.)*)/([A-Za-z]*)\s+(\S+)\s*$")
_REPEATS = (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT,
            getattr(sre_constants, "POSSESSIVE_REPEAT", sre_constants.MAX_REPEAT))


class CategoriesError(ValueError):
    """A rules file that cannot be used; the text names the file and line."""


@dataclass(frozen=True, slots=True)
class Rule:
    """One line of a rules file."""

    source: str
    pattern: re.Pattern[str]
    #: The same pattern for a lowered ASCII text, or None when that would not be the
    #: same match (case-sensitive, or an upper-case letter in the pattern).
    lowered: re.Pattern[str] | None
    negate: bool
    category: str
    where: str
    #: For the lowered pattern: the first three characters any match must start with,
    #: each at the start of a word, or None when the pattern does not say (see
    #: :func:`_word_anchors`); lets a text skip the rule without a search.
    anchors: frozenset[str] | None = None
    #: The pattern starts with ``^``: ``match`` is the same as ``search``, and cheaper.
    at_start: bool = False
    #: Every match holds a character that is not ASCII (``/(?:不存在|désactivé)/``,
    #: not ``/(?:不存在|unbekannt)/``): an ASCII text skips the rule.
    non_ascii: bool = False


class Categorizer:
    """The rules, in order; :meth:`category` is what the event writer calls."""

    def __init__(self, rules: list[Rule]) -> None:
        self.rules = tuple(rules)
        # Two plans of (search, use the lowered text, anchors, negate): one for ASCII
        # texts, with the fast lowered patterns where they exist, one for the rest.
        self._ascii = tuple(_step(r, r.lowered) if r.lowered is not None
                            else _step(r, r.pattern) for r in self.rules)
        self._other = tuple(_step(r, r.pattern) for r in self.rules)
        # For the rules the prefilter reads: each alternative by the three characters a
        # word must start with for it to match, so that a text searches only the
        # alternatives its own words could start (see _parts).
        self._index: dict[str, list[tuple[int, _Part]]] = {}
        for i, rule in enumerate(self.rules):
            if rule.anchors is not None and rule.lowered is not None:
                for anchors, part in _parts(rule):
                    for anchor in anchors:
                        self._index.setdefault(anchor, []).append((i, part))

    def category(self, status: str, reply: str) -> str:
        """The category of a DSN status and reply text; ``other`` when no rule matches."""
        return self.match(status, reply)[0]

    def match(self, status: str, reply: str) -> tuple[str, Rule | None]:
        """The category and the rule that chose it (None: no rule did), for explain."""
        reply = reply[:REPLY_LIMIT]
        text = f"{rule_status(status, reply)} {reply}"
        if text.isascii():
            plan, low = self._ascii, text.lower()
        else:
            plan, low = self._other, text
        # The words' starts are found when the first rule that has anchors asks (only
        # the ASCII plan has them): a delivery's status alone settles it before that.
        hits: dict[int, dict[_Part, None]] | None = None
        for i, (search, lowered, anchors, negate) in enumerate(plan):
            if anchors is not None:
                if hits is None:
                    hits = self._hits(low)
                parts = hits.get(i)
                found = parts is not None and any(
                    fast(low) is not None and (exact is None or exact(low) is not None)
                    for fast, exact in parts)
            else:
                found = search(low if lowered else text) is not None
            if found is not negate:
                return self.rules[i].category, self.rules[i]
        return "other", None

    def _hits(self, low: str) -> dict[int, dict[_Part, None]]:
        """Per rule, the alternatives that some word of the text starts as (in order,
        each once)."""
        hits: dict[int, dict[_Part, None]] = {}
        index = self._index
        for start in set(_WORD_START.findall(low)):
            for i, part in index.get(start, ()):
                hits.setdefault(i, {})[part] = None
        return hits


#: Some alternatives of a rule: a search without the leading ``\b`` (which lets :mod:`re`
#: scan for their first characters), then, when that finds something, the exact search
#: with it (None: the first is exact).
_Part = tuple[Callable[[str], object], Callable[[str], object] | None]


def _parts(rule: Rule) -> list[tuple[frozenset[str], _Part]]:
    """A rule ``\\b(?:A|B|...)`` as its alternatives, those with the same anchors
    together (:mod:`re` then scans for their common first characters); any other rule
    with anchors as one part. A text's answer is the same: the rule matches where one of
    its alternatives does, and an alternative only at a word that starts as one of its
    anchors."""
    assert rule.anchors is not None and rule.lowered is not None
    flags = rule.lowered.flags
    whole: list[tuple[frozenset[str], _Part]] = [(rule.anchors, (rule.lowered.search, None))]
    texts = _split_alternatives(rule.source)
    tree = list(sre_parser.parse(rule.source, flags))
    if texts is None or len(tree) != 2 or len(_alternatives(*tree[1])) != len(texts):
        return whole
    groups: dict[frozenset[str], list[str]] = {}
    for alternative in texts:
        anchors = _word_anchors(list(sre_parser.parse(rf"\b(?:{alternative})", flags)))
        if anchors is None:
            return whole
        groups.setdefault(anchors, []).append(alternative)
    return [(anchors, (re.compile(f"(?:{'|'.join(alts)})", flags).search,
                       re.compile(rf"\b(?:{'|'.join(alts)})", flags).search))
            for anchors, alts in groups.items()]


def _split_alternatives(source: str) -> list[str] | None:
    """The top-level alternatives of a pattern written ``\b(?:A|B|...)``, as text; None
    for any other pattern."""
    if not source.startswith("\\b(?:"):
        return None
    out, start, depth, in_class, i = [], 5, 0, False, 5
    while i < len(source):
        c = source[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "(":
            depth += 1
        elif c == ")" and depth:
            depth -= 1
        elif c == ")":
            out.append(source[start:i])
            return out if i == len(source) - 1 else None
        elif c == "|" and not depth:
            out.append(source[start:i])
            start = i + 1
        i += 1
    return None


#: An enhanced status quoted inside a reply (``(#5.1.1)``, ``<552 5.2.2 Over quota>``):
#: a class, a subject of one digit (RFC 3463 defines 0 to 7) and a detail, not part of a
#: longer dotted number (an address, a version).
_QUOTED_STATUS = re.compile(r"(?<![\w.])([245]\.[0-7]\.\d{1,3})(?![\w.])")


def rule_status(status: str, reply: str) -> str:
    """The status the rules see: Postfix's, except that ``X.0.0`` (what Postfix logs when
    the server put no enhanced status right after its reply code) gives way to the first
    enhanced status of the same class the reply quotes elsewhere, as qmail's ``(#5.1.1)``
    does: the server said more than Postfix could read, and the rules use it."""
    if status[1:] != ".0.0":
        return status
    found = _QUOTED_STATUS.search(reply)
    if found is None or found[1][0] != status[0] or found[1].endswith(".0.0"):
        return status
    return found[1]


def _step(rule: Rule, pattern: re.Pattern[str]) -> tuple[Callable[[str], object], bool,
                                                         frozenset[str] | None, bool]:
    lowered = pattern is rule.lowered
    if lowered and rule.non_ascii:
        return _never, lowered, None, rule.negate  # an ASCII text cannot match it
    find = pattern.match if rule.at_start else pattern.search
    return find, lowered, rule.anchors if lowered else None, rule.negate


# -- reading ----------------------------------------------------------------------------


def load(path: str | None = None, files: RootFiles | None = None,
         read: Callable[[str, int], bytes] | None = None) -> Categorizer:
    """The admin's rules from ``path`` (None: none) before the shipped ones.

    ``files`` is the daemon's :class:`pyqmgr.trust.RootFiles` when it reads as root:
    the file is then judged as every other file pyqmgr.cf names, and
    :class:`pyqmgr.trust.UntrustedFile` (not caught here) says why it is refused.
    ``read`` replaces the reader in tests. CategoriesError names the file and line of a
    mistake; an unreadable, oversized or non-UTF-8 file is one too.
    """
    rules: list[Rule] = []
    if path:
        rules += parse_rules(_read(path, files, read), path, probe=True)
    rules += shipped_rules()
    return Categorizer(rules)


_shipped: list[Rule] | None = None


def shipped_rules() -> list[Rule]:
    """The shipped file's rules, parsed once (they are tested, not probed, here)."""
    global _shipped
    if _shipped is None:
        with open(SHIPPED, encoding="utf-8") as f:
            _shipped = parse_rules(f.read(), SHIPPED)
    return list(_shipped)


def _read(path: str, files: RootFiles | None,
          read: Callable[[str, int], bytes] | None) -> str:
    if read is None:
        read = file_reader(files)
    try:
        data = read(path, MAX_FILE_BYTES)
    except TooLarge:
        raise CategoriesError(f"{path}: larger than {MAX_FILE_BYTES} bytes; a rules file "
                              "is read whole at start-up") from None
    except OSError as exc:
        raise CategoriesError(f"{path}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CategoriesError(f"{path}: not UTF-8 (byte {exc.start})") from None


def logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, line) of each rule: comments and blank lines dropped, a line
    that starts with white space joined to the one before, as Postfix reads tables."""
    current: tuple[int, str] | None = None
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        if raw[:1].isspace() and current is not None:
            current = (current[0], current[1] + " " + raw.strip())
            continue
        if current is not None:
            yield current
        current = (n, raw.strip())
    if current is not None:
        yield current


def parse_rules(text: str, path: str, probe: bool = False) -> list[Rule]:
    """A whole rules file; CategoriesError names the file and line of the first mistake.
    ``probe``: also refuse a pattern that backtracks catastrophically (see the module)."""
    rules = []
    for n, line in logical_lines(text):
        where = f"{path}, line {n}"
        rule = parse_rule(line, where)
        if probe:
            _probe(rule)
        rules.append(rule)
    return rules


def parse_rule(line: str, where: str) -> Rule:
    """One rule: ``[!]/pattern/flags category``."""
    if re.match(r"(if|endif)\b", line, re.IGNORECASE):
        raise CategoriesError(f"{where}: if/endif blocks are not supported here; write "
                              "the condition into each pattern")
    m = _RULE_RE.match(line)
    if m is None:
        raise CategoriesError(f"{where}: expected /pattern/flags then one category name, "
                              f"not {line[:80]!r}")
    bang, source, flags, category = m.groups()
    if category not in CATEGORIES:
        raise CategoriesError(f"{where}: unknown category {category!r} (one of: "
                              f"{', '.join(CATEGORIES)})")
    ignore = True
    re_flags = 0
    for flag in flags:
        if flag == "i":
            ignore = not ignore
        elif flag == "x":
            re_flags |= re.VERBOSE
        elif flag != "m":
            raise CategoriesError(f"{where}: unknown pattern flag {flag!r} (i, m or x)")
    try:
        pattern = re.compile(source, re_flags | (re.IGNORECASE if ignore else 0))
        tree = sre_parser.parse(source, re_flags)
    except (re.error, OverflowError, RecursionError) as exc:
        raise CategoriesError(f"{where}: bad pattern: {exc}") from None
    nested = _nested_repeat(list(tree), False)
    if nested:
        raise CategoriesError(f"{where}: a repetition inside an unbounded repetition "
                              f"({nested}) can take exponential time on some texts: "
                              "rewrite it without the nesting")
    lowered = None
    if ignore and not _has_upper(list(tree)):
        lowered = re.compile(source, re_flags)
    at_start = bool(tree) and tree[0] in ((sre_constants.AT, sre_constants.AT_BEGINNING),
                                          (sre_constants.AT, sre_constants.AT_BEGINNING_STRING))
    non_ascii = _needs_non_ascii(list(tree))
    return Rule(source, pattern, lowered, bool(bang), category, where,
                _word_anchors(list(tree)) if lowered is not None else None, at_start,
                non_ascii)


# -- the prefilter ---------------------------------------------------------------------------

#: Characters of a word's start that the prefilter compares.
_ANCHOR = 3
#: Each word's first :data:`_ANCHOR` characters (fewer at the end of the text).
_WORD_START = re.compile(rf"\b(?=(\w[\s\S]{{0,{_ANCHOR - 1}}}))")
_WORD = re.compile(r"\w")


def _word_anchors(tree: list[Any]) -> frozenset[str] | None:
    """For a pattern that starts with ``\\b`` and then must match one of a few literal
    beginnings (``\\b(?:user unknown|no such user)``): those beginnings, cut to
    :data:`_ANCHOR` characters. Every match starts at a word's start with one of them, so a
    text none of whose words starts so cannot match, and is not searched. None when the
    pattern does not say that much (then it is always searched)."""
    if not tree or tree[0] != (sre_constants.AT, sre_constants.AT_BOUNDARY):
        return None
    found = _grow({""}, tree[1:])
    if found is None or not all(_WORD.match(a) for a in found):
        return None
    return frozenset(found)


def _grow(prefixes: set[str], seq: list[Any], size: int = _ANCHOR) -> set[str] | None:
    """The prefixes extended by what ``seq`` must begin with, up to ``size``
    characters; None when some way through ``seq`` leaves one shorter."""
    for op, av in seq:
        if all(len(p) >= size for p in prefixes):
            return prefixes
        if op is sre_constants.LITERAL:
            prefixes = {p + chr(av) if len(p) < size else p for p in prefixes}
        elif op in (sre_constants.AT, sre_constants.ASSERT, sre_constants.ASSERT_NOT):
            continue  # zero-width: it adds no character
        elif op is sre_constants.SUBPATTERN or op is sre_constants.BRANCH:
            alternatives = _alternatives(op, av)
            grown: set[str] = set()
            for alternative in alternatives:
                more = _grow(prefixes, alternative, size)
                if more is None:
                    return None
                grown |= more
            prefixes = grown
        else:
            break
    return prefixes if all(len(p) >= size for p in prefixes) else None


def _needs_non_ascii(seq: list[Any]) -> bool:
    """Whether every match of ``seq`` holds a character that is not ASCII: a literal
    one outside any repetition, or one in every alternative of a group."""
    for op, av in seq:
        if op is sre_constants.LITERAL and av > 127:
            return True
        if op is sre_constants.SUBPATTERN or op is sre_constants.BRANCH:
            if all(_needs_non_ascii(a) for a in _alternatives(op, av)):
                return True
    return False


def _never(text: str) -> None:
    """The search of a rule that cannot match an ASCII text."""
    return None


def _alternatives(op: Any, av: Any) -> list[list[Any]]:
    if op is sre_constants.BRANCH:
        return [list(b) for b in av[1]]
    body = list(av[3])
    if len(body) == 1 and body[0][0] is sre_constants.BRANCH:
        return [list(b) for b in body[0][1][1]]
    return [body]


# -- the guards ---------------------------------------------------------------------------


def _items(tree: list[Any]) -> Iterator[tuple[Any, Any]]:
    """Every (op, argument) of a parsed pattern, depth first."""
    for op, av in tree:
        yield op, av
        for sub in _children(op, av):
            yield from _items(sub)


def _children(op: Any, av: Any) -> list[list[Any]]:
    if op in _REPEATS:
        return [list(av[2])]
    if op is sre_constants.SUBPATTERN:
        return [list(av[3])]
    if op is sre_constants.BRANCH:
        return [list(b) for b in av[1]]
    if op in (sre_constants.ASSERT, sre_constants.ASSERT_NOT):
        return [list(av[1])]
    if op is sre_constants.GROUPREF_EXISTS:
        return [list(b) for b in av[1:] if b is not None]
    if op is getattr(sre_constants, "ATOMIC_GROUP", None):
        return [list(av)]
    return []


def _nested_repeat(tree: list[Any], inside: bool) -> str | None:
    """'+ inside +' when an unbounded repetition holds another repetition of more than
    one, else None."""
    for op, av in tree:
        if op in _REPEATS:
            unbounded = av[1] == sre_constants.MAXREPEAT
            if inside and av[1] > 1:
                return "a repetition inside an unbounded one"
            found = _nested_repeat(list(av[2]), inside or unbounded)
        else:
            found = next((f for sub in _children(op, av)
                          if (f := _nested_repeat(sub, inside))), None)
        if found:
            return found
    return None


def _has_upper(tree: list[Any]) -> bool:
    """Whether the pattern names an upper-case ASCII letter (so that it would not match
    the same in a lowered text)."""
    for op, av in _items(tree):
        if op is sre_constants.LITERAL or op is sre_constants.NOT_LITERAL:
            if 65 <= av <= 90:
                return True
        elif op is sre_constants.IN:
            for iop, iav in av:
                if iop is sre_constants.LITERAL and 65 <= iav <= 90:
                    return True
                if iop is sre_constants.RANGE and iav[0] <= 90 and iav[1] >= 65:
                    return True
        elif op is sre_constants.GROUPREF:
            return True  # a back-reference compares the original text
    return False


def _literals(tree: list[Any]) -> str:
    """The pattern's literal characters, in order (what the probes are made of)."""
    out = []
    for op, av in _items(tree):
        if op is sre_constants.LITERAL:
            out.append(chr(av))
        elif op is sre_constants.IN:
            for iop, iav in av:
                if iop is sre_constants.LITERAL:
                    out.append(chr(iav))
                elif iop is sre_constants.RANGE:
                    out.append(chr(iav[0]))
    return "".join(out)


def _probe(rule: Rule) -> None:
    """Time the pattern on texts of its own characters, longer and longer: a pattern
    whose time explodes with the length is refused before a reply meets it."""
    lits = _literals(list(sre_parser.parse(rule.source, rule.pattern.flags & re.VERBOSE)))
    seeds = {lits + "!"} | {c for c in lits[:16]} | {"a", " "}
    lengths = [4, 8, 12, 16, 20, 24, 28, 32, 48, 64, 128, 256, 512, 1024, 2048,
               REPLY_LIMIT + 16]
    for length in lengths:
        for seed in seeds:
            text = (seed * (length // max(len(seed), 1) + 1))[:length]
            start = time.thread_time()
            rule.pattern.search(text)
            took = time.thread_time() - start
            if took > PROBE_BUDGET:
                raise CategoriesError(
                    f"{rule.where}: the pattern took {took * 1000:.0f} ms on a "
                    f"{length}-character text of {seed[:20]!r}; it backtracks too much "
                    "to be matched against every reply")
