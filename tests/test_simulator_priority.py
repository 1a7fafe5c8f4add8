"""Classes and tenants in the simulator (issue #34): the scenario's [pyqmgr_cf] as the
daemon reads it, each message classified by its sender."""

from __future__ import annotations

import dataclasses
import os
import statistics

import pytest

from pyqmgr.simulator import load, simulate
from pyqmgr.simulator.scenario import ScenarioError

DATA = os.path.join(os.path.dirname(__file__), "data")


def _delays(sc, dest: str) -> list[float]:
    return simulate(sc).delays[dest]


def test_resets_go_before_the_newsletter_with_classes_and_not_without():
    sc = load(os.path.join(DATA, "priority.toml"))
    with_classes = _delays(sc, "yahoo.example")
    stock = _delays(dataclasses.replace(sc, pyqmgr_cf={}), "yahoo.example")
    print(f"\nresets' delay: stock median {statistics.median(stock):.1f} s, "
          f"with classes {statistics.median(with_classes):.2f} s")
    assert len(with_classes) == len(stock) == 20
    assert max(with_classes) < 0.5
    assert statistics.median(stock) > 10


def test_tenants_share_in_the_simulator():
    """Three sender domains in one class, one with ten times the mail: with
    tenant_key = sender_domain each gets a third while all have mail."""
    sc = load(os.path.join(DATA, "priority.toml"))
    messages = [dataclasses.replace(sc.messages[0], name=f"{d}", count=n,
                                    sender=f"news@{d}.example")
                for d, n in (("a", 1000), ("b", 100), ("c", 100))]
    sc = dataclasses.replace(sc, messages=messages, pyqmgr_cf={"tenant_key": "sender_domain"})
    res = simulate(sc)
    ends = {}
    for d in ("b", "c"):
        ends[d] = max(x.end for x in res.deliveries if x.message.startswith(d))
    cut = min(ends.values())
    share = {d: sum(1 for x in res.deliveries if x.message.startswith(d) and x.end <= cut)
             for d in "abc"}
    print(f"\nshares until the first light tenant was done: {share}")
    total = sum(share.values())
    for n in share.values():
        assert abs(n / total - 1 / 3) < 0.05, share


@pytest.mark.parametrize("cf, text", [
    ({"message_classes": "a b", "message_class_key": "sasl_username"},
     "message_class_key"),
    ({"tenant_key": "client_address"}, "tenant_key"),
    ({"message_classes": "a b", "message_class_maps": "texthash:no-such-table"},
     "cannot read"),
    # Tenant limits are read as the daemon reads them (issue #44): refused, not taken
    # for no limit.
    ({"tenant_key": "sender_domain", "smtp_tenant_rate": "fast"},
     r"pyqmgr_cf\.smtp_tenant_rate: .*N/PERIOD"),
    ({"tenant_rate": "5/1s"}, "tenant_rate: has no effect without tenant_key"),
])
def test_what_a_scenario_cannot_say_is_an_error(cf, text):
    sc = load(os.path.join(DATA, "priority.toml"))
    with pytest.raises(ScenarioError, match=text):
        simulate(dataclasses.replace(sc, pyqmgr_cf=cf))


def test_a_tenants_rate_in_the_simulator():
    """tenant_rate = 5/1s (issue #34): two sender domains of 50 messages each to one
    destination take about ten simulated seconds, side by side (each at its own 5 a
    second), where without the rate they take about one."""
    sc = load(os.path.join(DATA, "priority.toml"))
    messages = [dataclasses.replace(sc.messages[0], name=d, count=50,
                                    sender=f"news@{d}.example") for d in ("a", "b")]
    sc = dataclasses.replace(sc, messages=messages,
                             pyqmgr_cf={"tenant_key": "sender_domain"})
    free = simulate(sc)
    rated = simulate(dataclasses.replace(
        sc, pyqmgr_cf={"tenant_key": "sender_domain", "tenant_rate": "5/1s"}))
    print(f"\n100 messages: {free.end_time:.1f} s without the rate, "
          f"{rated.end_time:.1f} s with 5/1s a tenant")
    assert len(rated.delays["gmail.example"]) == 100
    assert free.end_time < 2.0
    assert 9.5 <= rated.end_time <= 11.0
