"""Lookup tables as pyqmgr reads them, against Postfix's own postmap(1) (issue #34).

Every answer pyqmgr's reader gives is checked against ``postmap -q KEY TYPE:NAME``
on the same file (Debian's Postfix 3.7.11), keys that match and keys that do not,
for the table types it reads: texthash, hash (dumped with ``postmap -s``), inline,
static and cidr. The files hold what admins' files hold: mixed case, tabs, comments,
continuation lines, duplicates and a bad line or two.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from pyqmgr.postfix import lookup_table
from pyqmgr.postfix.lookup_table import LookupTableError, address_keys, open_table

pytestmark = pytest.mark.skipif(shutil.which("postmap") is None,
                                reason="needs Postfix's postmap (./dev installs postfix)")

TEXT = """# classes by sender
Example.COM\tbulk
user@example.org    transactional
news@Example.ORG bulk
  continued on the next line
@example.net tenant-x
.example.net  sub
alice+promo@example.com    promo
a.example one
A.example two
novalue
bücher.example  umlaut
example.com.au\tau   with   spaces
"""
KEYS = ["example.com", "EXAMPLE.com", "user@example.org", "USER@EXAMPLE.ORG",
        "news@example.org", "@example.net", ".example.net", "x.example.net",
        "alice+promo@example.com", "alice@example.com", "a.example", "novalue",
        "bücher.example", "example.com.au", "missing.example", ""]


@pytest.fixture
def cf(tmp_path):
    """A config directory of its own for postmap (no /etc/postfix here)."""
    (tmp_path / "main.cf").write_text("")
    return str(tmp_path)


def postmap_q(cf: str, key: str, spec: str) -> str | None:
    proc = subprocess.run(["postmap", "-c", cf, "-q", key, spec], capture_output=True,
                          text=True, timeout=30, check=False)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.stdout.rstrip("\n") if proc.returncode == 0 else None


def agree(cf: str, spec: str, keys: list[str]) -> None:
    table = open_table(spec, cf)
    for key in keys:
        if not key:
            continue  # postmap -q refuses an empty key; nothing to compare
        assert table.get(key) == postmap_q(cf, key, spec), (spec, key)


def test_texthash_answers_as_postmap(cf, tmp_path):
    path = tmp_path / "classes"
    path.write_text(TEXT)
    spec = f"texthash:{path}"
    agree(cf, spec, KEYS)
    table = open_table(spec, cf)
    assert table.get("news@example.org") == "bulk  continued on the next line"
    # What postmap warns of, pyqmgr notes too: the duplicate and the key alone.
    proc = subprocess.run(["postmap", "-c", cf, "-q", "x", spec], capture_output=True,
                          text=True, timeout=30, check=False)
    theirs = {w.split(", line ")[1].split(":")[0] for w in proc.stderr.splitlines()
              if ", line " in w}
    ours = {w.split(", line ")[1].split(":")[0] for w in table.warnings}
    assert ours == theirs == {"10", "11"}, (table.warnings, proc.stderr)


def test_hash_is_read_through_postmap_s(cf, tmp_path):
    path = tmp_path / "classes"
    path.write_text(TEXT)
    subprocess.run(["postmap", "-c", cf, f"hash:{path}"], check=True, capture_output=True,
                   timeout=30)
    agree(cf, f"hash:{path}", KEYS)


def test_inline_and_static(cf):
    spec = "inline:{ Foo=bar, {Baz = q u x}, {comma = a,b} , last=1 }"
    agree(cf, spec, ["foo", "FOO", "baz", "comma", "last", "nope"])
    agree(cf, "static:transactional", ["anything", "x@y"])
    agree(cf, "static:{ two words }", ["anything"])


def test_cidr_answers_as_postmap(cf, tmp_path):
    path = tmp_path / "clients"
    path.write_text("# clients\n192.168.0.0/16  lan\n10.0.0.1 one\n!10.0.0.0/8 not-ten\n"
                    "[2001:db8::]/32\tv6\n10.1.0.0/8 bad-host-bits\n203.0.113.0/24 doc\n")
    spec = f"cidr:{path}"
    agree(cf, spec, ["192.168.3.4", "10.0.0.1", "10.0.0.2", "8.8.8.8", "2001:db8::5",
                     "2001:db9::1", "203.0.113.9", "not-an-address"])
    assert any("line 6" in w for w in open_table(spec, cf).warnings)


def test_a_table_that_cannot_be_used_says_why(cf, tmp_path, monkeypatch):
    with pytest.raises(LookupTableError, match="cannot read .*/absent"):
        open_table(f"texthash:{tmp_path}/absent", cf)
    with pytest.raises(LookupTableError, match="must be absolute"):
        open_table("texthash:relative/path", cf)
    with pytest.raises(LookupTableError, match="expected type:name"):
        open_table("/etc/postfix/classes", cf)
    with pytest.raises(LookupTableError, match="regexp tables are not supported"):
        open_table(f"regexp:{tmp_path}/r", cf)
    # An indexed table never built: postmap's own complaint.
    (tmp_path / "unbuilt").write_text("a b\n")
    with pytest.raises(LookupTableError, match=r"hash:.*unbuilt: postmap -s: .*unbuilt"):
        open_table(f"hash:{tmp_path}/unbuilt", cf)
    big = tmp_path / "big"
    big.write_text("k v\n" * 100)
    monkeypatch.setattr(lookup_table, "MAX_TABLE_BYTES", 64)
    with pytest.raises(LookupTableError, match="larger than 64 bytes"):
        open_table(f"texthash:{big}", cf)
    with pytest.raises(LookupTableError, match=r"expected inline:\{"):
        open_table("inline:a=b", cf)


def test_garbage_and_huge_lines_are_read_without_harm(cf, tmp_path):
    path = tmp_path / "garbage"
    path.write_bytes(b"\x00\xff\xfe key\n" + b"k" * 100_000 + b" v\n"
                     + b"ok value\n\n\n  \t\n#\n")
    table = open_table(f"texthash:{path}", cf)
    assert table.get("ok") == "value" and table.get("k" * 100_000) == "v"
    assert os.path.getsize(path) < lookup_table.MAX_TABLE_BYTES


def test_an_address_is_looked_up_in_access5_order():
    assert address_keys("Alice+promo@Mail.Example.COM") == [
        "Alice+promo@Mail.Example.COM", "Alice@mail.example.com", "mail.example.com",
        ".example.com", ".com", "Alice+promo@", "Alice@"]
    assert address_keys("bob@example.org") == ["bob@example.org", "example.org", ".org",
                                               "bob@"]
    assert address_keys("") == [""], "the null sender is itself alone"
    assert address_keys("postmaster") == ["postmaster", "postmaster@"]
    assert address_keys("+x@example.org")[:2] == ["+x@example.org", "example.org"], \
        "a delimiter first is no extension"


def test_a_table_file_that_blocks_costs_the_timeout_not_a_hang(cf, tmp_path):
    """hash:/path whose .db is a FIFO: Postfix's own postmap blocks opening it; the
    read gives up after its bound with a message that says so (the daemon then logs
    it, and the table's mail takes the defaults)."""
    os.mkfifo(tmp_path / "stuck.db")
    began = time.monotonic()
    with pytest.raises(LookupTableError, match=r"stuck: postmap -s did not finish in 1 s"):
        open_table(f"hash:{tmp_path}/stuck", cf, timeout=1.0)
    took = time.monotonic() - began
    print(f"\ngave up after {took:.2f} s")
    assert took < 3.0


def test_an_oversized_listing_is_refused_by_its_size(cf, tmp_path, monkeypatch):
    path = tmp_path / "big"
    path.write_text("".join(f"k{i} v\n" for i in range(1000)))
    subprocess.run(["postmap", "-c", cf, f"hash:{path}"], check=True, capture_output=True)
    monkeypatch.setattr(lookup_table, "MAX_TABLE_BYTES", 1000)
    with pytest.raises(LookupTableError, match="larger than 1000 bytes"):
        open_table(f"hash:{path}", cf)
    monkeypatch.setattr(lookup_table, "MAX_TABLE_BYTES", 64 << 20)
    assert open_table(f"hash:{path}", cf).get("k999") == "v"
