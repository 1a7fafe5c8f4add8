"""Sender-written class and tenant keys over real SMTP (issue #45): only mail from a
client the admin trusts picks its class and tenant by sender address or header.

Real Postfix relays for dest.example to a sink; main.cf's mynetworks is 127.0.0.1/32,
so a client connecting from 127.0.0.2 is outside it, as a stranger on the Internet
would be. smtpd offers AUTH through Cyrus SASL with a sasldb of one user, written by
Cyrus's own saslpasswd2. The same three messages go from the stranger without AUTH,
from the stranger after AUTH, and from inside mynetworks; the metrics say which class
and tenant each was delivered as. On the code before issue #45 the stranger's mail
was transactional and named its own tenant.
"""

from __future__ import annotations

import json
import os
import shutil
import smtplib
import subprocess

import pytest

from pyqmgr.testbed.instance import PostfixInstance, free_port
from pyqmgr.testbed.sink import SinkServer
from tests.test_control import cli
from tests.test_metrics_real import scrape

USER, PASSWORD, REALM = "shop", "s3cret-pass", "test.example"
OUTSIDE = "127.0.0.2"  # loopback, but not in mynetworks = 127.0.0.1/32

BY_SENDER = {"message_classes": "transactional bulk",
             "message_class_maps": "inline:{ alerts@shop.example=transactional }",
             "tenant_key": "sender_domain"}
BY_HEADER = {"message_classes": "transactional bulk",
             "message_class_key": "header:X-Priority",
             "message_class_maps": "inline:{ urgent=transactional }",
             "tenant_key": "header:X-Tenant"}


def _sasl(pf: PostfixInstance) -> None:
    """Cyrus SASL for smtpd: a sasldb made by saslpasswd2, PLAIN and LOGIN."""
    saslpasswd2 = shutil.which("saslpasswd2") or "/usr/sbin/saslpasswd2"
    if not os.path.exists(saslpasswd2):
        pytest.fail("saslpasswd2 is missing: ./dev installs sasl2-bin")
    conf = os.path.join(pf.config_dir, "sasl")
    os.makedirs(conf)
    db = os.path.join(conf, "sasldb2")
    subprocess.run([saslpasswd2, "-f", db, "-c", "-p", "-u", REALM, USER],
                   input=PASSWORD.encode(), check=True, timeout=30)
    os.chown(db, *pf.mail_owner_ids())
    with open(os.path.join(conf, "smtpd.conf"), "w") as f:
        f.write(f"pwcheck_method: auxprop\nauxprop_plugin: sasldb\nsasldb_path: {db}\n"
                "mech_list: PLAIN LOGIN\n")
    os.chmod(conf, 0o755)


def _send(pf: PostfixInstance, source: str, auth: bool, n: int, by_header: bool) -> None:
    with smtplib.SMTP("127.0.0.1", pf.smtpd_port, timeout=30,
                      source_address=(source, 0)) as smtp:
        smtp.ehlo("client.example")
        if auth:
            smtp.login(f"{USER}@{REALM}", PASSWORD)
        sender = "news@one.example" if by_header else "alerts@shop.example"
        head = [f"From: {sender}", f"To: r{n}@dest.example"]
        if by_header:
            head += ["X-Priority: urgent", "X-Tenant: acme"]
        raw = "\r\n".join(head) + "\r\n\r\nhi\r\n"
        smtp.sendmail(sender, [f"r{n}@dest.example"], raw.encode())


@pytest.mark.parametrize("by_header", [False, True], ids=["alerts@", "headers"])
def test_a_stranger_gets_the_defaults_and_a_trusted_client_the_table(
        postfix_instance, sink, by_header):
    srv: SinkServer = sink()
    port = free_port()
    pf: PostfixInstance = postfix_instance(
        start=False, qmgr="pyqmgr",
        transports={"dest.example": f"smtp:[127.0.0.1]:{srv.port}"},
        main_cf={"mynetworks": "127.0.0.1/32", "relay_domains": "dest.example",
                 "smtpd_relay_restrictions": "permit_mynetworks, "
                 "permit_sasl_authenticated, reject_unauth_destination",
                 "smtpd_recipient_restrictions": "permit",
                 "smtpd_sasl_auth_enable": "yes", "smtpd_sasl_type": "cyrus",
                 "smtpd_sasl_path": "smtpd", "smtpd_sasl_local_domain": REALM},
        pyqmgr_cf={**(BY_HEADER if by_header else BY_SENDER),
                   "metrics_listen": str(port)})
    pf.postconf("-e", f"cyrus_sasl_config_path = {os.path.join(pf.config_dir, 'sasl')}")
    _sasl(pf)
    pf.start()
    plan = [(OUTSIDE, False), (OUTSIDE, True), ("127.0.0.1", False)]
    for n, (source, auth) in enumerate(plan):
        _send(pf, source, auth, n, by_header)
    pf.wait_until(lambda: srv.delivered_count() >= len(plan), 60, "all three delivered")
    found: dict[str, float] = {}

    def counted() -> bool:
        found.clear()
        for line in scrape(port).splitlines():
            if line.startswith(("pyqmgr_class_deliveries_total", "pyqmgr_tenant_deliveries_"
                                "total", "pyqmgr_untrusted_sender_keys_messages_total")):
                found[line.rpartition(" ")[0]] = float(line.rpartition(" ")[2])
        return sum(v for k, v in found.items() if k.startswith("pyqmgr_class")
                   and 'outcome="final"' in k) >= len(plan)

    pf.wait_until(counted, 30, "the three deliveries counted by the scrape")
    status = cli(pf, "status").stdout
    print("\n" + "\n".join(f"{k} {v}" for k, v in found.items() if v) + "\n"
          + "\n".join(line for line in status.splitlines() if "sender-written" in line))
    assert found['pyqmgr_class_deliveries_total{class="transactional",outcome="final"}'] \
        == 2, "the authenticated stranger and the client in mynetworks"
    assert found['pyqmgr_class_deliveries_total{class="bulk",outcome="final"}'] == 1, \
        "the stranger without AUTH: the default class"
    tenant = "acme" if by_header else "shop.example"
    assert found[f'pyqmgr_tenant_deliveries_total{{outcome="final",tenant="{tenant}"}}'] \
        == 2
    assert found['pyqmgr_tenant_deliveries_total{outcome="final",tenant="-"}'] == 1
    assert found["pyqmgr_untrusted_sender_keys_messages_total"] == 1
    reply = json.loads(cli(pf, "status", "--json").stdout)["sender_keys"]
    assert reply == {"trusted_clients": "local sasl_authenticated mynetworks",
                     "untrusted_messages": 1}
    # smtpd's own record: the stranger authenticated from outside mynetworks.
    with open(pf.maillog_path, encoding="utf-8", errors="replace") as f:
        log = f.read()
    assert f"[{OUTSIDE}], sasl_method=PLAIN, sasl_username={USER}@{REALM}" in log, log[-3000:]


def test_a_new_tenant_per_message_gets_one_share_past_the_limit(postfix_instance, sink):
    """unlisted_tenant_limit = 3, tenant_key = header:X-Tenant, and a trusted client
    that names a new tenant in every message (30), while the sink holds each delivery
    a second: three tenants are named, every later message is tenant _other, the
    maillog says so and the metric counts them."""
    srv: SinkServer = sink(latency=1.0)
    port = free_port()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"dest.example": f"smtp:[127.0.0.1]:{srv.port}"},
        pyqmgr_cf={"tenant_key": "header:X-Tenant", "unlisted_tenant_limit": "3",
                   "metrics_listen": str(port)})
    n = 30
    with smtplib.SMTP("127.0.0.1", pf.smtpd_port, timeout=30) as smtp:
        for i in range(n):
            raw = (f"From: news@one.example\r\nTo: r{i}@dest.example\r\n"
                   f"X-Tenant: t{i}\r\n\r\nhi\r\n")
            smtp.sendmail("news@one.example", [f"r{i}@dest.example"], raw.encode())
    pf.wait_until(lambda: srv.delivered_count() >= n, 90, f"all {n} delivered")
    found: dict[str, float] = {}

    def counted() -> bool:
        found.clear()
        for line in scrape(port).splitlines():
            if line.startswith(("pyqmgr_tenant_deliveries_total",
                                "pyqmgr_unlisted_tenant_folded_messages_total")):
                found[line.rpartition(" ")[0]] = float(line.rpartition(" ")[2])
        return sum(v for k, v in found.items()
                   if k.startswith("pyqmgr_tenant") and 'outcome="final"' in k) >= n

    pf.wait_until(counted, 30, f"the {n} deliveries counted by the scrape")
    tenants = {k.partition('tenant="')[2].partition('"')[0]: v for k, v in found.items()
               if k.startswith("pyqmgr_tenant") and 'outcome="final"' in k and v}
    print(f"\n{tenants}")
    folded = found["pyqmgr_unlisted_tenant_folded_messages_total"]
    named = {t for t in tenants if t != "_other"}
    assert len(named) >= 3 and tenants.get("_other", 0) == folded >= n - 10, tenants
    with open(pf.maillog_path, encoding="utf-8", errors="replace") as f:
        log = f.read()
    assert "classes: unlisted_tenant_limit (3) reached: the mail of new tenants such as" \
        in log
