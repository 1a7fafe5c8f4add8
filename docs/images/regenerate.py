"""Regenerate the pictures in docs/images/ from the code that draws them.

    .venv/bin/python docs/images/regenerate.py              # both pictures
    .venv/bin/python docs/images/regenerate.py --simulate   # simulate-sites.png only
    .venv/bin/python docs/images/regenerate.py --report DIR # compare-sites.png from an
                                                            # existing compare --out DIR

``simulate-sites.png`` is ``pyqmgr simulate compat/workloads/sites-one-server.toml
--plot`` (a second, no root). ``compare-sites.png`` is the HTML report of ``pyqmgr
compare`` on the same workload (stock against pyqmgr with sites, real Postfix: root,
Debian's postfix, unbound and chromium; about a minute), opened in headless Chromium
(pyqmgr/testbed/chromium.py) and cut to what a person reads first: the title, the
differences that matter and the overview, then the MX host's table and chart. Both are
kept under 200 KB (the screenshot in 128 colours). CI does not run this; the layout of
freshly drawn figures is tested by tests/unit/test_plots_layout.py.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKLOAD = os.path.join(ROOT, "compat", "workloads", "sites-one-server.toml")
#: Most a picture in docs/ may weigh.
MAX_BYTES = 200_000

#: Where the parts to keep are on the laid-out page (document coordinates, CSS px).
_MEASURE = """(() => {
  const span = e => { const b = e.getBoundingClientRect();
                      return [b.top + window.scrollY, b.bottom + window.scrollY]; };
  const h2 = [...document.querySelectorAll('h2')];
  const find = t => h2.find(h => h.textContent.startsWith(t));
  const overview = find('Overview').nextElementSibling;
  const img = document.querySelector('img[alt^="MX host"]');
  return {overview_end: span(overview)[1], hosts: span(find('MX hosts'))[0],
          hosts_end: span(img)[1]};
})()"""


def simulate_plot(path: str) -> None:
    from pyqmgr.simulator import load, simulate
    from pyqmgr.simulator.plot import plot

    sc = load(WORKLOAD)
    print(f"wrote {plot(simulate(sc), path, sc.title, sc)}")


def run_compare() -> tuple[str, str]:
    """compare on real Postfix into a fresh directory; (its --out, the directory to
    remove after)."""
    from pyqmgr.compare import compare

    base = tempfile.mkdtemp(prefix="pyqmgr-docs-images-", dir="/tmp")
    os.chmod(base, 0o755)  # Postfix's daemons traverse it
    out = os.path.join(base, "out")
    instances = os.path.join(base, "instances")
    os.mkdir(instances, 0o755)
    compare(os.path.relpath(WORKLOAD), None, out, base_dir=instances)
    return out, base


def screenshot(report_dir: str, path: str) -> None:
    from PIL import Image

    from pyqmgr.testbed.chromium import open_page

    url = f"file://{os.path.abspath(os.path.join(report_dir, 'report.html'))}"
    seen = open_page(url, width=1100, height=900, evaluate=_MEASURE)
    if seen.errors():
        raise SystemExit(f"{url}: {seen.errors()}")
    page = Image.open(io.BytesIO(seen.screenshot)).convert("RGB")
    at = seen.evaluated
    top = page.crop((0, 0, page.width, int(at["overview_end"]) + 16))
    hosts = page.crop((0, int(at["hosts"]) - 8, page.width, int(at["hosts_end"]) + 16))
    gap = 24
    out = Image.new("RGB", (page.width, top.height + gap + hosts.height), "white")
    out.paste(top, (0, 0))
    out.paste(hosts, (0, top.height + gap))
    for x in range(0, page.width, 12):  # a dashed rule where the page was cut
        for dx in range(6):
            out.putpixel((min(x + dx, page.width - 1), top.height + gap // 2), (160, 160, 160))
    out.quantize(colors=128, dither=Image.Dither.NONE).save(path, optimize=True)
    print(f"wrote {path} ({os.path.getsize(path)} bytes, from {url})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--simulate", action="store_true", help="only simulate-sites.png")
    ap.add_argument("--report", metavar="DIR", help="screenshot this compare --out DIR "
                    "instead of running compare")
    args = ap.parse_args()
    os.chdir(ROOT)  # the report names the workload as compat/workloads/...
    simulate_plot(os.path.join(HERE, "simulate-sites.png"))
    if args.simulate:
        return 0
    base = None
    report = args.report
    if report is None:
        report, base = run_compare()
    try:
        screenshot(report, os.path.join(HERE, "compare-sites.png"))
    finally:
        if base is not None:
            shutil.rmtree(base, ignore_errors=True)
    for name in ("simulate-sites.png", "compare-sites.png"):
        size = os.path.getsize(os.path.join(HERE, name))
        if size > MAX_BYTES:
            print(f"{name}: {size} bytes, over {MAX_BYTES}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
