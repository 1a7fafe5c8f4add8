"""Repeated code in pyqmgr/: at most 6 pairs of files share a run of six lines.

Issue #22 counts "pairs of places in pyqmgr/ that share six or more lines of the same
shape": the same lines, or lines alike but for their names, strings and numbers. The
project's machine has a tool for that, CI has not, so this test counts them its own
way: each line of code is reduced to its shape (names, numbers and strings each
become one symbol, keywords and operators stay), and every run of six lines of code
(blank, comment, import and lone-punctuation lines do not count; a line that is
only a string, a docstring, is prose and alike only if the same words) whose shape
stands again elsewhere makes its two files a pair. Two kinds of run are idioms, not
repetitions one could write once, and are left out: a run found in more than eight
places, and a run of mostly thin lines (shapes found 50 times or more in pyqmgr/, such
as a dataclass's ``N: N`` fields or a table of constants). The machine's own
``duplicates`` tool counted 8 pairs on 2026-11-27 and this count 6; 28-31 and 9
during issue #44, which brought the tool's count to 10 (its bar) and this one to 6,
the limit since.

A new pair fails the test with the two places, so the author sees what repeats.
"""

from __future__ import annotations

import io
import itertools
import keyword
import os
import tokenize
from collections import Counter, defaultdict

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "pyqmgr")
RUN = 6
#: More places than this: an idiom, not a repetition.
TOO_COMMON = 8
#: A line shape found this often in the tree is thin ("N: N", "return N", "try:"); a
#: run of mostly thin lines is how Python is written, not code one could share.
THIN = 50
#: Issue #22's bar: fewer than 10 pairs.
MOST_PAIRS = 6

Place = tuple[str, int]  # file, first line of the run


def code_shapes(text: str) -> list[tuple[int, str]]:
    """(line number, shape) for each line of code, in order."""
    by_line: dict[int, list[str]] = defaultdict(list)
    literal: dict[int, str] = {}
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER}
    # Python 3.12 splits an f-string into tokens; 3.11 gives one STRING. Either way
    # it is one string here.
    start, end = getattr(tokenize, "FSTRING_START", None), getattr(tokenize, "FSTRING_END", None)
    depth = 0
    statement_start, importing = True, False
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.NEWLINE:
            statement_start, importing = True, False
            continue
        if tok.type in skip:
            continue
        if statement_start:
            statement_start = False
            # Every line of an import, a parenthesized one's too.
            importing = tok.string in ("import", "from")
        if importing:
            continue
        if tok.type == start:
            depth += 1
            if depth == 1:
                by_line[tok.start[0]].append("S")
            continue
        if tok.type == end:
            depth -= 1
            continue
        if depth:
            continue
        if tok.type == tokenize.NAME:
            shape = tok.string if keyword.iskeyword(tok.string) else "N"
        elif tok.type == tokenize.NUMBER:
            shape = "0"
        elif tok.type == tokenize.STRING:
            shape = "S"
            literal[tok.start[0]] = tok.string
        else:
            shape = tok.string
        by_line[tok.start[0]].append(shape)
    lines = []
    for number in sorted(by_line):
        parts = by_line[number]
        if parts == ["S"]:
            # A line that is only a string is prose (a docstring): alike only if the
            # same words.
            lines.append((number, literal.get(number, "S")))
            continue
        if all(not (p[0].isalnum() or p == "S") for p in parts):
            continue  # lone punctuation: ")", "]:", "}"
        lines.append((number, " ".join(parts)))
    return lines


def pairs(root: str = ROOT) -> dict[frozenset[str], tuple[Place, Place]]:
    """Each pair of files sharing a run of RUN same-shape lines, with one such run."""
    files: dict[str, list[tuple[int, str]]] = {}
    for folder, _, names in os.walk(root):
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    files[os.path.relpath(path, root)] = code_shapes(f.read())
    seen = Counter(shape for shapes in files.values() for _, shape in shapes)
    thin = {shape for shape, count in seen.items() if count >= THIN}
    runs: dict[tuple[str, ...], list[tuple[str, int, int]]] = defaultdict(list)
    for rel, shapes in files.items():
        for i in range(len(shapes) - RUN + 1):
            window = tuple(s for _, s in shapes[i:i + RUN])
            runs[window].append((rel, shapes[i][0], shapes[i + RUN - 1][0]))
    found: dict[frozenset[str], tuple[Place, Place]] = {}
    for window, places in runs.items():
        if len(places) < 2 or len(places) > TOO_COMMON:
            continue
        if sum(1 for shape in window if shape in thin) > RUN // 2:
            continue
        for (fa, a0, a1), (fb, b0, b1) in itertools.combinations(places, 2):
            if fa == fb and a0 <= b1 and b0 <= a1:
                continue  # overlapping runs of one file: a run of repeated lines
            found.setdefault(frozenset((fa, fb)), ((fa, a0), (fb, b0)))
    return found


def test_at_most_six_pairs_of_files_repeat_six_lines():
    found = pairs()
    listing = "\n".join(f"  {a[0]}:{a[1]} ~ {b[0]}:{b[1]}" for a, b in sorted(found.values()))
    print(f"{len(found)} pairs of files share a run of {RUN} same-shape lines:\n{listing}")
    assert len(found) <= MOST_PAIRS, (
        f"{len(found)} pairs of files in pyqmgr/ share {RUN} or more lines of the same "
        f"shape (at most {MOST_PAIRS}); write the repeated code once:\n{listing}")


def test_the_counter_finds_a_repetition_by_shape(tmp_path):
    """Two functions alike but for their names and values are a pair; prose is not."""
    body = "def {f}(a, b):\n    x = a + {n}\n    y = b * x\n    if y > {n}:\n" \
           "        return '{s}'\n    z = [x, y]\n    return z[0] - {n}\n"
    (tmp_path / "one.py").write_text(body.format(f="f", n=1, s="a"))
    (tmp_path / "two.py").write_text("import os\n\n" + body.format(f="g", n=7, s="b"))
    (tmp_path / "three.py").write_text('"""' + "words\n" * 10 + '"""\nx = 1\n')
    assert set(pairs(str(tmp_path))) == {frozenset(("one.py", "two.py"))}


@pytest.mark.parametrize("places", [TOO_COMMON + 1])
def test_an_idiom_in_many_places_is_not_a_pair(tmp_path, places):
    body = "".join(f"    f{i}: int = {i}\n" for i in range(RUN + 1))
    for n in range(places):
        (tmp_path / f"m{n}.py").write_text(f"class C{n}:\n{body}")
    assert pairs(str(tmp_path)) == {}
