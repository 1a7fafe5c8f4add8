"""The ``pyqmgr`` command: demo, install, uninstall, simulate.

The daemon itself is not started from here: master(8) runs the launcher that
``pyqmgr install`` writes, which calls :func:`pyqmgr.daemon.main` directly.
"""

from __future__ import annotations

import argparse
import sys


def _install(args: argparse.Namespace) -> int:
    from pyqmgr.install import InstallError, install

    try:
        for line in install(args.config_dir):
            print(line)
    except InstallError as exc:
        print(f"pyqmgr install: {exc}", file=sys.stderr)
        return 1
    return 0


def _uninstall(args: argparse.Namespace) -> int:
    from pyqmgr.install import InstallError, uninstall

    try:
        for line in uninstall(args.config_dir):
            print(line)
    except InstallError as exc:
        print(f"pyqmgr uninstall: {exc}", file=sys.stderr)
        return 1
    return 0


def _demo(args: argparse.Namespace) -> int:
    from pyqmgr.demo import run_demo

    return run_demo(messages=args.messages, keep=args.keep)


def _simulate(args: argparse.Namespace) -> int:
    from pyqmgr.simulator import load, simulate
    from pyqmgr.simulator.plot import PlotError, plot
    from pyqmgr.simulator.report import sequence, summary, windows
    from pyqmgr.simulator.scenario import ScenarioError

    try:
        scenario = load(args.scenario)
        result = simulate(scenario, seed=args.seed)
    except (ScenarioError, ValueError) as exc:
        print(f"pyqmgr simulate: {exc}", file=sys.stderr)
        return 1
    lines = summary(scenario, result)
    if not args.quiet:
        lines += ["", "deliveries:"] + sequence(result) + ["", "windows (time:window/busy):"]
        lines += windows(result)
    print("\n".join(lines))
    if args.plot:
        try:
            plot(result, args.plot, scenario.title)
        except PlotError as exc:
            print(f"pyqmgr simulate: {exc}", file=sys.stderr)
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pyqmgr", description="Postfix's queue manager, in Python."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="run a sandboxed Postfix with pyqmgr and send mail")
    p.add_argument("--messages", type=int, default=40, help="messages to send (default 40)")
    p.add_argument("--keep", action="store_true", help="keep the sandbox directory")
    p.set_defaults(func=_demo)

    p = sub.add_parser("install", help="make pyqmgr the qmgr service of a Postfix instance")
    p.add_argument("--config-dir", required=True, help="the instance's config_directory")
    p.set_defaults(func=_install)

    p = sub.add_parser("uninstall", help="restore stock qmgr for a Postfix instance")
    p.add_argument("--config-dir", required=True, help="the instance's config_directory")
    p.set_defaults(func=_uninstall)

    p = sub.add_parser("simulate", help="run a scheduling scenario on a virtual clock")
    p.add_argument("scenario", help="a scenario TOML file (see scenarios/)")
    p.add_argument("--plot", metavar="FILE.png", help="draw the windows over time")
    p.add_argument("--seed", type=int, help="override the scenario's random seed")
    p.add_argument("--quiet", action="store_true", help="only the summary table")
    p.set_defaults(func=_simulate)

    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
