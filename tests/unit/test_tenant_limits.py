"""pyqmgr.cf's tenant limits checked at start-up (issue #34): a limit the core could
not read would quietly be no limit."""

from __future__ import annotations

import pytest

from pyqmgr.daemon.tenant_limits import check
from pyqmgr.pyqmgr_cf import PyqmgrCfError, from_text


def run(text: str, tenant_key: str = "sender_domain", sites: bool = True) -> list[str]:
    said: list[str] = []
    check(from_text(text), tenant_key, sites, said.append)
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
