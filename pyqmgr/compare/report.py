"""The comparison: report.json, summary.md and one self-contained report.html.

The first contender is the baseline; each other is compared with it, and a difference
is stated in words when it crosses a threshold (:data:`THRESHOLDS`, documented in the
README) chosen so that noise between two runs of the same qmgr stays quiet:

* latency per message class: the p95s differ by a factor of 1.5 or more and by at
  least 0.1 s (else the medians, by as much);
* time to drain: a factor of 1.2 and at least 0.5 s; not draining within the timeout
  is always said;
* deferral rate at a destination: a factor of 2 (or from zero) and at least 5 points;
* remote 4xx replies of one code at a destination (as the sink counted them): a factor
  of 2 (or from zero) and at least 5 replies;
* sessions open at a destination (time-weighted mean while any is): a factor of 1.3
  and at least 1;
* at an MX host that destinations share (its sink's count), the 4xx replies of one
  code and the sessions open, by the same thresholds;
* delivery order: a similarity (difflib's ratio over the messages of the sent lines,
  in maillog order) below 0.9;
* the qmgr's CPU time: a factor of 1.5 and at least 0.05 s; its peak memory: a factor
  of 1.5.
"""

from __future__ import annotations

import datetime
import difflib
import html
from typing import Any

from pyqmgr.compare.plots import plots
from pyqmgr.compare.sources import markdown_lines

THRESHOLDS = {
    "latency_ratio": 1.5, "latency_seconds": 0.1,
    "drain_ratio": 1.2, "drain_seconds": 0.5,
    "deferral_ratio": 2.0, "deferral_points": 5.0,
    "replies_ratio": 2.0, "replies_count": 5,
    "in_flight_ratio": 1.3, "in_flight_diff": 1.0,
    "order_similarity": 0.9,
    "cpu_ratio": 1.5, "cpu_seconds": 0.05,
    "memory_ratio": 1.5,
}


def similarity(a: list[int], b: list[int]) -> float:
    """difflib's ratio of two delivery orders: 1.0 for the same order."""
    if not a and not b:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def _times(big: float, small: float) -> str:
    if small <= 0:
        return "infinitely"
    return f"{big / small:.1f}x"


def _s(x: float) -> str:
    return f"{x:.2f} s" if x < 10 else f"{x:.1f} s"


def _crosses(a: float, b: float, ratio: float, diff: float) -> bool:
    hi, lo = max(a, b), min(a, b)
    return hi - lo >= diff and (lo <= 0 or hi / lo >= ratio)


def differences(runs: list[dict[str, Any]], similar: dict[str, dict[str, float]],
                timeouts: dict[str, float]) -> list[str]:
    """The sentences at the top: first what a run shows did not take effect (a feature
    under test that never acted makes every comparison below meaningless), then each
    contender against the first."""
    th = THRESHOLDS
    out: list[str] = [s for run in runs for s in run.get("not_in_effect", [])]
    for run in runs:
        if not run["drained"]:
            out.append(f"{run['contender']} did not drain within "
                       f"{timeouts.get(run['contender'], 0):g} s: {run['undelivered']} "
                       "recipient(s) not delivered" + (f" ({run['error']})" if run["error"]
                                                       else ""))
    if len(runs) < 2:
        return out
    base = runs[0]
    b = base["contender"]
    for run in runs[1:]:
        x = run["contender"]
        for klass, fig in run["classes"].items():
            ref = base["classes"].get(klass)
            if ref is None:
                continue
            for p, where in (("p95", "at p95"), ("p50", "at the median")):
                mine, theirs = fig[p], ref[p]
                if mine is None or theirs is None or not _crosses(
                        mine, theirs, th["latency_ratio"], th["latency_seconds"]):
                    continue
                word = "sooner" if mine < theirs else "later"
                what = "mail" if klass == "mail" else f"{klass} mail"
                out.append(f"{x} delivered {what} {_times(max(mine, theirs), min(mine, theirs))}"  # noqa: E501
                           f" {word} {where} than {b} ({_s(mine)} against {_s(theirs)})")
                break
        if run["drain_time"] is not None and base["drain_time"] is not None and _crosses(
                run["drain_time"], base["drain_time"], th["drain_ratio"], th["drain_seconds"]):
            word = "faster" if run["drain_time"] < base["drain_time"] else "slower"
            out.append(f"{x} drained the queue "
                       f"{_times(max(run['drain_time'], base['drain_time']), min(run['drain_time'], base['drain_time']))} "  # noqa: E501
                       f"{word} than {b} ({_s(run['drain_time'])} against "
                       f"{_s(base['drain_time'])})")
        for dest, fig in run["destinations"].items():
            ref = base["destinations"].get(dest)
            if ref is None:
                continue
            a, r = 100 * fig["deferral_rate"], 100 * ref["deferral_rate"]
            if _crosses(a, r, th["deferral_ratio"], th["deferral_points"]):
                out.append(f"{x} deferred {a:.1f}% of its attempts at {dest}, {b} {r:.1f}%")
            out += _replies_sentences(x, b, dest, fig["replies_4xx"], ref["replies_4xx"])
            fa, fr = fig["in_flight_mean"], ref["in_flight_mean"]
            if _crosses(fa, fr, th["in_flight_ratio"], th["in_flight_diff"]):
                what = ("sessions open" if fig["in_flight_source"] == "sink"
                        else "connection attempts under way")
                out.append(f"{x} kept {fa:.1f} {what} at {dest} on average, {b} {fr:.1f}")
        out += _host_differences(run, base)
        sim = similar.get(x, {}).get(b)
        if sim is not None and sim < th["order_similarity"]:
            out.append(f"{x} delivered in another order than {b} (similarity {sim:.2f}; 1 is "
                       "the same order)")
        ca, cb = run["qmgr_cpu_s"], base["qmgr_cpu_s"]
        if ca is not None and cb is not None and _crosses(ca, cb, th["cpu_ratio"],
                                                          th["cpu_seconds"]):
            out.append(f"{x}'s qmgr used {_times(max(ca, cb), min(ca, cb))} "
                       f"{'more' if ca > cb else 'less'} CPU than {b}'s ({ca:.2f} s against "
                       f"{cb:.2f} s)")
        ma, mb = run["qmgr_vmhwm_mib"], base["qmgr_vmhwm_mib"]
        if ma and mb and max(ma, mb) / min(ma, mb) >= th["memory_ratio"]:
            out.append(f"{x}'s qmgr peaked at {_times(max(ma, mb), min(ma, mb))} "
                       f"{'more' if ma > mb else 'less'} memory than {b}'s ({ma:.0f} MiB "
                       f"against {mb:.0f} MiB)")
    return [s for s in out if s]


def _replies_sentences(x: str, b: str, where: str, mine: dict[str, int],
                       theirs: dict[str, int]) -> list[str]:
    """The 4xx replies of one code that ``x`` provoked at ``where``, against ``b``."""
    th = THRESHOLDS
    out = []
    for code in sorted(set(mine) | set(theirs)):
        n, m = mine.get(code, 0), theirs.get(code, 0)
        if not _crosses(n, m, th["replies_ratio"], th["replies_count"]):
            continue
        if m == 0:
            out.append(f"{x} provoked {n} '{code}' replies at {where}, {b} none")
        elif n == 0:
            out.append(f"{x} provoked no '{code}' replies at {where}, {b} {m}")
        elif n > m:
            out.append(f"{x} provoked {_times(n, m)} the '{code}' replies at {where} "
                       f"that {b} did ({n} against {m})")
        else:
            out.append(f"{x} provoked {_times(m, n)} fewer '{code}' replies at {where} "
                       f"than {b} ({n} against {m})")
    return out


def _host_differences(run: dict[str, Any], base: dict[str, Any]) -> list[str]:
    """What differs at the MX hosts the destinations share: a refusal is the host's,
    not a destination's, so only here does it show."""
    th = THRESHOLDS
    x, b = run["contender"], base["contender"]
    out = []
    for host, fig in run.get("mx_hosts", {}).items():
        ref = base.get("mx_hosts", {}).get(host)
        if ref is None:
            continue
        where = f"MX host {host} ({len(fig['domains'])} destinations)"
        out += _replies_sentences(x, b, where, fig["replies_4xx"], ref["replies_4xx"])
        fa, fr = fig["in_flight_mean"], ref["in_flight_mean"]
        if _crosses(fa, fr, th["in_flight_ratio"], th["in_flight_diff"]):
            out.append(f"{x} kept {fa:.1f} sessions open at {where} on average, {b} "
                       f"{fr:.1f}")
    return out


def build(workload: dict[str, Any], runs: list[dict[str, Any]],
          timeouts: dict[str, float]) -> dict[str, Any]:
    """report.json: the workload, each run's figures, the orders' similarity, the words."""
    labels = [r["contender"] for r in runs]
    similar = {a["contender"]: {b["contender"]: round(similarity(a["order"], b["order"]), 4)
                                for b in runs} for a in runs}
    return {
        "generated": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "workload": workload,
        "contenders": labels,
        "baseline": labels[0] if labels else None,
        "differences": differences(runs, similar, timeouts),
        # Of those, what the runs' maillogs show did not take effect (they lead).
        "not_in_effect": [s for r in runs for s in r.get("not_in_effect", [])],
        "thresholds": THRESHOLDS,
        "similarity": similar,
        "runs": {r["contender"]: r for r in runs},
    }


# -- text -------------------------------------------------------------------------------


def _fmt(x: float | None, unit: str = "", digits: int = 2) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}{unit}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(r) + " |" for r in rows])


def _overview_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for label in report["contenders"]:
        r = report["runs"][label]
        rows.append([label, _fmt(r["drain_time"], " s") if r["drained"] else "not drained",
                     str(r["sent"]), str(r["bounced"]), str(r["undelivered"]),
                     f"{100 * r['deferral_rate']:.1f}%", str(r["replies_4xx"]),
                     _fmt(r["qmgr_cpu_s"], " s", 3), _fmt(r["qmgr_vmhwm_mib"], " MiB", 1)])
    return rows


OVERVIEW = ["contender", "time to drain", "sent", "bounced", "undelivered", "deferral rate",
            "remote 4xx", "qmgr CPU", "qmgr peak memory"]


def _latency_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for label in report["contenders"]:
        for klass, c in report["runs"][label]["classes"].items():
            rows.append([klass, label, f"{c['sent']}/{c['recipients']}", _fmt(c["p50"], " s"),
                         _fmt(c["p95"], " s"), _fmt(c["p99"], " s"), _fmt(c["max"], " s")])
    rows.sort(key=lambda r: r[0])
    return rows


def _dest_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for label in report["contenders"]:
        for dest, d in report["runs"][label]["destinations"].items():
            sink = d["sink"]
            if sink.get("kind") == "mx":
                seen = (f"{sink.get('accepted', 0)} accepted at MX host {sink.get('mx')} "
                        "(its sessions: MX hosts)")
            elif sink.get("kind") != "sink":
                seen = "-"
            else:
                seen = (f"{sink.get('sessions', 0)} sessions, {sink.get('refused_421', 0)} "
                        f"x 421 limit, {sink.get('refused_rate', 0)} x rate, peak "
                        f"{sink.get('max_concurrent', 0)}")
            replies = ", ".join(f"{n} x {c}" for c, n in d["replies_4xx"].items()) or "-"
            if d["deferred_by_reply"]:
                replies += " (lines: " + ", ".join(
                    f"{n} x {c}" for c, n in d["deferred_by_reply"].items()) + ")"
            rows.append([dest, label, f"{d['sent']}/{d['recipients']}", str(d["deferred"]),
                         f"{100 * d['deferral_rate']:.1f}%", replies,
                         f"{d['in_flight_mean']:.2f} / {d['in_flight_peak']}", seen])
    rows.sort(key=lambda r: r[0])
    return rows


def _host_rows(report: dict[str, Any]) -> list[list[str]]:
    """One row per MX host and contender: what the host's sink saw of all its
    destinations together."""
    rows = []
    for label in report["contenders"]:
        for host, h in report["runs"][label].get("mx_hosts", {}).items():
            sink = h["sink"]
            replies = ", ".join(f"{n} x {c}" for c, n in h["replies_4xx"].items()) or "-"
            if h.get("kind") != "sink":
                rows.append([host, label, str(len(h["domains"])), "-", "-", replies,
                             f"- ({h.get('kind')})"])
                continue
            rows.append([host, label, str(len(h["domains"])), str(sink.get("accepted", 0)),
                         f"{sink.get('sessions', 0)} ({sink.get('refused_421', 0)} x 421 "
                         f"limit, {sink.get('refused_rate', 0)} x rate refused)", replies,
                         f"{h['in_flight_mean']:.2f} / {h['in_flight_peak']}"])
    rows.sort(key=lambda r: r[0])
    return rows


HOSTS = ["MX host", "contender", "destinations", "recipients accepted",
         "sessions served", "remote 4xx replies", "sessions open: mean / peak"]
DESTS = ["destination", "contender", "sent", "deferred lines", "deferral rate",
         "remote 4xx replies", "in flight: mean / peak", "the sink saw"]
LATENCY = ["class", "contender", "sent", "p50", "p95", "p99", "max"]


def _fleet_note(w: dict[str, Any]) -> str:
    """What a fleet workload's figures are: N servers' together, as one sender's."""
    n = w.get("servers", 1)
    if n <= 1:
        return ""
    return (f" Each contender ran as a fleet of {n} servers, dealt the messages in turn "
            "(pyqmgr's sharing their limits through one redis-server, Postfix's own "
            "each alone); the figures are the fleet's, as one sender's, and the qmgr "
            f"CPU is the {n} qmgrs' together.")


def markdown(report: dict[str, Any]) -> str:
    w = report["workload"]
    out = [f"# pyqmgr compare: {w['title'] or w['path']}", "",
           f"Workload `{w['path']}`, time scale {w['time_scale']:g}, {w['messages']} "
           f"messages, {w['recipients']} recipients; baseline {report['baseline']}; "
           f"{report['generated']}.{_fleet_note(w)}", "", "## Differences that matter", ""]
    diffs = report["differences"] or ["No difference crosses the thresholds: the "
                                      "contenders behaved alike on this workload."]
    out += [f"- {d}" for d in diffs] + ["", "## Overview", ""]
    out += _table(OVERVIEW, _overview_rows(report))
    out += ["", "## Delivery latency (arrival to status=sent) per message class", ""]
    out += _table(LATENCY, _latency_rows(report))
    out += ["", "## Destinations", ""] + _table(DESTS, _dest_rows(report))
    hosts = _host_rows(report)
    if hosts:
        out += ["", "## MX hosts (one server behind several destinations)", ""]
        out += _table(HOSTS, hosts)
    out += markdown_lines(report)
    labels = report["contenders"]
    out += ["", "## Delivery order similarity (1: the same order)", ""]
    out += _table(["", *labels], [[a] + [f"{report['similarity'][a][b]:.3f}" for b in labels]
                                  for a in labels])
    return "\n".join(out) + "\n"


# -- HTML -------------------------------------------------------------------------------

_CSS = """
body { font-family: sans-serif; margin: 2em auto; padding: 0 1em; max-width: 1200px;
  color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
th { background: #f0f0f0; }
.diffs li { margin: 0.3em 0; } .diffs { background: #fff8e0; padding: 0.8em 2em;
  border: 1px solid #e8d080; }
.plots img { max-width: 100%; border: 1px solid #ddd; margin: 0.3em 0; }
.note { color: #555; font-size: 0.9em; }
.diffs li.missed { font-weight: bold; color: #8a1c00; }
"""


def _html_table(head: list[str], rows: list[list[str]]) -> str:
    h = "".join(f"<th>{html.escape(c)}</th>" for c in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f"<table><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"


def to_html(report: dict[str, Any]) -> str:
    """One page, nothing fetched: styles inline, plots as data: PNGs, no script."""
    w = report["workload"]
    pics = plots(report)
    e = html.escape
    diffs = report["differences"] or ["No difference crosses the thresholds: the "
                                      "contenders behaved alike on this workload."]
    missed = set(report.get("not_in_effect", []))
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>pyqmgr compare: {e(w['title'] or w['path'])}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>pyqmgr compare: {e(w['title'] or w['path'])}</h1>",
        f"<p class=note>Workload <code>{e(w['path'])}</code>, time scale "
        f"{w['time_scale']:g}, {w['messages']} messages, {w['recipients']} recipients to "
        f"{len(w['destinations'])} destination(s). Baseline: {e(str(report['baseline']))}. "
        f"Generated {e(report['generated'])}.{e(_fleet_note(w))}</p>",
        "<h2>Differences that matter</h2><ul class=diffs>"
        + "".join(f"<li class=missed>{e(d)}</li>" if d in missed else f"<li>{e(d)}</li>"
                  for d in diffs) + "</ul>",
        "<h2>Overview</h2>", _html_table(OVERVIEW, _overview_rows(report)),
        "<h2>Delivery latency per message class</h2>",
        "<p class=note>From each message's arrival to its recipient's status=sent line "
        "(Postfix's delay=); percentiles interpolate linearly between ranks.</p>",
        _html_table(LATENCY, _latency_rows(report)),
    ]
    if "latency" in pics:
        parts.append(f'<div class=plots><img alt="latency percentiles per class" '
                     f'src="data:image/png;base64,{pics["latency"]}"></div>')
    parts += ["<h2>Destinations</h2>",
              "<p class=note>Deferral rate: deferred lines over all delivery lines (one per "
              "recipient and attempt). In flight: sessions open at the destination, by the "
              "sink's clock (time-weighted mean while any is open, and the peak); for a "
              "host without a sink (a dead one), connection attempts under way from the "
              "maillog. Remote 4xx replies are the sink's count (a 421 refusal is one reply; "
              "Postfix logs it for each recipient of the delivery: the lines in brackets). "
              "The sink's own count of sessions is the last column.</p>",
              _html_table(DESTS, _dest_rows(report))]
    hosts = _host_rows(report)
    if hosts:
        parts += ["<h2>MX hosts</h2>",
                  "<p class=note>Destinations whose MX record names one host share its "
                  "server: one sink, found through real MX records (unbound on loopback; "
                  "Postfix's smtp(8) looks them up). Its session limit counts their "
                  "sessions together, and a refusal comes before a session names its "
                  "recipients, so refusals and sessions open are the host's.</p>",
                  _html_table(HOSTS, hosts)]
        for host in sorted({h for r in report["runs"].values() for h in r.get("mx_hosts", {})}):
            if f"host:{host}" in pics:
                parts.append(f'<div class=plots><img alt="MX host {e(host)} over time" '
                             f'src="data:image/png;base64,{pics["host:" + host]}"></div>')
    for dest in sorted({d for r in report["runs"].values() for d in r["destinations"]}):
        if f"dest:{dest}" in pics:
            parts.append(f'<div class=plots><img alt="{e(dest)} over time" '
                         f'src="data:image/png;base64,{pics["dest:" + dest]}"></div>')
    labels = report["contenders"]
    parts += ["<h2>Delivery order similarity</h2>",
              "<p class=note>difflib's ratio over the messages of the sent lines in maillog "
              "order: 1 is the same order.</p>",
              _html_table(["", *labels], [[a] + [f"{report['similarity'][a][b]:.3f}"
                                                 for b in labels] for a in labels])]
    parts.append("<h2>Settings</h2>")
    rows = []
    for label in labels:
        r = report["runs"][label]
        rows.append([label, ", ".join(f"{k} = {v}" for k, v in (r.get("pyqmgr_cf") or {})
                                      .items()) or "-"])
    parts.append(_html_table(["contender", "pyqmgr.cf"], rows))
    parts.append(f"<p class=note>main.cf: {e(', '.join(f'{k} = {v}' for k, v in w['main_cf'].items()))}</p>")  # noqa: E501
    parts.append("<p class=note>Thresholds for the sentences at the top: "
                 + e(", ".join(f"{k} {v:g}" for k, v in THRESHOLDS.items())) + ".</p>")
    parts.append("</body></html>")
    return "\n".join(parts)
