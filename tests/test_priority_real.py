"""Message classes on real Postfix (issue #34): a password reset does not wait behind a
newsletter, whether the newsletter fills incoming/ or the active queue.

The newsletter (3,000 messages from news@letters.example) is queued while no qmgr
runs, then released to one destination whose server takes 0.1 s a message; the
active queue holds 200 (``qmgr_message_active_limit``), so 2,800 wait in incoming/.
Two seconds in, password resets from resets@shop.example to the same destination
arrive by SMTP, one every 0.3 s. pyqmgr.cf names two classes and a table that makes
shop.example's mail transactional; stock's figures are printed beside.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time

from pyqmgr.testbed.instance import PostfixInstance, free_port
from pyqmgr.testbed.sink import SinkServer
from tests.test_control import cli
from tests.test_metrics_real import scrape

BULK = 3000
RESETS = 10
CLASSES_CF = {"message_classes": "transactional bulk",
              "message_class_maps": "inline:{ shop.example=transactional }"}


def _received(srv: SinkServer, rcpts) -> bool:
    """Every one of ``rcpts`` in a message the sink accepted. Not ``outcomes``: the
    RCPT reply is recorded before DATA ends and the message with its time is."""
    got = {m.recipients[0] for m in srv.messages()}
    return all(r in got for r in rcpts)


def _run(postfix_instance, sink, qmgr: str, pyqmgr_cf: dict[str, str] | None
         ) -> tuple[list[float], int, str]:
    """The resets' delays (s, send to sink), the newsletter's messages still not
    delivered when the last reset was, and the instance's maillog."""
    srv: SinkServer = sink(latency=0.1)
    pf: PostfixInstance = postfix_instance(
        qmgr=qmgr, transports={"dest.example": f"smtp:[127.0.0.1]:{srv.port}"},
        main_cf={"qmgr_message_active_limit": "200"}, pyqmgr_cf=pyqmgr_cf)
    pf.preload(BULK, recipients=lambda i: [f"n{i}@dest.example"],
               sender="news@letters.example")
    pf.release_preload()
    pf.wait_until(lambda: srv.delivered_count() >= 100, 60, "the newsletter flowing")
    sent: dict[str, float] = {}
    for i in range(RESETS):
        rcpt = f"reset{i}@dest.example"
        sent[rcpt] = time.time()
        pf.smtp_send([("resets@shop.example", [rcpt])])
        time.sleep(0.3)
    pf.wait_until(lambda: _received(srv, sent), 240,
                  "every password reset delivered")
    got = {m.recipients[0]: m.time for m in srv.messages() if m.recipients[0] in sent}
    last = max(got.values())
    bulk_after = sum(1 for m in srv.messages()
                     if m.sender.startswith("news@") and m.time > last)
    bulk_left = BULK - sum(1 for m in srv.messages()
                           if m.sender.startswith("news@")) + bulk_after
    return [got[r] - sent[r] for r in sent], bulk_left, pf.maillog_path


def test_password_resets_do_not_wait_behind_a_newsletter(postfix_instance, sink):
    stock, stock_left, _ = _run(postfix_instance, sink, "stock", None)
    port = free_port()
    mine, mine_left, _ = _run(postfix_instance, sink, "pyqmgr",
                              {**CLASSES_CF, "metrics_listen": str(port)})
    text = scrape(port)
    found = [ln for ln in text.splitlines() if ln.startswith("pyqmgr_class_")
             and ("_total" in ln or "_count" in ln)]
    print("\n".join(found))
    assert (f'pyqmgr_class_deliveries_total{{class="transactional",outcome="final"}} '
            f'{float(RESETS)}') in found
    assert f'pyqmgr_class_message_age_at_delivery_seconds_count{{class="transactional"}} ' \
        f'{float(RESETS)}' in found
    print(f"\n{RESETS} resets behind {BULK} newsletter messages (active limit 200): "
          f"stock median {statistics.median(stock):.2f} s, max {max(stock):.2f} s "
          f"({stock_left} newsletter messages still to go when its last reset went); "
          f"pyqmgr with classes median {statistics.median(mine):.2f} s, max "
          f"{max(mine):.2f} s ({mine_left} to go)")
    assert max(mine) < 1.5, mine
    assert mine_left > 1000, "the resets went while the newsletter was still queued"


def test_bad_tables_are_a_log_line_each_and_mail_flows_on_the_defaults(
        postfix_instance, sink, tables_dir):
    """A missing table, a table type pyqmgr cannot read, a class no one declared: one
    warning each, and every message delivered in the default class."""
    srv: SinkServer = sink()
    # A hash table whose .db is garbage: postmap's lookup of it fails.
    (tables_dir / "broken.db").write_bytes(b"not a Berkeley DB file\n" * 100)
    os.chmod(tables_dir, 0o755)
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"dest.example": f"smtp:[127.0.0.1]:{srv.port}"},
        start=False)
    # Written after the install, whose check refuses tables that cannot be read
    # (tests/test_check_settings.py); the daemon runs without them.
    pf.write_pyqmgr_cf({"message_classes": "transactional bulk",
                        "message_class_maps": f"texthash:{tables_dir}/no-such-table, "
                                              "regexp:/etc/postfix/classes.re, "
                                              f"hash:{tables_dir}/broken, "
                                              "inline:{ shop.example=urgent }",
                        "tenant_key": "sender_domain",
                        "tenant_maps": f"texthash:{tables_dir}/no-tenants"})
    pf.start()
    pf.smtp_send([("resets@shop.example", ["a@dest.example"]),
                  ("news@letters.example", ["b@dest.example"]),
                  ("", ["c@dest.example"])])
    pf.wait_until(lambda: srv.delivered_count() >= 3, 60, "three messages delivered")
    pf.wait_queue_empty(30)
    text = "\n".join(ln.text for ln in pf.maillog.lines() if ln.program_name == "qmgr")
    print("\n" + "\n".join(ln for ln in text.splitlines() if "classes:" in ln))
    assert f"cannot read {tables_dir}/no-such-table: No such file or directory" in text
    assert "regexp tables are not supported" in text
    assert f"hash:{tables_dir}/broken: postmap -s: " in text
    assert f"cannot read {tables_dir}/no-tenants" in text
    assert "a table answered class 'urgent', which message_classes does not list" in text
    assert text.count("'urgent'") == 1, "that warning once, not a message"


def test_resets_already_queued_at_start_up_go_first(postfix_instance, sink):
    """Resets queued behind the newsletter before the queue manager starts (a restart,
    a reload): start-up reads incoming/'s envelopes once and takes them first."""
    srv: SinkServer = sink(latency=0.1)
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"dest.example": f"smtp:[127.0.0.1]:{srv.port}"},
        main_cf={"qmgr_message_active_limit": "200"}, pyqmgr_cf=CLASSES_CF)
    pf.preload([("news@letters.example", [f"n{i}@dest.example"]) for i in range(BULK)]
               + [("resets@shop.example", [f"reset{i}@dest.example"]) for i in range(5)])
    started = time.time()
    pf.release_preload()
    resets = [f"reset{i}@dest.example" for i in range(5)]
    pf.wait_until(lambda: _received(srv, resets), 60, "the resets delivered")
    took = time.time() - started
    news = sum(1 for m in srv.messages() if m.sender.startswith("news@"))
    classes = json.loads(cli(pf, "status", "--json").stdout)["classes"]
    assert classes["incoming"] == "watched", classes
    bulk = classes["classes"][1]
    assert 0 < bulk["active"] <= bulk["cap"] == 180, classes
    print(f"\nthe 5 resets queued behind {BULK} newsletter messages went within {took:.1f} s "
          f"of the release, {news} newsletter messages before them")
    assert news < 600, "the resets did not wait for the newsletter's scan"


def test_a_hashed_incoming_is_listed_and_resets_still_go_first(postfix_instance, sink):
    """hash_queue_names with incoming: no watch on its subdirectories; each new-mail
    trigger lists them (at most every 0.2 s) and the resets go as before."""
    srv: SinkServer = sink(latency=0.1)
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"dest.example": f"smtp:[127.0.0.1]:{srv.port}"},
        main_cf={"qmgr_message_active_limit": "200",
                 "hash_queue_names": "incoming, deferred, defer"},
        pyqmgr_cf=CLASSES_CF)
    pf.preload(1500, recipients=lambda i: [f"n{i}@dest.example"],
               sender="news@letters.example")
    pf.release_preload()
    pf.wait_until(lambda: srv.delivered_count() >= 100, 60, "the newsletter flowing")
    delays = []
    for i in range(5):
        rcpt = f"reset{i}@dest.example"
        sent = time.time()
        pf.smtp_send([("resets@shop.example", [rcpt])])
        pf.wait_until(lambda r=rcpt: _received(srv, [r]), 30, f"{rcpt} delivered")
        delays.append(next(m.time for m in srv.messages() if m.recipients[0] == rcpt) - sent)
    left = 1500 - sum(1 for m in srv.messages() if m.sender.startswith("news@"))
    status = cli(pf, "status")
    classes = json.loads(cli(pf, "status", "--json").stdout)["classes"]
    print(f"\nhashed incoming/: resets in {', '.join(f'{d:.2f}' for d in delays)} s, "
          f"{left} newsletter messages still to go\n{status.stdout[:600]}")
    assert max(delays) < 1.5 and left > 300
    assert classes["incoming"] == "listed" and classes["fed_past_the_scan"] >= 5
    assert [c["cap"] for c in classes["classes"]] == [200, 180]
    assert "CLASS" in status.stdout and "transactional" in status.stdout


#: Opens inotify instances as the given uid until the kernel refuses, says how many,
#: and holds them until its stdin closes.
_HOG = """
import ctypes, os, sys
os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[1]))
libc = ctypes.CDLL("libc.so.6", use_errno=True)
fds = []
while len(fds) < 100000:
    fd = libc.inotify_init1(0)
    if fd < 0:
        break
    fds.append(fd)
print(len(fds), flush=True)
sys.stdin.read()
"""


def test_no_inotify_left_for_the_mail_owner_is_a_warning_and_a_listing(
        postfix_instance, sink):
    """The kernel refuses the watch (fs.inotify.max_user_instances used up by the
    mail owner's other processes): one warning, incoming/ is listed instead, and the
    resets still go first."""
    srv: SinkServer = sink(latency=0.1)
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"dest.example": f"smtp:[127.0.0.1]:{srv.port}"},
        main_cf={"qmgr_message_active_limit": "200"}, start=False)
    pf.write_pyqmgr_cf(CLASSES_CF)
    uid, gid = pf.mail_owner_ids()
    hog = subprocess.Popen([sys.executable, "-c", _HOG, str(uid), str(gid)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout is not None
        held = int(hog.stdout.readline())
        assert held > 0
        pf.start()
        pf.preload(1000, recipients=lambda i: [f"n{i}@dest.example"],
                   sender="news@letters.example")
        pf.release_preload()
        pf.maillog.wait_for(lambda ln: "cannot watch incoming/" in ln.text, 30,
                            what="the warning")
        pf.wait_until(lambda: srv.delivered_count() >= 100, 60, "the newsletter flowing")
        sent = time.time()
        pf.smtp_send([("resets@shop.example", ["reset@dest.example"])])
        pf.wait_until(lambda: _received(srv, ["reset@dest.example"]), 30, "the reset")
        classes = json.loads(cli(pf, "status", "--json").stdout)["classes"]
    finally:
        assert hog.stdin is not None
        hog.stdin.close()
        hog.wait(10)
    took = next(m.time for m in srv.messages() if m.recipients[0] == "reset@dest.example")
    print(f"\nno inotify ({held} instances taken): the reset went in {took - sent:.2f} s; "
          f"incoming/ {classes['incoming']}")
    assert took - sent < 1.5 and classes["incoming"] == "listed"


def test_a_header_names_the_tenant_and_the_class(postfix_instance, sink):
    """tenant_key = header:X-Tenant and message_class_key = header:X-Priority (issue
    #34): one sender's mail splits into the tenants its headers name (a folded header
    too, and a 4 MB message, whose header is read without its body; a milter's padding
    after short headers), mail without the header takes the defaults, and X-Priority:
    urgent makes mail transactional; the metrics by tenant and by class count them."""
    import smtplib  # noqa: PLC0415

    srv: SinkServer = sink()
    port = free_port()
    pf: PostfixInstance = postfix_instance(
        qmgr="pyqmgr", transports={"dest.example": f"smtp:[127.0.0.1]:{srv.port}"},
        # A milter configured (its port closed, accept): cleanup pads short header
        # lines with records of their own, which the header reader must step over.
        main_cf={"message_size_limit": "20000000", "milter_default_action": "accept",
                 "smtpd_milters": f"inet:127.0.0.1:{free_port()}"},
        pyqmgr_cf={"message_classes": "transactional bulk",
                   "message_class_key": "header:X-Priority",
                   "message_class_maps": "inline:{ urgent=transactional }",
                   "tenant_key": "header:X-Tenant", "metrics_listen": str(port)})
    plan = ([("acme", None, "x")] * 4 + [("acme\r\n folded", None, "x")]
            + [("beta", "urgent", "x")] * 3 + [(None, None, "x")] * 2
            + [("big", None, "y" * 76 + "\n")])
    with smtplib.SMTP("127.0.0.1", pf.smtpd_port, timeout=60) as smtp:
        for i, (tenant, priority, line) in enumerate(plan):
            # Raw text: a folded header is what a real mailer writes, and what
            # Python's email package refuses to build.
            head = ["From: news@one.example", f"To: r{i}@dest.example", f"X-N: {i}"]
            if tenant is not None:
                head.append(f"X-Tenant: {tenant}")
            if priority is not None:
                head.append(f"X-Priority: {priority}")
            body = line * (4_000_000 // len(line)) if tenant == "big" else "hi\n"
            raw = "\r\n".join(head) + "\r\n\r\n" + body.replace("\n", "\r\n")
            smtp.sendmail("news@one.example", [f"r{i}@dest.example"], raw.encode())
    pf.wait_until(lambda: srv.delivered_count() >= len(plan), 60, "everything delivered")
    found: dict[str, float] = {}

    def counted() -> bool:
        # The sink has the message before smtp(8) tells qmgr, and qmgr counts it then:
        # under load the last one (the 4 MB one) was not in the first scrape yet.
        text = scrape(port)
        found.clear()
        found.update({ln.rpartition(" ")[0]: float(ln.rpartition(" ")[2])
                      for ln in text.splitlines() if ln.startswith(
                          ("pyqmgr_tenant_deliveries_total", "pyqmgr_class_deliveries"))})
        return sum(v for k, v in found.items() if k.startswith("pyqmgr_class")
                   and 'outcome="final"' in k) >= len(plan)

    pf.wait_until(counted, 30, f"the {len(plan)} deliveries counted by the scrape")
    print("\n".join(f"{k} {v}" for k, v in found.items() if v))
    tenants = {k.partition('tenant="')[2].partition('"')[0]: v for k, v in found.items()
               if k.startswith("pyqmgr_tenant") and 'outcome="final"' in k and v}
    assert tenants == {"acme": 4.0, "acme folded": 1.0, "beta": 3.0, "-": 2.0, "big": 1.0}
    assert found['pyqmgr_class_deliveries_total{class="transactional",outcome="final"}'] == 3
    assert found['pyqmgr_class_deliveries_total{class="bulk",outcome="final"}'] == 8


def test_lost_inotify_events_mean_a_full_listing(postfix_instance, sink):
    """The kernel drops inotify events when its queue for the watch overflows
    (fs.inotify.max_queued_events): the look into incoming/ then lists it whole, and a
    password reset among two hundred newsletter files is still found at once. The
    limit is lowered to 16 while pyqmgr starts (an instance keeps the limit it was
    made with) and restored at once; qmgr is stopped (SIGSTOP) while the mail
    arrives, so that nothing reads the events."""
    limit = "/proc/sys/fs/inotify/max_queued_events"
    with open(limit) as f:
        saved = f.read().strip()
    srv: SinkServer = sink(latency=0.1)
    try:
        with open(limit, "w") as f:
            f.write("16")
        pf: PostfixInstance = postfix_instance(
            qmgr="pyqmgr", transports={"dest.example": f"smtp:[127.0.0.1]:{srv.port}"},
            main_cf={"qmgr_message_active_limit": "100", "in_flow_delay": "0",
                     "smtp_destination_concurrency_limit": "2"},
            pyqmgr_cf=CLASSES_CF)
        pid = pf.qmgr_pid()
        # The watch is made when the feeder starts: wait for it before restoring.
        def watched() -> bool:
            out = cli(pf, "status", "--json").stdout
            # Until the daemon answers, --json prints the failure ({"ok": false, ...}).
            reply = json.loads(out) if out else {}
            return bool(reply.get("ok")) and reply["classes"]["incoming"] == "watched"

        pf.wait_until(watched, 20, "incoming/ watched")
    finally:
        with open(limit, "w") as f:
            f.write(saved)
    os.kill(pid, signal.SIGSTOP)
    try:
        mail = [("news@letters.example", [f"n{i}@dest.example"]) for i in range(200)]
        pf.smtp_send_many(mail[:120])
        pf.smtp_send([("resets@shop.example", ["reset@dest.example"])])
        pf.smtp_send_many(mail[120:])
    finally:
        os.kill(pid, signal.SIGCONT)
    began = time.time()
    pf.wait_until(lambda: _received(srv, ["reset@dest.example"]), 30, "the reset delivered")
    took = time.time() - began
    status = json.loads(cli(pf, "status", "--json").stdout)["classes"]
    left = 201 - srv.delivered_count()
    print(f"\nthe reset delivered {took:.1f} s after qmgr went on, {left} newsletter "
          f"messages still to go; {status}")
    assert status["events_lost"] >= 1, "the kernel's queue overflowed"
    assert took < 5.0 and left > 100
    pf.wait_until(lambda: srv.delivered_count() >= 201, 120, "everything delivered")
