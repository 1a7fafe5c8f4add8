"""pyqmgr replay: reading maillogs as they come, and the workload it derives.

These run the real command on real files (plain, gzip, rotated) written here line by
line in Postfix's formats; tests/test_replay_real.py replays a maillog that real
Postfix wrote.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys

import pytest

from pyqmgr.postfix.maillog import Reader, order_files
from pyqmgr.replay.workload import unrounded
from pyqmgr.simulator import load, simulate

PYQMGR = [sys.executable, "-c", "import sys; from pyqmgr.cli import main; sys.exit(main())"]


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([*PYQMGR, *args], capture_output=True, text=True, timeout=120,
                          check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"pyqmgr {' '.join(args)}: {proc.returncode}\n{proc.stderr}")
    return proc


def message(t: str, qid: str, rcpts: list[tuple[str, str, str]], host: str = "mx",
            name: str = "postfix", sender: str = "alice@example.org",
            qmgr: bool = True) -> list[str]:
    """The lines of one message: (time, recipient, outcome) per delivery line."""
    out = [f"{t} {host} {name}/smtpd[100]: {qid}: client=c.example[192.0.2.1]",
           f"{t} {host} {name}/cleanup[101]: {qid}: message-id=<{qid}@c.example>"]
    if qmgr:
        out.append(f"{t} {host} {name}/qmgr[102]: {qid}: from=<{sender}>, size=1234, "
                   f"nrcpt={len({r for _, r, _ in rcpts})} (queue active)")
    for when, rcpt, how in rcpts:
        if how == "sent":
            tail = "dsn=2.0.0, status=sent (250 2.0.0 Ok)"
        elif how == "busy":
            tail = ("dsn=4.2.0, status=deferred (host mx.x[198.51.100.1] said: 450 4.2.0 "
                    "mailbox busy (in reply to RCPT TO command))")
        else:
            tail = ("dsn=4.7.0, status=deferred (host mx.x[198.51.100.1] refused to talk "
                    "to me: 421 4.7.0 too many connections)")
        out.append(f"{when} {host} {name}/smtp[200]: {qid}: to=<{rcpt}>, "
                   f"relay=mx.x[198.51.100.1]:25, delay=0.5, delays=0/0/0.1/0.4, {tail}")
    out.append(f"{rcpts[-1][0] if rcpts else t} {host} {name}/qmgr[102]: {qid}: removed")
    return out


def write(path: str, lines: list[str], gz: bool = False) -> str:
    data = "".join(line + "\n" for line in lines)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(data)
    else:
        with open(path, "w") as f:
            f.write(data)
    return path


def test_formats_years_rotation_and_instances(tmp_path):
    """Rotated files are read oldest first and December runs into January; RFC 3339
    stamps are read; two instances on one host are two replays."""
    old = write(str(tmp_path / "mail.log.1.gz"), message(
        "Dec 31 23:59:58", "A1B2C3D4E5", [("Dec 31 23:59:59", "u1@one.example", "sent")]),
        gz=True)
    new = write(str(tmp_path / "mail.log"), message(
        "Jan  1 00:00:03", "B1B2C3D4E5", [("Jan  1 00:00:04", "u2@one.example", "sent")])
        + message("2027-01-01T00:00:05.250000+00:00", "C1B2C3D4E5",
                  [("2027-01-01T00:00:06.100000+00:00", "u3@two.example", "sent")],
                  name="postfix-out"))
    assert order_files([new, old]) == [old, new]
    reader = Reader([new, old], year=2026)
    times = [line.time for line in reader]
    assert times == sorted(times) and reader.skipped == {}
    assert times[-1] - times[0] == pytest.approx(8.1)
    rep = json.loads(run("replay", new, old, "--year", "2026", "--json").stdout)
    names = [i["instance"] for i in rep["instances"]]
    assert names == ["mx/postfix", "mx/postfix-out"]
    assert rep["instances"][0]["figures"]["log"]["one.example"]["sent"] == 2
    assert rep["instances"][1]["figures"]["log"]["two.example"]["sent"] == 1
    # From its first arrival (23:59:58 and a fraction) to the log's last line.
    assert 6.5 < rep["instances"][0]["span"] < 8.2
    only = json.loads(run("replay", new, old, "--year", "2026", "--json", "--instance",
                          "postfix-out").stdout)
    assert [i["instance"] for i in only["instances"]] == ["mx/postfix-out"]


def test_bad_input_is_skipped_and_counted_never_a_crash(tmp_path):
    """Other programs' lines, garbage, cut lines, another year's lines, a message
    without its qmgr line, an oversized line, a gzip file cut short: each is counted
    under its reason and the good mail is still replayed."""
    good = []
    for i in range(5):
        good += message(f"Nov 24 10:00:0{i}", f"G{i}AAAAAAAA",
                        [(f"Nov 24 10:00:1{i}", f"u{i}@good.example", "sent")])
    lines = [
        "Nov 24 09:59:59 mx CRON[55]: (root) CMD (run-parts /etc/cron.hourly)",
        "Nov 24 09:59:59 mx dovecot[66]: imap-login: Login: user=<bob>",
        "\x00\x01\x02 binary \xff garbage",
        "completely unrelated text",
        "Nov 24 09:59:59 mx kernel: [12.3] eth0: link up",
        "",
        *good[:7],
        # A delivery line cut mid-way, and a qmgr line cut before nrcpt.
        "Nov 24 10:00:20 mx postfix/smtp[200]: G9AAAAAAAA: to=<x@good.example>, relay=mx.x",
        "Nov 24 10:00:20 mx postfix/qmgr[102]: G8AAAAAAAA: from=<a@b.example>, size=12",
        # A line of a year before, in the middle (RFC 3339), and one going back months.
        "2025-03-01T10:00:00.000000+00:00 mx postfix/qmgr[102]: OLDAAAAAAA: removed",
        "Mar  1 10:00:00 mx postfix/qmgr[102]: OLD2AAAAAA: removed",
        "Nov 24 10:00:21 mx postfix/smtpd[100]: " + "x" * 20000,
        *good[7:],
        # A message whose qmgr line is missing.
        *message("Nov 24 10:00:30", "NOQMGRAAAA",
                 [("Nov 24 10:00:31", "n@good.example", "sent")], qmgr=False),
    ]
    log = write(str(tmp_path / "mail.log"), lines)
    cut = str(tmp_path / "mail.log.1.gz")
    with gzip.open(cut, "wb") as f:
        f.write("".join(x + "\n" for x in message(
            "Nov 24 09:00:00", "CUTAAAAAAA", [("Nov 24 09:00:01", "c@good.example", "sent")]
        )).encode())
    with open(cut, "r+b") as f:
        f.truncate(os.path.getsize(cut) - 12)
    proc = run("replay", log, cut, "--year", "2026", "--json")
    rep = json.loads(proc.stdout)
    skipped = rep["input"]["skipped"]
    print(json.dumps(skipped, indent=1), json.dumps(rep["instances"][0]["lines"]))
    assert skipped["other programs' lines"] == 2
    assert skipped["garbage"] == 2
    assert skipped["syslog lines of another form (no program[pid])"] == 1
    assert skipped["out of order (back in time: another year's line?)"] == 2
    assert skipped["line too long"] == 1
    assert skipped["file cut short or not gzip (read up to the damage)"] == 1
    inst = rep["instances"][0]
    assert inst["lines"]["delivery lines cut short or malformed"] == 1
    assert inst["lines"]["qmgr lines cut short or malformed"] == 1
    assert inst["messages"]["missing qmgr line"] == 1
    # The five good messages, the one the cut gzip file held before its damage, and
    # the one whose qmgr line is missing: its delivery line still says where it went.
    assert inst["messages"]["replayed"] == 7
    assert inst["figures"]["log"]["good.example"]["sent"] == 7
    assert inst["figures"]["stock"]["good.example"]["sent"] == 7
    text = run("replay", log, cut, "--year", "2026").stdout
    assert "skipped: 2 out of order" in text and "1 of them missing qmgr line" in text


def test_nothing_postfix_in_the_log(tmp_path):
    log = write(str(tmp_path / "syslog"), ["Nov 24 09:59:59 mx CRON[55]: hello"] * 3)
    proc = run("replay", log, check=False)
    assert proc.returncode == 2 and "no Postfix message" in proc.stderr
    proc = run("replay", str(tmp_path / "missing.log"), check=False)
    assert proc.returncode == 1 and "missing.log: no such file" in proc.stderr
    proc = run("replay", log, "-o", "not a setting", check=False)
    assert proc.returncode == 1 and "-o" in proc.stderr


def test_derived_workload_replays_scripts_and_reads_back(tmp_path):
    """A greylisted recipient (4xx then accepted) gets its two tries in the simulation
    too; the written workload is a scenario that simulate reads and runs alike, and
    sender addresses are hashed unless --no-hash."""
    lines = message("Nov 24 10:00:00", "GREYAAAAAA", [
        ("Nov 24 10:00:01", "g@grey.example", "busy"),
        ("Nov 24 10:05:01", "g@grey.example", "sent")], sender="alice@example.org")
    log = write(str(tmp_path / "mail.log"), lines)
    out = str(tmp_path / "wl")
    rep = json.loads(run("replay", log, "--year", "2026", "--json", "--write-workload", out,
                         "-o", "minimal_backoff_time=300s").stdout)
    figs = rep["instances"][0]["figures"]
    assert figs["log"]["grey.example"]["deferred"] == 1
    assert figs["stock"]["grey.example"] == figs["log"]["grey.example"] | {
        "p50": figs["stock"]["grey.example"]["p50"], "p95": figs["stock"]["grey.example"]["p95"]}
    arrivals = open(os.path.join(out, "arrivals.csv")).read()
    assert "grey.example=d" in arrivals and "alice" not in arrivals
    res = simulate(load(os.path.join(out, "workload.toml")), record=False)
    assert res.deferred == {"grey.example": 1} and res.sent == {"grey.example": 1}
    plain = str(tmp_path / "plain")
    run("replay", log, "--year", "2026", "--no-hash", "--write-workload", plain)
    assert "alice@example.org" in open(os.path.join(plain, "arrivals.csv")).read()


@pytest.mark.parametrize("bad, message_part", [
    ("1.0,100,mail,a@s.example,nowhere.example\n", "line 2: unknown destination"),
    ("1.0,100,mail,a@s.example\n", "line 2: want at,size,class,sender"),
    ("2.0,100,mail,a@s.example,d.example\n1.0,100,mail,a@s.example,d.example\n",
     "line 3: at 1 is before"),
    ("1.0,100,mail,a@s.example,d.example=xyz\n", "line 2: recipients item"),
    ("1.0,-5,mail,a@s.example,d.example\n", "line 2: at must be 0 or more and size"),
    ("x" * (1 << 20 + 1) + "\n", "line 2: longer than"),
])
def test_a_bad_arrivals_file_names_its_line(tmp_path, bad, message_part):
    (tmp_path / "arrivals.csv").write_text("# header\n" + bad)
    (tmp_path / "w.toml").write_text('arrivals = "arrivals.csv"\n'
                                     '[destinations."d.example"]\nlatency = 1\n')
    proc = run("simulate", str(tmp_path / "w.toml"), check=False)
    assert proc.returncode == 1, proc.stdout
    assert "arrivals.csv" in proc.stderr and message_part in proc.stderr, proc.stderr


def test_a_bad_empirical_distribution_names_its_line(tmp_path):
    (tmp_path / "w.toml").write_text(
        '[destinations."d.example"]\n'
        'latency = {dist = "empirical", values = [3, 1, 2]}\n'
        '[[messages]]\ndestination = "d.example"\n')
    proc = run("simulate", str(tmp_path / "w.toml"), check=False)
    assert proc.returncode == 1
    assert "line 2" in proc.stderr and "increasing order" in proc.stderr


def test_scan_phase_comes_from_the_returning_mails_qmgr_lines(tmp_path):
    """A deferred-queue scan runs in the second of qmgr's line for the mail it brings
    back, as that second begins (Postfix's timers count whole seconds): the
    workload's scans run on that second's tick."""
    t = "Nov 24 10:00:0"
    lines = [f"{t}0 mx postfix/smtpd[100]: GREYAAAAAA: client=c.example[192.0.2.1]",
             f"{t}0 mx postfix/qmgr[102]: GREYAAAAAA: from=<a@example.org>, size=900, "
             "nrcpt=1 (queue active)",
             f"{t}1 mx postfix/smtp[200]: GREYAAAAAA: to=<g@grey.example>, relay=mx.x"
             "[198.51.100.1]:25, delay=0.9, delays=0/0/0.1/0.8, dsn=4.2.0, status=deferred "
             "(host mx.x[198.51.100.1] said: 450 4.2.0 busy (in reply to RCPT TO command))",
             "Nov 24 10:05:03 mx postfix/qmgr[102]: GREYAAAAAA: from=<a@example.org>, "
             "size=900, nrcpt=1 (queue active)",
             "Nov 24 10:05:04 mx postfix/smtp[200]: GREYAAAAAA: to=<g@grey.example>, relay="
             "mx.x[198.51.100.1]:25, delay=304, delays=303/0/0.1/0.5, dsn=2.0.0, "
             "status=sent (250 2.0.0 Ok)",
             "Nov 24 10:05:04 mx postfix/qmgr[102]: GREYAAAAAA: removed"]
    log = write(str(tmp_path / "mail.log"), lines)
    out = str(tmp_path / "wl")
    run("replay", log, "--year", "2026", "--write-workload", out)
    text = open(os.path.join(out, "workload.toml")).read()
    assert "scan_phase = 3\n" in text, text


def test_handoffs_come_from_destinations_that_never_refused(tmp_path):
    """At a destination that answered 421, qmgr's b is a wait for its throttled
    window, which the simulation makes itself: only other destinations' b values make
    the transport's hand-off times."""
    lines = []
    for i in range(20):
        qid = f"HAND{i:06d}"
        t = f"Nov 24 10:00:{i:02d}"
        dest, b, tail = (("ok.example", "0.3", "dsn=2.0.0, status=sent (250 2.0.0 Ok)")
                         if i % 2 else
                         ("lim.example", "0.9", "dsn=4.7.0, status=deferred (host mx.x"
                          "[198.51.100.1] refused to talk to me: 421 4.7.0 too many)"))
        lines += [f"{t} mx postfix/smtpd[100]: {qid}: client=c.example[192.0.2.1]",
                  f"{t} mx postfix/qmgr[102]: {qid}: from=<a@example.org>, size=900, "
                  "nrcpt=1 (queue active)",
                  f"{t} mx postfix/smtp[200]: {qid}: to=<r{i}@{dest}>, relay=mx.x"
                  f"[198.51.100.1]:25, delay=0.5, delays=0/{b}/0.1/0.1, {tail}",
                  f"{t} mx postfix/qmgr[102]: {qid}: removed"]
    assert _within(_handoff(tmp_path, lines), 0.3), "only ok.example's b (0.3)"
    # Where every destination refused, their b's are all the log has: better hand-offs
    # of the right size than none (every try of a scan at one instant).
    only_refusing = [ln for ln in lines if "ok.example" not in ln]
    assert _within(_handoff(tmp_path, only_refusing), 0.9)


def test_handoffs_come_from_first_tries(tmp_path):
    """A retry's b is a wait behind the mail its deferred-queue scan brought back at
    once, which the simulation makes itself: only first tries make hand-off times."""
    lines = []
    for i in range(20):
        qid = f"RETR{i:06d}"
        t0, t1 = f"Nov 24 10:00:{i:02d}", f"Nov 24 10:05:{i:02d}"
        lines += [f"{t0} mx postfix/smtpd[100]: {qid}: client=c.example[192.0.2.1]",
                  f"{t0} mx postfix/qmgr[102]: {qid}: from=<a@example.org>, size=900, "
                  "nrcpt=1 (queue active)",
                  f"{t0} mx postfix/smtp[200]: {qid}: to=<r{i}@ok.example>, relay=mx.x"
                  "[198.51.100.1]:25, delay=0.5, delays=0/0.3/0.1/0.1, dsn=4.2.0, "
                  "status=deferred (host mx.x[198.51.100.1] said: 450 4.2.0 busy "
                  "(in reply to RCPT TO command))",
                  f"{t1} mx postfix/qmgr[102]: {qid}: from=<a@example.org>, size=900, "
                  "nrcpt=1 (queue active)",
                  f"{t1} mx postfix/smtp[200]: {qid}: to=<r{i}@ok.example>, relay=mx.x"
                  "[198.51.100.1]:25, delay=300, delays=299/0.7/0.1/0.1, dsn=2.0.0, "
                  "status=sent (250 2.0.0 Ok)",
                  f"{t1} mx postfix/qmgr[102]: {qid}: removed"]
    assert _within(_handoff(tmp_path, lines), 0.3), "only first tries' b (0.3)"


def test_logged_delays_are_spread_over_their_rounding():
    """Postfix logs delays= to two significant digits, at most two decimals: a 0 is
    anything under 5 ms. The hand-offs drawn from such values cover that interval,
    the same way for the same seed."""
    logged = [0.0] * 50 + [0.01] * 20 + [0.44, 2.3, 17.0]
    out = unrounded(logged, 1)
    assert all(0 <= v < 0.005 for v in out[:50]) and len(set(out[:50])) == 50
    assert all(0.005 <= v <= 0.015 for v in out[50:70])
    assert 0.435 <= out[70] <= 0.445 and 2.25 <= out[71] <= 2.35 and 16.5 <= out[72] <= 17.5
    assert unrounded(logged, 1) == out and unrounded(logged, 2) != out


def _within(handoff: str, logged: float) -> bool:
    """Every value of a hand-off line lies within the rounding of ``logged``."""
    values = [float(v) for v in re.findall(r"[0-9.]+(?:e-?[0-9]+)?", handoff.partition(
        "values")[2])]
    return bool(values) and all(abs(v - logged) <= 0.005 + 1e-9 for v in values)


def _handoff(tmp_path, lines: list[str]) -> str:
    """The derived workload's hand-off line for a log of ``lines``."""
    log = write(str(tmp_path / "mail.log"), lines)
    out = str(tmp_path / "wl")
    run("replay", log, "--year", "2026", "--write-workload", out)
    handoff = [ln for ln in open(os.path.join(out, "workload.toml")) if "handoff" in ln]
    assert len(handoff) == 1, handoff
    return handoff[0]


def test_runs_pool_several_seeds(tmp_path):
    lines = []
    for i in range(6):
        lines += message(f"Nov 24 10:00:0{i}", f"POOL{i:06d}",
                         [(f"Nov 24 10:00:0{i}", f"r{i}@p.example", "sent")])
    log = write(str(tmp_path / "mail.log"), lines)
    rep = json.loads(run("replay", log, "--year", "2026", "--json", "--runs", "3",
                         "--seed", "7").stdout)
    stock = rep["instances"][0]["runs"]["stock"]
    assert stock["runs"] == 3 and stock["seeds"] == [7, 8, 9]
    assert rep["instances"][0]["figures"]["stock"]["p.example"]["sent"] == 6
    auto = json.loads(run("replay", log, "--year", "2026", "--json").stdout)
    assert auto["instances"][0]["runs"]["stock"]["runs"] == 5, "a small log: five runs"
    text = run("replay", log, "--year", "2026").stdout
    assert "5 runs, seeds 1-5" in text
    for bad, why in (("0", "must be 1 or more: 0"), ("-2", "must be 1 or more: -2"),
                     ("many", "not a whole number: 'many'")):
        proc = run("replay", log, "--year", "2026", "--runs", bad, check=False)
        assert proc.returncode == 2 and f"argument --runs: {why}" in proc.stderr, proc.stderr


def test_limits_fitted_on_another_log(tmp_path):
    """--fit-on: a destination's session limit comes from another log (where it
    refused sessions) and is used on the replayed log unchanged; the report says where
    each limit was fitted, and warns when it is the replayed log itself."""
    fit_lines: list[str] = []
    for i in range(6):
        outcome = "limit" if i % 2 else "sent"
        fit_lines += message(f"Nov 24 10:00:0{i}", f"F{i}AAAAAAAA",
                             [(f"Nov 24 10:00:0{i + 1}", f"u{i}@lim.example", outcome),
                              (f"Nov 24 10:05:0{i + 1}", f"u{i}@lim.example", "sent")]
                             if outcome == "limit" else
                             [(f"Nov 24 10:00:0{i + 1}", f"u{i}@lim.example", "sent")])
    fit_log = write(str(tmp_path / "fit.log"), fit_lines)
    replayed = write(str(tmp_path / "day2.log"), message(
        "Nov 25 10:00:00", "D1AAAAAAAA", [("Nov 25 10:00:01", "v@lim.example", "sent")]))
    alone = run("replay", fit_log, "--year", "2026").stdout
    assert "server_limit" in alone and "limits fitted on this log itself" in alone
    out = str(tmp_path / "wl")
    rep = json.loads(run("replay", replayed, "--year", "2026", "--json", "--fit-on", fit_log,
                         "--write-workload", out).stdout)
    inst = rep["instances"][0]
    assert inst["fitted_on"] == fit_log
    [model] = inst["model"]
    assert any(f"fitted on {fit_log}, not on this log" in n for n in model["notes"])
    limit = int(next(n for n in model["notes"] if "server_limit" in n).split()[1].rstrip(":"))
    assert f"server_limit = {limit}\n" in open(os.path.join(out, "workload.toml")).read()
    text = run("replay", replayed, "--year", "2026", "--fit-on", fit_log).stdout
    assert f"(limits fitted on {fit_log}, not on this log)" in text
    proc = run("replay", replayed, "--fit-on", str(tmp_path / "none.log"), check=False)
    assert proc.returncode == 1 and "none.log: no such file" in proc.stderr


def test_a_bad_gap_or_arrivals_gap_is_refused(tmp_path):
    """--gap takes a duration; a word, a negative or an absurd one is an argparse error
    naming --gap. An arrivals line with a negative or non-numeric follower gap names its
    line."""
    log = write(str(tmp_path / "mail.log"), message(
        "Nov 24 10:00:00", "G1AAAAAAAA", [("Nov 24 10:00:01", "u@a.example", "sent")]))
    for bad in ("soon", "-5m", "99999999999"):
        proc = run("replay", log, "--gap", bad, check=False)
        assert proc.returncode == 2 and "--gap" in proc.stderr, (bad, proc.stderr)
    assert run("replay", log, "--year", "2026", "--gap", "90m").returncode == 0
    for bad in ("-1", "x"):
        (tmp_path / "arrivals.csv").write_text(
            "0.0,100,mail,a@s.example,d.example\n"
            f"1.0,100,mail,a@s.example,d.example,1,0.5,0,{bad}\n")
        (tmp_path / "w.toml").write_text('arrivals = "arrivals.csv"\n'
                                         '[destinations."d.example"]\nlatency = 1\n')
        proc = run("simulate", str(tmp_path / "w.toml"), check=False)
        assert proc.returncode == 1 and "line 2" in proc.stderr, (bad, proc.stderr)


def test_arrivals_are_placed_by_the_queue_ids_microseconds(tmp_path):
    """A queue id holds the microseconds of its file's making, which whole-second
    lines leave open: the arrival is put there, within what the lines allow, and in
    the middle of that where the id's fraction does not fit (or it is none)."""
    def lines(qid: str, sec: int) -> list[str]:
        t, t1 = f"Nov 24 10:00:{sec:02d}", f"Nov 24 10:00:{sec + 1:02d}"
        return [f"{t} mx postfix/smtpd[100]: {qid}: client=c.example[192.0.2.1]",
                f"{t} mx postfix/qmgr[102]: {qid}: from=<a@example.org>, size=900, "
                "nrcpt=1 (queue active)",
                f"{t1} mx postfix/smtp[200]: {qid}: to=<r{sec}@ok.example>, relay=mx.x"
                "[198.51.100.1]:25, delay=0.8, delays=0/0/0.1/0.7, dsn=2.0.0, "
                "status=sent (250 2.0.0 Ok)",
                f"{t1} mx postfix/qmgr[102]: {qid}: removed"]
    # The lines allow 10:00:05.19 to 10:00:06.00 for each (sent at :06 after 0.8 s,
    # received at :05); 0x7A120 is .500000, 0x1E848 is .125000 (outside: the middle).
    log = write(str(tmp_path / "mail.log"), lines("7A12000ABC", 5) + lines("1E84800ABD", 8))
    out = str(tmp_path / "wl")
    run("replay", log, "--year", "2026", "--write-workload", out)
    rows = [ln.split(",") for ln in open(os.path.join(out, "arrivals.csv"))
            if not ln.startswith("#")]
    assert [r[0] for r in rows] == ["0.500", "3.595"], rows


def test_a_replay_with_message_classes_sends_the_resets_first(tmp_path, tables_dir):
    """Issue #34: a log of a newsletter and password resets at ten agents, replayed
    as stock and as pyqmgr with classes (the resets' sender transactional): the
    resets' destination's delay drops from the newsletter's wait to its own."""
    lines = []
    for i in range(200):
        lines += message("Nov 24 10:00:00", f"NEWS{i:06d}",
                         [("Nov 24 10:00:30", f"n{i}@gmail.example", "sent")],
                         sender="news@letters.example")
    for i in range(5):
        lines += message(f"Nov 24 10:00:0{i + 2}", f"RESET{i:05d}",
                         [(f"Nov 24 10:00:0{i + 3}", f"r{i}@yahoo.example", "sent")],
                         sender="resets@shop.example")
    log = write(str(tmp_path / "mail.log"), lines)
    table = tables_dir / "classes"  # read as root by the replay's qmgr: judged
    table.write_text("shop.example transactional\n")
    classes = (f"pyqmgr:nqmgr,message_classes=transactional bulk,"
               f"message_class_maps=texthash:{table}")
    rep = json.loads(run("replay", log, "--year", "2026", "--json", "--no-hash",
                         "--runs", "1", "-o", "default_process_limit=10",
                         "--with", "stock", "--with", classes).stdout)
    figures = rep["instances"][0]["figures"]
    stock, ours = figures["stock"]["yahoo.example"], figures[classes]["yahoo.example"]
    print(f"\nthe resets' p50 in the replay: stock {stock['p50']} s, with classes "
          f"{ours['p50']} s")
    assert ours["sent"] == stock["sent"] == 5
    assert ours["p50"] < stock["p50"] / 3, (stock, ours)
