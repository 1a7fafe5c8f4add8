"""Three Postfix servers with pyqmgr as one sender: the fleet's limits through one real
Redis, against a sink that takes 5 sessions and answers 421 beyond (issue #23).

Each server is a real Postfix instance (its own master, queue and smtp agents) whose
qmgr is pyqmgr with ``shared_state`` pointing at one redis-server; the sink sees all
three as one client (127.0.0.1), as a provider sees one sender's relays. Three stock
servers against the same kind of sink, in the same report as pyqmgr's fleet, are
compat/workloads/fleet-421.toml, run by tests/test_compare_real.py: stock's servers
each open their own 5 and meet the 421s.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from pyqmgr.control.client import ClientError, request
from pyqmgr.control.render import status_lines
from pyqmgr.fleet.shared import bucket
from pyqmgr.testbed.instance import PostfixInstance, wait_until
from pyqmgr.testbed.redis import RedisServer
from pyqmgr.testbed.sink import SinkServer

NODES = 3
PER_NODE = 60
SINK_SESSIONS = 5
LATENCY = 0.2
#: One session per delivery.
SMTP = {"smtp_connection_cache_on_demand": "no"}


def fleet_cf(redis: RedisServer, **extra: str) -> dict[str, str]:
    return {"shared_state": redis.url, "fast_fleet_destination_concurrency_limit":
            str(SINK_SESSIONS), **extra}


def start_nodes(postfix_instance, sink: SinkServer, pyqmgr_cf: dict[str, str] | None,
                qmgr: str = "pyqmgr") -> list[PostfixInstance]:
    return [postfix_instance(
        qmgr=qmgr, pyqmgr_cf=None if pyqmgr_cf is None else {
            **pyqmgr_cf, "shared_state_node": f"node{i}"},
        transports={"big.example": f"fast:[127.0.0.1]:{sink.port}"},
        master_cf_extra=["fast unix - - n - 20 smtp"], main_cf=SMTP)
        for i in range(NODES)]


def one_node(postfix_instance, srv: SinkServer, pyqmgr_cf: dict[str, str],
             main_cf: dict[str, str] | None = None) -> PostfixInstance:
    """One pyqmgr server whose "fast" transport goes to the sink."""
    return postfix_instance(
        qmgr="pyqmgr", pyqmgr_cf=pyqmgr_cf,
        transports={"big.example": f"fast:[127.0.0.1]:{srv.port}"},
        master_cf_extra=["fast unix - - n - 20 smtp"], main_cf=main_cf or SMTP)


def send_all(nodes: list[PostfixInstance], tag: str, per_node: int = PER_NODE) -> None:
    """Each node gets its share at once, in parallel, as a busy relay would."""
    errors: list[BaseException] = []

    def send(i: int, pf: PostfixInstance) -> None:
        try:
            pf.smtp_send([("s@test.example", [f"{tag}{i}-{k}@big.example"])
                          for k in range(per_node)])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(i, pf)) for i, pf in enumerate(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def deferred(nodes: list[PostfixInstance]) -> int:
    return sum(len(pf.maillog.lines(contains="status=deferred")) for pf in nodes)


def run_workload(nodes: list[PostfixInstance], sink: SinkServer, tag: str,
                 timeout: float = 120) -> tuple[float, float]:
    """Send the workload; wait until every recipient is at the sink. (busy share, s)."""
    started = time.monotonic()
    send_all(nodes, tag)
    total = NODES * PER_NODE
    # A deferred message waits out its backoff: what counts is each one's first try.
    nodes[0].wait_until(lambda: len(sink.messages()) + deferred(nodes) >= total, timeout,
                        f"all {total} messages at the sink or deferred")
    took = time.monotonic() - started
    stats = sink.snapshot()
    return stats.mean_concurrency() / SINK_SESSIONS, took


def test_three_nodes_keep_to_the_fleets_five_sessions(postfix_instance, sink, redis_server):
    redis = redis_server()
    srv: SinkServer = sink(latency=LATENCY, client_limit=SINK_SESSIONS)
    nodes = start_nodes(postfix_instance, srv, fleet_cf(redis))
    busy, took = run_workload(nodes, srv, "f")
    stats = srv.snapshot()
    total = NODES * PER_NODE
    defers = deferred(nodes)
    print(f"\nfleet of {NODES}: {total} messages in {took:.1f} s; sink at most "
          f"{stats.max_concurrent} sessions, busy {busy:.0%} of {SINK_SESSIONS}; "
          f"421s {stats.rejected_421} of {stats.sessions} sessions; deferrals {defers}")
    # Every session beyond the sink's five is answered 421: none means the sink never
    # saw more than the fleet's limit.
    assert stats.rejected_421 == 0 and stats.max_concurrent <= SINK_SESSIONS
    assert defers < 0.05 * total
    fleets = reply_fleet(nodes)
    asked, trips = (sum(f[k] for f in fleets) for k in ("asked", "round_trips"))
    handed, kept = (sum(f[k] for f in fleets) for k in ("handed", "kept"))
    print(f"Redis asked {asked} times for {total} starts ({asked / total:.2f} a start); "
          f"{trips} round trips in all, start and end ({trips / total:.2f} a delivery); "
          f"sessions handed to another server {handed} times, kept for the next "
          f"delivery {kept} times")
    # One round trip a delivery: the release at its end passes the session on to the
    # next start, here or on another server; beyond that only each server's first
    # questions and last releases.
    assert trips <= total + NODES * (SINK_SESSIONS + 2), trips
    # A session lost for the whole run caps this at 4 of 5 (0.8); a
    # serialising fleet at 1 of 5. Above 0.8 is what the fleet guarantees; the
    # rest is the ramp and the tail, which the machine's load moves (89.996% in
    # one CI run, 90-95% here).
    assert busy > 0.8, f"the sink was busy {busy:.0%} of its {SINK_SESSIONS} sessions"
    assert max(stats.delivered.values()) == 1, "a recipient delivered twice"
    for pf in nodes:
        assert not pf.maillog.lines(contains="shared state"), "Redis was there all along"
    # pyqmgr status names each node's share of the fleet's sessions.
    reply = request(os.path.join(nodes[0].queue_dir, "pyqmgr", "control"), "status",
                    timeout=10)
    fleet = reply["fleet"]
    assert fleet["node"] == "node0" and fleet["connected"] and fleet["admitted"] == PER_NODE
    (dest,) = fleet["destinations"]
    assert dest["transport"] == "fast" and dest["limit"] == SINK_SESSIONS
    text = "\n".join(status_lines(reply))
    print(text.split("\n\n")[-2] if "fleet:" in text else text)
    assert re.search(r"fleet: node node0, shared state redis://127\.0\.0\.1:\d+ \(connected",
                     text)
    assert re.search(r"\d of 5 fleet sessions, \d here", text), text


@pytest.mark.parametrize("mode", ["local", "hold"])
def test_redis_gone_at_start_follows_the_failure_mode(postfix_instance, sink, redis_server,
                                                      mode):
    """Redis stopped before any mail: local delivers under each node's own limits with
    a warning; hold delivers nothing to the shared destination until Redis is back."""
    redis = redis_server()
    srv: SinkServer = sink(latency=0.05)
    (pf,) = [postfix_instance(
        qmgr="pyqmgr", pyqmgr_cf=fleet_cf(redis, shared_state_failure=mode,
                                          shared_state_timeout="200ms"),
        transports={"big.example": f"fast:[127.0.0.1]:{srv.port}"},
        master_cf_extra=["fast unix - - n - 20 smtp"], main_cf=SMTP)]
    redis.stop(remove=False)
    pf.smtp_send([("s@test.example", [f"r{k}@big.example"]) for k in range(10)])
    warning = pf.maillog.wait_for(r"warning: shared state redis://127\.0\.0\.1:\d+: ", 30)
    assert f"shared_state_failure = {mode}" in warning[0].text
    if mode == "local":
        pf.wait_until(lambda: len(srv.messages()) == 10, 30, "local delivery without Redis")
    else:
        time.sleep(2)
        assert srv.messages() == [], "hold must start nothing while Redis is gone"
        assert pf.queue_counts()["active"] == 10
        redis.start()
        pf.wait_until(lambda: len(srv.messages()) == 10, 30, "delivery once Redis is back")
        pf.maillog.wait_for("answering again; fleet limits apply", 10)
    assert len(pf.maillog.lines(contains="warning: shared state")) == 1, "one a minute"


def test_a_fleet_rate_of_10_a_second_across_three_nodes(postfix_instance, sink, redis_server):
    """fast_fleet_destination_rate = 10/1s with a burst of 2: the sink, which sees every
    node, never gets more than 10 + 2 new sessions in any second."""
    redis = redis_server()
    srv: SinkServer = sink(latency=0.05)
    cf = {"shared_state": redis.url, "fast_fleet_destination_rate": "10/1s",
          "fast_fleet_destination_rate_burst": "2"}
    nodes = start_nodes(postfix_instance, srv, cf)
    per_node = 20
    send_all(nodes, "r", per_node)
    total = NODES * per_node
    nodes[0].wait_until(lambda: len(srv.messages()) >= total, 60, f"{total} at the sink")
    opened = sorted(srv.snapshot().opened)
    most = max(sum(1 for s in opened if t <= s < t + 1.0) for t in opened)
    span = opened[-1] - opened[0]
    print(f"\nfleet rate 10/1s burst 2 over {NODES} nodes: {total} sessions in {span:.1f} s, "
          f"at most {most} in any second")
    assert most <= 10 + 2, most
    # And near the rate, not far below it: 60 starts at 10/s take about 6 s.
    assert span < (total - 2) / 10 * 1.3, span
    assert max(srv.snapshot().delivered.values()) == 1


def holders(redis: RedisServer) -> list[str]:
    """The fleet's unexpired leases on the sink's destination, read by hand (the queue
    is named after the nexthop, [127.0.0.1]:PORT, as on every node)."""
    keys = redis.command("KEYS", "pyqmgr:{*}:sessions:fast:*")
    assert isinstance(keys, list)
    found: list[str] = []
    for key in keys:
        assert isinstance(key, bytes)
        reply = redis.command("ZRANGEBYSCORE", key.decode(), str(int(time.time() * 1000)),
                              "+inf")
        assert isinstance(reply, list)
        found += [m.decode() for m in reply if isinstance(m, bytes)]
    return found


def test_a_killed_nodes_sessions_come_back_to_the_fleet(postfix_instance, sink,
                                                        redis_server):
    """kill -9 of one node's qmgr mid-run: its leases expire within the lease time (2 s
    here), the other nodes take its share, and nothing is lost or delivered twice."""
    redis = redis_server()
    srv: SinkServer = sink(latency=LATENCY, client_limit=SINK_SESSIONS)
    nodes = start_nodes(postfix_instance, srv, fleet_cf(redis, shared_state_lease_time="2s"))
    send_all(nodes, "k")
    total = NODES * PER_NODE
    nodes[0].wait_until(lambda: len(srv.messages()) >= 40, 60, "40 messages at the sink")
    dead = nodes[0].qmgr_pid()
    # Sessions pass from server to server at every delivery's end, so a server may
    # hold none at a given instant: kill it at one when it holds some.
    nodes[0].wait_until(lambda: any(h.startswith("node0/") for h in holders(redis)), 30,
                        "node0 holding a fleet session", interval=0.005)
    os.kill(dead, signal.SIGKILL)
    killed = time.monotonic()
    # Its leases are still counted for a moment, then no more.
    held = [h for h in holders(redis) if h.startswith("node0/")]
    nodes[1].wait_until(lambda: not any(h.startswith("node0/") for h in holders(redis)),
                        10, "the dead node's leases to expire")
    gone = time.monotonic() - killed
    # master starts a new qmgr at the next trigger (its 300 s wakeup at the latest): a
    # flush is that trigger, as in the parity suite's kill -9 trials.

    def all_delivered() -> bool:
        nodes[0].postqueue("-f")
        return len(srv.messages()) + deferred(nodes) >= total

    nodes[0].wait_until(all_delivered, 120, "every message delivered", interval=1.0)
    stats = srv.snapshot()
    print(f"\nkill -9 of one node's qmgr: {len(held)} leases held, gone {gone:.1f} s after; "
          f"{len(srv.messages())} delivered, 421s {stats.rejected_421}, deferrals "
          f"{deferred(nodes)}")
    assert held, "the killed node held fleet sessions when it died"
    assert gone <= 2.5, "the dead node's leases outlived shared_state_lease_time"
    assert stats.rejected_421 == 0
    assert len(srv.messages()) == total and max(stats.delivered.values()) == 1


def test_postfix_stop_gives_the_kept_sessions_back_at_once(postfix_instance, redis_server):
    """At the end of a busy spell a node keeps the sessions of its last deliveries for
    the next ones (Fleet.spares, given back after a second unused). ``postfix stop``
    (SIGTERM) right then must give them back, not leave them counted for the lease
    time (60 s) while the other nodes wait: seen as 19 of 20 sessions held for a
    minute after a drain in ./dev bench drain's fleet pairs, whose discard
    deliveries end many at a time."""
    redis = redis_server()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"discard.example": "discard:"},
        pyqmgr_cf={"shared_state": redis.url,
                    "discard_fleet_destination_concurrency_limit": "20"})
    n = 2000
    pf.preload([("s@discard.example", [f"r{i}@discard.example"]) for i in range(n)])
    key = f"pyqmgr:{{{bucket('discard', 'discard.example')}}}:sessions:discard:discard.example"
    pf.release_preload()
    pf.wait_until(pf.queue_empty, 120, f"{n} messages drained", interval=0.01)
    kept = redis.command("ZCARD", key)
    pf.stop()
    left = redis.command("ZCARD", key)
    print(f"\nsessions counted at the drain's end {kept}, after postfix stop {left}")
    assert kept, "the drain kept no session for a next delivery: nothing tested"
    assert left == 0, f"{left} sessions still counted after the node stopped"
    assert pf.maillog.lines(contains="shared state") == []


@pytest.mark.parametrize("mode", ["local", "hold"])
def test_redis_stopped_mid_run_and_back(postfix_instance, sink, redis_server, mode):
    """Redis goes away while mail flows and comes back: the failure mode holds meanwhile
    (one warning), nothing is lost or doubled, and fleet limits apply again after."""
    redis = redis_server()
    srv: SinkServer = sink(latency=0.1, client_limit=SINK_SESSIONS)
    # One node, whose own limit is the sink's: with Redis gone, local means that limit.
    # smtp(8) waits for the sink's answer to QUIT here: with Redis gone nothing waits
    # out the moment a server still counts a session its client has left (the fleet's
    # and a site's QUIT_GRACE), and a delivery started in it met the sink's limit,
    # was deferred for an hour, and was not at the sink within the test's minute
    # (CI, twice, under load: "421 too many connections" during the outage).
    (node,) = [postfix_instance(
        qmgr="pyqmgr", pyqmgr_cf=fleet_cf(redis, shared_state_failure=mode,
                                          shared_state_timeout="200ms"),
        transports={"big.example": f"fast:[127.0.0.1]:{srv.port}"},
        master_cf_extra=["fast unix - - n - 20 smtp"],
        main_cf={**SMTP, "fast_destination_concurrency_limit": str(SINK_SESSIONS),
                 "smtp_skip_quit_response": "no"})]
    nodes = [node]
    total = 60
    nodes[0].smtp_send([("s@test.example", [f"m{k}@big.example"]) for k in range(total)])
    nodes[0].wait_until(lambda: len(srv.messages()) >= 15, 60, "15 at the sink")
    redis.stop(remove=False)
    nodes[0].maillog.wait_for(f"shared_state_failure = {mode}", 20)
    at_stop = len(srv.messages())
    time.sleep(1.5)
    during = len(srv.messages()) - at_stop
    redis.start()
    # The client tries Redis again a second after its last failure (fail-fast until
    # then); more mail after that is asked about again and goes by the fleet's limits.
    time.sleep(1.5)
    more = 10
    nodes[0].smtp_send([("s@test.example", [f"n{k}@big.example"]) for k in range(more)])
    nodes[0].maillog.wait_for("answering again; fleet limits apply", 20)
    total += more

    def missing() -> str:
        # What a timeout needs to be understood (CI saw one once, under load, with
        # the last lines all deliveries): whose mail is not at the sink, what the
        # maillog says of it, and the fleet's own view.
        got = {r for m in srv.messages() for r in m.recipients}
        lost = [f"{p}{k}@big.example" for p, n in (("m", 60), ("n", more))
                for k in range(n) if f"{p}{k}@big.example" not in got]
        said = [ln.raw for ln in nodes[0].maillog.lines()
                if any(f"<{r}>" in ln.text for r in lost[:5]) or "fleet" in ln.text
                or "shared state" in ln.text]
        try:
            fleet = reply_fleet(nodes)
        except Exception as exc:  # noqa: BLE001 - a diagnosis must not hide the timeout
            fleet = [{"error": str(exc)}]
        return (f"; not at the sink: {lost[:10]} ({len(lost)}); fleet: {fleet}; their "
                "lines and the fleet's:\n" + "\n".join(said[-40:]))

    wait_until(lambda: len(srv.messages()) >= total, 60, "all at the sink", detail=missing)
    print(f"\nRedis gone for 1.5 s ({mode}): {during} delivered meanwhile")
    if mode == "local":
        assert during > 5, "local delivers on under the node's own limits"
    else:
        assert during <= SINK_SESSIONS, "hold starts nothing new while Redis is gone"
    stats = srv.snapshot()
    assert max(stats.delivered.values()) == 1 and len(stats.delivered) == total
    # The sink has the last message before smtp(8)'s reply reaches qmgr and qmgr
    # removes its file: wait for that, bounded (a message left queued still fails).
    nodes[0].wait_queue_empty(30)


def reply_fleet(nodes: list[PostfixInstance]) -> list[dict[str, object]]:
    """Each node's fleet block of ``pyqmgr status``."""
    return [request(os.path.join(pf.queue_dir, "pyqmgr", "control"), "status",
                    timeout=10)["fleet"] for pf in nodes]


def cli(pf: PostfixInstance, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pyqmgr.cli", *args, "--config-dir",
                           pf.config_dir], capture_output=True, text=True, timeout=30,
                          check=False)


def suspended(pf: PostfixInstance) -> list[str]:
    reply = request(os.path.join(pf.queue_dir, "pyqmgr", "control"), "status", timeout=10)
    return [str(s["target"]) for s in reply["suspensions"]]


HELD = "transport fast"


def answers(pf: PostfixInstance) -> bool:
    try:
        suspended(pf)
    except ClientError:
        return False
    return True


def test_a_fleet_suspension_holds_on_every_node_and_ends_on_every_node(
        postfix_instance, sink, redis_server):
    """pyqmgr suspend --fleet on one node: all three hold the mail within a second, and
    each says who and why in its maillog; pyqmgr resume --fleet on another node ends it
    on all three."""
    redis = redis_server()
    srv: SinkServer = sink(latency=0.05)
    nodes = start_nodes(postfix_instance, srv, fleet_cf(redis))
    for pf in nodes:
        pf.wait_until(lambda pf=pf: answers(pf), 20, "the control socket answering")
    proc = cli(nodes[0], "suspend", "fast:", "--fleet", "--reason", "provider asked",
               "--ttl", "1h")
    assert proc.returncode == 0, proc.stderr
    made = time.monotonic()
    for pf in nodes:
        pf.wait_until(lambda pf=pf: HELD in suspended(pf), 2, "the fleet's suspension")
    took = time.monotonic() - made
    print(f"\nsuspended on all three {took:.2f} s after the control returned")
    assert took <= 1.0
    for pf in nodes[1:]:
        line = pf.maillog.wait_for("control: suspend transport fast", 5)[0].text
        assert "on node0 (fleet)" in line and "reason: provider asked" in line, line
    # A server that starts later reads the fleet's table when it subscribes.
    late = postfix_instance(
        qmgr="pyqmgr", pyqmgr_cf={**fleet_cf(redis), "shared_state_node": "late"},
        transports={"big.example": f"fast:[127.0.0.1]:{srv.port}"},
        master_cf_extra=["fast unix - - n - 20 smtp"], main_cf=SMTP)
    late.wait_until(lambda: answers(late) and HELD in suspended(late), 20,
                    "the late server holding the fleet's suspension")
    late.stop()
    send_all(nodes, "h")
    time.sleep(2)
    assert srv.messages() == [], "every node holds the suspended transport's mail"
    # A server down while the suspension ends keeps it in its state file: when it
    # comes back, the fleet's table says it is over.
    nodes[2].stop()
    proc = cli(nodes[1], "resume", "fast:", "--fleet")
    assert proc.returncode == 0, proc.stderr
    ended = time.monotonic()
    for pf in nodes[:2]:
        pf.wait_until(lambda pf=pf: HELD not in suspended(pf), 2, "the end of it")
    print(f"resumed on the two running {time.monotonic() - ended:.2f} s after")
    assert time.monotonic() - ended <= 1.0
    nodes[2].start()
    nodes[2].wait_until(lambda: answers(nodes[2]) and HELD not in suspended(nodes[2]), 20,
                        "the restarted server ending the fleet's ended suspension")
    line = nodes[0].maillog.wait_for("control: resume transport fast", 5)[0].text
    assert "on node1 (fleet)" in line, line
    total = NODES * PER_NODE
    nodes[0].wait_until(lambda: len(srv.messages()) >= total, 60, "the held mail delivered")
    assert max(srv.snapshot().delivered.values()) == 1


def test_explain_names_the_fleets_share(postfix_instance, sink, redis_server):
    """A destination waiting for a fleet session: explain says so, with the share."""
    redis = redis_server()
    srv: SinkServer = sink(latency=3.0)
    pf = one_node(postfix_instance, srv, {
        "shared_state": redis.url, "fast_fleet_destination_concurrency_limit": "1"})
    pf.smtp_send([("s@test.example", [f"e{k}@big.example"]) for k in range(3)])
    path = os.path.join(pf.queue_dir, "pyqmgr", "control")
    target = f"[127.0.0.1]:{srv.port}"
    texts: list[str] = []

    def waiting() -> bool:
        reply = request(path, "explain", {"target": target}, timeout=10)
        texts[:] = [str(r.get("text")) for r in reply.get("reasons", [])]
        return any("waits for a fleet session: 1 of 1 in use, 1 here" in t for t in texts)

    pf.wait_until(waiting, 10, "explain naming the fleet's share")
    print(f"\nexplain {target}: {texts}")
    pf.wait_until(lambda: len(srv.messages()) == 3, 30, "all three, one at a time")
    assert srv.snapshot().max_concurrent == 1


def test_a_fleet_limit_on_per_recipient_queues_is_a_warning(postfix_instance, sink,
                                                            redis_server):
    """With destination_recipient_limit = 1 every recipient is a destination (Postfix's
    rule): the fleet's limit would count per recipient, and the maillog says so."""
    redis = redis_server()
    srv: SinkServer = sink(latency=0.05)
    pf = one_node(postfix_instance, srv, fleet_cf(redis),
                  {**SMTP, "fast_destination_recipient_limit": "1"})
    pf.smtp_send([("s@test.example", ["a@big.example", "b@big.example"])])
    (line,) = pf.maillog.wait_for("makes each recipient a destination", 20)
    assert line.severity == "warning" and "fleet's limits for fast count per recipient" \
        in line.text, line.text
    pf.wait_until(lambda: len(srv.messages()) == 2, 20, "both delivered all the same")


def test_mail_after_a_busy_spell_asks_the_fleet_at_once(postfix_instance, sink,
                                                        redis_server):
    """A server refused while the fleet's sessions were all in use waits to be handed
    one (asking again only after a quarter of the lease time, 15 s here). Once it has
    nothing more waiting for the destination that is over: the next message, minutes
    or a moment later, asks at once."""
    redis = redis_server()
    srv: SinkServer = sink(latency=0.3)
    pf = one_node(postfix_instance, srv, {
        "shared_state": redis.url, "fast_fleet_destination_concurrency_limit": "1"})
    pf.smtp_send([("s@test.example", [f"b{k}@big.example"]) for k in range(3)])
    pf.wait_until(lambda: len(srv.messages()) == 3, 30, "the busy spell, one at a time")
    refused = request(os.path.join(pf.queue_dir, "pyqmgr", "control"), "status",
                      timeout=10)["fleet"]["sessions_full"]
    assert refused > 0, "the spell had this server wait for the fleet's one session"
    time.sleep(0.5)
    sent = time.monotonic()
    pf.smtp_send([("s@test.example", ["late@big.example"])])
    pf.wait_until(lambda: len(srv.messages()) == 4, 10, "the late message")
    took = time.monotonic() - sent
    print(f"\nthe message after the spell delivered {took:.2f} s after submission")
    assert took < 3.0


def test_redis_losing_its_data_mid_run_loosens_no_limit(postfix_instance, sink,
                                                         redis_server):
    """Three servers, a sink that takes 5 sessions, a fleet suspension of another
    destination; mid-run Redis is flushed, and later restarted empty (issue #31).
    The sink never sees a sixth session: the fleet counts its deliveries again before
    it starts another; and the suspension holds on every server and is written back,
    where a flush once lifted it everywhere."""
    redis = redis_server()
    # Deliveries of 2 s, leases of 6 s renewed every 2 s: deliveries under way when
    # Redis loses its data are still under way at the recount and the next renewal.
    srv: SinkServer = sink(latency=2.0, client_limit=SINK_SESSIONS)
    nodes = start_nodes(postfix_instance, srv, fleet_cf(
        redis, shared_state_failure="hold", shared_state_lease_time="6s"))
    for pf in nodes:
        pf.wait_until(lambda pf=pf: answers(pf), 20, "the control socket answering")
    held = "destination other.example"
    proc = cli(nodes[0], "suspend", "other.example", "--fleet", "--reason", "asked",
               "--ttl", "1h")
    assert proc.returncode == 0, proc.stderr
    for pf in nodes:
        pf.wait_until(lambda pf=pf: held in suspended(pf), 5, "the fleet's suspension")
    per_node = 20
    total = NODES * per_node
    send_all(nodes, "l", per_node)
    nodes[0].wait_until(lambda: len(srv.messages()) >= 10, 60, "deliveries under way")
    assert redis.command("FLUSHALL") == "OK"
    flushed = len(srv.messages())
    nodes[0].wait_until(lambda: len(srv.messages()) >= flushed + 15, 60,
                        "deliveries after the flush")
    redis.stop(remove=False)
    time.sleep(0.5)
    redis.start()
    nodes[0].wait_until(lambda: len(srv.messages()) + deferred(nodes) >= total, 180,
                        f"all {total} messages at the sink or deferred")
    stats = srv.snapshot()
    fleets = reply_fleet(nodes)
    print(f"\nflushed after {flushed} messages, restarted empty later: sink at most "
          f"{stats.max_concurrent} sessions, 421s {stats.rejected_421}, deferrals "
          f"{deferred(nodes)}; starts held for a recount "
          f"{sum(int(f['recount_wait']) for f in fleets)}, leases counted again "
          f"{sum(int(f['leases_recounted']) for f in fleets)}")
    assert stats.rejected_421 == 0 and stats.max_concurrent <= SINK_SESSIONS
    assert max(stats.delivered.values()) == 1
    assert sum(int(f["leases_recounted"]) for f in fleets) >= 1
    # The suspension holds everywhere and is in Redis again.
    for pf in nodes:
        assert held in suspended(pf), pf.config_dir
    nodes[0].wait_until(lambda: redis.command("HEXISTS", "pyqmgr:suspensions",
                                              "other.example") == 1,
                        20, "the suspension written back to Redis")
    assert any(pf.maillog.lines(contains="is missing from Redis") for pf in nodes)


def test_a_fleet_suspension_made_while_redis_is_down_holds_and_is_shared_later(
        postfix_instance, sink, redis_server):
    """suspend --fleet while Redis is down: the command succeeds and the suspension
    holds here; when Redis is back it is written to the fleet's table, not undone
    (issue #31: the reconnection's sync once ended it)."""
    redis = redis_server()
    srv: SinkServer = sink(latency=0.05)
    pf = one_node(postfix_instance, srv, {**fleet_cf(redis), "shared_state_node": "solo",
                                          "shared_state_timeout": "200ms"})
    pf.wait_until(lambda: answers(pf), 20, "the control socket answering")
    redis.stop(remove=False)
    proc = cli(pf, "suspend", "other.example", "--fleet", "--reason", "asked", "--ttl", "1h")
    assert proc.returncode == 0, proc.stderr
    held = "destination other.example"
    assert held in suspended(pf)
    pf.maillog.wait_for("holds on this server until Redis is back", 10)
    redis.start()
    pf.wait_until(lambda: redis.command("HEXISTS", "pyqmgr:suspensions",
                                        "other.example") == 1, 30,
                  "the suspension written to the fleet's table once Redis is back")
    time.sleep(1)
    assert held in suspended(pf), "the reconnection ended the suspension"
    # Records that are not records, from anyone who reaches Redis: read as nothing,
    # never a failed task (which would end the daemon, again at every restart).
    pid = pf.qmgr_pid()
    bad = ('{"target": "x", "reason": "r", "by": "b", "node": "n", "until": 1'
           + "0" * 400 + "}")
    redis.command("HSET", "pyqmgr:suspensions", "bad.example", bad)
    redis.command("HSET", "pyqmgr:suspensions", "deep.example", "[" * 100_000)
    redis.command("PUBLISH", "pyqmgr:suspensions", "{}")
    time.sleep(1.5)
    assert pf.qmgr_pid() == pid and not pf.maillog.lines(contains="fatal")
    assert held in suspended(pf)
    # A resume while Redis is down holds too: written when Redis is back, not undone
    # by the record the table has again (Redis comes back from a snapshot taken
    # while the suspension was in force).
    assert redis.command("SAVE") == "OK"
    redis.stop(remove=False)
    proc = cli(pf, "resume", "other.example", "--fleet")
    assert proc.returncode == 0, proc.stderr
    redis.start()
    pf.wait_until(lambda: b'"ended": true' in (redis.command(
        "HGET", "pyqmgr:suspensions", "other.example") or b""), 30,
        "the resume's tombstone in the fleet's table")
    time.sleep(1)
    assert held not in suspended(pf), "the reconnection suspended it again"
