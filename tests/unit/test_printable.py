"""Logged text is made printable as stock's msg_output does (printable(text, '?'))."""

from pyqmgr.postfix.maillog_client import printable


def test_ascii_text_is_unchanged():
    assert printable("abc: to=<a@b>, relay=none") == "abc: to=<a@b>, relay=none"


def test_control_characters_become_question_marks():
    assert printable("a\nb\rc\td\x7fe\x00") == "a?b?c?d?e?"


def test_utf8_kept_only_when_smtputf8_is_enabled():
    assert printable("to=<jürgen@exämple>") == "to=<jürgen@exämple>"
    assert printable("to=<jürgen@x>", utf8=False) == "to=<j??rgen@x>"


def test_invalid_utf8_bytes_become_question_marks():
    raw = b"x\xffy\x80z\xc3".decode("utf-8", "surrogateescape")
    assert printable(raw) == "x?y?z?"
