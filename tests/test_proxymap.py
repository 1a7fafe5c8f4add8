"""proxymap(8) tables for classes and tenants (issue #34): ``proxy:TYPE:NAME`` asked
key by key through a real proxymap, its answers checked against Postfix's own
``postmap -q``; and a proxymap that misbehaves (a server of the test's own on a
socket: the one place a fake peer is right)."""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import threading
import time

import pytest

from pyqmgr.postfix.attr import encode
from pyqmgr.postfix.lookup_table import LookupTableError, open_table
from pyqmgr.postfix.proxymap import (
    BACKOFF,
    ProxymapClient,
    ProxymapError,
    ProxyTable,
)
from pyqmgr.testbed.instance import PostfixInstance, free_port
from pyqmgr.testbed.sink import SinkServer
from tests.test_metrics_real import scrape

REGEXP = ("/^resets@shop\\.example$/  transactional\n"
          "/@news\\./                  bulk\n"
          "/^(alerts)@/               transactional\n")
KEYS = ["resets@shop.example", "RESETS@shop.example", "a@news.example", "alerts@x.example",
        "nobody@else.example", "resets@shop.example.evil"]


def test_a_real_proxymap_answers_as_postmap(postfix_instance, readable):
    tmp_path = readable
    regexp = tmp_path / "classes.regexp"
    regexp.write_text(REGEXP)
    hashed = tmp_path / "tenants"
    hashed.write_text("shop.example acme\nnews.example newsco\n")
    pf: PostfixInstance = postfix_instance(
        qmgr="stock", main_cf={"proxy_read_maps": f"proxy:regexp:{regexp} proxy:hash:{hashed}"})
    pf.run(["postmap", "-c", pf.config_dir, f"hash:{hashed}"])
    sock = os.path.join(pf.queue_dir, "private", "proxymap")
    warned: list[str] = []
    for spec, keys in ((f"regexp:{regexp}", KEYS), (f"hash:{hashed}",
                                                    ["shop.example", "SHOP.example",
                                                     "news.example", "x.example"])):
        table = open_table(f"proxy:{spec}", warn=warned.append, proxymap=sock)
        assert table.fixed == spec.startswith("hash:"), "pattern tables get whole keys"
        for key in keys:
            want = subprocess.run(["postmap", "-c", pf.config_dir, "-q", key, spec],
                                  capture_output=True, text=True)
            expected = want.stdout.strip() if want.returncode == 0 else None
            assert table.get(key) == expected, (spec, key)
    assert warned == []
    # A table proxymap does not serve: said at once, naming the parameter.
    other = tmp_path / "other.regexp"
    other.write_text(REGEXP)
    with pytest.raises(LookupTableError, match="proxy_read_maps"):
        open_table(f"proxy:regexp:{other}", proxymap=sock)


def test_pyqmgr_classifies_through_proxymap(postfix_instance, sink, readable):
    """message_class_maps = proxy:regexp:... on real Postfix: the resets are
    transactional, the newsletter bulk, as the regexp says; a table proxymap refuses
    is one warning and mail takes the defaults."""
    tmp_path = readable
    regexp = tmp_path / "classes.regexp"
    regexp.write_text(REGEXP)
    refused = tmp_path / "refused.regexp"
    refused.write_text(REGEXP)
    srv: SinkServer = sink()
    port = free_port()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"dest.example": f"smtp:[127.0.0.1]:{srv.port}"},
        main_cf={"proxy_read_maps": f"proxy:regexp:{regexp}"},
        pyqmgr_cf={"message_classes": "transactional bulk",
                   "message_class_maps": f"proxy:regexp:{refused}, proxy:regexp:{regexp}",
                   "metrics_listen": str(port)})
    mail = [("resets@shop.example", ["r1@dest.example"]),
            ("resets@shop.example", ["r2@dest.example"]),
            ("a@news.example", ["n1@dest.example"]),
            ("someone@else.example", ["e1@dest.example"])]
    pf.smtp_send(mail)
    pf.wait_until(lambda: srv.delivered_count() >= len(mail), 60, "everything delivered")
    found = {ln.rpartition(" ")[0]: float(ln.rpartition(" ")[2])
             for ln in scrape(port).splitlines()
             if ln.startswith("pyqmgr_class_deliveries_total")}
    assert found['pyqmgr_class_deliveries_total{class="transactional",outcome="final"}'] == 2
    assert found['pyqmgr_class_deliveries_total{class="bulk",outcome="final"}'] == 2
    lines = [ln.text for ln in pf.maillog.lines() if "proxy_read_maps" in ln.text]
    print("\n" + "\n".join(lines))
    # proxymap's own warning, and pyqmgr's one line.
    mine = [ln for ln in lines if "classes: message_class_maps" in ln]
    assert len(mine) == 1 and "refused.regexp" in mine[0] and "defaults" in mine[0]


class FakeProxymap:
    """A proxymap that misbehaves as told: ``reply(request_attrs) -> bytes | None``
    (None: say nothing)."""

    def __init__(self, path: str, reply, announce: bytes = encode([("protocol",
                                                                     "proxymap_protocol")])):
        self.path = path
        self.reply = reply
        self.announce = announce
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen(8)
        self.conns: list[socket.socket] = []
        self.requests = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        from pyqmgr.postfix.attr import AttrParser  # noqa: PLC0415

        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.conns.append(conn)
            conn.sendall(self.announce)
            parser = AttrParser()
            try:
                while data := conn.recv(4096):
                    parser.feed(data)
                    while (attrs := parser.pop()) is not None:
                        self.requests += 1
                        out = self.reply(attrs)
                        if out is not None:
                            conn.sendall(out)
            except OSError:
                pass

    def close(self) -> None:
        self.server.close()
        for conn in self.conns:
            conn.close()


@pytest.fixture
def readable(tmp_path):
    """A directory proxymap (the mail owner, not root) can read: pytest's own
    tmp_path lies under a directory only root may enter."""
    path = tempfile.mkdtemp(prefix="pyqmgr-proxymap-")
    os.chmod(path, 0o755)
    yield pathlib.Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def fake(tmp_path):
    made: list[FakeProxymap] = []

    def make(reply, **kw) -> FakeProxymap:
        server = FakeProxymap(str(tmp_path / f"proxymap{len(made)}"), reply, **kw)
        made.append(server)
        return server

    yield make
    for server in made:
        server.close()


def _ok_open(attrs):
    if attrs[0][1] == "open":
        return encode([("status", 0), ("flags", 16)])
    return None


@pytest.mark.parametrize(("answer", "says"), [
    (b"status\x000\x00\x00", "missing attribute value"),                  # short
    (b"junk\x00junk\x00\x00", "missing attribute|unexpected attribute"),  # wrong names
    (encode([("status", "x"), ("value", "v")]), "bad integer"),          # bad number
    (encode([("status", 2), ("value", "")]), "try again"),               # RETRY
    (encode([("status", 5), ("value", "")]), "configuration"),           # CONFIG
    (encode([("status", 9), ("value", "")]), "unexpected status 9"),
    (b"status\x000\x00value\x00" + b"v" * (100 << 10), "longer than 65536"),  # oversized
    (None, "no answer in time"),                                          # silent
])
def test_a_misbehaving_proxymap_is_one_warning_and_then_quiet(fake, answer, says):
    server = fake(lambda a: _ok_open(a) or answer)
    warned: list[str] = []
    clock = [0.0]
    table = ProxyTable("regexp:/x", ProxymapClient(server.path, timeout=0.3),
                       warned.append, clock=lambda: clock[0])
    table.opened()
    began = time.monotonic()
    assert table.get("a@b.example") is None
    assert table.get("c@d.example") is None, "in its backoff: not asked again"
    took = time.monotonic() - began
    print(f"\n{warned} ({took:.2f} s)")
    assert len(warned) == 1
    import re  # noqa: PLC0415
    assert re.search(says, warned[0]), warned[0]
    assert "takes the defaults" in warned[0]
    assert took < 1.0, "one timeout at most for the episode"
    asked = server.requests
    clock[0] += BACKOFF + 1
    table.get("e@f.example")
    assert server.requests > asked, "asked again after the backoff"


def test_answers_are_cached(fake):
    server = fake(lambda a: _ok_open(a) or encode([("status", 0), ("value", "bulk")]))
    table = ProxyTable("hash:/x", ProxymapClient(server.path), lambda t: None)
    table.opened()
    assert [table.get("k") for _ in range(5)] == ["bulk"] * 5
    assert server.requests == 2, "one open, one lookup"


def test_no_server_is_a_start_up_error(tmp_path):
    with pytest.raises(LookupTableError, match="proxymap"):
        open_table("proxy:regexp:/x", proxymap=str(tmp_path / "absent"))
    with pytest.raises(LookupTableError, match="expected proxy:type:name"):
        open_table("proxy:nothing", proxymap=str(tmp_path / "absent"))


def test_a_wrong_announcement_is_refused(fake):
    server = fake(_ok_open, announce=encode([("protocol", "other_protocol")]))
    with pytest.raises(ProxymapError, match="unexpected protocol"):
        ProxymapClient(server.path, timeout=0.3).open("regexp:/x")
