"""The plots as a person sees them, measured on the rendered figure (issue #43).

`simulate --plot` for the sites workload once drew a 20-entry legend over the data in
colours that repeated, no site cap, and did not say where it wrote; compare's charts
per destination each had an x-axis of their own. Here each figure is drawn (Agg, the
canvas rendered) and its layout measured in pixels: every legend lies outside every
axes' box and inside the figure, the legend's colours are distinct, the cap and the
host's limit are lines at their values, and every chart over time has the same x
limits. compare's charts are drawn from a report built from the recorded real run in
tests/data/compare-dns-stopped/ (the same run read twice, once as another contender
whose run lasted longer: their x-axes must still agree).
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import matplotlib
import matplotlib.colors
import matplotlib.pyplot
import pytest

from pyqmgr.cli import main
from pyqmgr.compare.figures import run_figures
from pyqmgr.compare.plots import figures, time_span
from pyqmgr.compare.report import build
from pyqmgr.simulator import load, simulate
from pyqmgr.simulator.plot import SHOWN, figure

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SITES = os.path.join(ROOT, "compat", "workloads", "sites-one-server.toml")
FIFTY = os.path.join(ROOT, "tests", "data", "sites-one-server.toml")
LIMITER = os.path.join(ROOT, "scenarios", "limiter-421-feedback-1-over-n.toml")
RECORDED = os.path.join(ROOT, "tests", "data", "compare-dns-stopped")


def _overlap(a: Any, b: Any) -> float:  # noqa: ANN401 - two Bboxes
    """The area two boxes share, in square pixels."""
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return max(w, 0) * max(h, 0)


def _legends(fig: Any) -> list[Any]:  # noqa: ANN401
    return [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + \
        list(fig.legends)


def _assert_legends_outside(fig: Any) -> None:  # noqa: ANN401
    renderer = fig.canvas.get_renderer()
    legends = _legends(fig)
    assert legends, "a figure with a legend"
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            if ax.axison:
                assert _overlap(box, ax.get_window_extent(renderer)) == 0, \
                    (legend.get_texts()[0].get_text(), ax.get_title() or ax.get_ylabel())
        # Not cut off: inside the figure.
        assert box.x0 >= 0 and box.x1 <= fig.bbox.x1 + 0.5, (box, fig.bbox)
        assert box.y0 >= 0 and box.y1 <= fig.bbox.y1 + 0.5, (box, fig.bbox)


def _colours(legend: Any) -> list[tuple[float, ...]]:  # noqa: ANN401
    return [tuple(matplotlib.colors.to_rgba(h.get_color()))
            for h in legend.legend_handles]


def test_the_sites_plot_legend_beside_the_data_distinct_colours_and_the_cap_drawn():
    sc = load(SITES)
    fig = figure(simulate(sc), sc.title, sc)
    try:
        _assert_legends_outside(fig)
        site, windows, busy = fig.axes
        # One time axis for the three panels.
        assert site.get_xlim() == windows.get_xlim() == busy.get_xlim()
        legend = windows.get_legend()
        names = [t.get_text() for t in legend.get_texts()]
        assert names == [f"d{i}.example" for i in range(10)]
        assert len(set(_colours(legend))) == 10, "no colour twice"
        caps = [ln for ln in site.get_lines()
                if ln.get_label().startswith("site cap: site_concurrency_limit = 5")]
        assert len(caps) == 1 and set(caps[0].get_ydata()) == {5}
        assert "mx.site.example takes 5 sessions" in caps[0].get_label()
        # The site's deliveries in flight reach the cap and never pass it.
        (data,) = [ln for ln in site.get_lines() if "10 destinations" in ln.get_label()]
        assert max(data.get_ydata()) == 5
        assert site.get_ylim()[1] > 5, "the cap is inside the axes, not on its edge"
    finally:
        matplotlib.pyplot.close(fig)


def test_fifty_destinations_are_the_busiest_nine_and_others_in_grey():
    sc = load(FIFTY)
    fig = figure(simulate(sc), sc.title, sc)
    try:
        _assert_legends_outside(fig)
        legend = fig.axes[1].get_legend()
        names = [t.get_text() for t in legend.get_texts()]
        assert len(names) == SHOWN and names[-1] == ("others (41 destinations): in flight "
                                                     "summed")
        colours = _colours(legend)
        assert len(set(colours)) == SHOWN
        assert colours[-1] == matplotlib.colors.to_rgba("#7f7f7f")
    finally:
        matplotlib.pyplot.close(fig)


def test_a_destinations_own_server_limit_is_drawn_where_it_is():
    sc = load(LIMITER)
    fig = figure(simulate(sc), sc.title, sc)
    try:
        _assert_legends_outside(fig)
        windows, busy = fig.axes
        (limit,) = [ln for ln in busy.get_lines() if "takes" in ln.get_label()]
        assert limit.get_label() == "limited.example takes 5 sessions (421 beyond)"
        assert set(limit.get_ydata()) == {5}
        assert windows.get_xlim() == busy.get_xlim()
    finally:
        matplotlib.pyplot.close(fig)


def test_simulate_plot_says_where_it_wrote(tmp_path, capsys):
    png = tmp_path / "sites.png"
    assert main(["simulate", SITES, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith(f"plot: {png}")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 200_000
    # --json's stdout stays one JSON document; the path goes to stderr.
    assert main(["simulate", SITES, "--json", "--plot", str(tmp_path / "j.png")]) == 0
    both = capsys.readouterr()
    json.loads(both.out)
    assert f"plot: {tmp_path / 'j.png'}" in both.err
    # A directory that is not there is said in one line, not a traceback.
    assert main(["simulate", SITES, "--plot", str(tmp_path / "no" / "x.png")]) == 1
    assert capsys.readouterr().err.strip().endswith("No such file or directory")


def _report() -> dict[str, Any]:
    with open(os.path.join(RECORDED, "run.json")) as f:
        record = json.load(f)
    with open(os.path.join(RECORDED, "maillog")) as f:
        text = f.read()
    ours = run_figures(record, text)
    # The same run as a contender that took twice as long: its charts run to 2x.
    slow = copy.deepcopy(ours)
    slow["contender"] = "stock"
    slow["pyqmgr_cf"] = None
    slow["elapsed"] = 2 * (ours["elapsed"] or 1.0)
    workload = {"title": "recorded", "path": "recorded.toml", "time_scale": 1,
                "messages": 6, "recipients": 6,
                "destinations": sorted(ours["destinations"]), "main_cf": {},
                "mx_limits": {"mx.one.example": 5}}
    return build(workload, [slow, ours], {"stock": 30, ours["contender"]: 30})


def test_compares_charts_share_one_x_axis_with_legends_beside_them():
    report = _report()
    charts = figures(report)
    try:
        assert set(charts) == {"host:mx.one.example", "dest:d0.example", "dest:d1.example",
                               "latency"}
        span = time_span(report)
        assert span == report["runs"]["stock"]["elapsed"] > report["runs"][
            report["contenders"][1]]["last_final"]
        limits = {ax.get_xlim() for name, fig in charts.items() if name != "latency"
                  for ax in fig.axes}
        assert limits == {(0.0, span)}, limits
        for fig in charts.values():
            _assert_legends_outside(fig)
        host = charts["host:mx.one.example"].axes[0]
        lines = {ln.get_label(): set(ln.get_ydata()) for ln in host.get_lines()}
        assert lines["mx.one.example takes 5 sessions (421 beyond)"] == {5}
        label = report["contenders"][1]
        assert lines[f"{label}'s site cap: site_concurrency_limit = 5"] == {5}
    finally:
        for fig in charts.values():
            matplotlib.pyplot.close(fig)


def test_the_check_catches_a_legend_on_the_data_and_one_cut_off():
    """The control: the layout of the plots before #43 fails the check."""
    for where in ({"loc": "best"}, {"loc": "upper left", "bbox_to_anchor": (1.5, 1.0)}):
        fig, ax = matplotlib.pyplot.subplots(figsize=(6, 3))
        try:
            for i in range(20):
                ax.plot([0, 1], [i, i], label=f"d{i}")
            ax.legend(**where)
            fig.canvas.draw()
            with pytest.raises(AssertionError):
                _assert_legends_outside(fig)
        finally:
            matplotlib.pyplot.close(fig)


def test_the_docs_pictures_are_small_pngs_beside_their_text():
    images = os.path.join(ROOT, "docs", "images")
    for name, docs in (("compare-sites.png", ("compare.md", "sites.md")),
                       ("simulate-sites.png", ("simulator.md", "sites.md"))):
        with open(os.path.join(images, name), "rb") as f:
            data = f.read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and 20_000 < len(data) < 200_000, name
        for doc in docs:
            with open(os.path.join(ROOT, "docs", doc)) as f:
                assert f"(images/{name})" in f.read(), (doc, name)
