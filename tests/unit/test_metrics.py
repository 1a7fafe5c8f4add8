"""Prometheus metrics without Postfix: settings, the core's counters, the collector.

The scheduler is built directly and driven through its events, the delivery counts are
fed as the daemon feeds them, and the exposition is read back with prometheus_client's
own parser, so what is checked is what a Prometheus server would store. The real
server scraping the real daemon is tests/test_metrics_real.py.
"""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pyqmgr.daemon.metrics import (
    AGE_BUCKETS,
    DeliveryStats,
    Histogram,
    MetricsSettings,
    delivery_transports,
    import_exporter,
    metrics_settings,
    parse_listen,
)
from pyqmgr.daemon.metrics_exporter import OTHER, registry_for
from pyqmgr.daemon.metrics_http import parse_request
from pyqmgr.pyqmgr_cf import PyqmgrCfError, from_text
from pyqmgr.scheduler.core import Route, Scheduler
from pyqmgr.scheduler.entry import Entry
from pyqmgr.scheduler.message import Message, Recipient
from pyqmgr.scheduler.queue import Dsn
from pyqmgr.trust import UntrustedError
from tests.unit.params import Params

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(s: Scheduler, stats: DeliveryStats | None = None, limit: int = 100,
            messages: int = 0) -> Samples:
    """Every sample of one scrape, by (name, sorted labels)."""
    source = SimpleNamespace(scheduler=s, message_count=messages)
    registry = registry_for(source, stats or DeliveryStats(), limit, process=False)
    text = generate_latest(registry).decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(found: Samples, name: str, **labels: str) -> float:
    return found[(name, tuple(sorted(labels.items())))]


def routes(n: int, dest: str = "d.example", transport: str = "smtp") -> list[Route]:
    return [Route(transport, dest, dest, Recipient(i, f"r{i}@{dest}")) for i in range(n)]


# -- settings -------------------------------------------------------------------------


def settings_of(text: str) -> MetricsSettings | None:
    return metrics_settings(from_text(text, "/etc/postfix/pyqmgr.cf"))


def test_metrics_are_off_without_metrics_listen():
    assert settings_of("") is None
    assert settings_of("metrics_listen =\nmetrics_destination_limit = 5\n") is None


@pytest.mark.parametrize("text, host, port", [
    ("9155", "127.0.0.1", 9155),
    (":9155", "127.0.0.1", 9155),
    ("127.0.0.1:9155", "127.0.0.1", 9155),
    ("localhost:9155", "127.0.0.1", 9155),
    ("127.0.0.53:9155", "127.0.0.53", 9155),
    ("[::1]:9155", "::1", 9155),
])
def test_listen_addresses_that_work(text, host, port):
    assert parse_listen(text) == (host, port)
    got = settings_of(f"metrics_listen = {text}\n")
    assert got == MetricsSettings(host, port, 100)


@pytest.mark.parametrize("text, why", [
    ("mail.example.com:9155", "not a numeric IP address"),
    ("127.0.0.1", "expected HOST:PORT or PORT"),
    ("127.0.0.1:80", "no port below 1024"),
    ("127.0.0.1:65536", "not a number in 1024..65535"),
    ("127.0.0.1:x", "not a number"),
    ("::1:9155", "in brackets"),
    ("[::1]9155", "expected [IPV6-ADDRESS]:PORT"),
    ("0.0.0.0:9155", "not a loopback address; set metrics_allow_remote = yes"),
    ("[::]:9155", "not a loopback address"),
    ("192.0.2.1:9155", "not a loopback address"),
])
def test_bad_listen_values_are_errors_naming_the_file_and_parameter(text, why):
    with pytest.raises(PyqmgrCfError) as err:
        settings_of(f"metrics_listen = {text}\n")
    message = str(err.value)
    assert message.startswith("/etc/postfix/pyqmgr.cf: parameter metrics_listen: "), message
    assert why in message


def test_remote_listening_is_an_explicit_choice():
    got = settings_of("metrics_listen = 0.0.0.0:9155\nmetrics_allow_remote = yes\n")
    assert got == MetricsSettings("0.0.0.0", 9155, 100)
    with pytest.raises(PyqmgrCfError, match="parameter metrics_allow_remote: bad boolean"):
        settings_of("metrics_listen = 0.0.0.0:9155\nmetrics_allow_remote = sure\n")


def test_destination_limit():
    assert settings_of("metrics_listen = 9155\nmetrics_destination_limit = 0\n") == (
        MetricsSettings("127.0.0.1", 9155, 0))
    for bad in ("-1", "10001", "lots"):
        with pytest.raises(PyqmgrCfError, match="parameter metrics_destination_limit"):
            settings_of(f"metrics_listen = 9155\nmetrics_destination_limit = {bad}\n")


def test_a_missing_library_is_an_error_naming_the_parameter(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(PyqmgrCfError) as err:
        import_exporter(from_text("metrics_listen = 9155\n", "/etc/postfix/pyqmgr.cf"))
    assert str(err.value).startswith(
        "/etc/postfix/pyqmgr.cf: parameter metrics_listen: the prometheus_client library "
        "does not load"), str(err.value)


def test_a_library_file_others_can_change_stops_the_start(tmp_path, monkeypatch):
    fake = tmp_path / "prometheus_client"
    fake.mkdir()
    init = fake / "__init__.py"
    init.write_text("raise SystemExit('must never run')\n")
    init.chmod(0o666)
    monkeypatch.delitem(sys.modules, "prometheus_client")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UntrustedError) as err:
        import_exporter(from_text("metrics_listen = 9155\n", "/etc/postfix/pyqmgr.cf"))
    assert any(str(init) in problem for problem in err.value.warnings + [str(err.value)])


MASTER_CF = """\
smtp      inet  n       -       y       -       -       smtpd
pickup    unix  n       -       y       60      1       pickup
cleanup   unix  n       -       y       -       0       cleanup
qmgr      unix  n       -       n       300     1       qmgr
smtp      unix  -       -       y       -       -       smtp
relay     unix  -       -       y       -       -       smtp
  -o syslog_name=postfix/$service_name
error     unix  -       -       y       -       -       error
retry     unix  -       -       y       -       -       error
discard   unix  -       -       y       -       -       discard
local     unix  -       n       n       -       -       local
bounce    unix  -       -       y       -       0       bounce
maildrop  unix  -       n       n       -       -       pipe
  flags=DRXhu user=vmail argv=/usr/bin/maildrop -d ${recipient}
#uucp     unix  -       n       n       -       -       pipe
"""


def test_master_cf_delivery_services_get_counters_from_the_start(tmp_path):
    (tmp_path / "master.cf").write_text(MASTER_CF)
    found = delivery_transports(str(tmp_path))
    assert found == ("discard", "error", "local", "maildrop", "relay", "retry", "smtp")
    assert delivery_transports(str(tmp_path / "nowhere")) == ()
    stats = DeliveryStats(transports=found)
    got = samples(Scheduler(lambda n: Params()), stats)
    assert value(got, "pyqmgr_deliveries_total", transport="maildrop", outcome="final") == 0
    # No histogram lines for a transport that has not replied yet.
    assert not [k for k in got if k[0].startswith("pyqmgr_delivery_latency_seconds")]


# -- the core's counters ----------------------------------------------------------------


def test_feedback_steps_and_a_destination_declared_dead():
    s = Scheduler(lambda n: Params(initial_destination_concurrency=2,
                                   destination_recipient_limit=1, failed_cohort_limit=2))
    s.assign(Message("Q1", 0.0), routes(10), now=0.0)
    t = s.transport("smtp")
    e = s.select("smtp", 0.0).deliver
    assert e is not None
    s.done(e, 0, None, False, 0.0)  # feedback 1: the window grows by one
    assert (t.feedback_up, t.feedback_down) == (1, 0)
    failing = [s.select("smtp", 1.0).deliver for _ in range(3)]
    s.done(failing[0], 1, Dsn("4.4.1", "connect refused"), False, 1.0)
    assert t.feedback_down >= 1 and t.destinations_died == 0
    for e in failing[1:]:
        s.done(e, 1, Dsn("4.4.1", "connect refused"), False, 1.0)
    assert t.destinations_died == 1
    found = samples(s)
    assert value(found, "pyqmgr_feedback_steps_total", transport="smtp",
                 direction="up") == 1
    assert value(found, "pyqmgr_feedback_steps_total", transport="smtp",
                 direction="down") == t.feedback_down
    assert value(found, "pyqmgr_destinations_declared_dead_total", transport="smtp") == 1
    assert value(found, "pyqmgr_destination_dead", transport="smtp",
                 destination="d.example") == 1


def test_preemptions_and_transport_deaths_are_counted():
    s = Scheduler(lambda n: Params(destination_recipient_limit=1,
                                   initial_destination_concurrency=1,
                                   destination_concurrency_limit=1,
                                   delivery_slot_cost=2, delivery_slot_loan=0,
                                   delivery_slot_discount=0))
    s.assign(Message("BIG", 0.0), routes(40, "big.example"), now=0.0)
    for _ in range(4):
        e = s.select("smtp", 0.0).deliver
        assert e is not None
        s.done(e, 0, None, False, 0.0)
    s.assign(Message("SMALL", 1.0), routes(2, "small.example"), now=1.0)
    e = s.select("smtp", 2.0).deliver
    assert e is not None and e.message.queue_id == "SMALL"
    assert s.transport("smtp").preemptions == 1
    s.allocation_failed("smtp", Dsn("4.3.0", "mail transport unavailable"), 3.0)
    s.allocation_failed("smtp", Dsn("4.3.0", "mail transport unavailable"), 3.5)
    found = samples(s)
    assert value(found, "pyqmgr_preemptions_total", transport="smtp") == 1
    assert value(found, "pyqmgr_transport_declared_dead_total", transport="smtp") == 1
    assert value(found, "pyqmgr_transport_dead", transport="smtp") == 1


# -- delivery counts ----------------------------------------------------------------------


def owned_message(qid: str, arrival: float) -> Message:
    sec = int(arrival)
    qf = SimpleNamespace(arrival_time=(sec, int((arrival - sec) * 1e6)))
    m = Message(qid, 0.0)
    m.owner = SimpleNamespace(qf=qf)
    return m


def test_outcomes_recipients_latency_and_age():
    now = 1_000_000.0
    stats = DeliveryStats(wall_clock=lambda: now)
    s = Scheduler(lambda n: Params(destination_recipient_limit=2))
    s.assign(owned_message("Q1", now - 90), routes(4, "a.example"), now=0.0)
    s.assign(owned_message("Q2", now - 3600), routes(1, "b.example", "relay"), now=0.0)
    a1, a2 = s.select("smtp", 0.0).deliver, s.select("smtp", 0.0).deliver
    b1 = s.select("relay", 0.0).deliver
    assert isinstance(a1, Entry) and isinstance(a2, Entry) and isinstance(b1, Entry)
    stats.delivery_done(a1, 0, 0.004)      # final, 2 recipients
    stats.delivery_done(a2, 1, 0.3)        # deferred, 2 recipients
    stats.delivery_done(b1, None, 2.0)     # crashed
    found = samples(s, stats)
    for transport, outcome, requests, rcpts in (("smtp", "final", 1, 2),
                                                ("smtp", "deferred", 1, 2),
                                                ("smtp", "crashed", 0, 0),
                                                ("relay", "crashed", 1, 1),
                                                ("relay", "final", 0, 0)):
        assert value(found, "pyqmgr_deliveries_total", transport=transport,
                     outcome=outcome) == requests
        assert value(found, "pyqmgr_delivery_recipients_total", transport=transport,
                     outcome=outcome) == rcpts
    lat = "pyqmgr_delivery_latency_seconds"
    assert value(found, lat + "_bucket", transport="smtp", le="0.005") == 1
    assert value(found, lat + "_bucket", transport="smtp", le="0.25") == 1
    assert value(found, lat + "_bucket", transport="smtp", le="0.5") == 2
    assert value(found, lat + "_count", transport="smtp") == 2
    assert value(found, lat + "_sum", transport="smtp") == pytest.approx(0.304)
    age = "pyqmgr_message_age_at_delivery_seconds"
    # Only the final reply has an age: 90 s, in qshape's first column (5 minutes).
    assert value(found, age + "_bucket", transport="smtp", le="300.0") == 1
    assert value(found, age + "_count", transport="smtp") == 1
    assert value(found, age + "_sum", transport="smtp") == pytest.approx(90.0)
    assert value(found, age + "_count", transport="relay") == 0


def test_histogram_buckets_are_le_and_qshapes():
    h = Histogram(AGE_BUCKETS)
    assert AGE_BUCKETS == (300, 600, 1200, 2400, 4800, 9600, 19200, 38400, 76800)
    for v in (0.0, 300.0, 300.5, 76800.0, 1e9):
        h.observe(v)
    assert h.cumulative()[0] == (300, 2)
    assert h.cumulative()[1] == (600, 3)
    assert h.cumulative()[-2] == (76800, 4)
    assert h.cumulative()[-1] == (float("inf"), 5) and h.count == 5


def test_a_broken_entry_is_counted_as_an_error_not_raised():
    stats = DeliveryStats()
    stats.delivery_done(SimpleNamespace(), 0, 0.1)  # type: ignore[arg-type]
    assert stats.errors == 1


# -- gauges and cardinality ------------------------------------------------------------


def test_gauges_per_transport_and_destination():
    s = Scheduler(lambda n: Params(destination_recipient_limit=1,
                                   initial_destination_concurrency=3),
                  process_limit_for=lambda name: 7)
    s.assign(Message("Q1", 0.0), routes(5, "a.example") + routes(2, "b.example"), now=0.0)
    for _ in range(2):
        assert s.select("smtp", 0.0).deliver is not None
    found = samples(s, messages=1)
    in_flight = {d: value(found, "pyqmgr_destination_in_flight", transport="smtp",
                          destination=d) for d in ("a.example", "b.example")}
    queued = {d: value(found, "pyqmgr_destination_queued_recipients", transport="smtp",
                       destination=d) for d in ("a.example", "b.example")}
    assert sum(in_flight.values()) == 2 and sum(queued.values()) == 5
    assert value(found, "pyqmgr_destination_window", transport="smtp",
                 destination="a.example") == 3
    assert value(found, "pyqmgr_transport_in_flight", transport="smtp") == 2
    assert value(found, "pyqmgr_transport_queued_recipients", transport="smtp") == 5
    assert value(found, "pyqmgr_transport_window", transport="smtp") == 6
    assert value(found, "pyqmgr_transport_destinations", transport="smtp") == 2
    assert value(found, "pyqmgr_transport_process_limit", transport="smtp") == 7
    assert value(found, "pyqmgr_transport_destination_concurrency_limit",
                 transport="smtp") == 20
    assert value(found, "pyqmgr_active_messages") == 1
    assert value(found, "pyqmgr_active_recipients") == 7
    assert not [k for k in found if k[0] == "pyqmgr_destination_series_folded"]


def test_the_busiest_destinations_get_series_the_rest_one_aggregate():
    s = Scheduler(lambda n: Params(destination_recipient_limit=1))
    s.assign(Message("Q1", 0.0), routes(5, "big.example") + routes(3, "mid.example")
             + routes(1, "small.example") + routes(1, "tiny.example"), now=0.0)
    found = samples(s, limit=2)
    shown = {dict(labels)["destination"] for name, labels in found
             if name == "pyqmgr_destination_queued_recipients"}
    assert shown == {"big.example", "mid.example", OTHER}
    assert value(found, "pyqmgr_destination_queued_recipients", transport="smtp",
                 destination=OTHER) == 2
    assert value(found, "pyqmgr_destination_window", transport="smtp",
                 destination=OTHER) == 10
    assert value(found, "pyqmgr_destination_series_folded", transport="smtp") == 2
    # Totals per transport still count every destination.
    assert value(found, "pyqmgr_transport_queued_recipients", transport="smtp") == 10
    nothing = samples(s, limit=0)
    assert {dict(labels)["destination"] for name, labels in nothing
            if name == "pyqmgr_destination_window"} == {OTHER}


def test_idle_destinations_have_no_series():
    s = Scheduler(lambda n: Params(destination_recipient_limit=1))
    s.assign(Message("Q1", 0.0), routes(1, "a.example"), now=0.0)
    e = s.select("smtp", 0.0).deliver
    assert e is not None
    assert ("pyqmgr_destination_in_flight", (("destination", "a.example"),
                                             ("transport", "smtp"))) in samples(s)
    s.done(e, 0, None, False, 0.0)
    assert not [k for k in samples(s) if k[0] == "pyqmgr_destination_in_flight"]


def test_100000_destinations_make_a_small_exposition_quickly():
    s = Scheduler(lambda n: Params(destination_recipient_limit=1))
    n = 100_000
    for k in range(10):
        part = range(k * n // 10, (k + 1) * n // 10)
        s.assign(Message(f"Q{k}", 0.0),
                 [Route("smtp", f"d{i}.example", f"d{i}.example",
                        Recipient(i, f"r@d{i}.example")) for i in part], now=0.0)
    s.assign(Message("BUSY", 0.0), routes(50, "busy.example"), now=0.0)
    assert s.queue_count == n + 1
    source = SimpleNamespace(scheduler=s, message_count=11)
    registry = registry_for(source, DeliveryStats(), 100, process=False)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        text = generate_latest(registry)
        best = min(best, time.perf_counter() - started)
    lines = text.count(b"\n")
    print(f"100,000 destinations: {len(text)} bytes, {lines} lines, built in "
          f"{best * 1000:.0f} ms")
    assert len(text) < 64 * 1024 and lines < 700
    series = [ln for ln in text.decode().splitlines()
              if ln.startswith("pyqmgr_destination_window{")]
    assert len(series) == 101  # the limit, plus _other
    assert any('destination="busy.example"' in ln for ln in series)
    # About 0.05 s on the 2-core CI machine; the bound leaves room for a loaded one.
    limit = float(os.environ.get("PYQMGR_METRICS_SCRAPE_LIMIT", "1.0"))
    assert best < limit


# -- HTTP requests -----------------------------------------------------------------------


@pytest.mark.parametrize("head, expected", [
    (b"GET /metrics HTTP/1.1\r\nHost: x", (200, "/metrics", False)),
    (b"GET /metrics?x=1 HTTP/1.0", (200, "/metrics", False)),
    (b"HEAD /metrics HTTP/1.0", (200, "/metrics", True)),
    (b"GET / HTTP/1.0", (404, "/", False)),
    (b"POST /metrics HTTP/1.0", (405, "/metrics", False)),
    (b"GET /metrics", (400, "", False)),
    (b"GET /metrics SPDY/3", (400, "", False)),
    (b"\x00\xff garbage", (400, "", False)),
    (b"GET /\xff HTTP/1.0", (400, "", False)),
])
def test_request_lines(head, expected):
    assert parse_request(head) == expected


def test_per_recipient_queues_are_one_series_per_nexthop_without_addresses():
    """Recipient limit 1: Postfix names each recipient's queue user@nexthop; the
    endpoint is anyone's on the machine, so no address is a label (issue #31)."""
    s = Scheduler(lambda n: Params(destination_recipient_limit=1,
                                   initial_destination_concurrency=3))
    s.assign(Message("Q1", 0.0),
             [Route("smtp", f"u{i}@d.example", "[mx.d.example]:25",
                    Recipient(i, f"u{i}@d.example")) for i in range(4)]
             + [Route("smtp", "v@e.example", "e.example", Recipient(9, "v@e.example"))],
             now=0.0)
    assert s.select("smtp", 0.0).deliver is not None
    found = samples(s)
    labels = {dict(k[1]).get("destination") for k in found}
    assert not [x for x in labels if x and "@" in x], labels
    assert value(found, "pyqmgr_destination_in_flight", transport="smtp",
                 destination="[mx.d.example]:25") + value(
        found, "pyqmgr_destination_queued_recipients", transport="smtp",
        destination="[mx.d.example]:25") == 4
    assert value(found, "pyqmgr_destination_window", transport="smtp",
                 destination="[mx.d.example]:25") == 12
    assert value(found, "pyqmgr_transport_destinations", transport="smtp") == 2


def test_sites_have_gauges_only_while_sites_are_on():
    from pyqmgr.scheduler.structures import SiteLimits, SiteTable

    plain = Scheduler(lambda n: Params())
    plain.assign(Message("Q0", 0.0), routes(1))
    assert not any(name.startswith("pyqmgr_site_") for name, _ in samples(plain))
    table = SiteTable(lambda t: SiteLimits(2, "site_concurrency_limit in pyqmgr.cf"),
                      pinned={"a.example": "google", "b.example": "google"})
    s = Scheduler(lambda n: Params(destination_recipient_limit=1), sites=table)
    for dest in ("a.example", "b.example"):
        s.assign(Message(f"Q{dest}", 0.0), routes(3, dest))
    while s.select("smtp", 0.0).deliver is not None:
        pass
    found = samples(s)
    labels = {"transport": "smtp", "site": "google"}
    assert value(found, "pyqmgr_site_in_flight", **labels) == 2
    assert value(found, "pyqmgr_site_limit", **labels) == 2
    assert value(found, "pyqmgr_site_destinations", **labels) == 2
    assert value(found, "pyqmgr_site_held", **labels) == 1


def test_deliveries_and_age_by_class_and_tenant_with_tenants_bounded():
    """Issue #34: the same counts by message class and by tenant; tenants past the
    limit are summed as _other (a sender domain each would be unbounded)."""
    now = 1_000_000.0
    stats = DeliveryStats(wall_clock=lambda: now, class_names=("transactional", "bulk"),
                          tenant_limit=2)
    s = Scheduler(lambda n: Params(destination_recipient_limit=1))
    for i, (rank, tenant) in enumerate([(0, "acme"), (1, "acme"), (1, "beta"),
                                        (1, "gamma"), (1, "delta")]):
        m = owned_message(f"Q{i}", now - 10 * (i + 1))
        m.rank, m.tenant = rank, tenant
        s.assign(m, routes(1, f"d{i}.example"), now=0.0)
    while (entry := s.select("smtp", 0.0).deliver) is not None:
        stats.delivery_done(entry, 0, 0.01)
    found = samples(s, stats)
    assert value(found, "pyqmgr_class_deliveries_total", outcome="final",
                 **{"class": "transactional"}) == 1
    assert value(found, "pyqmgr_class_deliveries_total", outcome="final",
                 **{"class": "bulk"}) == 4
    assert value(found, "pyqmgr_class_message_age_at_delivery_seconds_sum",
                 **{"class": "transactional"}) == pytest.approx(10.0)
    assert value(found, "pyqmgr_tenant_deliveries_total", tenant="acme",
                 outcome="final") == 2
    assert value(found, "pyqmgr_tenant_deliveries_total", tenant="beta",
                 outcome="final") == 1
    assert value(found, "pyqmgr_tenant_deliveries_total", tenant="_other",
                 outcome="final") == 2
    assert not any(labels and ("tenant", "gamma") in labels for _, labels in found)


def test_no_class_or_tenant_series_without_them():
    stats = DeliveryStats()
    s = Scheduler(lambda n: Params(destination_recipient_limit=1))
    s.assign(owned_message("Q1", 0.0), routes(1), now=0.0)
    entry = s.select("smtp", 0.0).deliver
    assert entry is not None
    stats.delivery_done(entry, 0, 0.01)
    assert not any(name.startswith(("pyqmgr_class_", "pyqmgr_tenant_"))
                   for name, _ in samples(s, stats))
