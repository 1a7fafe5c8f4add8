"""pyqmgr compare without Postfix: the workload format, its errors, the figures, the words.

The real runs are in tests/test_compare_real.py; here a synthetic maillog stands in for
one, so that each figure is checked against numbers worked out by hand.
"""

from __future__ import annotations

import glob
import json
import os

import pytest

from pyqmgr.cli import main
from pyqmgr.compare.contender import ContenderError, parse_contender, parse_contenders
from pyqmgr.compare.figures import parse_delivery, percentile, run_figures, steps
from pyqmgr.compare.plan import make_plan, parse_address
from pyqmgr.compare.report import build, differences, markdown, to_html
from pyqmgr.compare.runner import message_bytes
from pyqmgr.simulator import simulate
from pyqmgr.simulator.scenario import ScenarioError, load, locate, parse

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKLOADS = sorted(glob.glob(os.path.join(ROOT, "compat", "workloads", "*.toml")))


# -- the format: one file for simulate and compare ----------------------------------------

def test_nine_workloads_ship_and_every_one_runs_in_the_simulator():
    names = {os.path.basename(p) for p in WORKLOADS}
    assert names == {"limiter-421.toml", "bulk-and-small.toml", "inbound-gateway.toml",
                     "finch-big-envelopes.toml", "provider-rate-limit.toml", "dead-mx.toml",
                     "fleet-421.toml", "sites-one-server.toml", "priority.toml"}
    for path in WORKLOADS:
        sc = load(path)
        res = simulate(sc)
        assert res.deliveries, path
        plan = make_plan(sc)
        assert plan.recipients == sum(m.recipients * m.count for m in sc.messages)
        assert sc.compare.contenders, f"{path}: names its contenders"


def test_the_superset_keys(tmp_path):
    sc = parse({
        "destinations": {"a.example": {"latency": 0.1, "rcpt_4xx": 0.2, "rcpt_5xx": 0.1},
                         "b.example": {"dead": "timeout", "timeout": 5},
                         "c.example": {"dead": True}},
        "messages": [{"recipients": {"a.example": 3, "b.example": 2}, "class": "bulk",
                      "sender": "news@lists.example", "size": {"dist": "uniform",
                                                              "low": 100, "high": 200}},
                     {"at": 1, "count": 4, "every": 0.5, "destination": "c.example",
                      "name": "s1-"}],
        "compare": {"time_scale": 0.5, "timeout": 60, "contenders": ["stock"],
                    "main_cf": {"queue_run_delay": "1s"}},
    })
    assert sc.messages[0].spread == (("a.example", 3), ("b.example", 2))
    assert sc.messages[0].recipients == 5 and sc.messages[0].klass == "bulk"
    assert sc.messages[1].klass == "s1"  # from the name, trailing punctuation cut
    assert sc.destinations["b.example"].dead_mode == "timeout"
    assert sc.destinations["c.example"].dead_mode == "refused"
    plan = make_plan(sc)
    assert plan.main_cf["smtp_connect_timeout"] == "3s"  # 5 s x 0.5, whole seconds up
    assert plan.main_cf["queue_run_delay"] == "1s"
    assert plan.main_cf["minimal_backoff_time"] == "150s"  # Postfix's 300 s, scaled
    assert [a.at for a in plan.arrivals] == [0, 0.5, 0.75, 1.0, 1.25]
    first = plan.arrivals[0]
    assert first.recipients[0] == "bulk.m0.r0@a.example"
    assert first.recipients[3] == "bulk.m0.r3@b.example"
    assert parse_address(first.recipients[3]) == ("bulk", 0, 3, "b.example")
    assert 100 <= first.size <= 200 and first.sender == "news@lists.example"
    assert plan.sender_domains == ["lists.example", "senders.test.example"]
    assert plan.never_deliver() == {"b.example", "c.example"}
    # The simulator plays the new keys too: spread recipients, dead timeouts, 5xx.
    res = simulate(sc)
    assert res.deferred["b.example"] == 2
    assert sum(res.sent.values()) + sum(res.bounced.values()) + res.deferred.get(
        "a.example", 0) == 3
    timed_out = [d for d in res.deliveries if d.destination == "b.example"]
    assert timed_out and all(d.end - d.start == pytest.approx(5) for d in timed_out)


def test_the_message_body_has_the_size_asked_for():
    sc = parse({"destinations": {"a.example": {}},
                "messages": [{"destination": "a.example", "size": 5000}]})
    (a,) = make_plan(sc).arrivals
    assert abs(len(message_bytes(a)) - 5000) <= 80


BAD = [
    # (file text, the line the message must name, words it must contain)
    ('[destinations."a.example"]\nlatency = 1\nlatncy = 2\n\n[[messages]]\n'
     'destination = "a.example"\n', 3, "unknown key 'latncy'"),
    ('[destinations."a.example"]\n\n[[messages]]\ndestination = "a.example"\n\n'
     '[[messages]]\ndestination = "a.example"\ncount = "ten"\n', 8,
     "messages[1].count must be a whole number"),
    ('[destinations."a.example"]\nlatency = {dist = "gauss"}\n[[messages]]\n'
     'destination = "a.example"\n', 2, "unknown latency distribution 'gauss'"),
    ('[destinations."a.example"]\n\n[[messages]]\ndestination = "b.example"\n', 4,
     "unknown destination 'b.example'"),
    ('[destinations."a.example"]\nrcpt_4xx = 1.5\n[[messages]]\n'
     'destination = "a.example"\n', 2, "rcpt_4xx must be at most 1"),
    ('[destinations."a.example"]\nrate_reply = "250 ok"\n[[messages]]\n'
     'destination = "a.example"\n', 2, "must be an SMTP reply starting with a 4xx"),
    ('[destinations."a.example"]\n[[messages]]\ndestination = "a.example"\n'
     'class = "no-dash"\n', 4, "class 'no-dash' must be letters"),
    ('[compare]\ntime_scale = 0\n[destinations."a.example"]\n[[messages]]\n'
     'destination = "a.example"\n', 2, "time_scale must be more than 0"),
    ('title = "x"\n[destinations."a.example"]\nlatency = \n', 3, "not valid TOML"),
    ('[destinations."a.example"]\ndead = "maybe"\n[[messages]]\n'
     'destination = "a.example"\n', 2, 'must be true, false or "timeout"'),
    ('[compare.content_filter]\nlatency = -1\n[destinations."a.example"]\n[[messages]]\n'
     'destination = "a.example"\n', 2, "latency must be 0 or more"),
    ('[compare.content_filter]\nprocess_limit = 0\n[destinations."a.example"]\n'
     '[[messages]]\ndestination = "a.example"\n', 2, "process_limit must be at least 1"),
    ('[compare.content_filter]\nprocess_limit = 100000\n[destinations."a.example"]\n'
     '[[messages]]\ndestination = "a.example"\n', 2, "process_limit must be at most 1000"),
    ('[compare.content_filter]\nport = 10024\n[destinations."a.example"]\n'
     '[[messages]]\ndestination = "a.example"\n', 2, "unknown key"),
]


@pytest.mark.parametrize("text, line, words", BAD)
def test_a_bad_workload_names_the_line(tmp_path, capsys, text, line, words):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ScenarioError) as err:
        load(str(path))
    assert f"{path}, line {line}: " in str(err.value) and words in str(err.value)
    # Both commands say it the same way, and start nothing.
    assert main(["simulate", str(path)]) == 1
    assert main(["compare", str(path)]) == 1
    out = capsys.readouterr().err
    assert out.count(f"line {line}: ") == 2 and words in out


def test_what_real_postfix_cannot_play_is_refused_with_the_line(tmp_path, capsys):
    path = tmp_path / "w.toml"
    path.write_text('[destinations."a.example"]\nserver_limit = 5\n'
                    'overload = "connect-timeout"\n\n[[messages]]\ndestination = "a.example"\n')
    load(str(path))  # the simulator plays it
    assert main(["compare", str(path)]) == 1
    assert f"{path}, line 3: " in capsys.readouterr().err
    path.write_text('[destinations."a.example"]\ntimeout = 5\n[destinations."b.example"]\n'
                    'timeout = 10\n[[messages]]\ndestination = "a.example"\n')
    assert main(["compare", str(path)]) == 1
    assert "one per transport" in capsys.readouterr().err


def test_locate_finds_keys_in_tables_and_arrays():
    text = ('title = "t"\n[destinations."a.example"]\nlatency = {dist = "uniform"}\n'
            '[[messages]]\ncount = 1\n[[messages]]\ncount = 2\n[compare.main_cf]\nx = "1"\n')
    assert locate(text, ("title",)) == 1
    assert locate(text, ("destinations", "a.example", "latency", "low")) == 3
    assert locate(text, ("messages", 1, "count")) == 7
    assert locate(text, ("messages", 1, "size")) == 6  # the table it belongs in
    assert locate(text, ("compare", "main_cf", "x")) == 9


# -- contenders -------------------------------------------------------------------------

def test_contenders():
    assert parse_contender("stock").qmgr == "stock"
    assert parse_contender("oqmgr").qmgr == "oqmgr"
    c = parse_contender("pyqmgr:finch,smtp_finch_max_message_concurrency=5,"
                        "smtp_response_rules=rules", base="/etc/x")
    assert (c.qmgr, c.policy) == ("pyqmgr", "finch")
    assert c.settings == {"smtp_finch_max_message_concurrency": "5",
                          "smtp_response_rules": "/etc/x/rules"}
    assert parse_contender("pyqmgr").policy is None
    for bad, words in [("postfix", "a contender is stock"), ("stock:x", "takes no policy"),
                       ("pyqmgr:fifo", "unknown policy 'fifo'"),
                       ("pyqmgr:finch,novalue", "is not name=value")]:
        with pytest.raises(ContenderError, match=words):
            parse_contender(bad)
    with pytest.raises(ContenderError, match="given twice"):
        parse_contenders(["stock", "stock"])


def test_a_bad_contender_is_refused_before_anything_starts(capsys):
    assert main(["compare", WORKLOADS[0], "--with", "stock", "--with", "pyqmgr:fifo"]) == 1
    assert "unknown policy 'fifo'" in capsys.readouterr().err


# -- the figures, from a synthetic run ----------------------------------------------------

def _line(pid, qid, to, delay, delays, status, detail, program="smtp", relay="x[1]:2"):
    return (f"Nov 23 23:13:11 pfx postfix/{program}[{pid}]: {qid}: to=<{to}>, relay={relay},"
            f" delay={delay}, delays={delays}, dsn=2.0.0, status={status} ({detail})")


def _synthetic() -> tuple[dict, str]:
    record = {
        "contender": "stock", "drained": True, "elapsed": 4.0, "error": None,
        "qmgr": {"cpu_s": 0.5, "vmhwm_kib": 10240},
        "messages": [
            {"qid": "AAAAAA1", "submitted": 0.0, "mid": 0, "recipients":
             ["bulk.m0.r0@a.example", "bulk.m0.r1@a.example", "bulk.m0.r2@a.example"]},
            {"qid": "AAAAAA2", "submitted": 1.0, "mid": 1, "recipients":
             ["small.m1.r0@b.example"]},
        ],
        "sinks": {"a.example": {"kind": "sink", "timeline": [[0.1, 1], [0.2, 2], [0.7, 1],
                                                            [1.2, 0]],
                                "received": [[0.5, 1], [1.1, 1]], "refused_421": 1},
                  "b.example": {"kind": "refused"}},
    }
    refused = "host x[1] refused to talk to me: 421 4.7.0 too many connections"
    log = "\n".join([
        "Nov 23 23:13:10 pfx postfix/qmgr[9]: AAAAAA1: from=<s@x>, size=1, nrcpt=3 (queue active)",
        _line(11, "AAAAAA1", "bulk.m0.r0@a.example", 0.5, "0/0/0.1/0.4", "sent", "250 ok"),
        # One 421 session for two recipients: one reply, two deferred lines.
        _line(12, "AAAAAA1", "bulk.m0.r1@a.example", 0.3, "0/0/0.3/0", "deferred", refused),
        _line(12, "AAAAAA1", "bulk.m0.r2@a.example", 0.3, "0/0/0.3/0", "deferred", refused),
        _line(13, "AAAAAA1", "bulk.m0.r1@a.example", 2.5, "0/2/0.1/0.4", "sent", "250 ok"),
        _line(13, "AAAAAA1", "bulk.m0.r2@a.example", 3.0, "0/2/0.1/0.9", "bounced",
              "host x said: 550 5.1.1 no such user (in reply to RCPT TO command)"),
        _line(14, "AAAAAA2", "small.m1.r0@b.example", 0.2, "0/0.2/0/0", "deferred",
              "delivery temporarily suspended: connect to x: Connection refused",
              program="retry", relay="none"),
        # Not the workload's: a bounce notice to the sender.
        _line(15, "BBBBBB1", "s@x", 0.1, "0/0/0/0", "sent", "discarded", program="discard"),
    ])
    return record, log


def test_figures_from_a_synthetic_maillog():
    record, log = _synthetic()
    f = run_figures(record, log)
    assert (f["sent"], f["bounced"], f["deferred"], f["undelivered"]) == (2, 1, 3, 1)
    assert f["drain_time"] == 3.0  # message 0 submitted at 0, its bounce at delay 3.0
    a = f["destinations"]["a.example"]
    assert a["replies_4xx"] == {"421 4.7.0": 1}  # the sink's one reply ...
    assert a["deferred_by_reply"] == {"421 4.7.0": 2}  # ... logged for two recipients
    assert a["replies_5xx"] == {"550 5.1.1": 1}
    assert a["deferral_rate"] == pytest.approx(2 / 5, abs=1e-4)
    # From the sink's timeline: 1 open 0.1-0.2, 2 open 0.2-0.7, 1 open 0.7-1.2.
    assert a["in_flight_source"] == "sink" and a["in_flight_peak"] == 2
    assert a["in_flight_mean"] == pytest.approx((0.1 + 1.0 + 0.5) / 1.1, abs=1e-3)
    b = f["destinations"]["b.example"]
    assert b["deferral_rate"] == 1.0 and b["attempts"] == 0  # the retry transport's line
    assert f["classes"]["bulk"]["sent"] == 2 and f["classes"]["bulk"]["p50"] == 1.5
    assert f["classes"]["small"] == {"recipients": 1, "sent": 0, "undelivered": 1,
                                     "p50": None, "p95": None, "p99": None, "max": None}
    assert f["order"] == [0, 0]
    assert f["qmgr_cpu_s"] == 0.5 and f["qmgr_vmhwm_mib"] == 10.0
    assert sum(a["per_second"]) * f["bin_width"] == pytest.approx(2)


def test_percentile_is_numpys_linear():
    import numpy

    values = [0.3, 1.2, 0.05, 7.0, 2.2, 2.2, 0.9]
    for p in (0, 50, 95, 99, 100):
        assert percentile(values, p) == pytest.approx(float(numpy.percentile(values, p)))
    assert percentile([], 50) is None
    assert steps([(0, 2), (1, 3), (2, 4)]) == [(0, 1), (1, 2), (2, 2), (3, 1), (4, 0)]


def test_delivery_lines_parse():
    d = parse_delivery(_line(7, "ABCDEF1", "x.m1.r2@d.example", 12, "0.01/0/3/9", "deferred",
                             "host d said: 421 4.7.28 slow down (in reply to MAIL FROM "
                             "command)"))
    assert d is not None and d.delay == 12 and d.delays == (0.01, 0, 3, 9)
    assert d.reply == "421 4.7.28" and d.status == "deferred" and d.pid == 7
    assert parse_delivery("Nov 23 23:13:11 pfx postfix/qmgr[9]: ABCDEF1: removed") is None


# -- the words ------------------------------------------------------------------------------

def _run(label, p95=1.0, p50=0.5, drain=10.0, rate=0.1, replies=None, cpu=0.1, mem=10.0,
         order=(1, 2, 3), drained=True, mean=3.0):
    return {"contender": label, "drained": drained, "error": None, "undelivered": 0,
            "drain_time": drain if drained else None, "order": list(order),
            "classes": {"small": {"p95": p95, "p50": p50}},
            "destinations": {"x.example": {"deferral_rate": rate,
                                           "replies_4xx": replies or {},
                                           "in_flight_mean": mean,
                                           "in_flight_source": "sink"}},
            "qmgr_cpu_s": cpu, "qmgr_vmhwm_mib": mem}


def test_differences_are_stated_only_past_their_thresholds():
    base = _run("stock", replies={"421 4.7.0": 20})
    same = _run("pyqmgr", p95=1.3, drain=11.0, rate=0.12, replies={"421 4.7.0": 24},
                cpu=0.14, mem=14.0, mean=3.5)
    assert differences([base, same], {"pyqmgr": {"stock": 0.95}}, {}) == []
    other = _run("pyqmgr:finch", p95=0.25, drain=5.0, rate=0.3, replies={"421 4.7.0": 40},
                 cpu=0.5, mem=30.0, mean=5.0)
    words = differences([base, other], {"pyqmgr:finch": {"stock": 0.5}}, {})
    assert words == [
        "pyqmgr:finch delivered small mail 4.0x sooner at p95 than stock (0.25 s against "
        "1.00 s)",
        "pyqmgr:finch drained the queue 2.0x faster than stock (5.00 s against 10.0 s)",
        "pyqmgr:finch deferred 30.0% of its attempts at x.example, stock 10.0%",
        "pyqmgr:finch provoked 2.0x the '421 4.7.0' replies at x.example that stock did "
        "(40 against 20)",
        "pyqmgr:finch kept 5.0 sessions open at x.example on average, stock 3.0",
        "pyqmgr:finch delivered in another order than stock (similarity 0.50; 1 is the "
        "same order)",
        "pyqmgr:finch's qmgr used 5.0x more CPU than stock's (0.50 s against 0.10 s)",
        "pyqmgr:finch's qmgr peaked at 3.0x more memory than stock's (30 MiB against "
        "10 MiB)",
    ]
    # The median speaks when the p95 does not; a run that did not drain always does.
    med = _run("oqmgr", p95=1.1, p50=2.0, drained=False)
    words = differences([base, med], {}, {"oqmgr": 60})
    assert words[0].startswith("oqmgr did not drain within 60 s")
    assert "oqmgr delivered small mail 4.0x later at the median than stock" in words[1]


def test_the_report_files_from_a_synthetic_run(tmp_path):
    record, log = _synthetic()
    f = run_figures(record, log)
    g = dict(f, contender="pyqmgr")
    workload = {"path": "w.toml", "title": "synthetic", "time_scale": 0.1, "messages": 2,
                "recipients": 4, "destinations": ["a.example", "b.example"],
                "main_cf": {"x": "1"}, "classes": ["bulk", "small"]}
    report = build(workload, [f, g], {"stock": 60, "pyqmgr": 60})
    assert report["similarity"]["stock"]["pyqmgr"] == 1.0
    json.dumps(report)
    md = markdown(report)
    assert "## Differences that matter" in md and "| bulk | stock | 2/3 |" in md
    page = to_html(report)
    assert page.startswith("<!DOCTYPE html>") and "http" not in page.replace(
        "http-equiv", "")
    assert "<script" not in page and "data:image/png;base64," in page


def test_simulate_says_it_has_no_content_filter(tmp_path, capsys):
    """[compare.content_filter] is parsed (a filter of 2 processes holding mail 0.2 to
    0.6 s) and played by compare alone: simulate says so rather than pass it over."""
    path = tmp_path / "w.toml"
    path.write_text('[compare.content_filter]\nlatency = {dist = "uniform", low = 0.2, '
                    'high = 0.6}\nprocess_limit = 2\n[destinations."a.example"]\n'
                    '[[messages]]\ndestination = "a.example"\n')
    cf = load(str(path)).compare.content_filter
    assert cf is not None and cf.process_limit == 2 and cf.latency.high == 0.6
    assert main(["simulate", str(path)]) == 0
    assert "this simulation has no content filter" in capsys.readouterr().out
