"""``--plot``: windows and busy deliveries per destination over time, as a PNG.

matplotlib is an optional extra (``pip install 'pyqmgr[plot]'``); the rest of the
simulator does not need it.
"""

from __future__ import annotations

import os

from pyqmgr.output import open_new
from pyqmgr.simulator.engine import Result


class PlotError(RuntimeError):
    pass


def plot(res: Result, path: str, title: str = "") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("--plot needs the plot extra: pip install 'pyqmgr[plot]'") from None
    fig, ax = plt.subplots(figsize=(10, 5))
    for dest, points in sorted(res.windows.items()):
        times = [t for t, _, _ in points] + [res.end_time]
        win = [max(w, 0) for _, w, _ in points]
        busy = [b for _, _, b in points]
        ax.step(times, win + win[-1:], where="post", label=f"{dest} window")
        ax.step(times, busy + busy[-1:], where="post", linestyle=":", label=f"{dest} busy")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("concurrency")
    ax.set_title(title or "destination concurrency windows")
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    # Opened here, without following a link (pyqmgr.output); the format from the
    # name's extension, as savefig(path) would take it.
    with open_new(path, "wb") as f:
        fig.savefig(f, format=os.path.splitext(path)[1][1:].lower() or "png")
    plt.close(fig)
