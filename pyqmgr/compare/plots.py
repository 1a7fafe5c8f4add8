"""The report's charts: each destination's and each MX host's over time, latency per class.

Charts a person reads at a glance and side by side (issue #43): every chart over time
has the same x-axis, from the first submission to the end of the longest run, so a
destination that was done in 4 s under one contender and 39 s under another looks
it, and one chart can be read against the next; legends stand beside the axes, not on
the data; the limits that hold the sessions are drawn as labelled lines: an MX host's
session limit (``server_limit``, 421 beyond) and each contender's site cap
(``site_concurrency_limit`` with ``site_grouping = mx``). matplotlib draws them (Agg);
without it the report has its tables alone.
"""

from __future__ import annotations

import base64
import io
import math
from typing import Any

#: Legend beside the axes it explains, outside the data.
LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0,
          "fontsize": "small", "frameon": False}
DPI = 90


def _pyplot() -> Any:  # noqa: ANN401 - matplotlib.pyplot, or None without it
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def time_span(report: dict[str, Any]) -> float:
    """The x-axis every chart over time shares: the longest run's end, its last
    session or its last delivery, whichever is latest."""
    span = 0.0
    for run in report["runs"].values():
        span = max(span, run.get("elapsed") or 0.0, run.get("last_final") or 0.0)
        for d in [*run["destinations"].values(), *run.get("mx_hosts", {}).values()]:
            if d["in_flight"]:
                span = max(span, d["in_flight"][-1][0] or 0.0)
        span = max(span, run["bin_width"] * max(
            (len(d["per_second"]) for d in run["destinations"].values()), default=0))
    return span or 1.0


def _site_cap(run: dict[str, Any]) -> int:
    """A contender's site cap (0: sites off or no cap)."""
    cf = run.get("pyqmgr_cf") or {}
    if (cf.get("site_grouping") or "").strip().lower() != "mx":
        return 0
    try:
        return int(cf.get("site_concurrency_limit") or 0)
    except ValueError:
        return 0


def _destination(plt: Any, report: dict[str, Any], dest: str, span: float) -> Any:  # noqa: ANN401
    labels = report["contenders"]
    runs = report["runs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.4), sharex=True,
                                   layout="constrained")
    for i, label in enumerate(labels):
        d = runs[label]["destinations"].get(dest)
        if d is None:
            continue
        colour = f"C{i % 10}"
        pts = d["in_flight"]
        if pts:
            ax1.step([0.0] + [p[0] for p in pts], [0] + [p[1] for p in pts],
                     where="post", color=colour, label=label)
        width = runs[label]["bin_width"]
        xs = [width * (k + 0.5) for k in range(len(d["per_second"]))]
        ax2.plot(xs, d["per_second"], marker=".", color=colour, label=label)
    by_sink = any(runs[lb]["destinations"].get(dest, {}).get("in_flight_source") == "sink"
                  for lb in labels)
    ax1.set_title(f"{dest}: sessions open" if by_sink
                  else f"{dest}: connection attempts under way")
    ax2.set_title(f"{dest}: recipients accepted per second")
    _finish(fig, (ax1, ax2), span)
    return fig


def _host(plt: Any, report: dict[str, Any], host: str, span: float) -> Any:  # noqa: ANN401
    """Sessions open at an MX host, each contender's, with the host's session limit
    and each contender's site cap."""
    labels = report["contenders"]
    runs = report["runs"]
    fig, ax = plt.subplots(figsize=(12, 3.4), layout="constrained")
    top = 1
    for i, label in enumerate(labels):
        h = runs[label].get("mx_hosts", {}).get(host)
        if h is None or not h["in_flight"]:
            continue
        pts = h["in_flight"]
        ax.step([0.0] + [p[0] for p in pts], [0] + [p[1] for p in pts], where="post",
                color=f"C{i % 10}", label=label)
        top = max(top, h["in_flight_peak"])
    limit = (report["workload"].get("mx_limits") or {}).get(host, 0)
    if limit:
        ax.axhline(limit, color="#d62728", linestyle=":", linewidth=1.6, zorder=3,
                   label=f"{host} takes {limit} sessions (421 beyond)")
    for i, label in enumerate(labels):
        cap = _site_cap(runs[label])
        if cap:
            ax.axhline(cap, color=f"C{i % 10}", linestyle="--", linewidth=1.4, zorder=3,
                       label=f"{label}'s site cap: site_concurrency_limit = {cap}")
        top = max(top, cap, limit)
    ax.set_ylim(0, top * 1.15 + 0.5)
    n = len(next((r["mx_hosts"][host]["domains"] for r in runs.values()
                  if host in r.get("mx_hosts", {})), []))
    ax.set_title(f"MX host {host} ({n} destinations): sessions open")
    _finish(fig, (ax,), span)
    return fig


def _finish(fig: Any, axes: tuple[Any, ...], span: float) -> None:  # noqa: ANN401
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_xlim(0, span)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("seconds since the first message")
    handles, names = axes[-1].get_legend_handles_labels()
    for ax in axes[:-1]:
        for h, n in zip(*ax.get_legend_handles_labels(), strict=True):
            if n not in names:
                handles.append(h)
                names.append(n)
    if handles:
        axes[-1].legend(handles, names, **LEGEND)


def _latency(plt: Any, report: dict[str, Any]) -> Any:  # noqa: ANN401
    labels = report["contenders"]
    runs = report["runs"]
    classes = sorted({c for r in runs.values() for c in r["classes"]})
    cols = min(3, len(classes))
    rows = math.ceil(len(classes) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.3 * cols + 2.5, 3 * rows), squeeze=False,
                             layout="constrained")
    keys = ["p50", "p95", "p99", "max"]
    for i, klass in enumerate(classes):
        ax = axes[i // cols][i % cols]
        for k, label in enumerate(labels):
            c = runs[label]["classes"].get(klass)
            if c is None or not c["sent"]:
                continue
            ax.plot(range(len(keys)), [c[p] for p in keys], marker="o", color=f"C{k % 10}",
                    label=label)
        ax.set_title(f"{klass}: latency (s)")
        ax.set_xticks(range(4), keys)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for j in range(len(classes), rows * cols):
        axes[j // cols][j % cols].axis("off")
    handles, names = axes[0][0].get_legend_handles_labels()
    if handles:
        axes[0][cols - 1].legend(handles, names, **LEGEND)
    return fig


def figures(report: dict[str, Any]) -> dict[str, Any]:
    """Every chart by name (``dest:NAME``, ``host:NAME``, ``latency``), laid out and
    drawn; empty without matplotlib. The caller closes them."""
    plt = _pyplot()
    if plt is None:
        return {}
    out: dict[str, Any] = {}
    span = time_span(report)
    runs = report["runs"]
    for host in sorted({h for r in runs.values() for h in r.get("mx_hosts", {})}):
        out[f"host:{host}"] = _host(plt, report, host, span)
    for dest in sorted({d for r in runs.values() for d in r["destinations"]}):
        out[f"dest:{dest}"] = _destination(plt, report, dest, span)
    if any(r["classes"] for r in runs.values()):
        out["latency"] = _latency(plt, report)
    for fig in out.values():
        fig.canvas.draw()
    return out


def plots(report: dict[str, Any]) -> dict[str, str]:
    """Base64 PNGs by name; empty without matplotlib (the tables carry the figures)."""
    plt = _pyplot()
    out = {}
    for name, fig in figures(report).items():
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=DPI)
        plt.close(fig)
        out[name] = base64.b64encode(buf.getvalue()).decode()
    return out
