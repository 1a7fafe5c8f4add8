"""Editing master.cf in place (install/uninstall): one word replaced, every other byte
kept, and postconf reading the result as the same file with that one column changed."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyqmgr.postfix.config import logical_lines
from pyqmgr.postfix.master_cf import locate_entries, locate_entry, replace_command
from pyqmgr.rollback import only_layout_differs
from tests.test_master_cf import TRICKY, _postconf_fields

DEBIAN = Path("/usr/share/postfix/master.cf.dist")

#: Odd but valid layouts: CRLF line ends, an indented comment and a blank line inside
#: an entry, tabs, no newline at the end of the file.
ODD = ("# odd\r\n"
       "smtp\tinet\tn\t-\tn\t-\t-\tsmtpd\r\n"
       "   # indented comment\r\n"
       "\r\n"
       "  -o a=b\r\n"
       "qmgr unix n - n 300 1 qmgr\n"
       "  -o { x = 1 }\n"
       "pickup    unix  n       -       y       60      1       pickup")


@pytest.mark.parametrize("source", ["tricky", "debian", "odd"])
def test_each_command_replaced_alone(tmp_path, source):
    text = {"tricky": TRICKY, "odd": ODD}.get(source) or DEBIAN.read_text()
    entries = locate_entries(text)
    assert len(entries) == len(logical_lines(text, "master.cf", []))
    before = _postconf_fields(tmp_path, text)
    assert [(e.service, e.type) for e in entries] == list(before)
    for entry in entries:
        edited = replace_command(text, entry, "pyqmgr/x-1/qmgr")
        begin, stop = entry.command
        # Only that word's bytes changed.
        assert edited[:begin] == text[:begin] and edited[begin + 15:] == text[stop:]
        after = _postconf_fields(tmp_path, edited)
        key = (entry.service, entry.type)
        old_words = before[key]["command"].split()
        assert after[key]["command"].split() == ["pyqmgr/x-1/qmgr", *old_words[1:]]
        assert {k: v for k, v in after.items() if k != key} == \
            {k: v for k, v in before.items() if k != key}


def test_the_last_duplicate_is_the_one_master_uses():
    text = ("qmgr unix n - n 300 1 qmgr\n"
            "qmgr unix n - n 300 1 oqmgr\n")
    entry = locate_entry(text, "qmgr", "unix")
    assert entry is not None and entry.columns[7] == "oqmgr"
    assert locate_entry(text, "qmgr", "fifo") is None


BASE = ("pickup unix n - y 60 1 pickup\n"
        "qmgr unix n - n 300 1 qmgr -o { a = 1 }\n"
        "#qmgr unix n - n 300 1 oqmgr\n"
        "tlsmgr unix - - y 1000? 1 tlsmgr\n")


@pytest.mark.parametrize("other, same", [
    # postconf -F's rewrite: its own alignment, -o {a=1}, after the comment.
    ("pickup unix n - y 60 1 pickup\n#qmgr unix n - n 300 1 oqmgr\n"
     "qmgr       unix  n       -       n       300     1       qmgr\n    -o {a=1}\n"
     "tlsmgr unix - - y 1000? 1 tlsmgr\n", True),
    # Another -o value, another column, moved past a service, another line changed.
    (BASE.replace("a = 1", "a = 2"), False),
    (BASE.replace("300", "200"), False),
    ("qmgr unix n - n 300 1 qmgr -o { a = 1 }\npickup unix n - y 60 1 pickup\n"
     "#qmgr unix n - n 300 1 oqmgr\ntlsmgr unix - - y 1000? 1 tlsmgr\n", False),
    (BASE.replace("1000?", "3600?"), False),
    (BASE.replace("#qmgr", "# qmgr"), False),
    (BASE + "# a comment\n", False),
])
def test_only_layout_differs(other, same):
    assert only_layout_differs(other, BASE) is same
    assert only_layout_differs(BASE, other) is same
