"""One contender's run: a fresh Postfix instance, a sink per destination, the workload.

The instance is the test bed's (:class:`~pyqmgr.testbed.instance.PostfixInstance`: real
master(8), smtpd, cleanup and smtp on loopback, its own maillog). Each destination is a
port on 127.0.0.1 reached through ``transport_maps``: a sink SMTP server playing its
latency, 4xx/5xx shares, 421 session limit and rate limit; a bound socket that listens
to nothing for a dead host (connections refused); or a socket whose accept queue is
full and never drained for a host that never answers (every SYN dropped: the connect
times out).

Destinations that name an MX host (``mx = "HOST"``, issue #33) are routed as mail
really goes: one sink per host, shared by its destinations (its session and rate
limits count them together; latency and replies stay each destination's, chosen by
the recipient's domain), and a real DNS server (unbound on loopback,
:class:`~pyqmgr.testbed.dns.DnsServer`) answering each domain's MX record with HOST
and HOST's A record with 127.0.0.1. The instances are started in its mount namespace
(``/etc/resolv.conf`` names it) with ``smtp_host_lookup = dns`` and next hop
``DOMAIN:PORT``, so Postfix's smtp(8) looks the MX up itself and pyqmgr's sites
(``site_grouping = mx``) see the same records. Without unbound such a run is refused
(:func:`dns_lacking`): routing them otherwise would measure another world.

Messages are submitted over SMTP at their scaled arrival times by a few sessions in
threads, so the qmgr runs all along, as in production (a preloaded queue would start it
with everything in ``incoming/``). The run ends when every recipient is delivered or
bounced (a destination dead for the whole run: deferred at least once), or at the
timeout. What it leaves in its directory is raw: the maillog, and ``run.json`` with
what was submitted when (queue ids), what each sink saw, and the qmgr process's CPU
time (``/proc/PID/schedstat``) and peak resident memory (``VmHWM``), read while it runs
because stock qmgr's numbers are gone once it exits. :mod:`.figures` computes
everything else from these files.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import random
import smtplib
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pyqmgr.compare.contender import Contender
from pyqmgr.compare.figures import DeliveryLine, parse_delivery
from pyqmgr.compare.plan import Arrival, Plan, parse_address
from pyqmgr.compare.servers import Servers, fleet_cf
from pyqmgr.compare.sources import (
    master_cf_line,
    plan_root,
    quotas,
    real_cf,
    source_addresses,
)
from pyqmgr.compare.sources import record as sources_record
from pyqmgr.install import InstallError
from pyqmgr.output import open_new, output_dir
from pyqmgr.simulator.scenario import Destination, parse_script
from pyqmgr.testbed import dns
from pyqmgr.testbed.instance import BASE_ENV, PostfixInstance, TestbedError

if TYPE_CHECKING:
    # Imported where a sink is made: the sink needs aiosmtpd (the testbed extra), and
    # this module is imported with the compare package, which replay uses on a base
    # install.
    from pyqmgr.testbed.content_filter import ContentFilter
    from pyqmgr.testbed.sink import SinkServer

#: SMTP sessions that submit the workload at once.
SUBMITTERS = 4
#: Seconds between two looks at the maillog and the qmgr process.
POLL = 0.1


class RunError(RuntimeError):
    """The run could not be made (Postfix did not start, submission failed...)."""


def _unit(*parts: object) -> float:
    """A number in [0, 1) fixed by its inputs: the same recipients fail in every run."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


# -- the world: sinks, dead hosts --------------------------------------------------------


class _Host:
    """One server's port on loopback, as the workload says it behaves: a destination's
    own, or an MX host's, shared by the destinations that name it (``dests``, whose
    server settings agree: plan.mx_hosts checked; the first's are the server's)."""

    def __init__(self, dests: list[Destination], seed: int,
                 scripts: dict[str, str] | None = None, mx: str = "") -> None:
        dest = self.dest = dests[0]
        self.dests = {d.name: d for d in dests}
        #: The MX host's name; empty for a destination's own server.
        self.mx = mx
        self.sink: SinkServer | None = None
        self._socks: list[socket.socket] = []
        self._timer: threading.Timer | None = None
        if dest.dead and dest.dead_mode == "timeout":
            # listen(0) and one connection of our own in the accept queue, never
            # accepted: the kernel drops every further SYN, so connects time out.
            lsock = socket.socket()
            lsock.bind(("127.0.0.1", 0))
            lsock.listen(0)
            filler = socket.create_connection(lsock.getsockname(), timeout=5)
            self._socks += [lsock, filler]
            self.port = int(lsock.getsockname()[1])
            self.kind = "timeout"
            return
        if dest.dead:
            # Bound, not listening: the port is ours and every connect is refused.
            bsock = socket.socket()
            bsock.bind(("127.0.0.1", 0))
            self._socks.append(bsock)
            self.port = int(bsock.getsockname()[1])
            self.kind = "refused"
            return
        # A random stream per destination, named as before hosts were shared, so that
        # a destination of its own draws the same latencies as it always did.
        rngs = {d.name: random.Random(f"{seed} latency {d.name}") for d in dests}
        attempts: dict[str, int] = {}

        def of(addr: str) -> Destination:
            """The destination a recipient is for (the host's first, if none)."""
            return self.dests.get(addr.rpartition("@")[2].lower(), dest)

        def latency(addr: str) -> float:
            d = of(addr)
            return d.latency.draw(rngs[d.name])

        def reply(addr: str) -> str | None:
            dest = of(addr)
            n = attempts[addr] = attempts.get(addr, 0) + 1
            script = parse_script(scripts[addr]) if scripts and addr in scripts else None
            if script is not None:
                # A replayed recipient answers its nth try as the log shows it did.
                # A try that failed as a whole (D, B: a lost connection, a DNS
                # answer) is played as that recipient's 4xx or 5xx at RCPT: the sink
                # keeps its sessions whole, so on real Postfix it throttles nothing.
                code = script[n - 1][0] if n <= len(script) else "s"
                return dest.rcpt_4xx_reply if code in "dD" else \
                    dest.rcpt_5xx_reply if code in "bB" else None
            if dest.rcpt_5xx and _unit(seed, "5xx", addr) < dest.rcpt_5xx:
                return dest.rcpt_5xx_reply
            if dest.rcpt_4xx and _unit(seed, "4xx", addr, n) < dest.rcpt_4xx:
                return dest.rcpt_4xx_reply
            return None

        from pyqmgr.testbed.sink import SinkServer

        self.sink = SinkServer(latency=latency, replies=reply,
                               client_limit=dest.server_limit, rate_limit=dest.rate_limit,
                               rate_reply=dest.rate_reply, reject_delay=dest.reject_time)
        self.port = self.sink.port
        self.kind = "sink"

    def start(self) -> None:
        """Listen now, or at dead_until (until then the bound port refuses)."""
        if self.sink is None:
            return
        if self.dest.dead_until > 0:
            self._timer = threading.Timer(self.dest.dead_until, self._open)
            self._timer.daemon = True
            self._timer.start()
        else:
            self.sink.start()

    def _open(self) -> None:
        if self.sink is not None:
            try:
                self.sink.start()
            except Exception:  # stopped meanwhile
                pass

    def record(self, t0: float, wall0: float) -> dict[str, Any]:
        """What the sink saw; times in seconds since the run's start."""
        out: dict[str, Any] = {"port": self.port, "kind": self.kind}
        if self.sink is None:
            return out
        st = self.sink.snapshot()
        out["received"] = [[round(m.time - wall0, 4), len(m.recipients)]
                           for m in self.sink.messages()]
        out.update({
            "sessions": st.sessions - st.rejected_421 - st.rejected_rate,
            "refused_421": st.rejected_421, "refused_rate": st.rejected_rate,
            "replies": dict(st.replies), "accepted": sum(st.delivered.values()),
            "duplicates": sum(n - 1 for n in st.delivered.values() if n > 1),
            "max_concurrent": st.max_concurrent,
            "timeline": [[round(t - t0, 4), n] for t, n in st.timeline],
        })
        return out

    def domain_records(self, wall0: float) -> dict[str, dict[str, Any]]:
        """An MX host's sink as each of its destinations saw it: what the sink can
        tell apart by recipient (messages accepted, replies at RCPT and DATA); its
        sessions, refusals and timeline are the host's (run.json's ``mx_hosts``)."""
        out: dict[str, dict[str, Any]] = {
            name: {"port": self.port, "kind": "mx", "mx": self.mx, "received": [],
                   "replies": {}, "accepted": 0, "duplicates": 0} for name in self.dests}
        if self.sink is None:
            for rec in out.values():
                rec["host_kind"] = self.kind
            return out

        def domain(addr: str) -> str:
            return addr.rpartition("@")[2].lower()

        for m in self.sink.messages():
            counts: dict[str, int] = {}
            for r in m.recipients:
                counts[domain(r)] = counts.get(domain(r), 0) + 1
            for name, k in counts.items():
                if name in out:
                    out[name]["received"].append([round(m.time - wall0, 4), k])
        st = self.sink.snapshot()
        for addr, n in st.delivered.items():
            if domain(addr) in out:
                out[domain(addr)]["accepted"] += n
                out[domain(addr)]["duplicates"] += max(0, n - 1)
        for addr, given in st.outcomes.items():
            if domain(addr) not in out:
                continue
            replies = out[domain(addr)]["replies"]
            for text in given:
                if text[:1] != "2":
                    code = text.split()[0]
                    replies[code] = replies.get(code, 0) + 1
        for rec in out.values():
            rec["host_kind"] = self.kind
        return out

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.sink is not None:
            self.sink.stop()
        for s in self._socks:
            s.close()


# -- submitting the workload ------------------------------------------------------------


def message_bytes(arrival: Arrival) -> bytes:
    """Headers and a body padded to the workload's size (in bytes, roughly)."""
    head = (f"From: <{arrival.sender}>\r\nTo: undisclosed-recipients:;\r\n"
            f"Subject: workload message m{arrival.mid} ({arrival.klass})\r\n"
            f"X-Workload-Class: {arrival.klass}\r\n\r\n").encode()
    line = b"x" * 76 + b"\r\n"
    need = max(0, arrival.size - len(head))
    body = line * (need // len(line)) + b"x" * max(0, need % len(line) - 2) + b"\r\n"
    return head + body


class Submitter:
    """Submits arrivals at their times over a few SMTP sessions; records queue ids.

    One thread keeps the schedule and hands due messages to SUBMITTERS sessions, so a
    burst of a thousand messages at one instant goes out as fast as smtpd takes it
    while later arrivals still leave on time.
    """

    def __init__(self, port: int, arrivals: list[Arrival], t0: float) -> None:
        self.port = port
        self.arrivals = sorted(arrivals, key=lambda a: (a.at, a.mid))
        self.t0 = t0
        self.work: queue.Queue[Arrival | None] = queue.Queue()
        self.done: dict[int, tuple[str, float]] = {}
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self._threads = [threading.Thread(target=self._schedule, name="schedule",
                                          daemon=True)]
        self._threads += [threading.Thread(target=self._session, name=f"submit{i}",
                                           daemon=True) for i in range(SUBMITTERS)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def finished(self) -> bool:
        with self.lock:
            return len(self.done) + len(self.errors) >= len(self.arrivals)

    def _schedule(self) -> None:
        for a in self.arrivals:
            delay = self.t0 + a.at - time.monotonic()
            if delay > 0 and self.stop.wait(delay):
                break
            self.work.put(a)
        for _ in range(SUBMITTERS):
            self.work.put(None)

    def _session(self) -> None:
        smtp: smtplib.SMTP | None = None
        try:
            while not self.stop.is_set():
                a = self.work.get()
                if a is None:
                    return
                try:
                    if smtp is None:
                        smtp = smtplib.SMTP("127.0.0.1", self.port, timeout=60)
                        smtp.ehlo("submit.test.example")
                    qid = self._send(smtp, a)
                    with self.lock:
                        self.done[a.mid] = (qid, time.monotonic() - self.t0)
                except (OSError, smtplib.SMTPException, RunError) as exc:
                    with self.lock:
                        self.errors.append(f"message m{a.mid}: {exc}")
                    smtp = None
        finally:
            if smtp is not None:
                try:
                    smtp.quit()
                except (OSError, smtplib.SMTPException):
                    pass

    @staticmethod
    def _send(smtp: smtplib.SMTP, a: Arrival) -> str:
        code, resp = smtp.mail(a.sender)
        if code != 250:
            raise RunError(f"smtpd refused sender {a.sender}: {code} {resp!r}")
        for r in a.recipients:
            code, resp = smtp.rcpt(r)
            if code >= 400:
                smtp.rset()
                raise RunError(f"smtpd refused {r}: {code} {resp!r}")
        code, resp = smtp.data(message_bytes(a))
        if code != 250:
            raise RunError(f"smtpd refused the message: {code} {resp!r}")
        return resp.decode().rsplit(" ", 1)[-1]

    def close(self) -> None:
        self.stop.set()
        for _ in range(SUBMITTERS):
            self.work.put(None)
        for t in self._threads:
            t.join(5)


# -- the qmgr process -------------------------------------------------------------------


def proc_sample(pid: int) -> tuple[int, int] | None:
    """(nanoseconds on a CPU, VmHWM in KiB) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            on_cpu = int(f.read().split()[0])
        hwm = 0
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    hwm = int(line.split()[1])
        return on_cpu, hwm
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class QmgrMeter:
    """CPU and peak memory of whatever qmgr processes ran, from a baseline on.

    The baseline is taken once the first qmgr is idle after start-up, so the figure is
    the work the workload caused (pyqmgr's interpreter start-up is not in it). A qmgr
    that restarts (a crash, a reload) is counted in full from its first sample.
    """

    pf: PostfixInstance
    baseline: dict[int, int] = field(default_factory=dict)
    last: dict[int, tuple[int, int]] = field(default_factory=dict)
    samples: int = 0

    def settle(self, timeout: float = 10.0) -> None:
        pid = self.pf.qmgr_pid(timeout=timeout)
        deadline = time.monotonic() + timeout
        prev = proc_sample(pid)
        while time.monotonic() < deadline:
            time.sleep(0.25)
            now = proc_sample(pid)
            if now is None or prev is None or now[0] - prev[0] < 2_000_000:
                prev = now
                break
            prev = now
        if prev is not None:
            self.baseline[pid] = prev[0]
            self.last[pid] = prev

    def sample(self) -> None:
        for pid in self.pf.pids("qmgr"):
            got = proc_sample(pid)
            if got is not None:
                self.last[pid] = got
                self.baseline.setdefault(pid, 0)
                self.samples += 1

    def record(self) -> dict[str, Any]:
        cpu = sum(self.last[p][0] - self.baseline.get(p, 0) for p in self.last)
        return {"cpu_s": round(cpu / 1e9, 6),
                "vmhwm_kib": max((v[1] for v in self.last.values()), default=0),
                "pids": sorted(self.last), "samples": self.samples}


# -- one run ----------------------------------------------------------------------------


class Tracker:
    """Follows the maillog: which workload recipients are done, for the drain check."""

    def __init__(self, plan: Plan, filter_port: int | None = None) -> None:
        #: A delivery to the content filter is a hop, not the recipient's end.
        self.hop = f"]:{filter_port}" if filter_port else None
        self.expected = {r.lower() for a in plan.arrivals for r in a.recipients}
        self.never = plan.never_deliver()
        self.final: set[str] = set()
        self.deferred: set[str] = set()

    def feed(self, lines: list[DeliveryLine]) -> None:
        for d in lines:
            addr = d.to.lower()
            if addr not in self.expected or (self.hop and self.hop in d.relay):
                continue
            if d.status in ("sent", "bounced", "expired"):
                self.final.add(addr)
            elif d.status == "deferred":
                self.deferred.add(addr)

    def settled(self) -> int:
        """Recipients that are done: final, or tried if their host is dead for ever."""
        n = len(self.final)
        for addr in self.deferred - self.final:
            parsed = parse_address(addr)
            if parsed is not None and parsed[3] in self.never:
                n += 1
        return n

    def drained(self) -> bool:
        return self.settled() >= len(self.expected)


Progress = Callable[[str, float, int, int], None]


def _content_filter(plan: Plan) -> ContentFilter | None:
    """The scenario's content filter (bound, not started), or None."""
    cf = plan.scenario.compare.content_filter
    if cf is None:
        return None
    from pyqmgr.testbed.content_filter import ContentFilter

    return ContentFilter(cf.latency.scaled(plan.scale), cf.process_limit,
                         plan.scenario.seed)


def dns_lacking(plan: Plan) -> str | None:
    """Why this plan cannot be run here, if its destinations name MX hosts and there
    is no unbound to serve their records; None when it can."""
    if not plan.mx_hosts or dns.available():
        return None
    named = ", ".join(sorted(plan.mx_hosts)[:3]) + (", ..." if len(plan.mx_hosts) > 3
                                                    else "")
    return (f"the workload's destinations name MX hosts (mx = ...: {named}), which compare "
            "serves as real MX records from unbound on loopback, and unbound is not "
            f"installed ({dns.UNBOUND}; Debian's unbound package, which ./dev installs); "
            "not run, rather than routed some other way")


def _host_of(plan: Plan) -> dict[str, str]:
    """Destination -> its server's key in the run's hosts: its MX host, or itself."""
    out = {name: name for name in plan.destinations}
    for host, names in plan.mx_hosts.items():
        out.update({name: host for name in names})
    return out


def _make_hosts(plan: Plan) -> dict[str, _Host]:
    """A server per destination, or per MX host for the destinations that name one."""
    hosts: dict[str, _Host] = {}
    seed = plan.scenario.seed
    for host, names in plan.mx_hosts.items():
        hosts[host] = _Host([plan.destinations[n] for n in names], seed, plan.scripts,
                            mx=host)
    for name, key in _host_of(plan).items():
        if key not in hosts:
            hosts[key] = _Host([plan.destinations[name]], seed, plan.scripts)
    # A provider's rules per source address (issue #46): its sink's quotas.
    addresses = source_addresses(plan.scenario)
    for h in hosts.values():
        if h.sink is not None:
            for d in h.dests.values():
                h.sink.client_quotas.update(quotas(d, addresses))
    return hosts


def _dns_records(plan: Plan) -> tuple[list[str], list[str]]:
    """The zones and records that route the MX hosts' destinations: each domain's MX
    record names its host, each host's A record is 127.0.0.1 (a domain that is its
    own host, without ``mx``, has only the A record: smtp(8) falls back to it)."""
    zones: set[str] = set()
    records: list[str] = []
    for host, names in sorted(plan.mx_hosts.items()):
        zones.add(host)
        records.append(f"{host}. 300 IN A 127.0.0.1")
        for name in names:
            if plan.destinations[name].mx:
                zones.add(name)
                records.append(f"{name}. 300 IN MX 10 {host}.")
    return sorted(zones), records


def _configuration(plan: Plan, contender: Contender, hosts: dict[str, _Host],
                   filt: ContentFilter | None, record: dict[str, Any]) -> tuple[
        dict[str, str], dict[str, str], list[str], dict[str, str] | None]:
    """The instance's main.cf, transport map, master.cf lines and pyqmgr.cf, also
    written into the run's ``record``."""
    transports = {}
    for name, key in _host_of(plan).items():
        h = hosts[key]
        # An MX host's destination: the domain as next hop, its MX looked up by
        # smtp(8), the host's port; else straight to the destination's own port.
        hop = f"{name}:{h.port}" if h.mx else f"[127.0.0.1]:{h.port}"
        transports[name] = f"{plan.destinations[name].transport}:{hop}"
    transports.update({dom: "discard:" for dom in plan.sender_domains})
    main_cf = dict(plan.main_cf)
    if plan.mx_hosts:
        # The test bed's default (native) would ask the resolver for A records only.
        main_cf["smtp_host_lookup"] = "dns"
    most = max(len(a.recipients) for a in plan.arrivals)
    if most > 1000 and "smtpd_recipient_limit" not in main_cf:
        main_cf["smtpd_recipient_limit"] = str(most)
    addresses = source_addresses(plan.scenario)
    extra = [master_cf_line(t, n, addresses.get(t))
             for t, n in plan.process_limits.items() if t != "smtp"]
    if filt is not None:
        main_cf.update(filt.main_cf())
        extra += filt.master_cf()
    pyqmgr_cf = contender.pyqmgr_cf(plan.scenario)
    if pyqmgr_cf is not None and addresses:
        pyqmgr_cf = real_cf(pyqmgr_cf, plan.scenario)
    record["source_addresses"] = addresses
    record["destinations"] = {
        name: {"rate_reply": d.rate_reply, "rcpt_4xx_reply": d.rcpt_4xx_reply,
               "rcpt_5xx_reply": d.rcpt_5xx_reply,
               "day_replies": sorted({r.day_reply for r in d.sources.values()})}
        for name, d in plan.destinations.items()}
    record.update({"main_cf": main_cf, "pyqmgr_cf": pyqmgr_cf, "transports": transports,
                   "master_cf_extra": extra, "process_limits": plan.process_limits})
    return main_cf, transports, extra, pyqmgr_cf


def _follow(servers: Servers, tracker: Tracker, t0: float, timeout: float,
            progress: Progress | None, label: str) -> bool:
    """Read the maillog while the run goes on; True once every recipient settled, False
    when submission failed or the timeout passed."""
    next_sample = 0.0
    while True:
        now = time.monotonic() - t0
        tracker.feed([d for ln in servers.new_lines()
                      if (d := parse_delivery(ln.raw)) is not None])
        if now >= next_sample:
            servers.sample()
            next_sample = now + 0.5
        if progress is not None:
            progress(label, now, tracker.settled(), len(tracker.expected))
        finished = servers.finished()
        if finished and tracker.drained():
            return True
        if servers.errors and finished:
            return False
        if now > timeout:
            return False
        time.sleep(POLL)


def _record_messages(record: dict[str, Any], plan: Plan, servers: Servers) -> None:
    """What was submitted when, with its queue id, and what could not be."""
    done = servers.done()
    record["submission_errors"] = servers.errors
    record["messages"] = [
        {"mid": a.mid, "qid": done.get(a.mid, ("", 0.0))[0], "at": round(a.at, 4),
         "submitted": round(done[a.mid][1], 4) if a.mid in done else None,
         "class": a.klass, "sender": a.sender, "size": a.size,
         "recipients": list(a.recipients)} for a in plan.arrivals]


def _record_remote(record: dict[str, Any], hosts: dict[str, _Host],
                   filt: ContentFilter | None, t0: float, wall0: float) -> None:
    """What each destination and the content filter saw, once the instance stopped.

    ``sinks`` stays keyed by destination: an MX host's destinations get what its sink
    can tell apart by recipient, and the host's own record (sessions, refusals, its
    timeline) is in ``mx_hosts``.
    """
    record["sinks"] = {}
    for key, h in hosts.items():
        if h.mx:
            record["sinks"].update(h.domain_records(wall0))
            record.setdefault("mx_hosts", {})[key] = {
                **h.record(t0, wall0), "domains": sorted(h.dests)}
        else:
            record["sinks"][key] = h.record(t0, wall0)
    if record.get("source_addresses"):
        record["sources"] = sources_record(record["source_addresses"], {
            key: h.sink.snapshot() for key, h in hosts.items() if h.sink is not None})
    if filt is not None:
        record["content_filter"] = {"port": filt.port, "reinjected": filt.reinjected,
                                    "errors": filt.errors[:20]}
    if record["submission_errors"]:
        record["error"] = (f"{len(record['submission_errors'])} message(s) not "
                           f"submitted: {record['submission_errors'][0]}")


def _tear_down(run_dir: str, record: dict[str, Any], keep: bool, hosts: dict[str, _Host],
               filt: ContentFilter | None, servers: Servers | None,
               resolver: dns.DnsServer | None = None) -> None:
    """Stop whatever was started, keep the maillog, and write run.json in any case.

    The DNS server goes last, whatever failed before it: the instances resolve
    through it until they are stopped, and an unbound left running would hold its
    address and directory after the run.
    """
    try:
        if servers is not None:
            servers.close_submitters()
        for h in hosts.values():
            h.close()
        if filt is not None:
            filt.stop()
        if servers is not None:
            servers.keep_maillog(os.path.join(run_dir, "maillog"))
            kept = servers.close(keep)
            if kept:
                record["instance"] = kept[0] if len(kept) == 1 else kept
    finally:
        try:
            if resolver is not None:
                resolver.stop()
        finally:
            with open_new(os.path.join(run_dir, "run.json")) as f:
                json.dump(record, f, indent=1)


def _instance(plan: Plan, qmgr: str, config: tuple[dict[str, str], dict[str, str], list[str]],
              pyqmgr_cf: dict[str, str] | None, base_dir: str | None) -> PostfixInstance:
    """One server of the run, with the warm-up plan in its configuration directory."""
    main_cf, transports, extra = config
    root = None
    if pyqmgr_cf is not None:
        root, pyqmgr_cf = plan_root(pyqmgr_cf, plan.scenario,
                                    base_dir or os.environ.get(BASE_ENV) or "/tmp")
    return PostfixInstance(qmgr=qmgr, main_cf=main_cf, transports=transports,
                           master_cf_extra=extra, pyqmgr_cf=pyqmgr_cf, base_dir=base_dir,
                           root=root)


def run_contender(plan: Plan, contender: Contender, run_dir: str, timeout: float,
                  progress: Progress | None = None, keep: bool = False,
                  base_dir: str | None = None) -> dict[str, Any]:
    """Run the plan under one contender; write ``run_dir``; return run.json's content.

    Everything started here is stopped and removed before it returns or raises
    (KeyboardInterrupt included); ``keep`` keeps the instance's directory.
    """
    output_dir(os.path.dirname(run_dir))
    output_dir(run_dir)
    hosts: dict[str, _Host] = {}
    filt: ContentFilter | None = None
    servers: Servers | None = None
    resolver: dns.DnsServer | None = None
    n = plan.scenario.fleet_servers
    record: dict[str, Any] = {"contender": contender.label, "qmgr": contender.qmgr,
                              "policy": contender.policy, "time_scale": plan.scale,
                              "timeout": timeout, "error": None, "servers": n}
    try:
        lacking = dns_lacking(plan)
        if lacking is not None:
            record["error"] = lacking
            raise RunError(f"{contender.label}: {lacking}")
        hosts = _make_hosts(plan)
        filt = _content_filter(plan)
        main_cf, transports, extra, pyqmgr_cf = _configuration(plan, contender, hosts, filt,
                                                               record)
        redis = None
        servers = Servers([], None)
        if plan.mx_hosts:
            zones, records = _dns_records(plan)
            resolver = dns.DnsServer(zones, records)
            record["dns"] = {"address": resolver.address, "records": records}
            resolver.start()
            servers.prefix = resolver.start_prefix()
        if n > 1 and pyqmgr_cf is not None:
            # A fleet of pyqmgr servers shares its limits through one redis-server.
            from pyqmgr.testbed.redis import RedisServer

            redis = servers.redis = RedisServer()
            redis.start()
        for k in range(n):
            servers.pfs.append(_instance(plan, contender.qmgr, (main_cf, transports, extra),
                                         fleet_cf(pyqmgr_cf, redis, k), base_dir))
        if plan.process_limits.get("smtp"):
            for pf in servers.pfs:
                pf.postconf("-F", f"smtp/unix/process_limit={plan.process_limits['smtp']}")
        servers.start(QmgrMeter)
        tracker = Tracker(plan, filt.port if filt is not None else None)
        for h in hosts.values():
            h.start()
        if filt is not None:
            filt.start()
        t0 = time.monotonic()
        wall0 = record["started"] = time.time()
        servers.submit(Submitter, plan.arrivals, t0)
        drained = _follow(servers, tracker, t0, timeout, progress, contender.label)
        servers.sample()
        record.update({"drained": drained, "elapsed": round(time.monotonic() - t0, 4),
                       "qmgr": servers.qmgr_record(), "settled": tracker.settled(),
                       "recipients": len(tracker.expected)})
        _record_messages(record, plan, servers)
        servers.close_submitters()
        servers.stop()
        _record_remote(record, hosts, filt, t0, wall0)
    except (TestbedError, InstallError) as exc:
        # InstallError: the contender's pyqmgr.cf, refused as install refuses it
        # (``--with pyqmgr:nqmgr,site_grouping=bogus``), said as a run not made.
        record["error"] = str(exc)
        raise RunError(f"{contender.label}: {exc}") from None
    finally:
        _tear_down(run_dir, record, keep, hosts, filt, servers, resolver)
    return record
