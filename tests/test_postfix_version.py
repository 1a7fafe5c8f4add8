"""The installed Postfix release decides qmgr's dialect: asked of the real postconf,
refused by name when nobody read it, and followed on the wire (pyqmgr.postfix.version).
"""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from pyqmgr.postfix.version import (
    NO_MASK,
    SMTPUTF8_FLAG_ALL,
    SOPT_FLAG_ALL,
    PostfixVersion,
    VersionError,
    installed,
)
from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.maillog import LogLine
from pyqmgr.testbed.sink import SinkServer


@pytest.mark.parametrize(("text", "attribute", "mask", "verp"), [
    ("3.7.11", "smtputf8", NO_MASK, "verp failed"),
    ("3.7.12", "smtputf8", NO_MASK, "verp failed"),
    ("3.7.13", "smtputf8", SMTPUTF8_FLAG_ALL, "verp failed"),
    ("3.8.6", "smtputf8", NO_MASK, "verp failed"),
    ("3.8.8", "smtputf8", SMTPUTF8_FLAG_ALL, "verp failed"),
    ("3.9.0", "smtputf8", NO_MASK, "verp failed"),
    ("3.9.2", "smtputf8", SMTPUTF8_FLAG_ALL, "verp failed"),
    ("3.10.0", "sendopts", SOPT_FLAG_ALL, "verp failed"),
    ("3.10.13\n", "sendopts", SOPT_FLAG_ALL, "verp failed"),
    ("3.11.6", "sendopts", SOPT_FLAG_ALL, "verp-bounce failed"),
])
def test_each_release_s_dialect(text, attribute, mask, verp):
    """The facts of docs/postfix-versions.md §0-§2, release by release."""
    v = PostfixVersion.parse(text)
    assert (v.options_attribute, v.options_mask, v.verp_failed) == (attribute, mask, verp)
    # 0x31: SMTPUTF8 requested plus both REQUIRETLS bits, as a 3.11 cleanup writes it.
    expected = 0x31 if mask == NO_MASK else 0x31 & mask
    assert v.options(0x31) == expected


@pytest.mark.parametrize(("text", "why"), [
    ("3.6.14", "not a release pyqmgr knows"),
    ("3.12.0", "not a release pyqmgr knows"),
    ("4.0.0", "not a release pyqmgr knows"),
    ("3.7.10", "crashed delivery agent throttled its whole transport"),
    ("3.8.5", "crashed delivery agent throttled"),
    ("3.12-20260821", "is a snapshot"),
    ("", "cannot read the Postfix version"),
    ("3.10", "cannot read the Postfix version"),
    ("3.10.1-nonprod", "cannot read the Postfix version"),
    ("x" * 100_000, "cannot read the Postfix version"),
])
def test_releases_nobody_read_are_refused_by_name(text, why):
    with pytest.raises(VersionError, match=why) as err:
        PostfixVersion.parse(text)
    assert len(str(err.value)) < 300, "an oversized answer is not echoed whole"
    if text and len(text) < 50:
        assert text.strip() in str(err.value)


def test_the_real_postconf_is_asked():
    """Debian 12's Postfix, the one on this machine, says 3.7.11."""
    version = subprocess.run(["postconf", "-dh", "mail_version"], capture_output=True,
                             text=True, check=True).stdout.strip()
    assert str(installed("/usr/sbin")) == version


def _fake_postconf(tmp_path: Path, body: str) -> str:
    """A command_directory whose postconf is a script: an installation gone wrong."""
    directory = tmp_path / "sbin"
    directory.mkdir()
    script = directory / "postconf"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(directory)


@pytest.mark.parametrize(("body", "why"), [
    ("echo 'postconf: fatal: open /etc/postfix/main.cf: No such file' >&2; exit 1",
     "postconf: fatal: open /etc/postfix/main.cf"),
    ("echo 'mail_version = 3.10.2'", "cannot read the Postfix version"),
    ("head -c 2000000 /dev/zero | tr '\\0' 9", "cannot read the Postfix version"),
    ("exec sleep 30", "timed out"),
])
def test_a_postconf_that_misbehaves_is_a_clear_error(tmp_path, body, why):
    """Malformed, failing, oversized and slow answers: an error that says so, in time."""
    directory = _fake_postconf(tmp_path, body)
    started = time.monotonic()
    with pytest.raises(VersionError, match=why) as err:
        installed(directory, timeout=2)
    assert time.monotonic() - started < 10
    assert len(str(err.value)) < 400


def test_no_postconf_at_all(tmp_path):
    with pytest.raises(VersionError, match=f"cannot ask {tmp_path}/postconf"):
        installed(str(tmp_path))


def test_an_unknown_release_stops_qmgr_and_mail_waits(postfix_instance, sink, tmp_path):
    """Under real master(8): the fatal line names the release; nothing is delivered in
    a dialect the agents may not speak, and the message stays queued."""
    directory = _fake_postconf(tmp_path, "echo 3.12.1")
    os.chmod(tmp_path, 0o755)
    srv: SinkServer = sink()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", qmgr_args=["-o", f"command_directory={directory}"],
        transports={"d.example": f"smtp:[127.0.0.1]:{srv.port}"})
    (qid,) = pf.smtp_send([("s@test.example", ["r@d.example"])])

    def is_fatal(ln: LogLine) -> bool:
        return ln.program_name == "qmgr" and ln.severity == "fatal"

    fatal = pf.maillog.wait_for(is_fatal, timeout=30, what="qmgr's fatal line")[0]
    assert "Postfix 3.12.1 is not a release pyqmgr knows" in fatal.text, fatal.text
    assert "3.7.11+" in fatal.text and "3.11" in fatal.text, fatal.text
    assert pf.queue_path("incoming", qid) or pf.queue_path("active", qid), pf.queue_counts()
    assert srv.delivered_count() == 0
