"""``--plot``: windows and deliveries in flight over time, as a PNG a person can read.

matplotlib is an optional extra (``pip install '.[plot]'`` in a checkout); the rest of the
simulator does not need it.

What the figure shows, one panel above another on one time axis:

* with destinations that name an MX host: the deliveries in flight at each site
  (``site_grouping = mx``; each MX host's destinations together without it), with
  the limits that hold them drawn as labelled lines: the site's cap
  (``site_concurrency_limit`` or its own from the maps) and the host's session
  limit (``server_limit``, 421 beyond);
* each destination's window, the scheduler's concurrency limit for it;
* each destination's deliveries in flight, with its own server's limit.

A plot is read at a glance or not at all (issue #43: the sites plot had a 20-entry
legend over the data, colours that repeated, and no cap). So legends stand beside the
axes, never on the data; at most :data:`SHOWN` destinations are drawn in colours of
their own (tab10's ten, all distinct) and the rest as one grey "others" line, their
deliveries in flight summed; windows and deliveries share a destination's colour,
one legend naming it once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pyqmgr.output import open_new
from pyqmgr.simulator.engine import Result

if TYPE_CHECKING:
    from pyqmgr.simulator.scenario import Scenario

#: Destinations drawn each in a colour of its own; beyond, the busiest this many less
#: one, and "others" in grey.
SHOWN = 10
GREY = "#7f7f7f"
#: Sites (or MX hosts) drawn each in a colour of its own (Dark2's eight).
GROUPS = 8
LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0,
          "fontsize": "small", "frameon": False}


class PlotError(RuntimeError):
    pass


@dataclass
class Group:
    """Destinations that share a server (one MX host) or a site: their deliveries in
    flight together, and the limits that hold them."""

    name: str
    members: list[str] = field(default_factory=list)
    #: The site's cap (0: none) and the setting that set it, as a legend says it.
    cap: int = 0
    cap_setting: str = ""
    #: The MX host's session limit (0: none) and the host.
    server_limit: int = 0
    host: str = ""


def _pyplot() -> Any:  # noqa: ANN401 - matplotlib.pyplot, imported on demand
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from pyqmgr.extras import install_command

        raise PlotError(f"--plot needs the plot extra: {install_command(['plot'])}") from None
    return plt


def groups(sc: Scenario) -> list[Group]:
    """The scenario's shared servers: by site with sites on (the simulator's own
    answer to the core's lookups), else by MX host; a destination of its own is none."""
    from pyqmgr.simulator.engine import PYQMGR_CF_SECTION
    from pyqmgr.simulator.sites import scenario_sites
    from pyqmgr.site_names import site_name

    settings = scenario_sites(sc, PYQMGR_CF_SECTION)
    out: dict[str, Group] = {}
    for name, dest in sorted(sc.destinations.items()):
        if not dest.mx:
            continue
        key = dest.mx
        if settings is not None:
            key = site_name([(10, dest.mx)], settings.providers) or dest.mx
        g = out.setdefault(key, Group(key, host=dest.mx, server_limit=dest.server_limit))
        g.members.append(name)
        if g.host != dest.mx:  # a provider's several hosts: no one server's limit
            g.host, g.server_limit = "", 0
        if settings is not None and not g.cap:
            own = settings.own_limits.get(key.lower())
            limits = settings.limits.get(dest.transport)
            if own:
                g.cap, g.cap_setting = own, "site_concurrency_limit_maps"
            elif limits is not None and limits.concurrency:
                g.cap, g.cap_setting = limits.concurrency, limits.setting.split(" in ")[0]
    return list(out.values())


def _busiest(res: Result) -> list[str]:
    def tried(d: str) -> int:
        return res.sent.get(d, 0) + res.deferred.get(d, 0) + res.bounced.get(d, 0)

    return sorted(res.windows, key=lambda d: (-tried(d), d))


def _steps(points: list[tuple[float, int]], end: float) -> tuple[list[float], list[int]]:
    """A step series carried to the run's end (drawn ``where="post"``)."""
    xs = [t for t, _ in points] + [end]
    ys = [n for _, n in points]
    return xs, ys + ys[-1:]


#: Deliveries in flight are drawn as their peak in each of this many bins: about a
#: pixel each, where the raw steps of a busy run (a delivery ending and the next
#: starting a millisecond later) would draw a comb of spikes to zero.
BINS = 400


def _peaks(points: list[tuple[float, int]], end: float) -> list[tuple[float, int]]:
    """A step series as its peak in each of BINS bins over [0, end]."""
    if end <= 0 or not points:
        return points
    width = end / BINS
    peaks = [0] * BINS
    current = 0
    i = 0
    for b in range(BINS):
        hi = current
        stop = (b + 1) * width
        while i < len(points) and points[i][0] < stop:
            current = points[i][1]
            hi = max(hi, current)
            i += 1
        peaks[b] = hi
    out: list[tuple[float, int]] = []
    for b, n in enumerate(peaks):
        if not out or out[-1][1] != n:
            out.append((b * width, n))
    return out


def _summed(res: Result, members: list[str]) -> list[tuple[float, int]]:
    """Deliveries in flight at several destinations together, whenever one changed."""
    events = sorted((t, d, busy) for d in members for t, _, busy in res.windows.get(d, []))
    now: dict[str, int] = {}
    out: list[tuple[float, int]] = []
    for t, d, busy in events:
        now[d] = busy
        total = sum(now.values())
        if out and out[-1][0] == t:
            out[-1] = (t, total)
        else:
            out.append((t, total))
    return out or [(0.0, 0)]


def _group_panel(ax: Any, res: Result, found: list[Group], sites: bool) -> None:  # noqa: ANN401
    import matplotlib

    colours = matplotlib.color_sequences["Dark2"]
    shown = sorted(found, key=lambda g: -len(g.members))[:GROUPS]
    top = 1
    drawn_limits: set[tuple[str, int]] = set()
    for i, g in enumerate(shown):
        xs, ys = _steps(_peaks(_summed(res, g.members), res.end_time), res.end_time)
        ax.step(xs, ys, where="post", color=colours[i], linewidth=2.5, zorder=2,
                label=f"{g.name}: {len(g.members)} destinations")
        top = max(top, *ys, g.cap, g.server_limit)
        for label, y, style in _limit_lines(g, len(shown) > 1):
            if (label, y) in drawn_limits:
                continue
            drawn_limits.add((label, y))
            # Over the data, in a colour of its own: a site held at its cap draws
            # its line right on it.
            ax.axhline(y, color="#d62728" if len(shown) == 1 else colours[i],
                       linestyle=style, linewidth=1.4, zorder=3, label=label)
    what = "site" if sites else "MX host"
    ax.set_ylabel(f"in flight per {what}")
    ax.set_ylim(0, top * 1.15 + 0.5)
    ax.legend(**LEGEND)


def _limit_lines(g: Group, named: bool) -> list[tuple[str, int, str]]:
    """(label, y, linestyle) of the lines that hold a group: its site cap, its host's
    session limit; one line saying both where they are the same number."""
    who = f"{g.name}'s " if named else ""
    host = (f"{g.host} takes {g.server_limit} sessions\n(421 beyond)"
            if g.server_limit else "")
    if g.cap and g.cap == g.server_limit:
        return [(f"{who}site cap: {g.cap_setting} = {g.cap},\nas {host}", g.cap, "--")]
    out = []
    if g.cap:
        out.append((f"{who}site cap: {g.cap_setting} = {g.cap}", g.cap, "--"))
    if host:
        out.append((host, g.server_limit, ":"))
    return out


def _destination_panels(ax_win: Any, ax_busy: Any, res: Result,  # noqa: ANN401
                        sc: Scenario | None) -> None:
    import matplotlib

    order = _busiest(res)
    many = len(order) > SHOWN
    shown = order[:SHOWN - 1] if many else order
    palette = [c for i, c in enumerate(matplotlib.color_sequences["tab10"])
               if not (many and i == 7)]  # tab10's grey is the others' when there are any
    handles = []
    limits: list[tuple[str, int, Any]] = []
    limit_lines = []
    for i, dest in enumerate(shown):
        points = res.windows[dest]
        xs, wins = _steps([(t, max(w, 0)) for t, w, _ in points], res.end_time)
        line, = ax_win.step(xs, wins, where="post", color=palette[i], label=dest)
        handles.append(line)
        xs, busy = _steps(_peaks([(t, b) for t, _, b in points], res.end_time),
                          res.end_time)
        ax_busy.step(xs, busy, where="post", color=palette[i])
        d = sc.destinations.get(dest) if sc is not None else None
        if d is not None and d.server_limit and not d.mx:
            limits.append((dest, d.server_limit, palette[i]))
    for dest, limit, colour in limits:
        # Over the data and darker: a destination at its server's limit draws on it.
        handles_limit = ax_busy.axhline(
            limit, color="#d62728" if len(limits) == 1 else colour, linestyle="--",
            linewidth=1.4, zorder=3, label=f"{dest} takes {limit} sessions (421 beyond)")
        limit_lines.append(handles_limit)
    if many:
        rest = order[SHOWN - 1:]
        xs, busy = _steps(_peaks(_summed(res, rest), res.end_time), res.end_time)
        line, = ax_busy.step(xs, busy, where="post", color=GREY,
                             label=f"others ({len(rest)} destinations): in flight summed")
        handles.append(line)
    ax_win.set_ylabel("window per destination")
    ax_win.set_ylim(bottom=0)
    ax_busy.set_ylabel("in flight per destination")
    ax_busy.set_ylim(bottom=0)
    ax_win.legend(handles=handles, **LEGEND)
    if limit_lines:
        ax_busy.legend(handles=limit_lines, **LEGEND)


def _seconds(x: float) -> str:
    return f"{x * 1000:.3g} ms" if x < 1 else f"{x:.3g} s"


def figure(res: Result, title: str = "", sc: Scenario | None = None) -> Any:  # noqa: ANN401
    """The figure, drawn and laid out (Agg): ``plot`` saves it, the tests measure it."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    found = groups(sc) if sc is not None else []
    rows = 3 if found else 2
    fig, axes = plt.subplots(rows, 1, sharex=True, figsize=(11, 2.5 * rows + 0.9),
                             layout="constrained")
    if found:
        sites = sc is not None and bool(sc.pyqmgr_cf.get("site_grouping", "")
                                        .strip().lower() == "mx")
        _group_panel(axes[0], res, found, sites)
    _destination_panels(axes[-2], axes[-1], res, sc)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(0, max(res.end_time, 1e-9))
    axes[-1].set_xlabel(f"simulated time (s); in flight: the peak in each "
                        f"{_seconds(res.end_time / BINS)}")
    fig.suptitle(title or "destination concurrency windows")
    fig.canvas.draw()
    return fig


def plot(res: Result, path: str, title: str = "", sc: Scenario | None = None) -> str:
    """Write the figure to ``path`` (its format from the extension); return the
    absolute path written, which ``simulate --plot`` prints."""
    plt = _pyplot()
    fig = figure(res, title, sc)
    try:
        # Opened here, without following a link (pyqmgr.output); the format from the
        # name's extension, as savefig(path) would take it.
        with open_new(path, "wb") as f:
            fig.savefig(f, format=os.path.splitext(path)[1][1:].lower() or "png", dpi=90)
    finally:
        plt.close(fig)
    return os.path.abspath(path)
