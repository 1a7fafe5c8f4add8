"""Site names from MX host sets, and the provider table (issue #33)."""

from __future__ import annotations

import pytest

from pyqmgr.site_names import (
    MAX_MX,
    SHIPPED,
    Providers,
    ProviderTableError,
    load_providers,
    mx_site_name,
    normal_host,
    replied_from_site,
    reply_host,
    site_hosts,
    site_name,
)

GMAIL = [(5, "gmail-smtp-in.l.google.com."), (10, "alt1.gmail-smtp-in.l.google.com."),
         (20, "alt2.gmail-smtp-in.l.google.com."), (30, "alt3.gmail-smtp-in.l.google.com."),
         (40, "alt4.gmail-smtp-in.l.google.com.")]


def test_a_host_set_is_named_by_its_common_suffix():
    assert mx_site_name(h for _, h in GMAIL) == \
        "(alt1|alt2|alt3|alt4)?.gmail-smtp-in.l.google.com"
    assert mx_site_name(["mx2.example.net", "MX1.Example.NET."]) == "(mx1|mx2).example.net"
    assert mx_site_name(["a.example", "b.other"]) == "(a.example|b.other)"
    assert mx_site_name(["mx.example.net"]) == "mx.example.net"
    assert mx_site_name([]) is None and mx_site_name(["."]) is None


def test_the_name_does_not_depend_on_order_or_case():
    hosts = [h for _, h in GMAIL]
    assert mx_site_name(hosts) == mx_site_name(reversed([h.upper() for h in hosts]))


def test_two_domains_with_one_mx_set_are_one_site_without_a_table():
    empty = Providers()
    other = [(p, h) for p, h in reversed(GMAIL)]
    assert site_name(GMAIL, empty) == site_name(other, empty)


def test_the_shipped_table_names_the_big_providers():
    table = load_providers(["builtin"])
    assert site_name(GMAIL, table) == "google"
    assert site_name([(0, "example-com.mail.protection.outlook.com")], table) == "microsoft"
    assert site_name([(0, "hotmail-com.olc.protection.outlook.com")], table) == "microsoft"
    assert site_name([(1, "mta5.am0.yahoodns.net")], table) == "yahoo"
    assert site_name([(10, "mx.example.org")], table) == "mx.example.org"
    assert table.provider("notgoogle.com") is None, "a suffix matches whole labels"


def test_a_provider_names_a_site_only_when_every_host_is_its():
    """Issue #45: a stranger's domain with its own tarpit first and Google's host
    after it was in site ``google`` and held Google's sessions while smtp(8) waited
    on the tarpit. Now a domain that mixes hosts is a site of its own making."""
    table = load_providers(["builtin"])
    assert site_name(GMAIL, table) == "google"
    tarpit = [(0, "tarpit.attacker.example"), (99, "aspmx.l.google.com")]
    assert site_name(tarpit, table) == "(aspmx.l.google.com|tarpit.attacker.example)"
    assert site_name([(10, "aspmx.l.google.com"), (10, "mx.attacker.example")],
                     table) != "google", "equal preferences: smtp(8) picks either"
    assert site_name([(0, "aspmx.l.google.com"), (99, "tarpit.attacker.example")],
                     table) != "google", "a worse preference reaches it all the same"
    two = Providers({"pphosted.com": "proofpoint", "google.com": "google"})
    mx = [(20, "aspmx.l.google.com"), (10, "mx0a-001.pphosted.com")]
    assert site_name(mx, two) == "(aspmx.l.google|mx0a-001.pphosted).com"


def test_a_host_set_padded_past_the_cut_is_not_the_set_it_pads():
    """Without a provider table Google's customers are the site of Google's host set;
    32 of Google's hosts and a tarpit after them must not be that site."""
    google = [(i, f"alt{i}.aspmx.l.google.com") for i in range(MAX_MX)]
    plain = site_name(google, Providers())
    padded = site_name([*google, (99, "tarpit.attacker.example")], Providers())
    assert plain is not None and "+" not in plain
    assert padded == plain + "+1"
    assert site_name([*google, *google], Providers()) == plain, "a host twice is one host"


def test_an_admins_table_overrides_and_the_longest_suffix_wins(tmp_path):
    mine = tmp_path / "providers"
    mine.write_text("# ours\ngoogle.com  g-suite\nmx.example.net  mine  # inline comment\n"
                    "example.net  theirs\n")
    table = load_providers(["builtin", str(mine)])
    assert site_name(GMAIL, table) == "g-suite"
    assert table.provider("a.mx.example.net") == "mine"
    assert table.provider("b.example.net") == "theirs"


@pytest.mark.parametrize("line", ["google.com", "google.com a b", "..com x", "a..b x"])
def test_a_bad_table_line_says_where(line):
    with pytest.raises(ProviderTableError, match=r"t, line 2"):
        Providers.parse("# x\n" + line, "t")


def test_an_oversized_table_is_refused(tmp_path):
    big = tmp_path / "big"
    big.write_text("# " + "x" * (1 << 20) + "\n")
    with pytest.raises(ProviderTableError, match="larger than"):
        load_providers([str(big)])


def test_five_hundred_mx_records_name_a_site_of_the_most_preferred():
    mx = [(i, f"mx{i}.example.net") for i in range(500)]
    name = site_name(mx, Providers())
    assert name is not None and name.count("|") == MAX_MX - 1 and "mx0|" in name
    assert name.endswith(f"+{500 - MAX_MX}")
    assert len(name) < 2048


def test_the_shipped_table_parses_and_is_documented():
    with open(SHIPPED) as f:
        text = f.read()
    assert text.startswith("# pyqmgr's provider table")
    assert len(Providers.parse(text, SHIPPED).by_suffix) >= 20


@pytest.mark.parametrize("reason, host", [
    ("host alt1.aspmx.l.google.com[192.0.2.1] said: 421 4.7.28 unusual rate",
     "alt1.aspmx.l.google.com"),
    ("host MX.Example.NET[2001:db8::1] refused to talk to me: 421 too many", "mx.example.net"),
    ("connect to mx.example.net[192.0.2.1]:25: Connection refused", "mx.example.net"),
    ("lost connection with mx.example.net[192.0.2.1] while receiving the initial server "
     "greeting", "mx.example.net"),
    ("conversation with mx.example.net[192.0.2.1] timed out while sending end of data",
     "mx.example.net"),
    ("Host or domain name not found. Name service error for name=x.example type=MX", None),
    ("", None),
])
def test_the_replying_host_is_read_from_smtps_text(reason, host):
    assert reply_host(reason) == host


def test_a_host_set_name_reads_back_into_its_hosts():
    for mx in (GMAIL, [(0, "mx1.example.net"), (0, "mx2.example.net")],
               [(0, "a.example"), (1, "b.other")], [(0, "mx.example.net")]):
        hosts = {normal_host(h) for _, h in mx}
        name = mx_site_name(hosts)
        assert name is not None and site_hosts(name) == hosts, name
    assert site_hosts("(a.example|b.other)+3") == {"a.example", "b.other"}


def test_a_reply_speaks_for_a_site_only_from_its_own_hosts():
    table = load_providers(["builtin"])
    said = "host {}[192.0.2.1] said: 421 4.7.0 [TS01] temporarily deferred"
    assert replied_from_site("google", said.format("alt2.gmail-smtp-in.l.google.com"), table)
    assert not replied_from_site("google", said.format("tarpit.attacker.example"), table)
    assert not replied_from_site("google", "Name service error for name=x", table)
    sset = "(mx1|mx2).example.net"
    assert replied_from_site(sset, said.format("mx2.example.net"), Providers())
    assert not replied_from_site(sset, said.format("mx3.example.net"), Providers())
    # A gateway's reply may be its customer's own: it never speaks for the site.
    assert "proofpoint" in table.gateways and "google" not in table.gateways
    assert not replied_from_site("proofpoint", said.format("mx0a-001.pphosted.com"), table)


def test_an_admins_line_without_gateway_makes_a_gateway_a_provider_again(tmp_path):
    mine = tmp_path / "providers"
    mine.write_text("pphosted.com  proofpoint\nexample.net  hosting  gateway\n")
    table = load_providers(["builtin", str(mine)])
    assert "proofpoint" not in table.gateways and "hosting" in table.gateways
