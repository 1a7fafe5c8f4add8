"""The parity suite against every Postfix release the test bed can run: ``./dev test-matrix``.

For each release (the machine's own, then each root of :mod:`pyqmgr.testbed.release`),
the root is made if missing, the parity suite runs with ``PYQMGR_POSTFIX_RELEASE`` set,
and its report goes to ``compat/parity-<release>.md`` (the machine's own keeps
``compat/parity.md``). The table it prints is written to ``compat/matrix.md`` with the
way each release was obtained. Exit status 0 only if every release agreed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from pyqmgr.testbed.release import HOST, MIRROR, RELEASES, ReleaseError, ReleaseRoot

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: What the parity report's summary line says, read back for the table.
_SUMMARY = re.compile(r"^(\d+) of (\d+) scenarios agree; (\d+) differ as intended .*?; "
                      r"(\d+) differ otherwise\.$", re.M)
#: Suites of Debian's archive checked for other releases, and what they had.
NOT_IN_ARCHIVE = ("3.8 and 3.9: in no suite of Debian's archive (bookworm has 3.7.11, "
                  "bookworm-backports and trixie 3.10, forky and sid 3.11); building "
                  "them from upstream source is not done here")


@dataclass
class Row:
    release: str
    version: str
    obtained: str
    agree: int = 0
    scenarios: int = 0
    intended: int = 0
    differ: int = 0
    failed_tests: int = 0
    passed_tests: int = 0
    seconds: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.differ == 0 and self.failed_tests == 0 \
            and self.scenarios > 0


def report_path(release: str) -> str:
    name = "parity.md" if release == HOST else f"parity-{release}.md"
    return os.path.join(HERE, name)


def run_release(release: str, pytest_args: list[str]) -> Row:
    """The parity suite on one release; its report in compat/."""
    env = dict(os.environ)
    if release == HOST:
        env.pop("PYQMGR_POSTFIX_RELEASE", None)
        version = subprocess.run(["postconf", "-dh", "mail_version"], capture_output=True,
                                 text=True, check=True).stdout.strip()
        obtained = "the machine's own Postfix (Debian 12's package)"
    else:
        env["PYQMGR_POSTFIX_RELEASE"] = release
        spec = RELEASES[release]
        try:
            root = ReleaseRoot(release).ensure(lambda t: print(f"  {t}", flush=True))
        except ReleaseError as exc:
            return Row(release, "?", f"debootstrap {spec.suite}", error=str(exc))
        version = root.version()
        obtained = (f"Debian {spec.suite}'s package, in a root made by `debootstrap "
                    f"--variant=minbase --include=postfix,python3 {spec.suite}` from "
                    f"{MIRROR}")
    report = report_path(release)
    env["PYQMGR_PARITY_REPORT"] = report
    junit = os.path.join("/tmp", f"pyqmgr-matrix-{release}-{os.getpid()}.xml")
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={junit}", os.path.join(ROOT, "tests", "parity"),
                    *pytest_args], cwd=ROOT, env=env, check=False)
    row = Row(release, version, obtained, seconds=time.monotonic() - started)
    try:
        suite = ET.parse(junit).getroot()
        if suite.tag == "testsuites":
            suite = suite[0]
        total = int(suite.get("tests", 0))
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped = int(suite.get("skipped", 0))
        row.failed_tests = failed + skipped  # a skip hides a scenario: counted as failed
        row.passed_tests = total - failed - skipped
    except (OSError, ET.ParseError) as exc:
        row.error = f"no test results: {exc}"
    finally:
        if os.path.exists(junit):
            os.unlink(junit)
    try:
        with open(report) as f:
            m = _SUMMARY.search(f.read())
    except OSError:
        m = None
    if m:
        row.agree, row.scenarios, row.intended, row.differ = map(int, m.groups())
    elif not row.error:
        row.error = f"no parity report in {report}"
    return row


def table(rows: list[Row]) -> list[str]:
    out = ["| release | Postfix | scenarios agree | differ as intended | differ | "
           "tests passed/failed | minutes | report |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        report = os.path.relpath(report_path(r.release), ROOT)
        out.append(f"| {r.release} | {r.version} | {r.agree} of {r.scenarios} | "
                   f"{r.intended} | {r.differ} | {r.passed_tests}/{r.failed_tests} | "
                   f"{r.seconds / 60:.1f} | "
                   f"{r.error or ('`' + report + '`')} |")
    return out


def write_matrix(rows: list[Row]) -> str:
    lines = ["# Postfix releases: the parity suite on each", "",
             "Made by `./dev test-matrix` (compat/matrix.py) on "
             f"{time.strftime('%Y-%m-%d')}: for each release the parity suite "
             "(`tests/parity/`) ran every scenario under that release's stock qmgr and "
             "under pyqmgr, on fresh instances on loopback. CI runs it for the machine's "
             "own release (`./dev test`) and for 3.10 (`./dev test-parity 3.10`).", "",
             *table(rows), "", "How each release was obtained:", ""]
    lines += [f"- {r.release} ({r.version}): {r.obtained}" for r in rows]
    lines += [f"- {NOT_IN_ARCHIVE}", "",
              "A root is kept under $PYQMGR_ROOTS (default /var/cache/pyqmgr/roots) and "
              "reused; each instance runs in it through a private mount namespace and "
              "chroot, so the machine's own Postfix is never touched "
              "(pyqmgr/testbed/release.py).", ""]
    path = os.path.join(HERE, "matrix.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="./dev test-matrix",
        description="Run the parity suite against each Postfix release the test bed can "
                    "run (the machine's own, and Debian roots made with debootstrap), "
                    "print a table and write it to compat/matrix.md.")
    parser.add_argument("releases", nargs="*", default=[HOST, *RELEASES],
                        help=f"releases to run (default: {' '.join([HOST, *RELEASES])})")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args, pytest_args = parser.parse_known_args(argv)
    unknown = [r for r in args.releases if r != HOST and r not in RELEASES]
    if unknown:
        parser.error(f"unknown release {unknown[0]!r}; known: {HOST} {' '.join(RELEASES)}")
    rows = []
    for release in args.releases:
        print(f"== {release}", flush=True)
        rows.append(run_release(release, pytest_args))
    print("\n".join(table(rows)))
    if set(args.releases) == {HOST, *RELEASES}:
        print(f"written to {write_matrix(rows)}")
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], indent=1))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
