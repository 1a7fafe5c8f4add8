"""pyqmgr.cf's site settings (issue #33): off by default, each mistake named."""

from __future__ import annotations

import pytest

from pyqmgr.pyqmgr_cf import PyqmgrCfError, from_text
from pyqmgr.settings.sites import site_settings

COMMANDS = {"smtp": "smtp", "relay": "smtp", "lmtp": "lmtp", "local": "local",
            "retry": "error"}


def settings(text: str, relayhost: str = ""):
    return site_settings(from_text(text, "pyqmgr.cf"), COMMANDS, relayhost)


def test_off_unless_grouping_is_mx():
    assert settings("") is None
    assert settings("site_grouping = none\n") is None


def test_the_smtp_and_lmtp_transports_are_grouped_with_per_transport_limits():
    s = settings("site_grouping = mx\nsite_concurrency_limit = 20\n"
                 "relay_site_concurrency_limit = 5\n", relayhost="[relay.example]:587")
    assert s is not None
    assert sorted(s.limits) == ["lmtp", "relay", "smtp"]
    assert s.limits["smtp"].concurrency == 20 and s.limits["relay"].concurrency == 5
    assert s.limits["relay"].setting == "relay_site_concurrency_limit in pyqmgr.cf"
    assert s.limits["smtp"].setting == "site_concurrency_limit in pyqmgr.cf"
    assert s.skip == frozenset({"[relay.example]:587"})
    assert s.providers.provider("aspmx.l.google.com") == "google"
    assert (s.timeout, s.negative_ttl, s.max_ttl, s.lookups) == (5.0, 300.0, 86400.0, 16)


def test_a_site_rate_per_transport():
    s = settings("site_grouping = mx\nsite_rate = 10/1s\nrelay_site_rate = 1/2s\n")
    assert s is not None
    smtp, relay = s.limits["smtp"].shaping, s.limits["relay"].shaping
    assert smtp is not None and smtp.rate is not None and smtp.rate.interval == 0.1
    assert relay is not None and relay.rate is not None and relay.rate.interval == 2.0
    assert s.limits["relay"].rate_setting == "relay_site_rate in pyqmgr.cf"
    lmtp = s.limits["lmtp"].shaping
    assert lmtp is not None and lmtp.rate == smtp.rate
    with pytest.raises(PyqmgrCfError, match=r"parameter smtp_site_rate: "):
        settings("site_grouping = mx\nsmtp_site_rate = fast\n")


def test_transports_named_and_dns_knobs():
    s = settings("site_grouping = mx\nsite_transports = smtp\nsite_dns_timeout = 2s\n"
                 "site_dns_negative_ttl = 1m\nsite_dns_max_ttl = 1h\nsite_dns_lookups = 4\n")
    assert s is not None and list(s.limits) == ["smtp"]
    assert (s.timeout, s.negative_ttl, s.max_ttl, s.lookups) == (2.0, 60.0, 3600.0, 4)


def test_pins_and_an_own_provider_table(tmp_path):
    pins = tmp_path / "pins"
    pins.write_text("example.org  google\n")
    table = tmp_path / "providers"
    table.write_text("mx.example.net  ours\n")
    s = settings(f"site_grouping = mx\nsite_pins = {pins}\n"
                 f"site_providers = builtin, {table}\n")
    assert s is not None and s.pins == {"example.org": "google"}
    assert s.providers.provider("a.mx.example.net") == "ours"
    assert s.table().pinned == {"example.org": "google"}


@pytest.mark.parametrize(("text", "says"), [
    ("site_grouping = dns\n", r"parameter site_grouping: \"dns\" is not one of: none, mx"),
    ("site_grouping = mx\nsite_transports = nosuch\n",
     r"parameter site_transports: no master.cf unix service 'nosuch'"),
    ("site_grouping = mx\nsite_concurrency_limit = -1\n",
     r"parameter site_concurrency_limit: value -1 is out of range"),
    ("site_grouping = mx\nsmtp_site_concurrency_limit = lots\n",
     r"parameter smtp_site_concurrency_limit: bad numerical value"),
    ("site_grouping = mx\nsite_dns_timeout = soon\n", r"parameter site_dns_timeout: bad duration"),
    ("site_grouping = mx\nsite_dns_lookups = 0\n", r"parameter site_dns_lookups: value 0"),
    ("site_grouping = mx\nsite_providers = /nonexistent/providers\n",
     r"parameter site_providers: .*No such file"),
    ("site_grouping = mx\nsite_pins = /nonexistent/pins\n", r"parameter site_pins: .*No such"),
])
def test_a_bad_setting_is_named(text, says):
    with pytest.raises(PyqmgrCfError, match=says):
        settings(text)


def test_a_bad_pin_line_is_named(tmp_path):
    pins = tmp_path / "pins"
    pins.write_text("example.org\n")
    with pytest.raises(PyqmgrCfError, match=r"parameter site_pins: .*pins, line 1: expected"):
        settings(f"site_grouping = mx\nsite_pins = {pins}\n")


def test_an_oversized_pin_file_is_refused_not_cut(tmp_path):
    pins = tmp_path / "pins"
    line = "example.org  google\n"
    pins.write_text(line * ((1 << 20) // len(line) + 1))
    with pytest.raises(PyqmgrCfError, match=r"parameter site_pins: .*pins: larger than "
                                            "1048576 bytes"):
        settings(f"site_grouping = mx\nsite_pins = {pins}\n")


def test_site_dead_scope():
    s = settings("site_grouping = mx\nrelay_site_dead_scope = site\n")
    assert s is not None and s.limits["relay"].dead_takes_site
    assert not s.limits["smtp"].dead_takes_site
    with pytest.raises(PyqmgrCfError, match=r'parameter site_dead_scope: "all" is not one'):
        settings("site_grouping = mx\nsite_dead_scope = all\n")


def test_sites_with_limits_of_their_own(tmp_path):
    table = tmp_path / "site-limits"
    table.write_text("# provider caps\nGoogle  20\nmicrosoft 10\n")
    got = settings(f"site_grouping = mx\nsite_concurrency_limit_maps = texthash:{table}, "
                   "inline:{ google=99, yahoo=5 }\n")
    assert got is not None and got.own_limits == {"google": 20, "microsoft": 10, "yahoo": 5}
    assert got.table().own_limits == got.own_limits


@pytest.mark.parametrize("value, says", [
    ("inline:{ google=many }", "google: 'many' is not a limit from 0 to 100000"),
    ("inline:{ google=100001 }", "is not a limit"),
    ("texthash:/nonexistent/site-limits", "cannot read /nonexistent/site-limits"),
    ("cidr:/etc/hostname", "expected a table of site names"),
    ("regexp:/etc/x", "regexp tables are not supported"),
])
def test_a_bad_site_limit_table_is_a_start_up_error(value, says):
    with pytest.raises(PyqmgrCfError, match=f"parameter site_concurrency_limit_maps: .*{says}"):
        settings(f"site_grouping = mx\nsite_concurrency_limit_maps = {value}\n")
