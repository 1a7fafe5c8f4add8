"""The ``pyqmgr`` command: demo, check, install, uninstall, simulate, compare, and the
control channel's commands (status, explain, jobs, top, suspend, resume, retry).

The daemon itself is not started from here: master(8) runs the launcher that
``pyqmgr install`` writes, which calls :func:`pyqmgr.daemon.main` directly.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from pyqmgr.control.protocol import COMMANDS, CONTROL, READ, Arg
from pyqmgr.output import OutputError, output_dir


def _not_root(command: str, why: str) -> bool:
    """True, after one line saying so, when this is not root; ``why`` says what needs it.

    One line and a non-zero status instead of the first EACCES deep inside
    (``cannot be checked: Permission denied``, postconf's raw fatal, a traceback).
    """
    if os.geteuid() == 0:
        return False
    print(f"pyqmgr {command}: must be run as root: {why}", file=sys.stderr)
    return True


def _install(args: argparse.Namespace) -> int:
    from pyqmgr.install import InstallError, install, install_man_pages

    if _not_root("install", "it changes master.cf and writes the launcher that master(8) "
                            "runs as root"):
        return 1
    try:
        for line in install(args.config_dir):
            print(line)
        if not args.no_man:
            for line in install_man_pages(args.man_dir):
                print(line)
    except InstallError as exc:
        print(f"pyqmgr install: {exc}", file=sys.stderr)
        return 1
    return 0


#: Where ``pyqmgr install`` puts the manual pages: on man-db's default path, so that
#: ``man pyqmgr`` works without MANPATH.
DEFAULT_MAN_DIR = "/usr/local/share/man"

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
        if report.findings.unknown:
            settings += f", {len(report.findings.unknown)} unknown"
    else:
        settings = f"{report.pyqmgr_cf}: absent (no settings: stock behaviour)"
    lines = [f"config_dir  {report.config_dir}", f"launcher    {launcher}",
             f"python      {python}",
             f"package     {report.package_dir} ({report.build} build)",
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
    from pyqmgr.install import InstallError, remove_man_pages, uninstall

    if _not_root("uninstall", "it changes master.cf and reloads Postfix"):
        return 1
    try:
        lines = uninstall(args.config_dir)
        for line in lines:
            print(line)
        for line in remove_man_pages(args.man_dir, args.config_dir):
            print(line)
    except InstallError as exc:
        print(f"pyqmgr uninstall: {exc}", file=sys.stderr)
        return 1
    return 0


def _demo(args: argparse.Namespace) -> int:
    from pyqmgr import extras

    if _not_root("demo", "it starts a throwaway Postfix instance, whose master(8) runs "
                         "as root (the machine's own Postfix is not touched)"):
        return 1
    lacking = extras.missing("testbed")  # the demo's remote site is a sink SMTP server
    if lacking is not None:
        print(f"pyqmgr demo: {lacking}", file=sys.stderr)
        return 1
    from pyqmgr.demo import run_demo  # after the check: it imports the sink
    from pyqmgr.install import InstallError

    try:
        return run_demo(messages=args.messages, keep=args.keep)
    except InstallError as exc:
        print(f"pyqmgr demo: {exc}\n\n{_untrusted_advice()}", file=sys.stderr)
        return 1


def _untrusted_advice() -> str:
    """What to do when the trust check refuses this checkout for the demo's sandbox."""
    from pyqmgr import trust

    here = os.path.dirname(trust.package_dir())
    return (f"What to do: the demo's Postfix runs pyqmgr as root from {here}, so every "
            "directory from / down to it must be root's and writable by root alone "
            "(a checkout under /tmp or a home directory others can write to is not). "
            + ("Clone it under such a directory and run the demo there, for example:\n"
               f"  git clone {here} /opt/pyqmgr && cd /opt/pyqmgr && ./dev demo"
               if os.path.isdir(os.path.join(here, ".git")) else
               "Install pyqmgr into a venv under such a directory, for example:\n"
               "  python3 -m venv /opt/pyqmgr && /opt/pyqmgr/bin/pip install 'pyqmgr[testbed]'"
               " && /opt/pyqmgr/bin/pyqmgr demo"))


def _simulate(args: argparse.Namespace) -> int:
    """Run a scenario and print what a person compares between two settings.

    The default is the summary alone (a few lines: the table first), because that is
    what is read; the thousand-line delivery sequence and the window dump are for
    debugging a scenario and come only with --trace. --json is the same content for
    scripts. Errors in the scenario go to stderr with the file and line, exit 1.
    --plot without matplotlib is said once the scenario has loaded and before it runs,
    so that a long simulation is not waited for only to fail at the end.
    """
    from pyqmgr import extras
    from pyqmgr.simulator import load, simulate
    from pyqmgr.simulator.plot import PlotError, plot
    from pyqmgr.simulator.report import as_json, sequence, summary, windows
    from pyqmgr.simulator.scenario import ScenarioError

    try:
        scenario = load(args.scenario)
        if args.policy:
            scenario.pyqmgr_cf["scheduler_policy"] = args.policy
        for item in args.set or ():
            name, sep, value = item.partition("=")
            if not sep or not name.strip():
                raise ScenarioError(f"--set {item!r}: write NAME=VALUE, a pyqmgr.cf "
                                    "parameter and its value")
            scenario.pyqmgr_cf[name.strip()] = value.strip()
        lacking = extras.missing("plot") if args.plot else None
        if lacking is not None:
            print(f"pyqmgr simulate: --plot {lacking}", file=sys.stderr)
            return 1
        result = simulate(scenario, seed=args.seed)
    except (ScenarioError, ValueError) as exc:
        print(f"pyqmgr simulate: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(as_json(scenario, result, args.trace, scenario=args.scenario,
                                 seed=args.seed), indent=1))
    else:
        lines = summary(scenario, result)
        if scenario.compare.content_filter is not None:
            lines.append("note: [compare.content_filter] is played on real Postfix by "
                         "'pyqmgr compare' only; this simulation has no content filter")
        if args.trace:
            lines += ["", "deliveries (start, end, transport/destination, message, "
                      "x recipients, outcome, window when chosen):"]
            lines += sequence(result)
            lines += ["", "windows (a line whenever a destination's window or deliveries "
                      "in flight changed):"]
            lines += windows(result)
        print("\n".join(lines))
    if args.plot:
        try:
            written = plot(result, args.plot, scenario.title, scenario)
        except (PlotError, OutputError) as exc:
            print(f"pyqmgr simulate: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:
            print(f"pyqmgr simulate: --plot {args.plot}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 1
        # Where it went, as a person looks for it; on stderr under --json, whose
        # stdout is one JSON document.
        print(f"plot: {written}", file=sys.stderr if args.json else sys.stdout)
    return 0


#: ``pyqmgr compare`` exit statuses.
COMPARE_OK = 0
COMPARE_BAD_INPUT = 1
COMPARE_NOT_DRAINED = 3
COMPARE_RUN_FAILED = 4
COMPARE_INTERRUPTED = 130


def _compare(args: argparse.Namespace) -> int:
    from pyqmgr import extras
    from pyqmgr.compare import (
        ContenderError,
        ScenarioError,
        compare,
        load_plan,
        stderr_progress,
    )
    from pyqmgr.compare.contender import parse_contenders

    try:
        # Bad input is reported before anything is started or checked on the machine.
        plan = load_plan(args.workload, args.time_scale)
        if args.contenders:
            parse_contenders(args.contenders)
    except (ScenarioError, ContenderError) as exc:
        print(f"pyqmgr compare: {exc}", file=sys.stderr)
        return COMPARE_BAD_INPUT
    # The sinks' aiosmtpd before root and Postfix: on a base install, what to install
    # is the one thing to say, whoever runs it.
    lacking = extras.missing("testbed")
    if lacking is not None:
        print(f"pyqmgr compare: {lacking}", file=sys.stderr)
        return COMPARE_RUN_FAILED
    if not _can_run_postfix("pyqmgr compare: runs"):
        return COMPARE_RUN_FAILED
    stem = os.path.splitext(os.path.basename(args.workload))[0]
    out = args.out or f"pyqmgr-compare-{stem}"
    try:
        output_dir(out)
    except OutputError as exc:
        print(f"pyqmgr compare: {exc}", file=sys.stderr)
        return COMPARE_BAD_INPUT
    reports: list[dict[str, Any]] = []
    status = _run_on_postfix("pyqmgr compare", lambda: reports.append(compare(
        args.workload, args.contenders, out, plan.scale, args.timeout, args.keep,
        stderr_progress())))
    if status:
        return status
    report = reports[0]
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        with open(os.path.join(out, "summary.md")) as f:
            print(f.read(), end="")
        print(f"\nreport: {os.path.join(out, 'report.html')} (and report.json, summary.md, "
              "runs/)")
    drained = all(r["drained"] and not r["error"] for r in report["runs"].values())
    return COMPARE_OK if drained else COMPARE_NOT_DRAINED


def _replay(args: argparse.Namespace) -> int:
    from pyqmgr.compare.contender import ContenderError, parse_contenders
    from pyqmgr.postfix.config import ConfigError
    from pyqmgr.replay import GAP, Options, replay
    from pyqmgr.replay import report as replay_report
    from pyqmgr.replay.sources import read_pools
    from pyqmgr.replay.workload import write
    from pyqmgr.simulator.scenario import Scenario

    def fail(text: str) -> int:
        print(f"pyqmgr replay: {text}", file=sys.stderr)
        return 1

    for path in args.maillog + (args.fit_on or []):
        if not os.path.isfile(path):
            return fail(f"{path}: no such file")
    try:
        contenders = parse_contenders(args.contenders or ["stock"])
        pools, settings = read_pools(args.config_dir, args.settings)
        main_cf, limits = _replay_config(args.config_dir, settings)
    except (ContenderError, ConfigError, ValueError) as exc:
        return fail(str(exc))
    if args.compare:
        # Before the simulation, which can take minutes on a busy day's log.
        from pyqmgr import extras

        lacking = extras.missing("testbed")
        if lacking is not None:
            print(f"pyqmgr replay: --compare {lacking}", file=sys.stderr)
            return COMPARE_RUN_FAILED
    opts = Options(contenders, main_cf, limits, not args.no_hash,
                   args.hash_key.encode() if args.hash_key else None, args.year,
                   args.instance or [], args.seed, args.runs,
                   args.gap if args.gap is not None else GAP, args.fit_on or [],
                   sites=args.sites, pools=pools)
    progress = None
    if sys.stderr.isatty() and not args.json:
        def progress(text: str) -> None:
            print(f"\r\033[K{text}", end="", file=sys.stderr, flush=True)
    workloads: dict[str, Scenario] = {}
    try:
        report = replay(args.maillog, opts, progress, workloads)
    except ValueError as exc:  # a bad -o value met by the simulator's configuration
        return fail(str(exc))
    finally:
        if progress is not None:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
    if args.compare:
        status = _replay_on_postfix(args, report, workloads)
        if status:
            return status
    if args.write_workload:
        several = len(workloads) > 1
        for name, sc in workloads.items():
            where = os.path.join(args.write_workload, name.replace("/", "_")) if several \
                else args.write_workload
            try:
                report.setdefault("workloads", {})[name] = write(sc, where)
            except OutputError as exc:
                print(f"pyqmgr replay: {exc}", file=sys.stderr)
                return 1
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print("\n".join(replay_report.text(report, 0 if args.all else replay_report.ROWS)))
        for name, path in report.get("workloads", {}).items():
            print(f"workload of {name}: {path}")
    if not report["instances"]:
        print("pyqmgr replay: no Postfix message was found in the log"
              + (" for --instance " + ", ".join(args.instance) if args.instance else ""),
              file=sys.stderr)
        return 2
    return 0


def _replay_on_postfix(args: argparse.Namespace, report: dict[str, Any],
                       workloads: dict[str, Any]) -> int:
    """--compare: each replayed instance's workload through ``pyqmgr compare``."""
    from pyqmgr.compare import stderr_progress
    from pyqmgr.replay import on_postfix

    if not _can_run_postfix("pyqmgr replay: --compare runs"):
        return COMPARE_RUN_FAILED
    several = len(report["instances"]) > 1
    for inst in report["instances"]:
        name = inst["instance"]
        out = args.out or "pyqmgr-replay"
        if several:
            out = os.path.join(out, name.replace("/", "_"))
        status = _run_on_postfix("pyqmgr replay", functools.partial(
            on_postfix, inst, workloads[name], args.contenders or ["stock"], out,
            args.time_scale or 1.0, args.timeout, None if args.json else stderr_progress()))
        if status:
            return status
    return 0


def _can_run_postfix(what: str) -> bool:
    """Root and Debian's postfix package, or a message saying ``what`` needs them."""
    if os.geteuid() == 0 and shutil.which("postfix") is not None:
        return True
    print(f"{what} real Postfix instances: needs root and Debian's postfix package",
          file=sys.stderr)
    return False


def _run_on_postfix(command: str, run: Callable[[], object]) -> int:
    """Run compare's instances; a failed run or ^C as compare reports them (0: done)."""
    from pyqmgr.compare import RunError

    try:
        run()
    except (RunError, OutputError) as exc:
        print(f"\n{command}: {exc}", file=sys.stderr)
        return COMPARE_RUN_FAILED
    except KeyboardInterrupt:
        print(f"\n{command}: interrupted; every instance and sink was stopped",
              file=sys.stderr)
        return COMPARE_INTERRUPTED
    return 0


def _replay_config(config_dir: str | None,
                   settings: list[str]) -> tuple[dict[str, str], dict[str, int]]:
    """main.cf settings and master.cf process limits for the simulation."""
    from pyqmgr.postfix.config import ConfigError, QmgrConfig, parse_main_cf, split_nameval
    from pyqmgr.postfix.master_cf import load_master_cf

    main_cf: dict[str, str] = {}
    limits: dict[str, int] = {}
    if config_dir is not None:
        path = os.path.join(config_dir, "main.cf")
        try:
            with open(path, encoding="utf-8", errors="surrogateescape") as f:
                main_cf, _ = parse_main_cf(f.read(), path)
        except OSError as exc:
            raise ConfigError(f"{path}: {exc.strerror}") from None
    for text in settings:
        try:
            name, value = split_nameval(text)
        except ValueError as exc:
            raise ConfigError(f"-o {text!r}: {exc}") from None
        main_cf[name] = value
    cfg = QmgrConfig.from_text("".join(f"{k} = {v}\n" for k, v in main_cf.items()),
                               hostname="replay.example")
    if config_dir is not None:
        master = load_master_cf(config_dir, default_process_limit=cfg.default_process_limit)
        for svc in master.services:
            if svc.type == "unix" and svc.command in ("smtp", "lmtp", "local", "virtual",
                                                      "pipe"):
                limits[svc.service] = svc.process_limit or 0
    return main_cf, {k: v for k, v in limits.items() if v}


_REPLAY_DESCRIPTION = """\
Read Postfix maillogs and replay what they show in the simulator: the same arrivals
(time, size, recipients per domain), each destination as it behaved (how long a
recipient took, 421 session limits and rate replies, down times, and each
recipient's own 4xx/5xx answers try by try), under the schedulers you choose. The
report sets each choice's figures per destination next to the log's: recipients
sent, deferred tries, bounced, and the p50/p95 delay from arrival.

Reads syslog and postlogd (maillog_file) formats, RFC 3339 time stamps too, plain or
.gz, rotated files in any order (mail.log.2.gz mail.log.1 mail.log), several days and
several instances (host and syslog_name) told apart. Lines it cannot use (other
programs', garbage, cut short, back in time) are skipped and counted in the report.
Sender addresses are hashed in the derived workload unless --no-hash.

contenders (--with, repeat it): stock (the log's own nqmgr; the default), oqmgr,
pyqmgr:POLICY[,name=value...] as in 'pyqmgr compare'.

With --compare the derived workload also runs on real Postfix, each contender on a
fresh sandboxed instance as 'pyqmgr compare' runs it (the sinks answer each replayed
recipient as the log shows), and each run's own maillog is read back as the log was:
its figures stand in the table as "CONTENDER on Postfix", next to the simulation's.
"""


_N = TypeVar("_N", int, float)


def _number(convert: Callable[[str], _N], what: str, accept: Callable[[_N], bool],
            bound: str) -> Callable[[str], _N]:
    """An argparse type: the text ``convert``ed, refused unless ``accept``ed.

    The errors read "not WHAT: 'text'" and "must be BOUND: value" (the whole number
    as read; a fractional one as typed).
    """
    def parse(text: str) -> _N:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not accept(value):
            shown = value if isinstance(value, int) else text
            raise argparse.ArgumentTypeError(f"must be {bound}: {shown}")
        return value

    return parse


#: argparse types: compare's and replay's time scale, a timeout, top's interval, and
#: counts from 0 (jobs --limit) or from 1 (top -n, replay --runs).
_scale = _number(float, "a number", lambda v: 0 < v <= 100, "more than 0 and at most 100")
_seconds = _number(float, "a number of seconds", lambda v: v > 0, "more than 0")
_interval = _number(float, "a number of seconds", lambda v: v >= 0.1, "at least 0.1 s")
_count = _number(int, "a whole number", lambda v: v >= 0, "0 or more")
_positive = _number(int, "a whole number", lambda v: v >= 1, "1 or more")


_COMPARE_DESCRIPTION = (
    "Run one workload under several queue managers, each on a fresh sandboxed Postfix\n"
    "(real master, smtpd, cleanup and smtp on loopback, a sink SMTP server per\n"
    "destination playing its latency, 4xx/5xx replies, 421 session limit, rate limit\n"
    "or a dead host), one after the other, and compare what happened. The workload is\n"
    "a scenario file, the same that 'pyqmgr simulate' runs (see compat/workloads/ and\n"
    "the README's 'Side by side' section for its keys).\n\n"
    "contenders (--with, repeat it; the first is the baseline):\n"
    "  stock                      Postfix's qmgr\n"
    "  oqmgr                      Postfix's own old queue manager\n"
    "  pyqmgr                     pyqmgr with the workload's [pyqmgr_cf]\n"
    "  pyqmgr:POLICY[,name=value...]  ... with scheduler_policy = POLICY (nqmgr, oqmgr,\n"
    "                             finch, zmailer, module:/path.py) and pyqmgr.cf settings\n"
    "default: the workload's [compare] contenders, else stock and pyqmgr.\n\n"
    "The report (in --out DIR): report.html (one page, plots embedded, nothing fetched),\n"
    "report.json, summary.md (also printed), and runs/N-NAME/ with each run's maillog\n"
    "and run.json. It states the differences that cross its thresholds in words at the\n"
    "top, then per contender the time to drain, deferral rate, remote 4xx replies, the\n"
    "qmgr's CPU time and peak memory; latency percentiles per message class; per\n"
    "destination deliveries in flight and delivered per second over time; how similar\n"
    "the delivery orders are. Progress goes to stderr when it is a terminal.\n\n"
    "Needs root (it runs Postfix instances), Debian's postfix package and the testbed\n"
    "extra (the sinks' aiosmtpd: pip install '.[testbed]' in a checkout, pip install\n"
    "'pyqmgr[testbed]' from a package).")


#: Exit statuses of status and explain, sysexits(3) as postqueue(1) uses them.
EX_UNAVAILABLE = 69
EX_PROTOCOL = 76
EX_TEMPFAIL = 75
EX_NOPERM = 77

_CLIENT_EXIT = {"unavailable": EX_UNAVAILABLE, "timeout": EX_TEMPFAIL,
                "protocol": EX_PROTOCOL}


def _ask(args: argparse.Namespace, command: str, **request_args: object) -> (
        dict[str, object] | int):
    """One request to the instance's daemon: its successful reply, or an exit status.

    Failures are printed here, as ``pyqmgr COMMAND: text`` on stderr (and, with
    --json, also the daemon's failed reply on stdout, for scripts). When no daemon
    answers, what this user can see of why follows: the daemon's last fatal error
    and how to start it at once, or that Postfix is not running.
    """
    from pyqmgr.control.client import SOCKET_PATH, ClientError, not_running, queue_directory
    from pyqmgr.control.client import request as ask

    try:
        queue_dir = queue_directory(args.config_dir)
        reply = ask(os.path.join(queue_dir, SOCKET_PATH), command, request_args)
    except ClientError as exc:
        print(f"pyqmgr {command}: {exc}", file=sys.stderr)
        why = not_running(queue_dir, args.config_dir) if exc.down else None
        for line in why.lines if why is not None else ():
            print(f"pyqmgr {command}: {line}" if not line.startswith(" ") else line,
                  file=sys.stderr)
        if getattr(args, "json", False):
            print(json.dumps({"ok": False, "error": str(exc), "code": exc.kind,
                              **(why.data if why is not None else {})}, indent=2))
        return _CLIENT_EXIT[exc.kind]
    if not reply["ok"]:
        if args.json:
            print(json.dumps(reply, indent=2))
        print(f"pyqmgr {command}: {reply['error']}", file=sys.stderr)
        return EX_NOPERM if reply.get("code") == "denied" else 1
    return reply


def _command(args: argparse.Namespace) -> int:
    """Any control channel command (:data:`pyqmgr.control.protocol.COMMANDS`).

    Its arguments are read from ``args`` as its CommandSpec names them; an optional
    one left at its default is not sent, so the daemon's own default applies.
    """
    from pyqmgr.control.render import reply_lines

    spec = COMMANDS[args.command]
    request_args = {name: getattr(args, name) for name, arg in spec.args.items()
                    if arg.required or getattr(args, name) != arg.default}
    reply = _ask(args, args.command, **request_args)
    if isinstance(reply, int):
        return reply
    if args.json:
        print(json.dumps(reply, indent=2))
    else:
        view = {name: getattr(args, name) for name in spec.view}
        print("\n".join(reply_lines(args.command, reply, view)))
    return 0


def _top(args: argparse.Namespace) -> int:
    import curses

    from pyqmgr.control import top
    from pyqmgr.control.client import SOCKET_PATH, ClientError, not_running, queue_directory
    from pyqmgr.control.client import request as ask

    try:
        queue_dir = queue_directory(args.config_dir)
    except ClientError as exc:  # not a configuration directory: nothing to retry
        print(f"pyqmgr top: {exc}", file=sys.stderr)
        return _CLIENT_EXIT[exc.kind]
    path = os.path.join(queue_dir, SOCKET_PATH)

    def fetch() -> dict[str, object]:
        try:
            reply = ask(path, "status")
        except ClientError as exc:
            why = not_running(queue_dir, args.config_dir).lines if exc.down else []
            raise top.TopError("\n".join([str(exc), *why]), _CLIENT_EXIT[exc.kind]) from None
        if not reply["ok"]:
            raise top.TopError(f"the daemon refused: {reply['error']}",
                               EX_NOPERM if reply.get("code") == "denied" else 1)
        return reply

    def write(text: str) -> None:
        # Each frame whole as soon as it is made, to a pipe as to a file.
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        if args.once or args.iterations is not None or not (
                sys.stdin.isatty() and sys.stdout.isatty()):
            # As top -b: until stopped, unless -n (or --once) says how many.
            iterations = 1 if args.once else args.iterations
            try:
                return top.batch(fetch, args.config_dir, args.interval, args.sort,
                                 iterations, write)
            except top.TopError as exc:
                for line in str(exc).splitlines():
                    print(f"pyqmgr top: {line}" if not line.startswith(" ") else line,
                          file=sys.stderr)
                return exc.status
        try:
            return int(curses.wrapper(top.interactive, fetch, args.config_dir,
                                      args.interval, args.sort))
        except curses.error as exc:
            term = os.environ.get("TERM", "(unset)")
            print(f"pyqmgr top: cannot drive this terminal (TERM={term}): {exc}; "
                  "--once prints one plain snapshot", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        # curses.wrapper has restored the terminal already; Ctrl-C is a way to quit.
        return 0


def parse_duration(text: str) -> float:
    """argparse type: a TTL as Postfix writes time (90s, 15m, 2h, 1d, 1w; bare: seconds).

    The shaping settings' reader (:func:`pyqmgr.scheduler.shaping.parse_duration`),
    with argparse's error type and a bound on absurd values.
    """
    from pyqmgr.scheduler.shaping import ShapingError
    from pyqmgr.scheduler.shaping import parse_duration as duration

    try:
        value = duration(text, "ttl")
    except ShapingError:
        raise argparse.ArgumentTypeError(
            f"not a duration: {text.strip().lower()!r} (examples: 90s, 15m, 2h, 1d)"
        ) from None
    if value > 1e9:
        raise argparse.ArgumentTypeError("a duration must be more than 0 and under 30 years")
    return value


_CONTROL_EPILOG = (
    "The daemon answers on $queue_directory/pyqmgr/control; queue_directory comes\n"
    "from 'postconf -c CONFIG_DIR -h queue_directory'. Anyone allowed by main.cf's\n"
    "authorized_mailq_users (default static:anyone, as for 'postqueue -p') may read;\n"
    "root and mail_owner always may.\n\n"
    "exit status: 0 answered, 1 the daemon refused the request, 69 the daemon is not\n"
    "running (no socket or connection refused), 75 no reply within 10 s, 76 a reply\n"
    "that does not parse, 77 permission denied (authorized_mailq_users)")

#: The controls' epilog: who may, what is kept, and their exit statuses.
_CONTROLS_EPILOG = (
    "Controls are for root and mail_owner only (checked from the socket's peer\n"
    "credentials), and each one is logged in the maillog with who, what, the reason\n"
    "and the TTL. Suspensions are kept in $data_directory/pyqmgr/suspensions.json,\n"
    "so they survive 'postfix reload' and restarts, and end by themselves.\n\n"
    "exit status: 0 done, 1 the daemon refused (a bad target or TTL, nothing to\n"
    "resume), 69 the daemon is not running, 75 no reply within 10 s, 76 a reply that\n"
    "does not parse, 77 permission denied (not root or mail_owner)")

#: A control channel subcommand's epilog, by its command's kind.
_EPILOGS = {READ: _CONTROL_EPILOG, CONTROL: _CONTROLS_EPILOG}


def _add_setup(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """demo, check, install, uninstall: putting pyqmgr into a Postfix and seeing it run."""
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
            "writable by group or others, and so must every directory above it, up to / for\n"
            "the interpreter, venv and package, and up to config_directory or\n"
            "daemon_directory for pyqmgr.cf, policy files inside config_directory and the\n"
            "launcher (above those, Postfix's own files are at stake already). Symbolic\n"
            "links are followed; a sticky world-writable directory like /tmp does not\n"
            "count as safe. pyqmgr.cf must parse, and its values be ones the daemon accepts\n"
            "(policies, rates, response rules files, retry and metrics settings; checked\n"
            "only once all is trusted). The daemon makes the same checks at\n"
            "every start and refuses to run; 'pyqmgr install' refuses to install."),
        epilog=("exit status: 0 no problems, 1 problems found (listed), 2 could not check\n"
                "(not a Postfix configuration directory, postconf failed)"))
    p.add_argument("--config-dir", required=True, help="the instance's config_directory")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (keys: ok, problems, notes, launcher, python, "
                        "venv, package_dir, pyqmgr_cf, policy_modules, ...)")
    p.set_defaults(func=_check)

    p = sub.add_parser(
        "install", help="make pyqmgr the qmgr service of a Postfix instance",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Check the installation as 'pyqmgr check' does and refuse on any problem;\n"
            "then write this installation's launcher\n"
            "($daemon_directory/pyqmgr/<venv>-<hash>/qmgr: each venv has its own, so no\n"
            "other installation's is rewritten), save master.cf as master.cf.pyqmgr-backup\n"
            "(the last master.cf without pyqmgr; an older one is named and replaced), make\n"
            "the qmgr service run the launcher (only its command word changes, in place:\n"
            "every other byte of master.cf stays), install the manual pages pyqmgr(8) and\n"
            "pyqmgr(1), and 'postfix reload' the instance if it runs. Idempotent. Root only."),
        epilog="exit status: 0 installed (or already), 1 refused or not root (says why)")
    p.add_argument("--config-dir", required=True, help="the instance's config_directory")
    p.add_argument("--man-dir", default=DEFAULT_MAN_DIR, metavar="DIR",
                   help=f"where man finds the pages (default {DEFAULT_MAN_DIR}: "
                        "'man pyqmgr' then works)")
    p.add_argument("--no-man", action="store_true", help="do not install the manual pages")
    p.set_defaults(func=_install)

    p = sub.add_parser(
        "uninstall", help="restore stock qmgr for a Postfix instance",
        description=("Give the qmgr service back the command it ran before install (its "
                     "arguments kept) and reload a running instance. master.cf is restored "
                     "from master.cf.pyqmgr-backup byte for byte, and the backup removed, "
                     "when nothing else in it changed since install; otherwise only the "
                     "command word changes, your later edits stay and the backup is kept. "
                     "pyqmgr.cf is kept. The launcher goes when no instance of this Postfix "
                     "runs it any more, the manual pages with the last launcher, and the "
                     "daemon's own directories ($queue_directory/pyqmgr, "
                     "$data_directory/pyqmgr) once it has exited. Root only."),
        epilog="exit status: 0 done (or nothing to undo), 1 failed or not root (says why)")
    p.add_argument("--config-dir", required=True, help="the instance's config_directory")
    p.add_argument("--man-dir", default=DEFAULT_MAN_DIR, metavar="DIR",
                   help=f"where install put the manual pages (default {DEFAULT_MAN_DIR})")
    p.set_defaults(func=_uninstall)


def _add_simulate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "simulate", help="run a scheduling scenario on a virtual clock",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run a scenario (TOML: messages, destinations with latencies, 421 limiters,\n"
            "congestion, dead sites; transports; main.cf and pyqmgr.cf settings) through\n"
            "the scheduler core the daemon runs, on a virtual clock: a run takes a second,\n"
            "not the hours it simulates, and the same scenario and seed give the same run.\n\n"
            "Printed: the title, the simulated time, deliveries and scheduling decisions\n"
            "with the scheduler policy, then a table per destination: recipients sent,\n"
            "deferred (and bounced), the deferral rate, the mean deliveries in flight while\n"
            "any was, and the largest concurrency window reached; then the policy service's\n"
            "and the deferred queue's figures when the scenario models them, and with\n"
            "source pools (docs/sources.md) each source's recipients per site, the cold\n"
            "sources' counts against their warm-up plan and what the servers refused.\n\n"
            "--trace adds every delivery (start, end, where, message, recipients, outcome,\n"
            "the window when it was chosen) and a line per change of a destination's\n"
            "window or deliveries in flight. --json prints all of it as one JSON document."),
        epilog=(
            "example:\n"
            "  pyqmgr simulate scenarios/limiter-421-feedback-1-over-n.toml\n"
            "  pyqmgr simulate scenarios/preemption.toml --policy oqmgr --trace | less\n"
            "  pyqmgr simulate scenarios/warmup-plan.toml \\\n"
            "      --set source_warmup_plan=warmup-plan-steep\n\n"
            "exit status: 0 done, 1 a bad scenario file or --policy (the message names the\n"
            "file and line), or --plot without the plot extra (matplotlib)"))
    p.add_argument("scenario", help="a scenario TOML file (see scenarios/)")
    p.add_argument("--trace", action="store_true",
                   help="also print every delivery and every change of each destination's "
                        "window (thousands of lines)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON document instead (keys: scenario, title, seed, "
                        "policy, simulated_seconds, deliveries, decisions, destinations with "
                        "sent, deferred, bounced, deferral_rate, mean_concurrency, "
                        "max_window; policy_service, deferred_queue, sources; trace, with --trace: "
                        "deliveries and windows)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw the picture of the run and print its path: deliveries in "
                        "flight per site (or MX host) with the site cap and the host's "
                        "session limit, each destination's window, and its deliveries in "
                        "flight, on one time axis (the busiest nine destinations and the "
                        "others together when there are more than ten); needs the plot "
                        "extra, matplotlib: pip install '.[plot]' in a checkout, "
                        "'pyqmgr[plot]' from a package")
    p.add_argument("--seed", type=int, help="override the scenario's random seed")
    p.add_argument("--set", action="append", metavar="NAME=VALUE",
                   help="a pyqmgr.cf parameter for this run, over the scenario's [pyqmgr_cf] "
                        "(repeat): A/B one setting, e.g. --set "
                        "source_warmup_plan=warmup-plan-steep (a path relative to the "
                        "scenario file)")
    p.add_argument("--policy", metavar="NAME",
                   help="scheduler_policy for every transport, overriding the scenario's: "
                        "nqmgr (stock), oqmgr, finch, zmailer, or module:/path/file.py")
    # The summary alone used to need --quiet; it is the default now. Accepted, unlisted,
    # so that old scripts keep working.
    p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=_simulate)


def _add_replay(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "replay", help="replay a real maillog in the simulator under chosen schedulers",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_REPLAY_DESCRIPTION,
        epilog=("examples:\n"
                "  pyqmgr replay /var/log/mail.log* --config-dir /etc/postfix\n"
                "  pyqmgr replay mail.log --with stock --with pyqmgr:finch "
                "--write-workload wl/\n"
                "  pyqmgr replay mail.log --with stock --with pyqmgr:finch --compare "
                "--time-scale 0.1\n"
                "      # and on real Postfix, each run against the log\n\n"
                "exit status: 0 replayed, 1 bad arguments, 2 no Postfix mail in the log,\n"
                "4 --compare could not make a run (not root, no Postfix, no testbed\n"
                "extra)"))
    p.add_argument("maillog", nargs="+", help="maillog files (plain or .gz)")
    p.add_argument("--with", dest="contenders", action="append", metavar="CONTENDER",
                   help="a scheduler to simulate (repeat): stock, oqmgr or "
                        "pyqmgr:POLICY[,name=value...]; default stock")
    p.add_argument("--config-dir", metavar="DIR",
                   help="the logged instance's config_directory: its main.cf (backoff "
                        "times, concurrency limits...), master.cf process limits and "
                        "pyqmgr.cf's source pools (their members' refusals are read per "
                        "source and server, and replayed through the pools)")
    p.add_argument("-o", dest="settings", action="append", default=[],
                   metavar="NAME=VALUE", help="a main.cf setting for the simulation, or a "
                                              "pool's pyqmgr.cf setting (source_pools, "
                                              "NAME_sources, source_warmup_plan...) "
                                              "(repeat; over --config-dir's)")
    p.add_argument("--instance", action="append", metavar="NAME",
                   help="replay only this instance: HOST/SYSLOG_NAME or SYSLOG_NAME "
                        "(repeat); default all")
    p.add_argument("--year", type=int, metavar="YEAR",
                   help="year of the first line, for time stamps without one (default: "
                        "from the file's modification time)")
    p.add_argument("--write-workload", metavar="DIR",
                   help="write the derived workload (workload.toml, arrivals.csv) to DIR, "
                        "for pyqmgr simulate and pyqmgr compare")
    p.add_argument("--no-hash", action="store_true",
                   help="keep sender addresses as logged in the workload")
    p.add_argument("--hash-key", metavar="TEXT",
                   help="key of the address hashes, for the same hashes in every run "
                        "(default: a random one per run)")
    p.add_argument("--seed", type=int, default=1,
                   help="random seed of the (first) simulation run")
    p.add_argument("--runs", type=_positive, metavar="N",
                   help="simulation runs per contender, seeds SEED, SEED+1...: counts "
                        "are their mean, delays pooled (default: up to 5 while the runs "
                        "stay under 200,000 recipients; one for a busy day's log)")
    p.add_argument("--fit-on", action="append", metavar="MAILLOG",
                   help="fit the destinations' session and rate limits on this log "
                        "(another day's or another run's; repeat for rotated files) "
                        "instead of on the log replayed, so that its figures are held "
                        "against a model fitted without them; the report says which")
    p.add_argument("--gap", type=parse_duration, metavar="DURATION",
                   help="a silence this long cuts the log into stretches, each replayed "
                        "on its own with a warning (default 6h; 90s, 15m, 2h, 1d)")
    p.add_argument("--sites", action="store_true",
                   help="group destinations by the server their relay= fields name "
                        "(issue #33, no DNS): each gets mx = \"HOST\" in the workload "
                        "(host names as logged, addresses and localhost as ADDR:PORT), "
                        "destinations at one server share it, and a contender with "
                        "site_grouping=mx sees them as one site")
    p.add_argument("--compare", action="store_true",
                   help="also run the derived workload on real Postfix, each contender "
                        "in turn as 'pyqmgr compare' does, and set each run's figures, "
                        "read from its own maillog, next to the log's (needs root)")
    p.add_argument("--time-scale", type=_scale, metavar="F",
                   help="with --compare: run F times the log's time (0.1: an hour of "
                        "log in six minutes); delays are reported in the log's time")
    p.add_argument("--out", metavar="DIR",
                   help="with --compare: where the compare report and each run's "
                        "maillog go (default: pyqmgr-replay)")
    p.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                   help="with --compare: give up on a run that has not drained after "
                        "this many seconds")
    p.add_argument("--all", action="store_true",
                   help="every destination in the table (default: the 25 busiest)")
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.set_defaults(func=_replay)


def _add_compare(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "compare", help="run a workload under stock, oqmgr and pyqmgr on real Postfix and "
                        "report the differences",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_COMPARE_DESCRIPTION,
        epilog=("exit status: 0 every contender drained the workload, 1 a bad workload\n"
                "file or --with (the message names the line or the value), 3 the report is\n"
                "written but a contender did not drain within the timeout, 4 a run could\n"
                "not be made (not root, no Postfix, no testbed extra, an instance did not\n"
                "start), 130 interrupted (every instance and sink is stopped first)"))
    p.add_argument("workload", help="a workload (scenario) TOML file")
    p.add_argument("--with", dest="contenders", action="append", metavar="CONTENDER",
                   help="a contender: stock, oqmgr, pyqmgr or pyqmgr:POLICY[,name=value...]"
                        "; repeat for each (the first is the baseline)")
    p.add_argument("--time-scale", type=_scale, metavar="F",
                   help="multiply the workload's times (arrivals, latencies, timeouts, "
                        "dead_until) by F and divide its rates: 0.1 runs a 10-minute "
                        "workload in one (default: its [compare] time_scale, else 1)")
    p.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                   help="give up on a run that has not drained after this many seconds "
                        "(default: its [compare] timeout, else 300)")
    p.add_argument("--out", metavar="DIR",
                   help="where the report goes (default ./pyqmgr-compare-WORKLOAD)")
    p.add_argument("--json", action="store_true",
                   help="print report.json instead of the summary (keys: workload, "
                        "contenders, baseline, differences, thresholds, similarity, runs)")
    p.add_argument("--keep", action="store_true",
                   help="keep each run's Postfix instance directory (its path is in run.json)")
    p.set_defaults(func=_compare)


def _add_top(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "top", help="pyqmgr status refreshed live in the terminal, with what changed",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "What 'pyqmgr status' shows, asked again every --interval seconds: the\n"
            "transports on top, the destinations below, and beside the counts the change\n"
            "since the previous refresh (± columns: agents busy and queued recipients per\n"
            "transport, deliveries in flight and queued recipients per destination); rows\n"
            "that changed are bold, new destinations are marked new, and those that left\n"
            "core are counted.\n\n"
            "keys: q quit (Ctrl-C too), s next sort order (name, window, busy, queued),\n"
            "p pause/resume, space refresh now. While the daemon is not running or does\n"
            "not answer, the screen says so and top asks again every interval.\n\n"
            "Without a terminal on stdin and stdout (a pipe, a script), or with -n, top\n"
            "prints plain snapshots instead, as 'top -b' does: one every --interval until\n"
            "stopped (Ctrl-C, SIGTERM, or the pipe's reader going away: 'pyqmgr top | head'\n"
            "ends quietly), or N of them with -n N (--once: one). Each is written out as\n"
            "soon as it is made. A failed first request ends the run with the exit status\n"
            "of status; a later failure is that snapshot's text, and the next asks again."),
        epilog=_CONTROL_EPILOG)
    p.add_argument("--config-dir", default=_default_config(),
                   help="the instance's config_directory (default: $MAIL_CONFIG or "
                        "/etc/postfix)")
    p.add_argument("-d", "--interval", type=_interval, default=2.0, metavar="SECONDS",
                   help="seconds between refreshes (default 2, at least 0.1; top's -d)")
    p.add_argument("--sort", choices=["name", "window", "busy", "queued"], default="name",
                   help="initial order of the destinations (s changes it)")
    p.add_argument("--once", action="store_true", help="print one plain snapshot and exit")
    p.add_argument("-n", "--iterations", dest="iterations", type=_positive, metavar="N",
                   help="print N plain snapshots, --interval apart, and exit (top's -n); "
                        "without a terminal and without -n, top prints them until stopped")
    p.set_defaults(func=_top)


def _default_config() -> str:
    """--config-dir's default: $MAIL_CONFIG as Postfix's own commands read it."""
    return os.environ.get("MAIL_CONFIG", "/etc/postfix")


#: What argparse makes of the text typed for a command's argument (``Arg.parse``).
ARG_TYPES: dict[str, Callable[[str], object]] = {"duration": parse_duration, "count": _count}


def _add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser], kind: str) -> None:
    """One subcommand per control channel command of ``kind``, from COMMANDS alone.

    Its positionals, then the options sent to the daemon, --config-dir and --json,
    then the options that only shape what is printed (``CommandSpec.view``).
    """
    for name, spec in COMMANDS.items():
        if spec.kind != kind:
            continue
        p = sub.add_parser(name, help=spec.help, description=spec.description,
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog=_EPILOGS[kind])
        for arg_name, arg in spec.args.items():
            if arg.positional:
                p.add_argument(arg_name, metavar=arg.metavar or arg_name.upper(),
                               help=arg.help)
        for arg_name, arg in spec.args.items():
            if not arg.positional:
                _add_option(p, arg_name, arg)
        default = _default_config()
        p.add_argument("--config-dir", default=default,
                       help=f"the instance's config_directory (default: $MAIL_CONFIG or "
                            f"/etc/postfix, now {default})")
        p.add_argument("--json", action="store_true",
                       help=f"print the daemon's reply as JSON (keys: {spec.reply_keys})")
        for arg_name, arg in spec.view.items():
            _add_option(p, arg_name, arg)
        p.set_defaults(func=_command)


def _add_option(p: argparse.ArgumentParser, name: str, arg: Arg) -> None:
    """``--name`` for a command's argument that is not a positional."""
    if arg.types == (bool,):
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, action="store_true",
                       help=arg.help)
        return
    typed: dict[str, Any] = {"type": ARG_TYPES[arg.parse]} if arg.parse else {}
    p.add_argument(f"--{name.replace('_', '-')}", dest=name, default=arg.default,
                   metavar=arg.metavar, choices=arg.choices, help=arg.help, **typed)


def build_parser() -> argparse.ArgumentParser:
    """``pyqmgr``'s parser: each subcommand's arguments, help and handler (``func``)."""
    parser = argparse.ArgumentParser(
        prog="pyqmgr", description="Postfix's queue manager, in Python."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_setup(sub)
    _add_simulate(sub)
    _add_replay(sub)
    _add_compare(sub)
    _add_commands(sub, READ)
    _add_top(sub)
    _add_commands(sub, CONTROL)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
