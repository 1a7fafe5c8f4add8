"""master.cf parsing, checked against ``postconf -F`` / ``-P`` and master_ent.c's rules."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from pyqmgr.postfix.config import ConfigError
from pyqmgr.postfix.master_cf import (
    extract_overrides,
    load_master_cf,
    parse_master_cf,
    strip_braces,
    tokens_with_braces,
)

needs_postconf = pytest.mark.skipif(shutil.which("postconf") is None,
                                    reason="postconf not installed")

TRICKY = """\
# a comment
smtp      inet  n       -       y       -       -       smtpd
  -o syslog_name=postfix/$service_name
# a comment inside the entry
  -o { smtpd_banner = a  b   c }

\t-osmtpd_tls_security_level=may
slow      unix  -       -       -       60?     5       smtp -o { x = 1 } arg1 {  a b }
  -o slow_destination_concurrency_limit=1 -v
pick      fifo  n       -       -       60      1       pickup
qmgr      unix  n       -       n       300     1       qmgr -o queue_run_delay=7
postlog   unix-dgram n  -       n       -       1       postlogd
"""


def postconf(directory: Path, master_cf: str, *args: str) -> str:
    (directory / "main.cf").write_text("compatibility_level = 3.6\n")
    past = time.time() - 3600
    os.utime(directory / "main.cf", (past, past))
    (directory / "master.cf").write_text(master_cf)
    proc = subprocess.run(["postconf", "-c", str(directory), *args], capture_output=True,
                          text=True, check=True)
    return proc.stdout


def _postconf_fields(directory: Path, master_cf: str) -> dict[tuple[str, str], dict[str, str]]:
    entries: dict[tuple[str, str], dict[str, str]] = {}
    for line in postconf(directory, master_cf, "-F").splitlines():
        key, _, value = line.partition(" = ")
        service, type_, name = key.rsplit("/", 2)
        entries.setdefault((service, type_), {})[name] = value
    return entries


@needs_postconf
@pytest.mark.parametrize("source", ["tricky", "debian"])
def test_fields_and_overrides_match_postconf(tmp_path, source):
    if source == "debian":
        dist = Path("/usr/share/postfix/master.cf.dist")
        if not dist.exists():
            pytest.skip("no Debian master.cf.dist")
        text = dist.read_text()
    else:
        text = TRICKY
    parsed = parse_master_cf(text, compatibility_level="3.6", default_process_limit=100)
    assert parsed.warnings == []
    expected = _postconf_fields(tmp_path, text)
    assert [(s.service, s.type) for s in parsed.services] == list(expected)
    for entry in parsed.services:
        fields = expected[(entry.service, entry.type)]
        assert dict(entry.fields) == {name: fields[name] for name in entry.fields}
        assert fields["command"].split()[0] == entry.command
    overrides = {}
    for line in postconf(tmp_path, text, "-P").splitlines():
        key, _, value = line.partition(" = ")
        overrides[key] = value
    ours = {f"{s.service}/{s.type}/{name}": " ".join(value.split())
            for s in parsed.services for name, value in s.overrides}
    assert ours == overrides


def test_tricky_entries_resolved():
    parsed = parse_master_cf(TRICKY, compatibility_level="3.6", default_process_limit=42)
    smtp = parsed.find("smtp", "inet")
    assert smtp is not None
    assert (smtp.private, smtp.unprivileged, smtp.chroot) == (False, True, True)
    assert smtp.process_limit == 42 and smtp.wakeup == 0
    assert smtp.overrides == (("syslog_name", "postfix/$service_name"),
                              ("smtpd_banner", "a  b   c"),
                              ("smtpd_tls_security_level", "may"))
    slow = parsed.find("slow")
    assert slow is not None
    assert (slow.private, slow.chroot, slow.process_limit) == (True, False, 5)
    assert (slow.wakeup, slow.wakeup_conditional) == (60, True)
    assert slow.args == ("-o", "x = 1", "arg1", "a b", "-o",
                         "slow_destination_concurrency_limit=1", "-v")
    # getopt stops at "arg1": the later -o is an ordinary argument.
    assert slow.overrides == (("x", "1"),)
    qmgr = parsed.find("qmgr")
    assert qmgr is not None and qmgr.process_limit == 1
    assert qmgr.overrides == (("queue_run_delay", "7"),)
    assert qmgr.override("queue_run_delay") == "7" and qmgr.override("nope") is None
    assert parsed.process_limit("postlog", "unix-dgram") == 1
    assert parsed.process_limit("missing") is None
    assert parsed.find("pick", "fifo") is not None and parsed.find("pick") is None


def test_chroot_default_depends_on_compatibility_level():
    line = "x unix - - - - - cmd\n"
    assert parse_master_cf(line, compatibility_level="0").services[0].chroot is True
    assert parse_master_cf(line, compatibility_level="1").services[0].chroot is False


def test_later_duplicate_replaces_earlier_with_masters_warning():
    parsed = parse_master_cf("a unix - - n - 3 one\nb unix - - n - - two\n"
                             "a unix - - n - 7 three -o k=v\n", path="/c/master.cf")
    assert [(s.service, s.command) for s in parsed.services] == [("a", "three"),
                                                                 ("b", "two")]
    assert parsed.process_limit("a") == 7
    assert parsed.warnings == ['duplicate master.cf entry for service "a" (private/a)'
                               " -- using the last entry"]
    # A public and a private entry of the same name are different endpoints.
    both = parse_master_cf("a unix n - n - 1 one\na unix y - n - 1 two\n")
    assert len(both.services) == 2 and both.warnings == []


def test_master_service_disable():
    text = "smtp inet n - n - - smtpd\nsmtp unix - - n - - smtp\nrelay unix - - n - - smtp\n"
    kept = parse_master_cf(text, service_disable="inet, relay/unix").services
    assert [(s.service, s.type) for s in kept] == [("smtp", "unix")]
    kept = parse_master_cf(text, service_disable="!smtp/unix unix").services
    assert [(s.service, s.type) for s in kept] == [("smtp", "inet"), ("smtp", "unix")]


@pytest.mark.parametrize(("line", "message"), [
    ("x", 'missing "transport type" field'),
    ("x -", 'field "transport type" has no default value'),
    ("x tcp - - - - - c", "bad transport type: tcp"),
    ("x unix maybe - - - - c", 'field "private": bad value: "maybe"'),
    ("x inet y - - - - c", "inet service cannot be private"),
    ("x unix - - - soon - c", 'field "wakeup_time": bad value: "soon"'),
    ("x unix - - - - -1 c", 'field "max_proc": bad value: "-1"'),
    ("x unix - - - - - -", 'field "command" has no default value'),
    ("x unix - - - - 1", 'missing "command" field'),
    ("x unix - - - - 1 c {a", "missing '}' in \"{a\""),
    ("x unix - - - - 1 c {a}b", "syntax error after '}' in \"{a}b\""),
])
def test_errors_carry_masters_fatal_text(line, message):
    with pytest.raises(ConfigError) as err:
        parse_master_cf(f"# first\n{line}\n", path="/c/master.cf")
    assert str(err.value) == f"/c/master.cf: line 2: {message}"


def test_braces_glued_to_an_option_stay_in_its_value():
    # Master strips braces only from a word that starts with "{", so the daemon's
    # getopt sees "-o" with "{y=2}" and registers a parameter named "{y" (checked
    # with stock qmgr's dict_update trace). postconf -P reports y = 2 instead.
    parsed = parse_master_cf("qmgr unix n - n 300 1 qmgr -o{y=2}\n")
    assert parsed.services[0].overrides == (("{y", "2}"),)


def test_tokens_and_braces():
    assert tokens_with_braces(" a {b c} {d {e f}} g}h ") == ["a", "{b c}", "{d {e f}}", "g}h"]
    assert strip_braces("{  x = { y }  }") == "x = { y }"


def test_extract_overrides_like_getopt():
    assert extract_overrides(["-o", "a=1", "-ob = 2", "-vo", "c=3", "-n", "-o", "-o", "d=4"]
                             ) == [("a", "1"), ("b", "2"), ("c", "3"), ("d", "4")]
    assert extract_overrides(["-o", "a=1", "--", "-o", "b=2"]) == [("a", "1")]
    assert extract_overrides(["-o"]) == []
    with pytest.raises(ConfigError, match='^invalid "-o novalue" option value: missing'):
        extract_overrides(["-o", "novalue"])


def test_load_master_cf(tmp_path):
    (tmp_path / "master.cf").write_text("qmgr unix n - n 300 1 qmgr -o a=b\n")
    parsed = load_master_cf(str(tmp_path))
    assert parsed.services[0].overrides == (("a", "b"),)
    with pytest.raises(ConfigError, match="^open .*/nope/master.cf: No such file"):
        load_master_cf(str(tmp_path / "nope"))
