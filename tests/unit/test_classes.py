"""Message classes and tenants from pyqmgr.cf and lookup tables (issue #34): off by
default, access(5)'s order for senders, bad tables a warning with mail on defaults."""

from __future__ import annotations

import pytest

from pyqmgr.pyqmgr_cf import PyqmgrCfError, from_text
from pyqmgr.settings.classes import NO_TENANT, Envelope, classifier
from pyqmgr.settings.tenants import tenant_limits


def make(text: str, warned: list[str] | None = None):
    out = warned if warned is not None else []
    return classifier(from_text(text, "pyqmgr.cf"), out.append)


def test_off_unless_classes_or_a_tenant_key_is_set():
    assert make("") is None
    assert make("tenant_key = none\n") is None


def test_a_sender_finds_its_class_in_access5_order(tmp_path):
    table = tmp_path / "classes"
    table.write_text("resets@shop.example  transactional\n"
                     "news.shop.example    bulk\n"
                     ".lists.example       bulk\n"
                     "alerts@              transactional\n")
    c = make(f"message_classes = transactional bulk\n"
             f"message_class_maps = texthash:{table}\n")
    assert c is not None

    def rank(sender: str) -> int:
        return c.classify(Envelope(sender=sender))[0]

    assert rank("resets@shop.example") == 0
    assert rank("resets+x@shop.example") == 0, "the address without its extension"
    assert rank("anyone@news.shop.example") == 1, "the domain"
    assert rank("x@deep.lists.example") == 1, "a parent domain, with its leading dot"
    assert rank("alerts@anywhere.example") == 0, "user@"
    assert rank("someone@else.example") == 1, "no entry: the default, the last class"
    assert rank("") == 1, "the null sender"


def test_the_first_table_that_knows_the_key_wins_and_the_default_can_be_named():
    c = make("message_classes = transactional bulk\n"
             "message_class_maps = inline:{ shop.example=bulk }, "
             "inline:{ resets@shop.example=transactional, other.example=transactional }\n"
             "default_message_class = transactional\n")
    assert c is not None
    assert c.classify(Envelope(sender="resets@shop.example"))[0] == 1, \
        "the first table's domain entry before the second table's address"
    assert c.classify(Envelope(sender="x@nowhere.example"))[0] == 0


def test_other_keys_sasl_login_and_client_address(tmp_path):
    nets = tmp_path / "clients"
    nets.write_text("10.1.0.0/16 bulk\n")
    c = make(f"message_classes = transactional bulk\nmessage_class_key = client_address\n"
             f"message_class_maps = cidr:{nets}\ndefault_message_class = transactional\n")
    assert c is not None
    assert c.classify(Envelope(client_address="10.1.2.3"))[0] == 1
    assert c.classify(Envelope(client_address="192.0.2.1"))[0] == 0
    c = make("message_classes = a b\nmessage_class_key = sasl_username\n"
             "message_class_maps = inline:{ newsletter-bot=b, app=a }\n")
    assert c is not None
    assert c.classify(Envelope(sasl_username="app"))[0] == 0
    assert c.classify(Envelope(sasl_username=""))[0] == 1


def test_tenants_by_sender_domain_or_from_a_table():
    c = make("tenant_key = sender_domain\n")
    assert c is not None
    assert c.classify(Envelope(sender="a@Acme.Example"))[1] == "acme.example"
    assert c.classify(Envelope(sender=""))[1] == NO_TENANT
    c = make("tenant_key = sasl_username\n"
             "tenant_maps = inline:{ acme-app=acme, acme-news=acme, beta=beta }\n")
    assert c is not None
    assert c.classify(Envelope(sasl_username="acme-news"))[1] == "acme"
    assert c.classify(Envelope(sasl_username="stranger"))[1] == NO_TENANT
    assert c.classify(Envelope(sasl_username="x" * 10_000))[1] == NO_TENANT


def test_bad_tables_are_a_warning_and_mail_takes_the_defaults(tmp_path):
    warned: list[str] = []
    bad = tmp_path / "classes"
    bad.write_text("shop.example  urgent\nnews.example bulk\nkeyonly\n")
    c = make(f"message_classes = transactional bulk\n"
             f"message_class_maps = texthash:{tmp_path}/missing, texthash:{bad}, "
             f"regexp:{tmp_path}/r\n", warned)
    assert c is not None
    assert c.classify(Envelope(sender="a@news.example"))[0] == 1
    for _ in range(3):
        assert c.classify(Envelope(sender="a@shop.example"))[0] == 1
    text = "\n".join(warned)
    assert "texthash:" in text and "missing: cannot read" in text
    assert "regexp tables are not supported" in text
    assert "line 3: expected format" in text
    assert text.count("'urgent'") == 1, "an unknown class is said once"


@pytest.mark.parametrize("text, says", [
    ("message_classes = a b a\n", "message_classes: a class is named twice"),
    ("message_classes = a b\ndefault_message_class = c\n",
     "default_message_class: 'c' is not one of message_classes"),
    ("message_classes = a\nmessage_class_key = header\n", "message_class_key: expected"),
    ("tenant_key = login\n", "tenant_key: expected one of"),
    ("message_class_maps = inline:{ a=b }\n", "has no effect without message_classes"),
    ("tenant_maps = inline:{ a=b }\n", "tenant_maps: has no effect without tenant_key"),
])
def test_mistakes_in_the_parameters_are_start_up_errors(text, says):
    with pytest.raises(PyqmgrCfError, match=says):
        make(text)


def test_a_maps_value_splits_at_commas_and_spaces_outside_braces():
    from pyqmgr.postfix.lookup_table import table_specs
    assert table_specs("inline:{ a=b, {c = d e} }, texthash:/x  cidr:/y,static:{ z z }") \
        == ["inline:{ a=b, {c = d e} }", "texthash:/x", "cidr:/y", "static:{ z z }"]
    assert table_specs("") == [] and table_specs(" , ") == []


def test_each_lower_class_leaves_the_reserve_to_the_ones_above():
    c = make("message_classes = transactional normal bulk\n")
    assert c is not None and c.caps(20_000) == [20_000, 18_000, 16_000]
    c = make("message_classes = transactional bulk\nmessage_class_active_reserve = 25\n")
    assert c is not None and c.caps(100) == [100, 75]
    c = make("message_classes = a b c d\nmessage_class_active_reserve = 50\n")
    assert c is not None and c.caps(3) == [3, 2, 1, 1], "never below one message"


@pytest.mark.parametrize("text, name", [
    ("message_class_active_reserve = 10\n", "message_class_active_reserve"),
    ("message_classes = a b\nmessage_class_active_reserve = 51\n",
     "message_class_active_reserve"),
    ("message_classes = a b\nmessage_class_active_reserve = ten\n",
     "message_class_active_reserve"),
])
def test_a_bad_reserve_is_a_start_up_error(text, name):
    with pytest.raises(PyqmgrCfError, match=name):
        make(text)


def test_weights_from_a_table_and_a_bad_one_said_once():
    warned: list[str] = []
    c = make("tenant_key = sender_domain\n"
             "tenant_weight_maps = inline:{ acme.example=3, beta.example=x, big.example=5000 }\n",
             warned)
    assert c is not None
    assert c.weight("acme.example") == 3
    assert c.weight("other.example") == 1
    for _ in range(3):
        assert c.weight("beta.example") == 1
        assert c.weight("big.example") == 1
    assert len(warned) == 2 and "'beta.example' has weight 'x'" in warned[0], warned
    assert c.classify(Envelope(sender="a@acme.example"))[1] == "acme.example"


def test_no_tenant_key_no_tenant():
    c = make("message_classes = a b\n")
    assert c is not None and c.classify(Envelope(sender="a@acme.example"))[1] == ""
    with pytest.raises(PyqmgrCfError, match="tenant_weight_maps"):
        make("message_classes = a b\ntenant_weight_maps = inline:{ a=2 }\n")


@pytest.mark.parametrize("text, name", [
    ("tenant_key = sender_domain\ntenant_concurrency_limit = many\n",
     "tenant_concurrency_limit"),
    ("tenant_key = sender_domain\nsmtp_tenant_concurrency_limit = -1\n",
     "smtp_tenant_concurrency_limit"),
    ("message_classes = a b\ntenant_concurrency_limit = 5\n", "tenant_concurrency_limit"),
])
def test_a_bad_tenant_cap_is_a_start_up_error(text, name):
    """Read once, with the other tenant limits (settings/tenants.py), not again here."""
    cf = from_text(text, "pyqmgr.cf")
    with pytest.raises(PyqmgrCfError, match=name):
        tenant_limits(cf, (cf.get("tenant_key") or "none").strip(), True, print)


def test_a_tenant_cap_is_read():
    assert make("tenant_key = sender_domain\nsmtp_tenant_concurrency_limit = 4\n")
    table = tenant_limits(from_text("tenant_key = sender_domain\n"
                                    "smtp_tenant_concurrency_limit = 4\n"),
                          "sender_domain", True, print)
    assert table is not None and table.for_transport("smtp").limit == 4


def test_a_header_names_the_class_and_the_tenant():
    c = make("message_classes = transactional bulk\n"
             "message_class_key = header:X-Priority\n"
             "message_class_maps = inline:{ urgent=transactional }\n"
             "tenant_key = header:X-Tenant\n")
    assert c is not None and c.header_names == {"x-priority", "x-tenant"}
    env = Envelope("a@b.example", headers={"x-priority": "urgent", "x-tenant": "acme"})
    assert c.classify(env) == (0, "acme")
    assert c.classify(Envelope("a@b.example")) == (1, NO_TENANT), "no header: defaults"
    assert c.classify(Envelope(headers={"x-priority": "URGENT"})) == (0, NO_TENANT)


@pytest.mark.parametrize("line", ["tenant_key = header:", "tenant_key = header:X Tenant",
                                  "tenant_key = header:a:b",
                                  "tenant_key = header:" + "x" * 101])
def test_a_bad_header_name_is_a_start_up_error(line):
    with pytest.raises(PyqmgrCfError, match="tenant_key: expected"):
        make(line + "\n")


def test_no_header_key_no_header_read():
    c = make("tenant_key = sender_domain\n")
    assert c is not None and c.header_names == frozenset()
