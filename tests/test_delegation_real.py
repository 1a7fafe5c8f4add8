"""Delivery policy delegation on real Postfix (#13): pyqmgr asks a policy service first.

Against Debian's postfwd, a real and unmodified policy server, started on loopback with
a ``rate()`` rule: deliveries to one domain obey N per T seconds (measured at the sink
and in the maillog) while another domain flows freely, nothing lost; postfwd stopped
mid-run: mail goes on by the default action with one warning. Against the fake server:
garbage, slow and closing services cost a warning each, nothing lost; HOLD puts the
message in hold/ and ``postsuper -H`` releases it; REJECT bounces through error(8) when
told to and is otherwise held back with a warning. A bad setting is fatal, naming
pyqmgr.cf and the parameter. Every server is torn down by its fixture, even on failure.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.policy_server import FakePolicyServer
from pyqmgr.testbed.postfwd import Postfwd, find_postfwd2
from pyqmgr.testbed.sink import SinkServer
from tests.test_control import cli, wait_for_channel
from tests.test_explain_real import reasons_for

LIMITED = "limited.example"
FREE = "free.example"
SENDER = "s@test.example"


@pytest.fixture
def postfwd() -> Iterator[Callable[..., Postfwd]]:
    if find_postfwd2() is None:
        pytest.skip("needs Debian's postfwd package (postfwd2)")
    made: list[Postfwd] = []

    def make(*rules: str, **kw: Any) -> Postfwd:
        server = Postfwd(list(rules), **kw)
        made.append(server)
        return server.start()

    yield make
    for server in made:
        server.close()


@pytest.fixture
def policy_server() -> Iterator[Callable[..., FakePolicyServer]]:
    made: list[FakePolicyServer] = []

    def make(*args: Any, **kw: Any) -> FakePolicyServer:
        server = FakePolicyServer(*args, **kw).start()
        made.append(server)
        return server

    yield make
    for server in made:
        server.stop()


def qmgr_lines(pf: PostfixInstance, contains: str) -> list[str]:
    return [ln.text for ln in pf.maillog.lines("postfix/qmgr", contains=contains)]


def sent(pf: PostfixInstance, domain: str) -> list[str]:
    return [ln.raw for ln in pf.maillog.lines()
            if f"@{domain}>" in ln.text and "status=sent" in ln.text]


def windows(times: list[float], period: float) -> list[int]:
    """Deliveries per window as postfwd counts them: a window opens at the first one
    after the previous window's end and lasts ``period`` seconds."""
    counts: list[int] = []
    start = None
    for t in sorted(times):
        if start is None or t >= start + period:
            start = t
            counts.append(0)
        counts[-1] += 1
    return counts


def sliding_max(times: list[float], period: float) -> int:
    """The most deliveries within any ``period`` seconds."""
    ts = sorted(times)
    return max((sum(1 for u in ts[i:] if u < t + period) for i, t in enumerate(ts)),
               default=0)


def syslog_seconds(raw: str) -> int:
    """The whole-second time of day of a maillog line (``Mmm dd HH:MM:SS``)."""
    hh, mm, ss = raw[7:15].split(":")
    return int(hh) * 3600 + int(mm) * 60 + int(ss)


def test_postfwd_rate_limits_one_domain_while_another_flows(postfix_instance, sink, postfwd):
    n, period, count = 3, 10, 9
    server = postfwd(f"id=LIMIT; protocol_state==DELIVERY; recipient_domain=={LIMITED}; "
                     f"action=rate(recipient_domain/{n}/{period}/450 4.7.1 too many "
                     "deliveries)")
    limited: SinkServer = sink()
    free: SinkServer = sink()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr",
        transports={LIMITED: f"smtp:[127.0.0.1]:{limited.port}",
                    FREE: f"smtp:[127.0.0.1]:{free.port}"},
        main_cf={"smtp_connection_cache_on_demand": "no"},
        pyqmgr_cf={"delivery_policy_service": server.endpoint,
                   "delivery_policy_defer_delay": "1s"})
    wait_for_channel(pf)
    t0 = time.time()
    pf.smtp_send([(SENDER, [f"l{i}@{LIMITED}"]) for i in range(count)]
                 + [(SENDER, [f"f{i}@{FREE}"]) for i in range(count)])
    free.wait_delivered(count, 30)
    free_done = time.time() - t0
    nexthop = f"[127.0.0.1]:{limited.port}"
    gate = [r for r in reasons_for(pf, nexthop) if r["constraint"] == "policy service"]
    assert gate, "explain names the policy service's gate"
    assert gate[0]["setting"] == "delivery_policy_service"
    assert "too many deliveries" in gate[0]["text"] and gate[0]["opens_in"] <= 1.0
    status = json.loads(cli(pf, "status", "--json").stdout)
    (smtp,) = [t for t in status["transports"] if t["name"] == "smtp"]
    assert smtp["delivery_policy"]["service"] == server.endpoint
    assert smtp["delivery_policy"]["connections"] >= 1
    text = cli(pf, "status").stdout
    assert "POLICY SERVICE" in text and server.endpoint in text

    limited.wait_delivered(count, 3 * period * count // n)
    pf.wait_queue_empty(30)
    times = [m.time for m in limited.messages()]
    per_window = windows(times, period)
    spread = max(times) - min(times)
    free_times = [m.time - t0 for m in free.messages()]
    maillog = [syslog_seconds(raw) for raw in sent(pf, LIMITED)]
    print(f"postfwd rate {n}/{period}s: {LIMITED} deliveries per window {per_window} "
          f"over {spread:.2f} s (at most {sliding_max(times, period)} in any {period} s, "
          f"{sliding_max(times, period - 1)} in any {period - 1} s); at "
          + ", ".join(f"{t - min(times):.2f}" for t in sorted(times))
          + f" s; {FREE}: all {count} in {max(free_times):.2f} s (done at {free_done:.2f} s)"
          f"; maillog status=sent seconds {[t - min(maillog) for t in sorted(maillog)]}")
    assert per_window == [n] * (count // n), per_window
    assert spread >= (count // n - 1) * period, "the rule spaced the windows"
    assert sliding_max(times, period - 1) <= n
    assert max(free_times) < 5, "the other domain flows freely"
    assert sorted(r for m in limited.messages() for r in m.recipients) == sorted(
        f"l{i}@{LIMITED}" for i in range(count)), "each exactly once"
    assert sorted(r for m in free.messages() for r in m.recipients) == sorted(
        f"f{i}@{FREE}" for i in range(count))
    # The maillog agrees (whole seconds): never more than n within period - 1 s.
    assert len(maillog) == count
    assert max(sum(1 for u in maillog if t <= u < t + period - 1) for t in maillog) <= n
    held = qmgr_lines(pf, "held back 1s")
    assert held and all(f"delivery policy service {server.endpoint} replied "
                        '"450 4.7.1 too many deliveries"' in h for h in held), held[:2]
    assert not [ln.raw for ln in pf.maillog.lines("postfix/qmgr") if ln.severity != "info"]
    final = json.loads(cli(pf, "status", "--json").stdout)
    (smtp,) = [t for t in final["transports"] if t["name"] == "smtp"]
    counters = smtp["delivery_policy"]
    print(f"status counters: {counters}")
    assert counters["deliver"] == 2 * count and counters["defer"] == len(held)
    assert counters["asked"] == counters["deliver"] + counters["defer"]
    assert counters["errors"] == 0


def test_postfwd_stopped_mid_run_mail_goes_on_with_one_warning(postfix_instance, sink,
                                                              postfwd):
    server = postfwd("id=ALL; protocol_state==DELIVERY; action=DUNNO")
    srv: SinkServer = sink()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={FREE: f"smtp:[127.0.0.1]:{srv.port}"},
        pyqmgr_cf={"delivery_policy_service": server.endpoint,
                   "delivery_policy_timeout": "2s"})
    wait_for_channel(pf)
    pf.smtp_send([(SENDER, [f"a{i}@{FREE}"]) for i in range(5)])
    srv.wait_delivered(5, 30)
    server.stop()
    t0 = time.monotonic()
    for batch in range(4):
        pf.smtp_send([(SENDER, [f"b{batch}.{i}@{FREE}"]) for i in range(5)])
        time.sleep(1)
    srv.wait_delivered(25, 60)
    took = time.monotonic() - t0
    pf.wait_queue_empty(30)
    warnings = qmgr_lines(pf, f"delivery policy service {server.endpoint}")
    print(f"postfwd stopped: 20 more delivered in {took:.2f} s; warnings: {warnings}")
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"warning: delivery policy service {server.endpoint}: ")
    assert "delivering by delivery_policy_default_action = DUNNO" in warnings[0]
    assert sorted(r for m in srv.messages() for r in m.recipients) == sorted(
        [f"a{i}@{FREE}" for i in range(5)]
        + [f"b{b}.{i}@{FREE}" for b in range(4) for i in range(5)]), "each exactly once"
    (smtp,) = [t for t in json.loads(cli(pf, "status", "--json").stdout)["transports"]
               if t["name"] == "smtp"]
    assert smtp["delivery_policy"]["errors"] == 20


def test_misbehaving_services_cost_warnings_not_mail(postfix_instance, sink, policy_server):
    modes = {"garbage": {}, "slow": {"delay": 3.0}, "close": {}}
    servers = {name: policy_server("reply" if name == "slow" else name, **kw)
               for name, kw in modes.items()}
    srv: SinkServer = sink()
    transports, cf, extra = {}, {"delivery_policy_timeout": "1s"}, []
    for name, server in servers.items():
        transports[f"{name}.example"] = f"{name}:[127.0.0.1]:{srv.port}"
        cf[f"{name}_delivery_policy_service"] = server.endpoint
        extra.append(f"{name} unix - - n - - smtp")
    pf: PostfixInstance = postfix_instance(qmgr="pyqmgr", transports=transports,
                                           master_cf_extra=extra, pyqmgr_cf=cf)
    wait_for_channel(pf)
    t0 = time.monotonic()
    pf.smtp_send([(SENDER, [f"r{i}@{name}.example"]) for name in servers for i in range(4)])
    srv.wait_delivered(12, 60)
    took = time.monotonic() - t0
    pf.wait_queue_empty(30)
    for name, server in servers.items():
        lines = qmgr_lines(pf, f"delivery policy service {server.endpoint}")
        print(f"{name}: {server.request_count()} requests; {lines}")
        assert len(lines) == 1, (name, lines)
        assert lines[0].startswith("warning: ") and "delivery_policy_default_action = DUNNO" \
            in lines[0]
    garbage, slow, close = (qmgr_lines(pf, f"service {servers[n].endpoint}")[0]
                            for n in ("garbage", "slow", "close"))
    assert "reply line without '='" in garbage
    assert "no reply within 1s" in slow
    assert "connection closed before a reply" in close
    print(f"12 messages through three misbehaving services in {took:.2f} s")
    assert sorted(r for m in srv.messages() for r in m.recipients) == sorted(
        f"r{i}@{n}.example" for n in servers for i in range(4)), "each exactly once"


def test_hold_puts_the_message_in_hold_and_postsuper_releases_it(postfix_instance, sink,
                                                                 policy_server):
    server = policy_server(action=lambda a: "HOLD suspicious" if a.get("recipient", "")
                           .endswith("@held.example") else "DUNNO")
    held: SinkServer = sink()
    other: SinkServer = sink()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"held.example": f"smtp:[127.0.0.1]:{held.port}",
                                   FREE: f"smtp:[127.0.0.1]:{other.port}"},
        pyqmgr_cf={"delivery_policy_service": server.endpoint})
    wait_for_channel(pf)
    (qid,) = pf.smtp_send([(SENDER, ["h1@held.example", "h2@held.example", f"o@{FREE}"])])
    pf.wait_until(lambda: bool(pf.queue_path("hold", qid)), 30, "the message in hold/")
    assert held.delivered_count() == 0
    lines = qmgr_lines(pf, f"{qid}: hold: ")
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{qid}: hold: delivery policy service {server.endpoint} "
                               'replied "HOLD suspicious" for delivery to ')
    assert f"from=<{SENDER}> to=<h" in lines[0]
    assert qmgr_lines(pf, f"{qid}: placed on hold")
    assert not pf.queue_files("active") and not pf.queue_files("deferred")
    # The other destination was asked before or after: either it went out already
    # (then the file in hold/ has it marked done) or it waits in hold/ with the rest.
    before = other.delivered_count()
    server.set_mode("reply", action="DUNNO")
    pf.postsuper("-H", qid)
    pf.flush()
    held.wait_delivered(2, 60)
    pf.wait_queue_empty(30)
    assert sorted(r for m in held.messages() for r in m.recipients) == [
        "h1@held.example", "h2@held.example"]
    assert [r for m in other.messages() for r in m.recipients] == [f"o@{FREE}"], (
        "exactly once", before)


def test_reject_bounces_only_when_told_to(postfix_instance, sink, policy_server):
    server = policy_server(action="REJECT 5.7.1 no mail to this destination today")
    srv: SinkServer = sink()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"bounce.example": f"smtp:[127.0.0.1]:{srv.port}",
                                   "keep.example": f"keep:[127.0.0.1]:{srv.port}"},
        master_cf_extra=["keep unix - - n - - smtp"],
        pyqmgr_cf={"delivery_policy_service": server.endpoint,
                   "smtp_delivery_policy_reject": "bounce",
                   "delivery_policy_defer_delay": "2s"})
    wait_for_channel(pf)
    sender = pf.local_address
    (bounced,) = pf.smtp_send([(sender, ["b@bounce.example"])])
    line = pf.maillog.wait_for(lambda ln: ln.queue_id == bounced and ln.status == "bounced",
                               30, what="the bounced recipient")[0]
    assert line.program_name == "error" and line.dsn == "5.7.1", line.raw
    assert line.detail == "no mail to this destination today", line.raw
    assert qmgr_lines(pf, f"{bounced}: delivery policy service {server.endpoint} rejected "
                          f"delivery to [127.0.0.1]:{srv.port} (smtp): "
                          '"REJECT 5.7.1 no mail to this destination today"; 1 recipient '
                          "bounced through error(8)")
    # Without delivery_policy_reject = bounce (transport keep): held back, with a warning.
    (kept,) = pf.smtp_send([(sender, ["k@keep.example"])])
    pf.maillog.wait_for(lambda ln: ln.queue_id == kept and "treated as DEFER" in ln.text,
                        30, what="the warning")
    warning = qmgr_lines(pf, f"{kept}: delivery policy service")
    assert warning[0].startswith("warning: ") and "delivery_policy_reject = defer" in \
        warning[0]
    time.sleep(3)
    assert pf.queue_path("active", kept), "deferred in core, not to deferred/"
    assert not [ln for ln in pf.maillog.lines() if ln.queue_id == kept and ln.status]
    server.set_mode("reply", action="DUNNO")
    srv.wait_delivered(1, 30)
    assert [r for m in srv.messages() for r in m.recipients] == ["k@keep.example"]
    pf.wait_queue_empty(30)


def test_a_bad_setting_is_fatal_and_names_the_parameter(postfix_instance, sink):
    srv: SinkServer = sink()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", start=False, transports={"d.example": f"smtp:[127.0.0.1]:{srv.port}"})
    # After 'pyqmgr install', which refuses such a value as 'pyqmgr check' reports it:
    # what is tested here is the daemon's own refusal at start-up.
    pf.write_pyqmgr_cf({"delivery_policy_service": "inet:127.0.0.1:10040",
                        "smtp_delivery_policy_timeout": "soon"})
    pf.start()
    (qid,) = pf.smtp_send([(SENDER, ["r@d.example"])])
    fatal = pf.maillog.wait_for(lambda ln: ln.program_name == "qmgr" and ln.severity == "fatal",
                                timeout=30, what="qmgr's fatal line")[0]
    cf = os.path.join(pf.config_dir, "pyqmgr.cf")
    assert fatal.text == (f"fatal: {cf}: parameter smtp_delivery_policy_timeout: bad "
                          "duration 'soon' (examples: 500ms, 30s, 10m, 1h)"), fatal.text
    assert pf.queue_path("incoming", qid) or pf.queue_path("active", qid)
    assert srv.delivered_count() == 0


def test_a_service_that_holds_everything_can_be_refused(postfix_instance, sink,
                                                       policy_server):
    """delivery_policy_hold = defer: a HOLD is a DEFER with a warning, so a service
    that answers HOLD to every delivery holds mail back but parks none of it in hold/
    (issue #31, finding 8); once it answers DUNNO the mail goes."""
    server = policy_server(action="HOLD everything")
    srv: SinkServer = sink()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"held.example": f"smtp:[127.0.0.1]:{srv.port}"},
        pyqmgr_cf={"delivery_policy_service": server.endpoint,
                   "delivery_policy_hold": "defer", "delivery_policy_defer_delay": "2s"})
    wait_for_channel(pf)
    (qid,) = pf.smtp_send([(SENDER, ["a@held.example", "b@held.example"])])
    pf.maillog.wait_for(lambda ln: ln.program_name == "qmgr" and "treated as DEFER, as "
                        "delivery_policy_hold = defer" in ln.text, 30, what="the warning")
    assert not pf.queue_files("hold") and srv.delivered_count() == 0
    server.set_mode("reply", action="DUNNO")
    srv.wait_delivered(2, 30)
    pf.wait_queue_empty(30)
    assert not qmgr_lines(pf, f"{qid}: hold: ")
