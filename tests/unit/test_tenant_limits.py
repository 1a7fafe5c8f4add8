"""pyqmgr.cf's tenant limits read once at start-up (issues #34, #44): every form
checked, a bad one a start-up error, and the typed table what the core makes each
transport's caps from (it once read the strings again, and took what it could not
read as no limit)."""

from __future__ import annotations

import pytest

from pyqmgr.pyqmgr_cf import PyqmgrCfError, from_text
from pyqmgr.scheduler.tenant_cap import TenantLimits, caps_for
from pyqmgr.settings.tenants import tenant_limits


def run(text: str, tenant_key: str = "sender_domain", sites: bool = True) -> list[str]:
    said: list[str] = []
    tenant_limits(from_text(text), tenant_key, sites, said.append)
    return said


@pytest.mark.parametrize("line", [
    "tenant_concurrency_limit = 5", "smtp_tenant_site_concurrency_limit = 10",
    "tenant_rate = 10/1s", "smtp_tenant_rate = 600/h", "tenant_site_rate = 1/200ms",
    "tenant_rate = 0"])
def test_good_values_pass(line):
    assert run(line) == []


@pytest.mark.parametrize(("line", "says"), [
    ("tenant_concurrency_limit = -1", "tenant_concurrency_limit"),
    ("smtp_tenant_site_concurrency_limit = 5k", "smtp_tenant_site_concurrency_limit"),
    ("tenant_site_concurrency_limit = 10001", "tenant_site_concurrency_limit"),
    ("tenant_rate = fast", "tenant_rate.*N/PERIOD"),
    ("smtp_tenant_rate = 10/x", "smtp_tenant_rate"),
    ("tenant_site_rate = 0/1s", "tenant_site_rate.*count"),
    ("tenant_rate = " + "9" * 5000 + "/1s", "tenant_rate"),
])
def test_bad_values_are_start_up_errors_naming_the_line(line, says):
    with pytest.raises(PyqmgrCfError, match=says):
        run(line)


def test_limits_without_tenants_are_refused():
    with pytest.raises(PyqmgrCfError, match="tenant_rate.*without tenant_key"):
        run("tenant_rate = 5/1s", tenant_key="none")


def test_a_site_limit_without_sites_is_a_warning():
    said = run("tenant_site_rate = 5/1s", sites=False)
    assert len(said) == 1 and "per destination" in said[0]
    assert run("tenant_rate = 5/1s", sites=False) == []


def test_other_parameters_are_not_taken_for_limits():
    assert run("site_rate = junk\nsmtp_destination_rate_delay = 1s") == []


def test_the_table_holds_each_transport_s_limits_global_values_beneath():
    """A transport form wins for its parameter only; the others stay the global ones,
    as Postfix's naming rule reads each parameter on its own."""
    table = tenant_limits(from_text("tenant_concurrency_limit = 5\ntenant_rate = 10/1s\n"
                                    "smtp_tenant_rate = 600/h\n"
                                    "relay_tenant_site_concurrency_limit = +3\n"),
                          "sender_domain", True, lambda text: None)
    assert table is not None
    assert table.for_transport("local") == TenantLimits(5, 0, 0.1, 0.0)
    assert table.for_transport("smtp") == TenantLimits(5, 0, 6.0, 0.0)
    # "+3" is a number as Postfix reads one (strtol): the limit, not "no limit".
    assert table.for_transport("relay") == TenantLimits(5, 3, 0.1, 0.0)


def test_no_limit_set_is_no_table_and_no_caps():
    assert tenant_limits(from_text("tenant_key = sender"), "sender", True,
                         lambda text: None) is None
    table = tenant_limits(from_text("smtp_tenant_concurrency_limit = 2"), "sender", True,
                          lambda text: None)
    assert caps_for(table, "relay") is None and caps_for(None, "smtp") is None
    caps = caps_for(table, "smtp")
    assert caps is not None and caps.limit == 2
    # The retry, error and held transports never have caps.
    assert all(caps_for(table, t) is None for t in ("retry", "error", "pyqmgr-held"))
