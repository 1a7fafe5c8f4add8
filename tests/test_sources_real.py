"""Source pools on real Postfix (issue #46; docs/sources.md's worked example).

Three sources, smtp services of master.cf each bound to its own loopback address
(``-o smtp_bind_address=127.0.0.21`` .. ``.23``), form the pool ``bulk``; src1 is
cold (its first day is today) and the warm-up plan gives it 100 messages a day at a
site. The domain's MX (unbound on loopback) names a host at the sink, so the site is
known once the MX was looked up. The sink counts messages per client address: the
source each message left from.
"""

from __future__ import annotations

import datetime
import json
import os
import time

import pytest

from pyqmgr.testbed import dns
from pyqmgr.testbed.instance import PostfixInstance
from pyqmgr.testbed.instance_base import free_port
from pyqmgr.testbed.sink import SinkServer
from tests.test_control import cli
from tests.test_metrics_real import scrape, wait_for_exporter

pytestmark = pytest.mark.skipif(not dns.available(), reason="needs unbound (./dev installs it)")

SOURCES = {"src1": "127.0.0.21", "src2": "127.0.0.22", "src3": "127.0.0.23"}
DOMAIN = "x.test"
RECORDS = [f"{DOMAIN}. 300 IN MX 10 mx1.{DOMAIN}.", f"mx1.{DOMAIN}. 300 IN A 127.0.0.1"]
PLAN = 100
MESSAGES = 400
RESTORED = "counts of this day's warm-up restored"


def _master_cf() -> list[str]:
    return [f"{name} unix - - n - - smtp -o smtp_bind_address={addr} "
            f"-o smtp_helo_name={name}.relay.test" for name, addr in SOURCES.items()]


def _today() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")


def _pyqmgr_cf(plan_path: str, plan: str, extra: dict[str, str] | None = None
               ) -> dict[str, str]:
    return {"site_grouping": "mx", "message_classes": "bulk",
            "source_pools": "bulk", "bulk_sources": " ".join(SOURCES),
            "source_pool_maps": "inline:{ bulk=bulk }",
            "source_warmup_plan": plan_path, **(extra or {})}


def _instance(postfix_instance, server: dns.DnsServer, port: int, plan: str,
              pyqmgr_extra: dict[str, str] | None = None) -> PostfixInstance:
    pf: PostfixInstance = postfix_instance(
        start=False, qmgr="pyqmgr", master_cf_extra=_master_cf(),
        transports={DOMAIN: f"smtp:{DOMAIN}:{port}"},
        # Two sessions a source: the run lasts long enough for a reload midway.
        main_cf={"smtp_host_lookup": "dns", "minimal_backoff_time": "3600s",
                 "maximal_backoff_time": "3600s", "default_destination_concurrency_limit": "2"})
    plan_path = os.path.join(pf.config_dir, "pyqmgr-warmup")
    with open(plan_path, "w") as f:
        f.write(plan)
    pf.write_pyqmgr_cf(_pyqmgr_cf(plan_path, plan, pyqmgr_extra))
    pf.start(prefix=server.start_prefix())
    return pf


def by_client_now(srv: SinkServer) -> dict[str, int]:
    return dict(srv.snapshot().messages_by_client)


def _statuses(pf: PostfixInstance) -> tuple[int, int]:
    lines = pf.maillog.lines()
    sent = sum(1 for ln in lines if "status=sent" in ln.text and f"@{DOMAIN}>" in ln.text)
    deferred = sum(1 for ln in lines if "status=deferred" in ln.text)
    return sent, deferred


def _warmup_run(postfix_instance, sink
                ) -> tuple[dict[str, int], int, int, list[str], int, str]:
    srv: SinkServer = sink(latency=0.05)
    day = _today()
    with dns.DnsServer(["test"], RECORDS) as server:
        port = free_port()
        pf = _instance(postfix_instance, server, srv.port, f"0 {PLAN}\n30 warm\n",
                       {"src1_source_warmup_start": day, "metrics_listen": f"127.0.0.1:{port}"})
        # The domain's first message goes to a warm source and has its MX looked up;
        # from then on its site is known (and kept across the reload).
        pf.smtp_send([("s@relay.test", [f"r0@{DOMAIN}"])])
        pf.wait_until(lambda: srv.snapshot().messages == 1, 20, "the first message")
        pf.smtp_send_many([("s@relay.test", [f"r{i}@{DOMAIN}"])
                           for i in range(1, MESSAGES)])
        cold = SOURCES["src1"]
        pf.wait_until(lambda: srv.snapshot().messages_by_client[cold] >= PLAN // 2, 40,
                      f"{PLAN // 2} messages from the cold source")
        first = pf.qmgr_pid()
        at_reload = srv.snapshot().messages_by_client[cold]
        pf.reload()
        pf.wait_until(lambda: pf.qmgr_pid() != first, 20, "a new qmgr after the reload")
        pf.wait_until(lambda: any(RESTORED in ln.text for ln in pf.maillog.lines()), 20,
                      "the new qmgr reading the counts back")
        pf.wait_until(lambda: _statuses(pf)[0] >= MESSAGES, 40, f"{MESSAGES} messages sent")
        sent, deferred = _statuses(pf)
        restored = [ln.text for ln in pf.maillog.lines() if RESTORED in ln.text]
        status = json.loads(cli(pf, "status", "--json").stdout)["sources"]
        text = cli(pf, "status").stdout
        print("pyqmgr status says:\n" + "\n".join(ln for ln in text.splitlines()
                                                  if "source" in ln.lower() or "src" in ln))
        assert status["counts"][0]["source"] == "src1" and status["counts"][0]["counted"] \
            == by_client_now(srv)[SOURCES["src1"]], status
        assert status["pools"]["bulk"][0] == {"source": "src1", "weight": 1, "age_days": 0,
                                              "allowance": PLAN}
        assert "source pool bulk: src1 (cold, day 0, 100 a site this day), src2, src3" in text
        explained = json.loads(cli(pf, "explain", f"src1:{DOMAIN}", "--json").stdout)
        print("explain src1:", explained)
        (warmup,) = [r for r in explained["reasons"] if r.get("setting") ==
                     "source_warmup_plan"]
        assert warmup["counted"] == status["counts"][0]["counted"], warmup
        assert warmup["allowance"] == PLAN and warmup["site"] == status["counts"][0]["site"]
        assert "src1 is a cold source of pool bulk (weight 1 of 3), day 0 of its plan" in \
            cli(pf, "explain", f"src1:{DOMAIN}").stdout
        wait_for_exporter(pf, port)
        metrics = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1])
                   for ln in scrape(port).splitlines() if ln.startswith("pyqmgr_source_")}
        print("metrics:", metrics)
        assert metrics['pyqmgr_source_warmup_counted{source="src1"}'] == \
            status["counts"][0]["counted"], metrics
        assert metrics['pyqmgr_source_allowance{source="src1"}'] == PLAN
        assert metrics['pyqmgr_source_age_days{source="src1"}'] == 0
        assert {k for k in metrics if k.startswith("pyqmgr_source_pool_weight")} == {
            f'pyqmgr_source_pool_weight{{pool="bulk",source="{m}"}}' for m in SOURCES}
        assert 'pyqmgr_source_allowance{source="src2"}' not in metrics, "src2 is warm"
        state_path = os.path.join(pf.data_dir, "pyqmgr", "sources.json")
        with open(state_path) as f:
            state = f.read()
        pf.stop()
    by_client = dict(srv.snapshot().messages_by_client)
    return by_client, sent, deferred, restored, at_reload, state if day == _today() else ""


def test_cold_source_sends_its_plan_and_the_rest_goes_warm(postfix_instance, sink) -> None:
    by_client, sent, deferred, restored, at_reload, state = _warmup_run(postfix_instance, sink)
    if not state:
        # The UTC day changed mid-run: the plan's window rolled over. Once more.
        by_client, sent, deferred, restored, at_reload, state = _warmup_run(postfix_instance,
                                                                            sink)
    print(f"\n{MESSAGES} messages to {DOMAIN}, src1 cold with a plan of {PLAN} a day, "
          f"a postfix reload when src1 had sent {at_reload}; messages by source address: "
          f"{by_client}; "
          f"state file: {state.strip()}")
    cold = by_client.get(SOURCES["src1"], 0)
    assert abs(cold - PLAN) <= PLAN * 0.02, by_client
    assert sent == MESSAGES and deferred == 0
    assert sum(by_client.values()) == MESSAGES
    assert by_client.get(SOURCES["src2"], 0) + by_client.get(SOURCES["src3"], 0) == \
        MESSAGES - cold
    print(f"the new qmgr: {restored[0]}")
    assert at_reload < PLAN, "the reload came midway"
    assert len(restored) == 1
    saved = json.loads(state)
    assert saved["counts"] and saved["counts"][0][0] == "src1"
    assert saved["counts"][0][2] == cold


# -- one source throttled at one site ---------------------------------------------------

GMAIL_421 = ("421 4.7.28 [127.0.0.21] Our system has detected an unusual rate of "
             "unsolicited mail originating from your IP address.")
RULES = "/4\\.7\\.28/  throttle rate=0.1 rate_floor=1/5s quiet=2m ttl=1h\n"
RATE = 10  # starts a second per source and destination
BEFORE = (1.0, 6.0)  # seconds after the flow started, before the 421s
AFTER = (8.0, 13.0)  # after them: windows of 5 s make one start more or less 2%


def _per_second(messages, peer: str, t0: float, window: tuple[float, float]) -> float:
    lo, hi = t0 + window[0], t0 + window[1]
    return sum(1 for m in messages if m.peer == peer and lo <= m.time < hi) / (hi - lo)


def test_a_421_at_one_site_slows_only_that_source_there(postfix_instance, sink,
                                                        tmp_path) -> None:
    x: SinkServer = sink(latency=0.01)
    y: SinkServer = sink(latency=0.01)
    records = [*RECORDS, "y.test. 300 IN MX 10 mx1.y.test.", "mx1.y.test. 300 IN A 127.0.0.1"]
    n = 3 * RATE * 16  # each source's share lasts past AFTER at RATE a second
    with dns.DnsServer(["test"], records) as server:
        pf: PostfixInstance = postfix_instance(
            start=False, qmgr="pyqmgr", master_cf_extra=_master_cf(),
            transports={DOMAIN: f"smtp:{DOMAIN}:{x.port}", "y.test": f"smtp:y.test:{y.port}"},
            # A session a delivery: the 421 comes at the next one, not after a cached
            # session ends.
            main_cf={"smtp_host_lookup": "dns", "minimal_backoff_time": "3600s",
                     "maximal_backoff_time": "3600s",
                     "smtp_connection_cache_on_demand": "no"})
        rules = os.path.join(pf.config_dir, "pyqmgr_response_rules")
        with open(rules, "w") as f:
            f.write(RULES)
        pf.write_pyqmgr_cf({"site_grouping": "mx", "message_classes": "bulk",
                            "source_pools": "bulk", "bulk_sources": " ".join(SOURCES),
                            "source_pool_maps": "inline:{ bulk=bulk }",
                            "destination_rate": f"{RATE}/1s", "response_rules": rules})
        pf.start(prefix=server.start_prefix())
        pf.preload([("s@relay.test", [f"r{i}@{DOMAIN if i % 2 else 'y.test'}"])
                    for i in range(2 * n)])
        pf.release_preload()
        pf.wait_until(lambda: x.snapshot().messages > 0, 20, "the first delivery")
        t0 = time.time()
        time.sleep(BEFORE[1] + 0.5)
        x.refuse_client(SOURCES["src1"], GMAIL_421)
        refused_from = x.snapshot().refused_by_client[SOURCES["src1"]]
        time.sleep(AFTER[0] - BEFORE[1] - 0.5)
        refused_at = x.snapshot().refused_by_client[SOURCES["src1"]]
        time.sleep(AFTER[1] - AFTER[0] + 0.2)
        refused_to = x.snapshot().refused_by_client[SOURCES["src1"]]
        shaping = [ln.text for ln in pf.maillog.lines() if "shaping:" in ln.text]
        pf.stop()
    xs, ys = x.messages(), y.messages()
    rows = {}
    for name, addr in SOURCES.items():
        rows[f"{name} at x"] = (_per_second(xs, addr, t0, BEFORE),
                                _per_second(xs, addr, t0, AFTER))
        rows[f"{name} at y"] = (_per_second(ys, addr, t0, BEFORE),
                                _per_second(ys, addr, t0, AFTER))
    src1_tries_after = (refused_to - refused_at) / (AFTER[1] - AFTER[0])
    print(f"\nmessages a second by source and site, before and after x's 421 4.7.28 to "
          f"src1 (destination_rate {RATE}/1s):")
    for key, (before, after) in rows.items():
        print(f"  {key}: {before:.2f} -> {after:.2f}")
    print(f"  src1's sessions at x refused: {refused_at - refused_from} in the "
          f"{AFTER[0] - BEFORE[1] - 0.5:g} s after the first 421, then "
          f"{src1_tries_after:.2f} a second")
    print("  " + "\n  ".join(shaping[:3]))
    assert rows["src1 at x"][0] >= RATE * 0.9 and rows["src1 at x"][1] == 0
    assert src1_tries_after <= RATE * 0.25, "src1 slowed at x"
    assert any("4.7.28" in text for text in shaping), shaping
    for key in ("src2 at x", "src3 at x", "src1 at y", "src2 at y", "src3 at y"):
        before, after = rows[key]
        assert before >= RATE * 0.9 and abs(after - before) <= before * 0.05, (key, rows)


def test_pyqmgr_check_names_a_bad_pool_member(postfix_instance) -> None:
    """check reads master.cf as start-up does: a member that is not a service there,
    and one that is not a delivery agent bound to an address, each one line."""
    from tests.test_check_settings import check

    pf: PostfixInstance = postfix_instance(qmgr="pyqmgr", start=False,
                                           master_cf_extra=_master_cf())
    base = {"message_classes": "bulk", "source_pools": "bulk",
            "source_pool_maps": "inline:{ bulk=bulk }"}
    cf = pf.write_pyqmgr_cf({**base, "bulk_sources": "src1 src4"})
    proc = check(pf.config_dir)
    assert proc.returncode == 1, proc.stdout
    assert (f'{cf}: parameter bulk_sources: "src4" is not a unix service in master.cf'
            in proc.stdout), proc.stdout
    pf.write_pyqmgr_cf({**base, "bulk_sources": "src1 local"})
    assert 'parameter bulk_sources: "local" runs local, not smtp or lmtp' in \
        check(pf.config_dir).stdout
    pf.write_pyqmgr_cf({**base, "bulk_sources": "src1 src2:3"})
    proc = check(pf.config_dir)
    assert proc.returncode == 0, proc.stdout


# -- one source suspended at one site (SOURCE:site:NAME) ----------------------------------

SITE = f"mx1.{DOMAIN}"  # the site's name: its one MX host (site_names.site_name)
HELD_EACH = 10  # messages a source


def _control_error(pf: PostfixInstance, *args: str) -> str:
    done = cli(pf, *args)
    assert done.returncode == 1, (args, done.stdout, done.stderr)
    return done.stderr


def test_one_source_suspended_at_one_site_holds_only_its_mail_there(postfix_instance,
                                                                    sink) -> None:
    """``pyqmgr suspend src1:site:mx1.x.test``: src1's share of the pool's mail to the
    site waits in the queue while src2's and src3's there is delivered, and a resume
    sends it; what cannot name a source's site is refused with the reason."""
    srv: SinkServer = sink(latency=0.01)
    with dns.DnsServer(["test"], RECORDS) as server:
        pf: PostfixInstance = postfix_instance(
            start=False, qmgr="pyqmgr", master_cf_extra=_master_cf(),
            transports={DOMAIN: f"smtp:{DOMAIN}:{srv.port}"},
            main_cf={"smtp_host_lookup": "dns", "minimal_backoff_time": "3600s",
                     "maximal_backoff_time": "3600s"})
        pf.write_pyqmgr_cf({"site_grouping": "mx", "message_classes": "bulk",
                            "source_pools": "bulk", "bulk_sources": " ".join(SOURCES),
                            "source_pool_maps": "inline:{ bulk=bulk }"})
        pf.start(prefix=server.start_prefix())
        # One message first: the domain's MX lookup names its site before the rest.
        pf.smtp_send([("s@relay.test", [f"r0@{DOMAIN}"])])
        pf.wait_until(lambda: srv.snapshot().messages == 1, 20, "the first message")
        target = f"src1:site:{SITE}"
        done = cli(pf, "suspend", target, "--ttl", "1h", "--reason", "4.7.28 at x")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"suspended site {SITE} in transport src1 for 1h"), \
            done.stdout
        before = by_client_now(srv)
        pf.smtp_send_many([("s@relay.test", [f"r{i}@{DOMAIN}"])
                           for i in range(1, 3 * HELD_EACH + 1)])

        def sent_since(addr: str) -> int:
            return by_client_now(srv).get(addr, 0) - before.get(addr, 0)

        others = (SOURCES["src2"], SOURCES["src3"])
        pf.wait_until(lambda: sum(sent_since(a) for a in others) == 2 * HELD_EACH, 30,
                      f"{2 * HELD_EACH} messages from src2 and src3")
        held_then = sent_since(SOURCES["src1"])
        status = json.loads(cli(pf, "status", "--json").stdout)
        (src1,) = [d for d in status["destinations"] if d["transport"] == "src1"]
        (suspension,) = status["suspensions"]
        with open(os.path.join(pf.data_dir, "pyqmgr", "suspensions.json")) as f:
            (record,) = json.load(f)["suspensions"]
        explained = cli(pf, "explain", f"src1:{DOMAIN}").stdout
        errors = {
            "empty": _control_error(pf, "suspend", "src1:site:"),
            "unknown": _control_error(pf, "suspend", f"src9:site:{SITE}"),
            "no sites": _control_error(pf, "suspend", f"local:site:{SITE}"),
            "spaces": _control_error(pf, "suspend", "src1:site:mx1 x.test"),
            "long": _control_error(pf, "suspend", "src1:site:" + "x" * 300)}
        resumed = cli(pf, "resume", target)
        assert resumed.returncode == 0, resumed.stderr
        pf.wait_until(lambda: sent_since(SOURCES["src1"]) == HELD_EACH, 30,
                      f"src1's {HELD_EACH} held messages after the resume")
        pf.wait_queue_empty(30)
        pf.stop()
    print(f"\nsrc1 suspended at site {SITE}: src2 and src3 sent {2 * HELD_EACH}, src1 "
          f"{held_then} meanwhile ({src1['queued_entries']} waiting, {src1['state']}), "
          f"then {HELD_EACH} after the resume; state file record {record}; errors:")
    for what, text in errors.items():
        print(f"  {what}: {text.strip()}")
    assert held_then == 0, "src1's mail to the site waits"
    assert "src1 is a warm source of pool bulk (weight 1 of 3)" in explained, explained
    assert src1["queued_entries"] == HELD_EACH and src1["state"] == "held", src1
    assert src1["suspended"]["target"] == f"site {SITE} in transport src1", src1
    assert suspension["target"] == f"site {SITE} in transport src1"
    assert record["transport"] == "src1" and record["site"] == SITE, record
    assert "no site name after 'src1:site:'" in errors["empty"]
    assert "no transport 'src9' (not a master.cf service)" in errors["unknown"]
    assert "local has no sites" in errors["no sites"]
    assert "no spaces" in errors["spaces"]
    assert "longer than 300 characters" in errors["long"]
