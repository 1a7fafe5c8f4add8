"""Sender-written class and tenant keys count only for trusted clients (issue #45).

A sender address and a message's headers are what the sending client wrote: read from
anyone's mail they let a stranger put a newsletter ahead of all bulk or pick a tenant.
These tests drive the classifier and Postfix's address match list syntax directly;
tests/test_sender_key_trust_real.py sends the same mail over SMTP to real Postfix.
"""

from __future__ import annotations

import os

import pytest

from pyqmgr.postfix.addr_match_list import addr_match_list
from pyqmgr.pyqmgr_cf import PyqmgrCfError, from_text
from pyqmgr.settings.classes import NO_TENANT, Envelope, classifier

CLASSES = ("message_classes = transactional bulk\n"
           "message_class_maps = inline:{ alerts@shop.example=transactional, "
           "urgent=transactional }\n")
MYNETWORKS = "127.0.0.0/8 [::1]/128 192.0.2.0/24"


def make(text: str, mynetworks: str | None = MYNETWORKS, warned: list[str] | None = None):
    out = warned if warned is not None else []
    found = classifier(from_text(text, "pyqmgr.cf"), out.append, mynetworks=mynetworks)
    assert found is not None
    return found


def test_a_sender_key_counts_for_local_authenticated_and_mynetworks_clients_only():
    c = make(CLASSES + "tenant_key = sender_domain\n")
    alerts = "alerts@shop.example"
    assert c.classify(Envelope(sender=alerts)) == (0, "shop.example"), "local submission"
    assert c.classify(Envelope(sender=alerts, client_address="192.0.2.9")) == \
        (0, "shop.example"), "mynetworks"
    assert c.classify(Envelope(sender=alerts, client_address="203.0.113.5",
                               sasl_username="shop")) == (0, "shop.example"), "SASL"
    assert c.untrusted == 0
    assert c.classify(Envelope(sender=alerts, client_address="203.0.113.5")) == \
        (1, NO_TENANT), "an outsider: the default class and tenant"
    assert c.classify(Envelope(sender=alerts, client_address="2001:db8::5")) == \
        (1, NO_TENANT)
    assert c.untrusted == 2, "each such message counted"
    c.classify(Envelope(sender=alerts, client_address="203.0.113.5"), count=False)
    assert c.untrusted == 2, "a look into incoming/ is not a message loaded"


def test_a_header_key_is_not_even_read_for_an_outsider():
    c = make("message_classes = transactional bulk\nmessage_class_key = header:X-Priority\n"
             "message_class_maps = inline:{ urgent=transactional }\n"
             "tenant_key = header:X-Tenant\n")
    assert c.header_names == {"x-priority", "x-tenant"}
    heads = {"x-priority": "urgent", "x-tenant": "acme"}
    assert c.classify(Envelope(client_address="192.0.2.1", headers=heads)) == (0, "acme")
    outsider = Envelope(client_address="198.51.100.1", headers=heads)
    assert not c.trusts(outsider)
    assert c.classify(outsider) == (1, NO_TENANT)


def test_keys_the_client_owns_count_for_everyone():
    c = make("message_classes = transactional bulk\nmessage_class_key = sasl_username\n"
             "message_class_maps = inline:{ shop=transactional }\n"
             "tenant_key = client_address\n")
    assert not c.sender_keys
    env = Envelope(client_address="198.51.100.1", sasl_username="shop")
    assert c.trusts(env)
    assert c.classify(env) == (0, "198.51.100.1")
    assert c.untrusted == 0


def test_mixed_keys_set_aside_only_the_sender_written_one():
    c = make(CLASSES + "tenant_key = client_address\n")
    env = Envelope(sender="alerts@shop.example", client_address="198.51.100.1")
    assert c.classify(env) == (1, "198.51.100.1")


@pytest.mark.parametrize(("setting", "client", "sasl", "trusted"), [
    ("all", "198.51.100.1", "", True),
    ("mynetworks", "", "", False),          # local mail: only with "local"
    ("local", "", "", True),
    ("local", "192.0.2.1", "shop", False),  # SASL: only with sasl_authenticated
    ("sasl_authenticated", "198.51.100.1", "shop", True),
    ("198.51.100.0/24", "198.51.100.77", "", True),
    ("[2001:db8::]/32", "2001:db8:1::2", "", True),
    ("[2001:db8::]/32", "::ffff:198.51.100.1", "", False),
    ("198.51.100.0/24", "::ffff:198.51.100.1", "", True),  # an IPv4-mapped client
    ("!198.51.100.7 198.51.100.0/24", "198.51.100.7", "", False),
    ("inline:{ 198.51.100.9=ok }", "198.51.100.9", "", True),
    ("relay.example.com", "198.51.100.1", "", False),  # a host name: no match
])
def test_the_setting_words_and_patterns(setting, client, sasl, trusted):
    c = make(CLASSES + f"sender_keys_trusted_clients = {setting}\n")
    env = Envelope(sender="alerts@shop.example", client_address=client, sasl_username=sasl)
    assert c.trusts(env) is trusted


def test_a_pattern_not_understood_is_a_warning_and_trusts_nobody(tmp_path):
    warned: list[str] = []
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    c = make(CLASSES + f"sender_keys_trusted_clients = relay.example.com, {fifo}, "
             f"{tmp_path}/absent, 10.0.0.1/8\n", warned=warned)
    text = "\n".join(warned)
    assert "relay.example.com" in text and "not an address" in text
    assert f"{fifo} is not a regular file" in text, "a FIFO is refused, not waited on"
    assert "absent" in text
    assert "non-null host address bits in '10.0.0.1/8'" in text
    assert c.trusts(Envelope(client_address="10.2.3.4")), "the network it belongs to"
    assert not c.trusts(Envelope(client_address="198.51.100.1"))


def test_a_list_file_is_read_with_comments(tmp_path):
    listed = tmp_path / "relays"
    listed.write_text("# our relays\n198.51.100.0/28\n  [2001:db8::1]  # v6\n")
    found = addr_match_list(f"{listed}, 203.0.113.1", "test")
    assert found.warnings == []
    assert [found.match(a) for a in ("198.51.100.3", "198.51.100.16", "2001:db8::1",
                                      "[2001:db8::1]", "203.0.113.1", "unknown")] == \
        [True, False, True, True, True, False]


def test_without_a_sender_key_the_setting_is_a_mistake():
    with pytest.raises(PyqmgrCfError, match="sender_keys_trusted_clients"):
        make("tenant_key = client_address\nsender_keys_trusted_clients = all\n")


def test_no_mynetworks_known_means_the_word_matches_nobody():
    c = make(CLASSES, mynetworks=None)
    assert not c.trusts(Envelope(sender="a@b.example", client_address="127.0.0.1"))
    assert c.trusts(Envelope(sender="a@b.example"))


def test_read_as_root_a_fifo_or_a_strangers_file_refuses_start_up(tables_dir):
    """The list says whose mail may pick its class: as every file pyqmgr.cf names,
    one anyone but root could change is refused, and a FIFO is not waited on."""
    from dataclasses import replace  # noqa: PLC0415

    from pyqmgr.trust import UntrustedError  # noqa: PLC0415

    fifo = tables_dir / "relays.fifo"
    os.mkfifo(fifo)
    theirs = tables_dir / "relays.nobody"
    theirs.write_text("0.0.0.0/0\n")
    os.chown(theirs, 65534, 65534)
    good = tables_dir / "relays"
    good.write_text("198.51.100.0/24\n")
    for bad, why in ((fifo, "is a FIFO"), (theirs, "owned by uid 65534"),
                     (f"cidr:{theirs}", "owned by uid 65534")):
        settings = replace(from_text(CLASSES + f"sender_keys_trusted_clients = {bad}\n",
                                     str(tables_dir / "pyqmgr.cf")), read_as_root=True)
        with pytest.raises(UntrustedError, match=why) as err:
            classifier(settings, lambda text: None, mynetworks=MYNETWORKS)
        assert str(bad).removeprefix("cidr:") in str(err.value)
    settings = replace(from_text(CLASSES + f"sender_keys_trusted_clients = {good}\n",
                                 str(tables_dir / "pyqmgr.cf")), read_as_root=True)
    c = classifier(settings, lambda text: None, mynetworks=MYNETWORKS)
    assert c is not None and c.trusts(Envelope(client_address="198.51.100.8"))


def test_unlisted_tenants_past_the_limit_share_one_turn_and_are_said():
    warned: list[str] = []
    c = make("tenant_key = sender_domain\nunlisted_tenant_limit = 3\n", warned=warned)

    def enter(domain: str) -> str:
        return c.admit(c.classify(Envelope(sender=f"x@{domain}"))[1])

    assert [enter(d) for d in ("a.example", "b.example", "c.example")] == \
        ["a.example", "b.example", "c.example"]
    assert enter("a.example") == "a.example", "a tenant already there is not new"
    sprayed = [enter(f"r{i}.example") for i in range(25)]
    assert set(sprayed) == {"_other"}, "a new domain per message: one tenant, one turn"
    assert c.folded == 25
    assert len(warned) == 2 and "unlisted_tenant_limit (3) reached" in warned[0]
    assert "(10 messages so far)" in warned[1], "said again at 1, 10, 100... only"
    assert enter("") == "-" and "-" not in c.live, "no key (a bounce): not counted"
    c.left("b.example")
    assert enter("d.example") == "d.example", "room again once a tenant's mail left"
    c.left("_other")
    assert sorted(c.live) == ["a.example", "c.example", "d.example"]


def test_the_limit_is_a_mistake_without_unlisted_tenants():
    with pytest.raises(PyqmgrCfError, match="unlisted_tenant_limit"):
        make("message_classes = a b\nunlisted_tenant_limit = 5\n")
    with pytest.raises(PyqmgrCfError, match="tenant_maps names the tenants"):
        make("tenant_key = sender_domain\ntenant_maps = inline:{ a=b }\n"
             "unlisted_tenant_limit = 5\n")


def test_an_oversized_list_file_is_a_warning_and_trusts_nobody(tmp_path):
    from pyqmgr.postfix.addr_match_list import MAX_FILE_BYTES  # noqa: PLC0415

    big = tmp_path / "relays"
    big.write_text("198.51.100.0/24\n" + "#" * MAX_FILE_BYTES + "\n")
    found = addr_match_list(str(big), "test")
    assert any("larger than" in w for w in found.warnings), found.warnings
    assert not found.match("198.51.100.1")
