"""The ``pyqmgr`` command: demo, check, install, uninstall, simulate.

The daemon itself is not started from here: master(8) runs the launcher that
``pyqmgr install`` writes, which calls :func:`pyqmgr.daemon.main` directly.
"""

from __future__ import annotations

import argparse
import json
import os
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


#: ``pyqmgr check`` exit statuses: clean, problems found, could not check at all.
CHECK_OK = 0
CHECK_PROBLEMS = 1
CHECK_ERROR = 2


def _check(args: argparse.Namespace) -> int:
    from pyqmgr.install import InstallError, check_installation

    try:
        report = check_installation(args.config_dir)
    except InstallError as exc:
        if args.json:
            print(json.dumps({"config_dir": args.config_dir, "ok": False,
                              "error": str(exc)}, indent=2))
        else:
            print(f"pyqmgr check: {exc}", file=sys.stderr)
        return CHECK_ERROR
    if args.json:
        print(json.dumps(report.as_json(), indent=2))
        return CHECK_OK if report.ok else CHECK_PROBLEMS
    launcher = report.launcher if report.launcher_installed else f"{report.launcher} (absent)"
    if report.launcher_interpreter:
        launcher += f", runs {report.launcher_interpreter}"
    python = report.python + (f" (venv {report.venv})" if report.venv else "")
    if report.pyqmgr_cf_error:
        settings = f"{report.pyqmgr_cf}: does not parse"
    elif report.pyqmgr_cf_exists:
        settings = f"{report.pyqmgr_cf}: parses, {len(report.pyqmgr_cf_parameters)} parameter(s)"
    else:
        settings = f"{report.pyqmgr_cf}: absent (no settings: stock behaviour)"
    lines = [f"config_dir  {report.config_dir}", f"launcher    {launcher}",
             f"python      {python}", f"package     {report.package_dir}",
             f"pyqmgr.cf   {settings}"]
    lines += [f"policy      {name}: {path}" for name, path in report.policy_modules.items()]
    lines.append(f"checked     {report.paths_checked} paths in "
                 f"{report.check_seconds * 1000:.1f} ms")
    lines += [f"note: {text}" for text in report.notes]
    if report.ok:
        lines.append("ok: no problems found")
    else:
        lines.append(f"{len(report.problems)} problem(s):")
        lines += [f"  {text}" for text in report.problems]
    print("\n".join(lines))
    return CHECK_OK if report.ok else CHECK_PROBLEMS


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
        if args.policy:
            scenario.pyqmgr_cf["scheduler_policy"] = args.policy
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

    p = sub.add_parser(
        "check", help="report what would make the daemon unsafe to run as root (read-only)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Check, without changing anything, what master(8) would run as root for this\n"
            "instance: the launcher in $daemon_directory/pyqmgr/, this pyqmgr's interpreter\n"
            "and virtual environment, the pyqmgr package, $config_directory/pyqmgr.cf and\n"
            "every module:PATH policy file it names. Each must be owned by root and not be\n"
            "writable by group or others, and so must every directory above it (symbolic\n"
            "links are followed; a sticky world-writable directory like /tmp does not\n"
            "count as safe). pyqmgr.cf must also parse. The daemon makes the same check at\n"
            "every start and refuses to run; 'pyqmgr install' refuses to install."),
        epilog=("exit status: 0 no problems, 1 problems found (listed), 2 could not check\n"
                "(not a Postfix configuration directory, postconf failed)"))
    p.add_argument("--config-dir", required=True, help="the instance's config_directory")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (keys: ok, problems, notes, launcher, python, "
                        "venv, package_dir, pyqmgr_cf, policy_modules, ...)")
    p.set_defaults(func=_check)

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
    p.add_argument("--policy", metavar="NAME",
                   help="scheduler_policy for every transport, overriding the scenario's: "
                        "nqmgr (stock), oqmgr, finch, zmailer, or module:/path/file.py")
    p.set_defaults(func=_simulate)

    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # `pyqmgr simulate ... | head`: the reader has all it wanted. Point stdout at
        # /dev/null so that the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
