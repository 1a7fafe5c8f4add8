"""Reply categories (issue #46): the shipped rules scored on a corpus of real reply texts,
an admin's override file, and the bounds that keep a rule from stalling the event writer.

The corpus, tests/data/reply_texts/replies.jsonl, holds real reply texts, each with its
source, the DSN status, the category a person gave it and the set it belongs to:
``train`` (the rules were first written from these), then ``heldout1`` to ``heldout6``,
each scored once before any rule was changed for it and only then used to improve the
rules (tests/data/reply_texts/README.md records each first score). So the figures this
test asserts for the whole are a regression guard over every text collected, not a
held-out measure; the held-out figures are the first scores, kept in :data:`FIRST_SCORES`
and in the README, and checked to agree so that neither drifts.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter

import pytest

from pyqmgr.events import categories
from pyqmgr.events.categories import (
    CATEGORIES,
    MAX_FILE_BYTES,
    REPLY_LIMIT,
    CategoriesError,
    Categorizer,
    load,
    parse_rules,
)

CORPUS = os.path.join(os.path.dirname(__file__), "..", "data", "reply_texts", "replies.jsonl")
HALVES = ("train", "heldout1", "heldout2", "heldout3", "heldout4", "heldout5", "heldout6")
#: The bar of issue #46: at least 95% right.
BAR = 0.95
#: Each held-out set's first score (right, texts, the day it was computed), the honest
#: held-out figure: computed once, with the rules frozen before the set was collected and
#: labelled, and never recomputed. A set's texts may not change after its first score.
FIRST_SCORES = {
    "heldout1": (142, 161, "2026-11-29"),
    "heldout2": (76, 109, "2026-11-29"),
    "heldout3": (37, 75, "2026-11-29"),
    "heldout4": (42, 57, "2026-11-29"),
    "heldout5": (27, 35, "2026-11-29"),
    "heldout6": (148, 210, "2026-11-30"),
}
README = os.path.join(os.path.dirname(CORPUS), "README.md")


def _corpus() -> list[dict[str, str]]:
    with open(CORPUS, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def shipped() -> Categorizer:
    return load()


def test_corpus_is_real_and_documented() -> None:
    rows = _corpus()
    assert len(rows) >= 250
    assert len({r["text"] for r in rows}) == len(rows), "a text is in the corpus twice"
    for r in rows:
        assert r["expected"] in CATEGORIES, r
        assert r["half"] in HALVES, r
        assert re.fullmatch(r"[245]\.\d{1,3}\.\d{1,3}", r["status"]), r
        assert r["source"].startswith("http"), r
    held = [r for r in rows if r["half"] != "train"]
    assert len(held) >= 200


def _scores(shipped: Categorizer) -> dict[str, tuple[int, int, list[tuple[dict[str, str], str]]]]:
    """Per set and for "all": right, texts and the misses (text, category given)."""
    rows = _corpus()
    scores = {}
    for half in HALVES + ("all",):
        part = [r for r in rows if half in ("all", r["half"])]
        misses = [(r, shipped.category(r["status"], r["text"])) for r in part]
        misses = [(r, got) for r, got in misses if got != r["expected"]]
        scores[half] = (len(part) - len(misses), len(part), misses)
    return scores


def test_corpus_score(shipped: Categorizer) -> None:
    """Every set and the whole at or above the bar; each set's score and misses printed
    with their source, beside its first (held-out) score."""
    rows = _corpus()
    scores = {}
    for half, (right, total, misses) in _scores(shipped).items():
        scores[half] = (right, total)
        first = FIRST_SCORES.get(half)
        was = (f" (first score {first[0]}/{first[1]} = {first[0] / first[1]:.1%} on "
               f"{first[2]}, held out)" if first else "")
        print(f"{half}: {right}/{total} right = {right / total:.1%}{was}")
        if half != "all":
            for r, got in misses:
                print(f"  MISS {half}: expected {r['expected']}, got {got}: "
                      f"{r['status']} {r['text'][:160]!r} [{r['source']}]")
    by_category = Counter(r["expected"] for r in rows)
    print("texts by category:", dict(by_category.most_common()))
    for half, (right, total) in scores.items():
        assert right / total >= BAR, f"{half}: {right}/{total} under {BAR:.0%}"


def test_first_scores_are_recorded_and_kept(shipped: Categorizer) -> None:
    """Each held-out set's first score is the README's, its texts are as many as when it
    was scored, and the rules now get at least as many of them right."""
    with open(README, encoding="utf-8") as f:
        readme = f.read()
    scores = _scores(shipped)
    assert set(FIRST_SCORES) == set(HALVES) - {"train"}
    for half, (first, total, day) in FIRST_SCORES.items():
        row = next((line for line in readme.splitlines() if line.startswith(f"| `{half}` |")),
                   None)
        assert row is not None, f"{half} has no row in {README}"
        assert f"| {total} |" in row and f"{first} = {first / total:.1%}" in row, (half, row)
        right, now, _ = scores[half]
        assert now == total, f"{half} has {now} texts, {total} when it was first scored"
        assert right >= first, f"{half}: {right} right, under its first score {first} ({day})"


def test_speed(shipped: Categorizer) -> None:
    """Classifications per second over the corpus, printed (the target is under 20 us a
    text); the assertion only catches a pathological regression, as CI's machine is
    shared and a timing bar would depend on its load."""
    rows = [(r["status"], r["text"]) for r in _corpus()]
    start = time.process_time()
    rounds = 5
    for _ in range(rounds):
        for status, text in rows:
            shipped.category(status, text)
    took = (time.process_time() - start) / (rounds * len(rows))
    print(f"reply categories: {1 / took:,.0f} classifications a second, "
          f"{took * 1e6:.1f} us a text (CPU), over {len(rows)} texts")
    assert took < 0.001


def test_ascii_fast_path_matches_the_plain_patterns(shipped: Categorizer) -> None:
    """The lowered, case-sensitive patterns give what the case-insensitive ones give."""
    for r in _corpus():
        text = f"{categories.rule_status(r['status'], r['text'])} {r['text']}"
        plain = next((rule.category for rule in shipped.rules
                      if (rule.pattern.search(text) is None) is rule.negate), "other")
        assert shipped.category(r["status"], r["text"]) == plain, text
    # A text that is not ASCII takes the plain patterns.
    assert shipped.category("5.1.1", "550 5.1.1 Benutzer unbekannt \u2013 user unknown") == \
        "invalid_recipient"


def test_postfix_texts(shipped: Categorizer) -> None:
    cases = {
        ("4.4.1", "connect to mx.example.com[192.0.2.1]:25: Connection refused"): "network",
        ("4.4.3", "Host or domain name not found. Name service error for name=example.com "
                  "type=MX: Host not found, try again"): "network",
        ("5.4.4", "Host or domain name not found. Name service error for name=example.invalid "
                  "type=A: Host not found"): "bad_domain",
        ("4.4.1", "delivery temporarily suspended: connect to mx.example.com[192.0.2.1]:25: "
                  "Connection timed out"): "network",
        ("4.3.0", "mail transport unavailable"): "config",
        ("5.4.6", "mail for mx.example.com loops back to myself"): "config",
        ("4.4.2", "lost connection with mx.example.com[192.0.2.1] while receiving the initial "
                  "server greeting"): "network",
        ("4.7.28", "host gmail-smtp-in.l.google.com[142.250.1.26] said: 421-4.7.28 Gmail has "
                   "detected an unusual rate of email (in reply to end of DATA command)"):
            "rate_limited",
        ("2.0.0", "250 2.0.0 Ok: queued as 4XyZ"): "delivered",
        ("5.9.9", "something nobody wrote a rule for"): "other",
    }
    for (status, text), want in cases.items():
        assert shipped.category(status, text) == want, text


# -- the admin's file ---------------------------------------------------------------------------


def _write(tmp_path, text: str | bytes, name: str = "categories") -> str:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return str(path)


def test_admin_rule_wins(tmp_path) -> None:
    path = _write(tmp_path, "# our own\n/user unknown in virtual/  policy\n"
                            "!/^[245]\\./\n    other\n")
    cat = load(path)
    assert cat.category("5.1.1", "550 5.1.1 <a@b>: Recipient address rejected: User unknown "
                                 "in virtual alias table") == "policy"
    # Not the admin's pattern: the shipped rules still answer.
    assert cat.category("5.1.1", "550 5.1.1 User unknown") == "invalid_recipient"
    # A negated rule, written over a continuation line, matches when its pattern does not.
    category, rule = cat.match("9.9.9", "odd")
    assert category == "other" and rule is not None and rule.where == f"{path}, line 3"


def test_case_flag_toggles(tmp_path) -> None:
    path = _write(tmp_path, "/Blocked by ACME/i  policy\n/acme/  relay_denied\n")
    cat = load(path)
    assert cat.category("5.0.0", "550 Blocked by ACME") == "policy"
    assert cat.category("5.0.0", "550 BLOCKED BY ACME") == "relay_denied"


@pytest.mark.parametrize("line, why", [
    ("/user unknown/ nosuchcategory", "unknown category 'nosuchcategory'"),
    ("user unknown  policy", "expected /pattern/flags"),
    ("/user (unknown/  policy", "bad pattern"),
    ("/user unknown/q  policy", "unknown pattern flag 'q'"),
    ("if /^5/", "if/endif blocks are not supported"),
    ("/(a+)+$/  policy", "a repetition inside an unbounded repetition"),
    ("/(\\w+\\s?)*$/  policy", "a repetition inside an unbounded repetition"),
])
def test_bad_line_names_file_and_line(tmp_path, line: str, why: str) -> None:
    path = _write(tmp_path, f"# fine\n/fine/ policy\n\n{line}\n")
    with pytest.raises(CategoriesError) as err:
        load(path)
    assert str(err.value).startswith(f"{path}, line 4: ")
    assert why in str(err.value)


def test_unreadable_and_oversized_files(tmp_path) -> None:
    missing = str(tmp_path / "missing")
    with pytest.raises(CategoriesError, match=re.escape(missing)):
        load(missing)
    big = _write(tmp_path, b"# padding\n" * (MAX_FILE_BYTES // 10 + 1), "big")
    with pytest.raises(CategoriesError, match="larger than"):
        load(big)
    with pytest.raises(CategoriesError, match="not UTF-8"):
        load(_write(tmp_path, b"/\xff/ policy\n", "latin"))


def test_pathological_pattern_refused_in_bounded_time(tmp_path) -> None:
    """(a|a)*b passes the nesting check but backtracks exponentially: the probes find it
    after a few tens of characters, in well under a second."""
    path = _write(tmp_path, "/(a|a)*b/  policy\n")
    start = time.monotonic()
    with pytest.raises(CategoriesError, match=f"{re.escape(path)}, line 1: the pattern took"):
        load(path)
    assert time.monotonic() - start < 5


def test_shipped_rules_pass_the_guards() -> None:
    with open(categories.SHIPPED, encoding="utf-8") as f:
        rules = parse_rules(f.read(), categories.SHIPPED, probe=True)
    assert rules and all(r.lowered is not None for r in rules)


def test_text_cut_at_the_reply_limit(shipped: Categorizer) -> None:
    """Only the first REPLY_LIMIT characters are matched, so a 100 KB text costs what a
    4 KB one does."""
    pad = "x" * REPLY_LIMIT
    assert shipped.category("5.0.0", "550 user unknown " + pad) == "invalid_recipient"
    assert shipped.category("5.0.0", pad + " 550 user unknown") == "other"
    huge = "a " * 50_000
    start = time.process_time()
    assert shipped.category("5.0.0", huge) == "other"
    assert time.process_time() - start < 0.5


def test_the_docs_example_is_a_valid_file(tmp_path) -> None:
    """docs/events.md's example file parses, probes and does what it says."""
    docs = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "events.md")
    with open(docs, encoding="utf-8") as f:
        block = f.read().split("regexp_table(5) line syntax:\n\n")[1].split("\n\n")[0]
    path = _write(tmp_path, "\n".join(line[4:] for line in block.splitlines()) + "\n")
    cat = load(path)
    assert cat.category("4.0.0", "451 Internal resource temporarily unavailable") == \
        "rate_limited"
    assert cat.category("5.2.2", "552 Quota limit reached for a@example.com") == "mailbox_full"
    assert cat.match("9.0.0", "x")[1].where == f"{path}, line 8"


def test_word_prefilter_is_exact() -> None:
    """A rule skipped because no word of the text starts as its pattern must would not
    have matched: the answers equal a plain search of every rule, negated rules and
    rules the prefilter cannot read included."""
    text = "\n".join([
        "/\\b(?:foo bar|baz)/  policy",
        "!/\\b(?:zzz)/  network",            # negated: fires when zzz is absent
        "/\\b(?:\\(bl\\)|qux)/  tls",         # starts with '(': not prefiltered
        "/\\bMixed/i  config",               # case-sensitive: not prefiltered
        "/\\b(?:fo)/  relay_denied",         # shorter than the prefilter's 3 characters
    ])
    rules = parse_rules(text, "t")
    assert [r.anchors for r in rules] == [frozenset({"foo", "baz"}), frozenset({"zzz"}),
                                           None, None, None]
    cat = Categorizer(rules)
    for sample in ["xfoo bar zzz", "foo bar", "a baz", "zzz (bl)", "zzz qux", "zzz Mixed",
                   "zzz mixed", "zzz fo", "zzz", "x" * 10 + " zzz foo barbaz"]:
        plain = next((r.category for r in rules
                      if (r.pattern.search(f"5.0.0 {sample}") is None) is r.negate), "other")
        assert cat.category("5.0.0", sample) == plain, sample


def test_rule_status_reads_a_quoted_status() -> None:
    """X.0.0 (no enhanced status where Postfix looks) gives way to one the reply quotes
    elsewhere, of the same class; a dotted number that is not a status does not."""
    rule_status = categories.rule_status
    assert rule_status("5.0.0", "554 Sorry, no mailbox here by that name. (#5.1.1)") == "5.1.1"
    assert rule_status("5.0.0", "500 Depot returns error: <552 5.2.2 Over quota>") == "5.2.2"
    assert rule_status("5.7.1", "550 5.7.1 see 5.1.1") == "5.7.1"       # Postfix's stands
    assert rule_status("5.0.0", "550 (#4.4.1)") == "5.0.0"              # another class
    assert rule_status("4.0.0", "451 Exim 4.94.2 at 10.4.1.2") == "4.0.0"  # no status there
    assert rule_status("5.0.0", "550 (#5.0.0)") == "5.0.0"
    shipped = load()
    assert shipped.category("5.0.0", "554 Sorry, no mailbox here by that name. (#5.1.1)") == \
        "invalid_recipient"


def test_rules_of_other_scripts_are_skipped_exactly() -> None:
    """A rule every match of which holds a character that is not ASCII is skipped for an
    ASCII text; the answers equal a plain search of every rule, negated rules included."""
    rules = parse_rules("\n".join([
        "/(?:不存在|désactivé|überschritten)/  invalid_recipient",
        "!/(?:不存在)/  network",
        "/(?:不存在|unbekannt)/  policy",
    ]), "t")
    assert [r.non_ascii for r in rules] == [True, True, False]
    cat = Categorizer(rules)
    for sample in ["unbekannt", "compte désactivé", "desactive", "用户不存在",
                   "quota überschritten", "x"]:
        plain = next((r.category for r in rules
                      if (r.pattern.search(f"5.0.0 {sample}") is None) is r.negate), "other")
        assert cat.category("5.0.0", sample) == plain, sample


def test_read_as_root_is_judged(tmp_path) -> None:
    """With the daemon's RootFiles, the file is judged as every file pyqmgr.cf names: one
    that others can change is refused before it is read (the daemon reads it as root)."""
    from pyqmgr.trust import RootFiles, UntrustedFile

    path = _write(tmp_path, "/acme/  policy\n")
    os.chmod(path, 0o644)
    files = RootFiles(str(tmp_path))
    assert load(path, files).category("5.0.0", "550 acme") == "policy"
    os.chmod(path, 0o666)
    with pytest.raises(UntrustedFile):
        load(path, files)
