"""Postfix's ``$`` expansion (``mac_parse`` + ``mac_expand``), byte-for-byte in behaviour.

A daemon expands a parameter value lazily, at the moment it reads it, against its
dictionary of the moment; this module is only the engine. It follows the C code's
control flow closely on purpose: the corner cases (the Postfix 2.11 rule that text
after ``?`` without braces is taken verbatim, nesting counted per bracket type, the
nesting level restarting inside relational operands, scanning continuing after some
errors) are visible in configurations and in the warnings stock logs, and a cleaner
grammar would disagree with stock on exactly those inputs.

Errors do not stop the scan at once, as in C: each problem adds the warning stock
would log, and the caller turns a failed expansion into its own fatal message
(``dictionary mail_dict: macro processing error`` in a daemon).
"""

from __future__ import annotations

from collections.abc import Callable

#: ``CHARS_SPACE``: whitespace that mac_expand skips around operands and names.
MAC_SPACE = " \t\r\n"
#: C ``isspace()`` in the C locale: what strtol() and the main.cf reader skip.
C_SPACE = " \t\n\v\f\r"

LONG_MAX = 2**63 - 1
LONG_MIN = -(2**63)
INT_MAX = 2**31 - 1
INT_MIN = -(2**31)

PARSE_ERROR = 1
PARSE_UNDEF = 2

_LITERAL = 1
_EXPR = 2

#: Nesting level above which mac_expand gives up (``mc->level++ > 100``).
MAX_NESTING = 100
#: Our text for a case stock has none for: it dies of SIGSEGV (confirmed on 3.7.11).
RECURSION_FATAL = "unbounded macro recursion through a relational operand"

_OP_CHARS = "<>!=?+-*/~&|%"
_OPS = ("==", "!=", "<", "<=", ">=", ">")
#: The text stock prints when the operator is not one of _OPS (the doubled quotes are
#: stock's: they come from string concatenation in mac_expand.c).
_OP_STR_ANY = '"==" or "!="" or "<"" or "<="" or ">="" or ">"'

Lookup = Callable[[str], "str | None"]


class MacroError(Exception):
    """An expansion failed; ``warnings`` holds what stock logs before its fatal error."""

    def __init__(self, warnings: list[str]) -> None:
        super().__init__("; ".join(warnings) or "macro processing error")
        self.warnings = warnings


class ConversionFatal(Exception):
    """A fatal error raised from inside the engine itself (stock's ``msg_fatal``)."""


def is_alnum(ch: str) -> bool:
    """ASCII-only ``ISALNUM``, as Postfix tests characters (never locale letters)."""
    return ch.isascii() and ch.isalnum()


def is_digit(ch: str) -> bool:
    return "0" <= ch <= "9"


def all_digits(text: str) -> bool:
    """``alldig()``: non-empty and only ASCII digits."""
    return bool(text) and all(is_digit(c) for c in text)


def strtol(text: str, start: int = 0) -> tuple[int, int, bool]:
    """C ``strtol(text + start, &end, 10)``: returns (value, end index, ERANGE).

    Postfix relies on strtol's leniency (leading whitespace, a sign) and on the end
    pointer to spot trailing junk, so conversions need the same function, not int().
    When no digits are found the end index is ``start`` and the value 0.
    """
    i = start
    n = len(text)
    while i < n and text[i] in C_SPACE:
        i += 1
    negative = False
    if i < n and text[i] in "+-":
        negative = text[i] == "-"
        i += 1
    digits_start = i
    while i < n and is_digit(text[i]):
        i += 1
    if i == digits_start:
        return 0, start, False
    value = int(text[digits_start:i])
    if negative:
        value = -value
    if value > LONG_MAX:
        return LONG_MAX, i, True
    if value < LONG_MIN:
        return LONG_MIN, i, True
    return value, i, False


# -- compatibility levels (global/compat_level.c) ---------------------------------------

_MINOR_BITS = 0x3FF
_PATCH_BITS = 0x3FF
_MAJOR_SHIFT = 20
_MINOR_SHIFT = 10


def compat_level_from_string(text: str) -> int | None:
    """Encode ``major[.minor[.patch]]`` so that plain integer comparison orders levels.

    Returns None where stock reports ``malformed compatibility level syntax``.
    """
    major, end, erange = strtol(text, 0)
    if not (end > 0 and (end == len(text) or text[end] == ".") and not erange
            and 0 <= major <= (LONG_MAX >> _MAJOR_SHIFT)):
        return None
    result = major << _MAJOR_SHIFT
    if end == len(text):
        return result
    start = end + 1
    minor, end, erange = strtol(text, start)
    if not (end > start and (end == len(text) or text[end] == ".") and not erange
            and 0 <= minor <= _MINOR_BITS):
        return None
    result |= minor << _MINOR_SHIFT
    if end == len(text):
        return result
    start = end + 1
    patch, end, erange = strtol(text, start)
    if end > start and end == len(text) and not erange and 0 <= patch <= _PATCH_BITS:
        return result | patch
    return None


def malformed_level(text: str) -> str:
    return f'malformed compatibility level syntax: "{text}"'


# -- the engine ----------------------------------------------------------------------------


def _compare(delta: int, op: str) -> bool:
    if op == "==":
        return delta == 0
    if op == "!=":
        return delta != 0
    if op == "<":
        return delta < 0
    if op == "<=":
        return delta <= 0
    if op == ">=":
        return delta >= 0
    return delta > 0


def _c_strcmp(left: str, right: str) -> int:
    """strcmp() on the UTF-8 bytes, which is what stock compares."""
    a = left.encode("utf-8", "surrogateescape")
    b = right.encode("utf-8", "surrogateescape")
    return (a > b) - (a < b)


class _Expansion:
    """One ``mac_expand()`` call: result buffer, status and nesting level."""

    def __init__(self, lookup: Lookup, warnings: list[str]) -> None:
        self.lookup = lookup
        self.warnings = warnings
        self.result: list[str] = []
        self.status = 0
        self.level = 0

    def error(self, text: str) -> int:
        self.warnings.append(text)
        self.status |= PARSE_ERROR
        return self.status

    # mac_parse(): split text into literals and $-expressions, calling back for each.
    def parse(self, value: str) -> int:
        status = 0
        buf: list[str] = []
        i = 0
        n = len(value)
        while i < n:
            ch = value[i]
            if ch != "$":
                buf.append(ch)
                i += 1
                continue
            if i + 1 < n and value[i + 1] == "$":
                buf.append("$")
                i += 2
                continue
            if buf:
                status |= self.callback(_LITERAL, "".join(buf))
                buf = []
            i += 1
            if i < n and value[i] in "({":
                open_ch = value[i]
                close_ch = ")" if open_ch == "(" else "}"
                level = 1
                i += 1
                j = i
                while level > 0:
                    if j >= n:
                        self.warnings.append(f'truncated macro reference: "{value}"')
                        status |= PARSE_ERROR
                        break
                    if value[j] == open_ch:
                        level += 1
                    if value[j] == close_ch:
                        level -= 1
                    j += 1
                # Stock tests the accumulated status here, so an earlier failed
                # expression also ends the scan at the next bracketed reference.
                if status & PARSE_ERROR:
                    break
                name = value[i:j - 1]
                i = j
            else:
                j = i
                while j < n and (is_alnum(value[j]) or value[j] == "_"):
                    j += 1
                name = value[i:j]
                i = j
            if not name:
                status |= PARSE_ERROR
                self.warnings.append(f'empty macro name: "{value}"')
                break
            status |= self.callback(_EXPR, name)
        if buf and not status & PARSE_ERROR:
            status |= self.callback(_LITERAL, "".join(buf))
        return status

    # mac_expand_callback()
    def callback(self, kind: int, text: str) -> int:
        if self.level > MAX_NESTING:
            self.level += 1
            self.error(f'unreasonable macro call nesting: "{text}"')
        else:
            self.level += 1
        if self.status & PARSE_ERROR:
            return self.status
        if kind == _LITERAL:
            self.result.append(text)
            self.level -= 1
            return self.status

        n = len(text)
        pos = _skip(text, 0)
        lookup: str | None
        op = ""
        if pos < n and text[pos] == "{":
            outcome = self._relational(text, pos)
            if outcome is None:
                return self.status
            lookup, pos = outcome
            if pos < n:
                op = text[pos]
                if op not in "?:":
                    return self.error(f'"?" or ":" expected at: "...}}>>>{text[pos:pos + 20]}"')
                pos += 1
        else:
            named = self._name(text, pos)
            if named is None:
                return self.status
            name, op, pos = named
            lookup = self.lookup(name)

        if op == "?":
            payload = self._branch(text, pos)
            if payload is None:
                return self.status
            if_true, pos = payload
            if lookup:
                self.status |= self.parse(if_true)
            if pos >= n:
                self.level -= 1
                return self.status
            if text[pos] != ":":
                return self.error(f'":" expected at: "...{if_true}}}>>>{text[pos:pos + 20]}"')
            pos += 1
            op = ":"
        if op == ":":
            payload = self._branch(text, pos)
            if payload is None:
                return self.status
            if_false, pos = payload
            if not lookup:
                self.status |= self.parse(if_false)
            if pos < n:
                return self.error(
                    f'unexpected input at: "...{if_false}}}>>>{text[pos:pos + 20]}"')
        else:
            if lookup is None:
                self.status |= PARSE_UNDEF
            elif lookup:
                self.status |= self.parse(lookup)
        self.level -= 1
        return self.status

    def _name(self, text: str, pos: int) -> tuple[str, str, int] | None:
        """A parameter name up to an optional ``?`` or ``:``: (name, operator, next).

        The operator is "" when the name runs to the end; None means a syntax error
        (already reported).
        """
        n = len(text)
        cp = pos
        while True:
            after = _skip(text, cp)
            if after >= n:
                return text[pos:cp], "", cp
            if text[after] in "?:":
                return text[pos:cp], text[after], after + 1
            ch = text[cp]
            if not is_alnum(ch) and ch != "_":
                self.error(
                    f'attribute name syntax error at: "...{text[:cp]}>>>{text[cp:cp + 20]}"')
                return None
            cp += 1

    def _branch(self, text: str, pos: int) -> tuple[str, int] | None:
        """The text after ``?`` or ``:``: a ``{...}`` payload, or else the rest verbatim.

        The Postfix 2.11 rule: without braces the whole remainder is the branch.
        None means unbalanced braces (already reported).
        """
        curly = _find_curly(text, pos)
        if curly is None:
            return text[pos:], len(text)
        return self._curly(text, curly)

    def _curly(self, text: str, pos: int) -> tuple[str, int] | None:
        """``mac_exp_extract_curly_payload``: text[pos] is ``{``; balance the braces."""
        level = 1
        cp = pos + 1
        n = len(text)
        while True:
            if cp >= n:
                self.error(f'unbalanced {{}} in attribute expression: "{text[pos:]}"')
                return None
            if text[cp] == "{":
                level += 1
            elif text[cp] == "}":
                level -= 1
                if level <= 0:
                    break
            cp += 1
        return text[pos + 1:cp], _skip(text, cp + 1)

    def _relational(self, text: str, pos: int) -> tuple[str, int] | None:
        """``${{left} OP {right}...}``: returns the fake lookup result and where to go on."""
        left_part = self._curly(text, pos)
        if left_part is None:
            return None
        left, cp = left_part
        op_len = 0
        while cp + op_len < len(text) and text[cp + op_len] in _OP_CHARS:
            op_len += 1
        op = text[cp:cp + op_len]
        if op not in _OPS:
            self.error(f'{_OP_STR_ANY} expected at: "...{left}}}>>>{text[cp:cp + 20]}"')
            return None
        op_pos = cp
        cp += op_len
        level_compare = False
        if cp < len(text) and is_alnum(text[cp]):
            suffix_end = cp
            while suffix_end < len(text) and is_alnum(text[suffix_end]):
                suffix_end += 1
            suffix = text[cp:suffix_end]
            if suffix != "level":
                self.error(f'bad operator suffix at: "...{op}>>>{suffix}"')
                return None
            cp = suffix_end
            level_compare = True
        curly = _find_curly(text, cp)
        if curly is None:
            self.error(f'"{{expression}}" expected at: '
                       f'"...{{{left}}} {text[op_pos:op_pos + op_len]}>>>{text[cp:cp + 20]}"')
            return None
        right_part = self._curly(text, curly)
        if right_part is None:
            return None
        right, cp = right_part
        # Each operand is a fresh mac_expand(): its own result and nesting level.
        left_value, left_status = _expand_status(left, self.lookup, self.warnings)
        right_value, right_status = _expand_status(right, self.lookup, self.warnings)
        self.status |= left_status | right_status
        result = False
        if level_compare:
            left_level = compat_level_from_string(left_value)
            right_level = None
            if left_level is None:
                self.warnings.append(malformed_level(left_value))
            else:
                right_level = compat_level_from_string(right_value)
                if right_level is None:
                    self.warnings.append(malformed_level(right_value))
            if left_level is None or right_level is None:
                self.status |= PARSE_ERROR
            else:
                result = _compare(left_level - right_level, op)
        elif all_digits(left_value) and all_digits(right_value):
            for number in (left_value, right_value):
                if int(number) > LONG_MAX:
                    raise ConversionFatal(f"mac_exp_eval: bad conversion: {number}")
            result = _compare(int(left_value) - int(right_value), op)
        else:
            result = _compare(_c_strcmp(left_value, right_value), op)
        if self.status & PARSE_ERROR:
            return None
        return ("true" if result else ""), cp


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in MAC_SPACE:
        pos += 1
    return pos


def _find_curly(text: str, pos: int) -> int | None:
    """``MAC_EXP_FIND_LEFT_CURLY``: the index of ``{`` after optional whitespace."""
    after = _skip(text, pos)
    return after if after < len(text) and text[after] == "{" else None


def _expand_status(value: str, lookup: Lookup, warnings: list[str]) -> tuple[str, int]:
    expansion = _Expansion(lookup, warnings)
    status = expansion.parse(value)
    return "".join(expansion.result), status


def expand(value: str, lookup: Lookup) -> str:
    """Expand ``value`` recursively (``MAC_EXP_FLAG_RECURSE``), as every daemon does.

    ``lookup`` returns a name's raw value, or None for a name that is not defined
    (which expands to nothing). Raises MacroError with stock's warnings on bad syntax,
    and ConversionFatal where stock exits from inside the evaluator.
    """
    warnings: list[str] = []
    try:
        result, status = _expand_status(value, lookup, warnings)
    except RecursionError:
        # Relational operands restart the nesting count, so a value that refers to
        # itself inside ${{...} OP {...}} recurses until stock's stack overflows.
        raise ConversionFatal(f"{RECURSION_FATAL}: \"{value}\"") from None
    if status & PARSE_ERROR:
        raise MacroError(warnings)
    return result
