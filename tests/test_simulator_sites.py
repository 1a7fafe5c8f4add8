"""Sites in the simulator (issue #33): the scenario's ``mx`` is the DNS.

tests/data/sites-one-server.toml is the issue's case (fifty domains at one
server of 5 sessions, 2,000 messages); ``./dev bench sites`` runs it on real Postfix
(stock 97.8% deferred on the first try, pyqmgr with sites 0%). The simulator must
agree in kind: destinations naming one MX host share its server, and the core's
site follows them. compat/workloads/sites-one-server.toml is the same case scaled
down, which compare runs on real Postfix with real MX records.
"""

from __future__ import annotations

import os
import tomllib

import pytest

from pyqmgr.simulator.engine import simulate
from pyqmgr.simulator.scenario import ScenarioError, parse

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOAD = os.path.join(HERE, "data", "sites-one-server.toml")


def data() -> dict:
    with open(WORKLOAD, "rb") as f:
        return tomllib.load(f)


def test_fifty_domains_at_one_server_stock_and_sites():
    d = data()
    sites = simulate(parse(d, os.path.dirname(WORKLOAD)))
    del d["pyqmgr_cf"]
    stock = simulate(parse(d, os.path.dirname(WORKLOAD)))
    n = 2000
    stock_deferred = sum(stock.deferred.values())
    print(f"\nsimulated: stock {stock_deferred / n:.1%} deferred, sites "
          f"{sum(sites.deferred.values()) / n:.1%}")
    assert stock_deferred > 0.9 * n, "one server's 5 sessions shared by fifty destinations"
    assert sum(sites.deferred.values()) == 0 and sum(sites.sent.values()) == n
    # 2,000 messages, 50 ms each, five at a time: the server's own pace.
    assert max(sites.delays.get("d0.example", [0])) <= 2000 * 0.05 / 5 + 1


def test_destinations_without_mx_keep_servers_of_their_own():
    d = data()
    for dest in d["destinations"].values():
        del dest["mx"]
    res = simulate(parse(d, os.path.dirname(WORKLOAD)))
    assert sum(res.deferred.values()) == 0, "fifty servers of five: no 421 at all"


def test_a_bad_site_setting_is_a_scenario_error():
    d = data()
    d["pyqmgr_cf"]["site_concurrency_limit"] = "lots"
    with pytest.raises(ScenarioError, match=r"pyqmgr_cf.site_concurrency_limit: bad "
                                            "numerical value"):
        simulate(parse(d, os.path.dirname(WORKLOAD)))


def test_a_fleet_of_three_counts_the_sites_sessions_together():
    """``fleet_site_concurrency_limit``: three servers, one site of one server of 5."""
    d = data()
    d["fleet"] = {"servers": 3}
    d["pyqmgr_cf"] = {"site_grouping": "mx", "fleet_site_concurrency_limit": "5"}
    fleet = simulate(parse(d, os.path.dirname(WORKLOAD)))
    d["pyqmgr_cf"] = {"site_grouping": "mx", "site_concurrency_limit": "5"}
    alone = simulate(parse(d, os.path.dirname(WORKLOAD)))
    n = 2000
    print(f"\nthree servers: each its own site limit of 5, "
          f"{sum(alone.deferred.values()) / n:.1%} deferred; the fleet's site limit of 5, "
          f"{sum(fleet.deferred.values()) / n:.1%}")
    assert sum(alone.deferred.values()) > 0.5 * n, "15 sessions at a server of 5"
    assert sum(fleet.deferred.values()) == 0 and sum(fleet.sent.values()) == n
