"""pyqmgr replay on what real servers log: each case built from real lines.

Every log line below is copied verbatim from a public maillog in
tests/data/public-maillogs (the file is named above each case; its provenance is in
that folder's README): mail already queued or in the active queue when the log
begins, a content filter's loop (amavis on 127.0.0.1:10024, re-injected through a
second smtpd), failures that are no reply to RCPT (lost connections, timeouts, a
pipe's deferral) and DNS outcomes (``5.4.4`` bounced, ``4.4.3`` deferred). Each is
replayed by the real command and the simulation must play it as the log had it.
"""

from __future__ import annotations

import gzip
import json
import os
from typing import Any

import pytest

from pyqmgr.simulator.scenario import TraceMessage, load, read_arrivals
from tests.test_replay import run, write

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def replay(tmp_path, lines: list[str], *extra: str) -> dict[str, Any]:
    log = write(str(tmp_path / "mail.log"), lines)
    return json.loads(run("replay", log, "--json", "--runs", "3", *extra).stdout)


def only(rep: dict[str, Any]) -> dict[str, Any]:
    assert len(rep["instances"]) == 1, [i["instance"] for i in rep["instances"]]
    return rep["instances"][0]


# louisitvn-pflgviewer-phoenix-mail.log, lines 1-5: a backlogged server. B12B9110102D
# waited 952 s in the active queue before the log began; the log has only its delivery.
PHOENIX = [
    "Dec 15 07:46:27 phoenix postfix/pickup[28944]: B4C5A1100935: uid=0 from=<root>",
    "Dec 15 07:46:27 phoenix postfix/cleanup[29869]: B4C5A1100935: message-id=<20141214204627."
    "B4C5A1100935@dmnesisparty.co.uk>",
    "Dec 15 07:46:27 phoenix postfix/qmgr[28945]: B4C5A1100935: from=<rtrim@dmnesisparty.co.uk>"
    ", size=579, nrcpt=1 (queue active)",
    "Dec 15 07:46:29 phoenix postfix/smtp[29715]: B12B9110102D: to=<sniptyboutrim@dmnesisparty"
    ".co.uk>, orig_to=<sniptybounce>, relay=testrelay.l.google.com[173.194.72.123]:25, delay=955"
    ", delays=0/952/2.1/0.96, dsn=2.0.0, status=sent (250 2.0.0 OK 1418589989 gk1si5712883pbc."
    "166 - gsmtp)",
    "Dec 15 07:46:29 phoenix postfix/qmgr[28945]: B12B9110102D: removed",
]


def test_mail_in_the_active_queue_as_the_log_begins_is_replayed(tmp_path):
    """The delivery is counted and its delay (955 s from an arrival the log never
    showed) is the log's and the simulation's both: the message arrives 955 s before
    its line, and enters the simulation as the log begins."""
    inst = only(replay(tmp_path, PHOENIX, "--year", "2014"))
    assert inst["messages"]["in the active queue as the log began"] == 1
    log = inst["figures"]["log"]["dmnesisparty.co.uk"]
    assert log["sent"] == 1 and log["p50"] == 955
    sim = inst["figures"]["stock"]["dmnesisparty.co.uk"]
    assert sim["sent"] == 1
    assert sim["p50"] == pytest.approx(955, abs=5)
    # The message still in the queue at the log's end (B4C5A1100935, no delivery line)
    # cannot be replayed: where it goes is unknown. It is said so.
    assert inst["messages"]["no delivery lines"] == 1


# kdent-postfix_log_analysis-conch-mail2.log: B3405242E7 was queued days before the log
# (delay=231661) and fails at every try, neither refused nor answered at RCPT: timeouts
# while sending the body and lost connections at greeting, about every 70 minutes.
CONCH = [
    "Nov  1 02:22:24 conch postfix/qmgr[25409]: B3405242E7: from=<>, size=16645, nrcpt=1 "
    "(queue active)",
    "Nov  1 02:25:25 conch postfix/smtp[19734]: B3405242E7: to=<ShoppingGuide:KitchenCabinets@"
    "findivisitnighteen.download>, relay=lbzod.findivisitnighteen.download[128.177.48.75]:25, "
    "delay=231661, delays=231480/0.01/0.25/180, dsn=4.4.2, status=deferred (conversation with "
    "lbzod.findivisitnighteen.download[128.177.48.75] timed out while sending message body)",
    "Nov  1 03:32:24 conch postfix/qmgr[25409]: B3405242E7: from=<>, size=16645, nrcpt=1 "
    "(queue active)",
    "Nov  1 03:32:25 conch postfix/smtp[19913]: B3405242E7: to=<ShoppingGuide:KitchenCabinets@"
    "findivisitnighteen.download>, relay=lbzod.findivisitnighteen.download[128.177.48.75]:25, "
    "delay=235680, delays=235680/0.01/0.17/0, dsn=4.4.2, status=deferred (lost connection with "
    "lbzod.findivisitnighteen.download[128.177.48.75] while receiving the initial server "
    "greeting)",
    "Nov  1 04:42:26 conch postfix/qmgr[25409]: B3405242E7: from=<>, size=16645, nrcpt=1 "
    "(queue active)",
    "Nov  1 04:42:26 conch postfix/smtp[20303]: B3405242E7: to=<ShoppingGuide:KitchenCabinets@"
    "findivisitnighteen.download>, relay=lbzod.findivisitnighteen.download[128.177.48.75]:25, "
    "delay=239882, delays=239882/0.03/0.18/0, dsn=4.4.2, status=deferred (lost connection with "
    "lbzod.findivisitnighteen.download[128.177.48.75] while receiving the initial server "
    "greeting)",
]
# oleg-medovikov-mail-server-anal-amavis-mail.log, lines 20-21, 23, 37-40, 42-45, 48:
# a pipe (dovecot) answering "temporary failure" to one recipient of 439F6DE204BF.
PIPE = [
    "Jun 14 12:02:44 mail postfix/10025/smtpd[628875]: 439F6DE204BF: client=localhost[127.0.0.1]",
    "Jun 14 12:02:44 mail postfix/cleanup[724186]: 439F6DE204BF: message-id=<cREa53uQxtySbpLBAd2P"
    "KRSSguGemDsPeE7ZD3Cg@spbgp44.ru>",
    "Jun 14 12:02:44 mail postfix/qmgr[2844429]: 439F6DE204BF: from=<spbgp44ru@vh227.sweb.ru>, "
    "size=4263, nrcpt=2 (queue active)",
    "Jun 14 12:02:44 mail postfix/pipe[678062]: 439F6DE204BF: to=<p44@zdrav.spb.ru>, relay=dovecot"
    ", delay=0.03, delays=0/0/0/0.02, dsn=4.3.0, status=deferred (temporary failure)",
    "Jun 14 12:02:44 mail postfix/smtp[713049]: 439F6DE204BF: to=<p44@spbgp44.ru>, relay=mx.yandex"
    ".net[77.88.21.249]:25, delay=0.53, delays=0/0/0.19/0.34, dsn=2.0.0, status=sent (250 2.0.0 "
    "Ok: queued on mail-nwsmtp-mxfront-production-main-41.vla.yp-c.yandex.net 1718355764-i2d0Y66"
    "ol4Y0-NZS0pUXZ)",
]


def test_failures_that_are_no_reply_to_rcpt_are_failures_in_the_simulation(tmp_path):
    """Timeouts and lost connections fail the try as a whole (stock throttles the site):
    replayed as deferrals, never as deliveries; a pipe's deferral defers its recipient."""
    inst = only(replay(tmp_path, CONCH, "--year", "2015", "-o", "maximal_backoff_time=4000s"))
    dest = "findivisitnighteen.download"
    log = inst["figures"]["log"][dest]
    assert (log["sent"], log["deferred"], log["bounced"]) == (0, 3, 0)
    sim = inst["figures"]["stock"][dest]
    assert (sim["sent"], sim["deferred"], sim["bounced"]) == (0, 3, 0)
    assert inst["messages"]["queued before the log"] == 1
    notes = {m["destination"]: " ".join(m["notes"]) for m in inst["model"]}
    assert "1 timeout in the conversation" in notes[dest]
    assert "2 lost connection" in notes[dest]

    inst = only(replay(tmp_path, PIPE, "--year", "2024"))
    for fig in ("log", "stock"):
        f = inst["figures"][fig]["zdrav.spb.ru"]
        assert (f["sent"], f["deferred"]) == (0, 1), fig
        assert inst["figures"][fig]["spbgp44.ru"]["sent"] == 1


# teliten-log.plemma-vultr-2021-08-mail.log, lines 17-21: a bounce to a domain that
# does not exist. infohtreasure-Postfix-Maillog-Dump-mailog2.log: A94DF404B38D, whose
# domain's DNS fails temporarily ("try again"), after two connect timeouts.
NXDOMAIN = [
    "Aug 29 15:49:39 localhost postfix/cleanup[21624]: 53A07C943: message-id=<20210829154939."
    "53A07C943@localhost>",
    "Aug 29 15:49:39 localhost postfix/qmgr[21598]: 53A07C943: from=<>, size=2245, nrcpt=1 "
    "(queue active)",
    "Aug 29 15:49:39 localhost postfix/bounce[21627]: 6BFFDC93B: sender non-delivery "
    "notification: 53A07C943",
    "Aug 29 15:49:39 localhost postfix/smtp[21626]: 53A07C943: to=<test@tester.testing.com>, "
    "relay=none, delay=0.03, delays=0/0/0.02/0, dsn=5.4.4, status=bounced (Host or domain name "
    "not found. Name service error for name=tester.testing.com type=AAAA: Host not found)",
    "Aug 29 15:49:39 localhost postfix/qmgr[21598]: 53A07C943: removed",
]
TRY_AGAIN = [
    "Feb 25 15:36:31 server1 postfix/cleanup[25205]: A94DF404B38D: message-id=<20220225143631."
    "A94DF404B38D@server1.alsoft.org>",
    "Feb 25 15:36:31 server1 postfix/qmgr[5898]: A94DF404B38D: from=<>, size=2343, nrcpt=1 "
    "(queue active)",
    "Feb 25 15:37:32 server1 postfix/smtp[25298]: A94DF404B38D: to=<sender@tecadmin.net>, "
    "relay=none, delay=60, delays=0.01/0.02/60/0, dsn=4.4.1, status=deferred (connect to "
    "tecadmin.net[172.67.134.5]:25: Connection timed out)",
    "Feb 25 15:44:43 server1 postfix/qmgr[5898]: A94DF404B38D: from=<>, size=2343, nrcpt=1 "
    "(queue active)",
    "Feb 25 15:45:43 server1 postfix/smtp[27217]: A94DF404B38D: to=<sender@tecadmin.net>, "
    "relay=none, delay=552, delays=491/0.02/60/0, dsn=4.4.1, status=deferred (connect to "
    "tecadmin.net[104.21.25.106]:25: Connection timed out)",
    "Feb 25 15:59:43 server1 postfix/qmgr[5898]: A94DF404B38D: from=<>, size=2343, nrcpt=1 "
    "(queue active)",
    "Feb 25 16:00:03 server1 postfix/smtp[28748]: A94DF404B38D: to=<sender@tecadmin.net>, "
    "relay=none, delay=1412, delays=1392/0.04/19/0, dsn=4.4.3, status=deferred (Host or domain "
    "name not found. Name service error for name=tecadmin.net type=MX: Host not found, try "
    "again)",
    "Feb 25 16:24:43 server1 postfix/qmgr[5898]: A94DF404B38D: from=<>, size=2343, nrcpt=1 "
    "(queue active)",
    "Feb 25 16:25:02 server1 postfix/smtp[30554]: A94DF404B38D: to=<sender@tecadmin.net>, "
    "relay=none, delay=2911, delays=2891/0.02/19/0, dsn=4.4.3, status=deferred (Host or domain "
    "name not found. Name service error for name=tecadmin.net type=MX: Host not found, try "
    "again)",
]


def test_dns_outcomes(tmp_path):
    """``5.4.4`` host not found bounces, once (it was a down host retried for ever);
    ``4.4.3`` defers as a failure of the try, each as often as logged."""
    inst = only(replay(tmp_path, NXDOMAIN, "--year", "2021"))
    for fig in ("log", "stock"):
        f = inst["figures"][fig]["tester.testing.com"]
        assert (f["sent"], f["deferred"], f["bounced"]) == (0, 0, 1), fig
    notes = " ".join(inst["model"][0]["notes"])
    assert "1 DNS: not found" in notes and "down" not in notes
    inst = only(replay(tmp_path, TRY_AGAIN, "--year", "2022"))
    for fig in ("log", "stock"):
        f = inst["figures"][fig]["tecadmin.net"]
        assert (f["sent"], f["deferred"], f["bounced"]) == (0, 4, 0), fig
    notes = " ".join(inst["model"][0]["notes"])
    assert "2 DNS: temporary failure" in notes


# oleg-medovikov-mail-server-anal-amavis-mail.log, lines 16-17, 19-21, 23, 25-26, 46-47:
# 6C72ADE204BF goes to amavis (127.0.0.1:10024), which re-injects it through the
# 10025 smtpd as B9AB1DE204C8, which goes to mail.ru.
AMAVIS = [
    "Jun 14 12:02:43 mail postfix/smtpd[710439]: 6C72ADE204BF: client=unknown[5.183.29.23], "
    "sasl_method=DIGEST-MD5, sasl_username=p43.nok",
    "Jun 14 12:02:43 mail postfix/cleanup[724186]: 6C72ADE204BF: message-id=<008001dabe39$9ee8e"
    "f50$dcbacdf0$@nok@zdrav.spb.ru>",
    "Jun 14 12:02:43 mail postfix/qmgr[2844429]: 6C72ADE204BF: from=<p43.nok@zdrav.spb.ru>, "
    "size=75627, nrcpt=1 (queue active)",
    "Jun 14 12:02:43 mail postfix/10025/smtpd[632128]: B9AB1DE204C8: client=localhost[127.0.0.1]",
    "Jun 14 12:02:43 mail postfix/cleanup[723304]: B9AB1DE204C8: message-id=<008001dabe39$9ee8e"
    "f50$dcbacdf0$@nok@zdrav.spb.ru>",
    "Jun 14 12:02:43 mail postfix/10025/smtpd[632128]: disconnect from localhost[127.0.0.1] "
    "ehlo=1 mail=2 rcpt=2 data=2 noop=1 quit=1 commands=9",
    "Jun 14 12:02:43 mail postfix/qmgr[2844429]: B9AB1DE204C8: from=<p43.nok@zdrav.spb.ru>, "
    "size=76428, nrcpt=1 (queue active)",
    "Jun 14 12:02:43 mail postfix/amavis/smtp[721621]: 6C72ADE204BF: to=<guzbrf@mail.ru>, "
    "relay=127.0.0.1[127.0.0.1]:10024, delay=0.37, delays=0.23/0/0/0.14, dsn=2.0.0, status=sent "
    "(250 2.0.0 from MTA(smtp:[127.0.0.1]:10025): 250 2.0.0 Ok: queued as B9AB1DE204C8)",
    "Jun 14 12:02:43 mail postfix/qmgr[2844429]: 6C72ADE204BF: removed",
    "Jun 14 12:02:44 mail postfix/smtp[713051]: B9AB1DE204C8: to=<guzbrf@mail.ru>, relay=mxs.mail"
    ".ru[94.100.180.31]:25, delay=0.98, delays=0/0/0.22/0.75, dsn=2.0.0, status=sent (250 OK "
    "id=1sI2pY-0000000EQEJ-0Cqr)",
    "Jun 14 12:02:44 mail postfix/qmgr[2844429]: B9AB1DE204C8: removed",
]


def test_content_filter_loop_is_followed_to_the_final_delivery(tmp_path):
    """The hop to amavis is a destination of its own (its transport, amavis), the
    recipient is sent once at its domain, end to end: the re-injected message follows
    the filter's delivery in the simulation too."""
    out = tmp_path / "wl"
    inst = only(replay(tmp_path, AMAVIS, "--year", "2024", "--write-workload", str(out)))
    log = inst["figures"]["log"]
    assert set(log) == {"filter-127-0-0-1-10024.invalid", "mail.ru"}
    assert log["filter-127-0-0-1-10024.invalid"]["sent"] == 1
    assert log["mail.ru"]["sent"] == 1
    assert inst["messages"]["re-injected by a content filter"] == 1
    # End to end: the filter's 0.37 s, then 0.98 s to mail.ru, within the seconds'
    # resolution of the lines that place the re-injected arrival.
    assert 1.2 <= log["mail.ru"]["p50"] <= 2.4
    sim = inst["figures"]["stock"]["mail.ru"]
    assert sim["sent"] == 1 and abs(sim["p50"] - log["mail.ru"]["p50"]) <= 0.5
    models = {m["destination"]: m for m in inst["model"]}
    assert models["filter-127-0-0-1-10024.invalid"]["transport"] == "amavis"
    assert "content filter" in " ".join(models["filter-127-0-0-1-10024.invalid"]["notes"])
    # The arrivals file says so: the second message follows the first.
    sc = load(str(out / "workload.toml"))
    assert [m.follows for m in sc.trace] == [-1, 0]


def test_gaps_in_time_cut_the_log_with_a_warning(tmp_path):
    """Two logs nine days apart (the same server) are two stretches, each replayed on
    its own, and the report warns."""
    later = [line.replace("Aug 29", "Sep  7") for line in NXDOMAIN]
    rep = replay(tmp_path, NXDOMAIN + later, "--year", "2021")
    names = [i["instance"] for i in rep["instances"]]
    assert names == ["localhost/postfix", "localhost/postfix#2"]
    for inst in rep["instances"]:
        assert any("no line for 216.0 hours" in w for w in inst["warnings"])
        assert inst["figures"]["log"]["tester.testing.com"]["bounced"] == 1
    text = run("replay", str(tmp_path / "mail.log"), "--year", "2021").stdout
    assert "1 Postfix instance(s) in 2 stretches" in text
    assert "warning: no line for 216.0 hours" in text


def test_text_report_has_bounced_and_what_was_not_used(tmp_path):
    """Sent, deferred, bounced, p50 and p95 per destination; per instance, the lines
    not used, by kind, with their share of the instance's lines."""
    later = [line.replace("Aug 29 15:49", "Jun 14 12:05") for line in NXDOMAIN]
    log = write(str(tmp_path / "mail.log"), AMAVIS + later)
    text = run("replay", log, "--year", "2024").stdout
    head = next(line for line in text.splitlines() if "deferred" in line and "p95" in line)
    assert head.split("|")[1].split() == ["sent", "deferred", "bounced", "p50", "s", "p95", "s"]
    assert "not used: 1 of 5 lines (20%), by kind:" in text
    assert "1 bounce: notices sent (the notice is a message of its own)" in text
    assert "not used: 1 of 11 lines (9%), by kind:" in text
    assert "1 smtpd: SMTP sessions (no message)" in text
    row = next(line for line in text.splitlines() if line.startswith("tester.testing.com"))
    assert row.split("|")[1].split() == ["0", "0", "1", "-", "-"]


def test_arrivals_keep_born_follows_and_gap(tmp_path):
    """The arrivals file carries what replay derives (born before at, a follower), and
    refuses a born after its at or a follower of a later line, naming the line."""
    from pyqmgr.simulator.scenario import Destination, Scenario, write_arrivals
    sc = Scenario(destinations={"a.example": Destination("a.example")})
    trace = [TraceMessage(0.0, 10, "mail", "x@y.example", (("a.example", 1, "D1.5s"),), True,
                          -955.0),
             TraceMessage(1.0, 10, "mail", "x@y.example", (("a.example", 1, "B0"),), True,
                          -2.0, 0, 0.25)]
    path = str(tmp_path / "arrivals.csv")
    write_arrivals(path, trace)
    assert read_arrivals(path, sc) == trace
    with open(path, "a") as f:
        f.write("2.0,10,mail,x@y.example,a.example,1,3.0\n")
    with pytest.raises(Exception, match="line 4: born 3 must be"):
        read_arrivals(path, sc)
    write_arrivals(path, trace[:1])
    with open(path, "a") as f:
        f.write("2.0,10,mail,x@y.example,a.example,1,,5,0\n")
    with pytest.raises(Exception, match="line 3: follows 5"):
        read_arrivals(path, sc)


RATE_RUNS = [os.path.join(DATA, f"rate-limiter-run{i}.log.gz") for i in (1, 2)]


def test_rate_limiter_held_out_on_another_real_run():
    """A provider's 4.7.28 rate limiter (2 sessions a second) met by stock: the limit
    fitted on one real run's log is the sink's own, and the other run's log replays
    close to it. Postfix logs delays to 10 ms and nine hand-offs in ten as 0: taken as
    exact, every retry a deferred-queue scan brings back met the server at the scan's
    very instant, never while the previous scan's sessions were still in the server's
    last second. The replay then fitted a limit of 1 to make up for it, and on the
    held-out run left 3 of 80 recipients undelivered at the log's end, deferred 286
    times (the log: 231) and put p50 at 53.7 s (the log: 36 s). Measured now (arrivals
    placed by their queue ids, deferred-queue scans run when qmgr wakes): 78 of 80
    sent by the log's end on average over five runs (the slowest seed is a retry
    late), 210 deferred, p50 -3%, p95 -0.4%. With hand-offs waited inside the active
    queue (simulator/engine.py, _let_in): 189-227 deferred over five runs, 206 on
    average. The log's count is held against the range as benchmarks/fidelity.py
    holds every held-out run: widened by the log's resolution (5% of hundreds)."""
    fitted = json.loads(run("replay", RATE_RUNS[0], "--json", *RATE_SETTINGS).stdout)
    [model] = fitted["instances"][0]["model"]
    assert any("rate_limit 2:" in n for n in model["notes"]), model["notes"]
    rep = json.loads(run("replay", RATE_RUNS[1], "--json", "--fit-on", RATE_RUNS[0],
                         *RATE_SETTINGS).stdout)
    inst = rep["instances"][0]
    log, sim = inst["figures"]["log"]["rate.example"], inst["figures"]["stock"]["rate.example"]
    lo, hi = inst["ranges"]["stock"]["rate.example"]["deferred"]
    print(f"\nlog {log}\nreplay {sim}, deferred over the runs {lo}-{hi}")
    assert (log["sent"], log["deferred"]) == (80, 231)
    assert sim["sent"] >= 0.95 * 80
    assert lo - 0.05 * lo <= log["deferred"] <= hi + 0.05 * hi
    assert abs(sim["deferred"] - log["deferred"]) <= 0.15 * log["deferred"]
    assert abs(sim["p50"] - log["p50"]) <= 0.1 * log["p50"]
    assert abs(sim["p95"] - log["p95"]) <= 0.1 * log["p95"]


RATE_SETTINGS = ("-o", "minimal_backoff_time=10s", "-o", "maximal_backoff_time=20s",
                 "-o", "queue_run_delay=1s")


def test_a_rate_limit_is_fitted_on_refused_sessions_where_the_site_was_held_dead():
    """Nine real runs of one workload held a 4.7.28 limiter of 2 sessions a second dead
    for 79 to 536 deferrals, while its refused sessions were 102 to 136. Fitted on all
    deferrals and the delays, the run with 536 (134 refused) read as a rate of 1, a
    stand-in; fitted on the refused sessions, as the other runs, 2, the sink's own."""
    rep = json.loads(run("replay", os.path.join(DATA, "fidelity-field-set3-run1.log.gz"),
                         "--json", "--runs", "1", *RATE_SETTINGS).stdout)
    inst = rep["instances"][0]
    assert inst["figures"]["log"]["rate.example"]["deferred"] == 670
    notes = {m["destination"]: " ".join(m["notes"]) for m in inst["model"]}
    assert "refused 134 sessions with a rate reply" in notes["rate.example"]
    assert "rate_limit 2:" in notes["rate.example"], notes["rate.example"]
    assert "server_limit 3:" in notes["near.example"], notes["near.example"]


def test_a_busy_queue_managers_rate_limiter_fits_the_servers_own_rate():
    """In a busy queue manager (benchmarks/fidelity_shapes/field.toml, a real stock
    run) stock met a 4.7.28 limiter of 2 sessions a second with 102 refused sessions
    and 213 deferrals of the site it held dead. Fitted alone, with hand-offs waited
    outside the active queue, the simulation never held the site dead and the fit
    went to 1, a stand-in. Fitted among the log's other traffic, hand-offs inside
    the active queue, it is the sink's own 2. The 421 limiters' fits, whose
    whole-second estimates smear sessions over each other (5 seen at once at a limit
    of 3), are their servers' own too."""
    rep = json.loads(run("replay", os.path.join(DATA, "fidelity-field-run1.log.gz"),
                         "--json", "--runs", "1", *RATE_SETTINGS).stdout)
    notes = {m["destination"]: " ".join(m["notes"]) for m in rep["instances"][0]["model"]}
    assert "rate_limit 2:" in notes["rate.example"], notes["rate.example"]
    assert "stand-in" not in notes["rate.example"]
    assert "server_limit 3:" in notes["near.example"]
    assert not any("stand-in" in notes[d] for d in notes if d != "rate.example")


@pytest.mark.parametrize("seed", ["1", "16"])
def test_a_log_with_few_refusals_fits_its_sinks_limits_under_any_seed(seed):
    """A real run whose 421 limiter of 5 refused only 8 sessions (the fewest of the
    runs on record) and whose 4.7.28 limiter deferred 190 times: with one simulated
    run per candidate, seed 1 fitted the rate limiter as 1 and seed 16 the session
    limiter as 6, by one run's chance. Three runs averaged give the sinks' own.

    With stock's agent allocation (over-busy queues counted, #32) the log's 101
    refused sessions, the fewest of every real run on record (the ten recorded runs
    refused 111-132), lie between the simulation's 94 at the sink's rate of 2 and 111
    at 1 (means of 40 seeds): refusals alone picked 1 for 15 of 38 three-seed windows,
    seed 1's among them. Where the two are as near within the runs' chance, the
    log's own sessions a second decide, and the note says so."""
    rep = json.loads(run("replay", os.path.join(DATA, "fidelity-field-few-refusals.log.gz"),
                         "--json", "--runs", "1", "--seed", seed, *RATE_SETTINGS).stdout)
    inst = rep["instances"][0]
    assert inst["figures"]["log"]["below.example"]["deferred"] == 8
    notes = {m["destination"]: " ".join(m["notes"]) for m in inst["model"]}
    assert "server_limit 5:" in notes["below.example"], notes["below.example"]
    assert "rate_limit 2:" in notes["rate.example"], notes["rate.example"]
    assert "server_limit 3:" in notes["near.example"], notes["near.example"]
    tie = "within the runs' chance: the log's own 2 a second decided"
    assert (tie in notes["rate.example"]) == (seed == "1"), notes["rate.example"]


FIELD_SET1 = [os.path.join(DATA, f"fidelity-field-set1-run{i}.log.gz") for i in (1, 2, 3)]


def _deferred_lines(path: str, domain: str) -> int:
    """The log's deferrals of a domain, counted as grep would."""
    with gzip.open(path, "rt") as f:
        return sum(1 for line in f if f"@{domain}>" in line and "status=deferred" in line)


#: The ten real runs of the same workload (field.toml unchanged since set 1) that the
#: fidelity gate holds replays against, recorded two days after set 1.
FIELD_RECORDED = [os.path.join(os.path.dirname(os.path.dirname(DATA)), "benchmarks",
                               "fidelity_recordings", "field", f"run{i:02d}.maillog.gz")
                  for i in range(1, 11)]


def test_a_down_host_held_dead_past_its_return_is_replayed_as_a_span():
    """A host down for 40 s (a real stock run of benchmarks/fidelity_shapes/field.toml):
    stock refused its last connection 39.7 s into the log and then held the site dead
    until 51 s,
    so the log's first session says nothing of when it came up. Replayed with the
    server up at the first session, every run deferred 46-48 times; the two other
    real runs of the workload deferred 42 and 39. Each run now draws the time between
    the last refusal and the first session: the held-out runs fall in the range.

    Reality's spread is that of every real run of the workload on record: set 1's
    three (39-45) and the ten recorded for the fidelity gate (35-39). Against set 1's
    three alone the bar was 7.6 wide; with stock's agent allocation (over-busy queues
    counted, #32) the replay's five runs spread 35-45, as the thirteen real runs do,
    and the gate's own score for this figure went from a miss to a pass."""
    rep = json.loads(run("replay", FIELD_SET1[0], "--json", "--runs", "5",
                         *RATE_SETTINGS).stdout)
    inst = rep["instances"][0]
    notes = {m["destination"]: " ".join(m["notes"]) for m in inst["model"]}
    assert "down until between 39.7 and 51.1 s" in notes["down.example"], notes["down.example"]
    assert "each simulated run draws the time" in notes["down.example"]
    logged = [_deferred_lines(p, "down.example") for p in FIELD_SET1]
    assert logged == [45, 42, 39]
    recorded = [_deferred_lines(p, "down.example") for p in FIELD_RECORDED]
    assert sorted(recorded) == [35] * 8 + [39] * 2
    assert inst["figures"]["log"]["down.example"]["deferred"] == logged[0]
    lo, hi = inst["ranges"]["stock"]["down.example"]["deferred"]
    held_out = logged[1:] + recorded
    print(f"\nreal runs {logged} and {recorded}, replay's range {lo}-{hi}")
    assert all(lo - 1 <= n <= hi + 1 for n in held_out), (lo, hi)
    everyone = logged + recorded
    assert hi - lo <= 1.1 * (max(everyone) - min(everyone)) + 1
