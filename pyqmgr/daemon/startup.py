"""Start-up in the order of Postfix's trigger-server skeleton (``trigger_server.c``).

The order matters: logging must be connected before chroot (postlog is an absolute
path), main.cf is read before the ``-o`` overrides are applied, every module must be
imported before privileges are dropped (the interpreter's files may not be readable by
mail_owner), and fd 5 must be watched so that ``postfix reload`` restarts us.

pyqmgr.cf is read and the trust check (:mod:`pyqmgr.trust`) runs as soon as logging
goes where main.cf says, before the queue directory is touched or privileges are
dropped: running as root with code or settings that someone else can change is worse
than not running. A failure is fatal like a bad main.cf: master(8) logs the exit,
throttles the service, and mail waits in the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import os
import pwd
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Protocol

from pyqmgr import extras, trust
from pyqmgr.daemon import (
    classes,
    control,
    delegation,
    late_imports,
    memory,
    metrics,
    sites,
    suspensions,
)
from pyqmgr.daemon.host import Fatal
from pyqmgr.daemon.memory import MemoryGuard
from pyqmgr.daemon.policies import PolicySetup, policy_setup
from pyqmgr.daemon.qmgr import Qmgr
from pyqmgr.daemon.setup import DaemonSetup
from pyqmgr.events.settings import setup as events_setup
from pyqmgr.fleet.settings import fleet_settings, import_redis
from pyqmgr.postfix import mail_queue, version
from pyqmgr.postfix.config import ConfigError, QmgrConfig
from pyqmgr.postfix.maillog_client import MailLog
from pyqmgr.postfix.master import (
    STATUS_FD,
    FlowControl,
    MasterStatus,
    TriggerServer,
    UsageError,
    generation_from_env,
    parse_argv,
)
from pyqmgr.pyqmgr_cf import PyqmgrCf, PyqmgrCfError
from pyqmgr.pyqmgr_cf import load as load_pyqmgr_cf
from pyqmgr.pyqmgr_cf_names import unknown_parameters
from pyqmgr.settings.sites import on as sites_on
from pyqmgr.settings.sources import source_settings
from pyqmgr.settings.tenants import tenant_limits


class QueueManager(Protocol):
    """What the start-up skeleton drives: :class:`Qmgr`, or a benchmark's stand-in."""

    def start(self) -> None: ...

    def trigger(self, data: bytes) -> None: ...

    def close(self) -> None: ...


#: Builds the queue manager once logging, configuration and privileges are settled.
QueueManagerFactory = Callable[[QmgrConfig, MailLog, FlowControl | None, DaemonSetup],
                               QueueManager]

#: Exit status for start-up failures: non-zero so master throttles instead of re-forking.
EXIT_FATAL = 1


def _tag(syslog_name: str, progname: str) -> str:
    return f"{syslog_name}/{progname}"


def main(argv: list[str], daemon: QueueManagerFactory = Qmgr) -> int:
    """Run as master(8)'s qmgr service.

    ``daemon`` exists so that a benchmark can run its own stand-in (a qmgr with no
    scheduler) under exactly the same start-up, master protocol and logging.
    """
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    progname = os.path.basename(argv[0]) if argv else "qmgr"
    log = MailLog(_tag(os.environ.get("MAIL_LOGTAG", "postfix"), progname))
    if os.environ.get("POSTLOG_SERVICE"):
        log.use_postlog(os.environ["POSTLOG_SERVICE"],
                        os.environ.get("POSTLOG_HOSTNAME", "amnesiac"))
    else:
        log.use_syslog()
    try:
        return _run(argv, log, daemon)
    except (UsageError, ConfigError, PyqmgrCfError, trust.UntrustedError,
            version.VersionError, Fatal, mail_queue.ScanError) as exc:
        warnings = list(getattr(exc, "warnings", ()))
        for text in warnings:
            log.warning(text)
        log.fatal(str(exc))
        # And where pyqmgr status finds it: its users may not read the maillog.
        control.keep_fatal(str(exc), warnings)
        return EXIT_FATAL
    except Exception as exc:
        # A defect, not a setting: without this master's bare "exit status 1" was all
        # the maillog said (issue #43). Where it happened goes with it, for the report.
        text = f"unexpected error: {type(exc).__name__}: {exc}{_where(exc)}"
        log.fatal(text)
        control.keep_fatal(text, [])
        return EXIT_FATAL


def _where(exc: BaseException) -> str:
    """`` (at FILE:LINE in FUNCTION)`` for the innermost frame of pyqmgr's own code."""
    ours = [frame for frame in traceback.extract_tb(exc.__traceback__)
            if f"{os.sep}pyqmgr{os.sep}" in frame.filename]
    if not ours:
        return ""
    frame = ours[-1]
    rel = frame.filename[frame.filename.rindex(f"{os.sep}pyqmgr{os.sep}") + 1:]
    return f" (at {rel}:{frame.lineno} in {frame.name})"


def _run(argv: list[str], log: MailLog, daemon: QueueManagerFactory) -> int:
    opts = parse_argv(argv)
    if opts.log_stderr:
        log.stderr = True
    config_dir = os.environ.get("MAIL_CONFIG", "/etc/postfix")
    cfg = QmgrConfig.load(config_dir, opts.overrides, process_name=opts.progname,
                          service_name=opts.service_name)
    if opts.args:
        raise UsageError(f"unexpected command-line argument: {opts.args[0]}")
    if not opts.alone and not opts.stand_alone:
        raise UsageError(f"service {opts.service_name} requires a process limit of 1")
    if opts.transport not in ("unix", "fifo", "pass"):
        if opts.transport is None:
            raise UsageError("no transport type specified")
        raise UsageError(f"unsupported transport type: {opts.transport}")

    # Re-point logging at the configured destination (syslog_name, maillog_file).
    log.tag = _tag(cfg.syslog_name, opts.progname)
    log.utf8 = cfg.smtputf8_enable
    os.environ["MAIL_LOGTAG"] = cfg.syslog_name
    if cfg.maillog_file:
        postlog = os.path.join(cfg.queue_directory, "public", cfg.postlog_service_name)
        log.use_postlog(postlog, cfg.myhostname)
    else:
        log.use_syslog(cfg.syslog_facility)
    for text in cfg.warnings:
        log.warning(text)
    # The agents' dialect follows the installed release (pyqmgr.postfix.version); a
    # release nobody read is fatal before any request goes out in the wrong one.
    cfg.postfix_version = version.installed(cfg.get("command_directory"), config_dir)
    pyqmgr_cf = load_trusted_settings(cfg, log)
    # module: policies are files to import: settle them while the file system is whole.
    policies = policy_setup(pyqmgr_cf, cfg)
    parts = _optional_parts(pyqmgr_cf, cfg, policies, log, config_dir)

    if not opts.debug and sys.stdin is not None and sys.stdin.isatty():
        raise UsageError("do not run this command by hand")
    generation = generation_from_env(os.environ)

    os.chdir(cfg.queue_directory)
    # The control channel's directory is made as root (its owner is mail_owner), and
    # its ACL's login names are looked up while the password file is still in reach.
    access = control.access_from_config(cfg, log)
    control_dir = control.prepare_directory(cfg, log)
    # Operator suspensions outlive the process in data_directory, outside the chroot:
    # its directory is opened now and used through the descriptor from then on.
    state = suspensions.open_state(cfg, log)
    _drop_privileges(cfg, log, opts.service_name, chroot=opts.chroot,
                     unprivileged=opts.unprivileged)
    # From here on an import reads files as mail_owner (perhaps in a chroot): each
    # one is a start-up gap, named in the maillog.
    late_imports.watch(log.warning)

    status = MasterStatus(STATUS_FD, os.getpid(), generation) if _fd_open(STATUS_FD) else None
    flow = FlowControl() if _fd_open(3) and _fd_open(4) else None
    # With tens of thousands of messages and recipients in core, the default GC
    # thresholds make full collections walk everything every few thousand allocations.
    # What a finished message leaves is freed by reference count (its structures
    # break their cycles when they end: tests/unit/test_no_cycles.py), so the
    # collector is a safety net for cycles made elsewhere (an own policy, a library):
    # an oldest-generation threshold of 1 lets CPython's own rule run a full
    # collection once the objects promoted since the last one pass a quarter of the
    # survivors, which bounds such garbage to that quarter at an amortized cost. A
    # threshold of 100 (before issue #30) made that once per 500 million allocations:
    # a site down for hours grew the qmgr by 35 KB a message.
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, GC_YOUNG_PER_MIDDLE, 1)
    setup = dataclasses.replace(parts, state=state)
    return asyncio.run(_serve(cfg, log, status, flow, daemon, setup,
                              access if control_dir else None))


def _optional_parts(pyqmgr_cf: PyqmgrCf, cfg: QmgrConfig, policies: PolicySetup,
                    log: MailLog, config_dir: str) -> DaemonSetup:
    """pyqmgr.cf's optional parts, each checked and its files read before the chroot
    (the suspensions' state file is opened later, in the queue directory)."""
    # A name nothing reads is a warning each (a misspelled setting leaves its feature
    # off), as postconf(1) warns of unused main.cf parameters (issue #43).
    table = policies.table
    for found in unknown_parameters(pyqmgr_cf, policies.commands,
                                    [table.default, *table.by_transport.values()]):
        log.warning(found.text(pyqmgr_cf.path))
    # A feature whose library is not installed: one fatal line naming the extra and the
    # command that adds it, before any of them is imported.
    lacking = extras.lacking(pyqmgr_cf.values)
    if lacking:
        raise PyqmgrCfError(extras.lacking_fatal(pyqmgr_cf.path, lacking))
    # Metrics are off unless pyqmgr.cf says where to serve them; then the exporter and
    # prometheus_client are imported now, before the chroot.
    metrics_cf = metrics.setup(pyqmgr_cf, cfg)
    if metrics_cf is not None:
        # Here, not in metrics.setup: the exporter imports metrics, not the other way.
        from pyqmgr.daemon import metrics_exporter  # noqa: F401
    # The fleet's shared state: its password file is read now, as root.
    fleet_cf = fleet_settings(pyqmgr_cf, cfg.myhostname)
    if fleet_cf is not None:
        import_redis(pyqmgr_cf, fleet_cf)
    # Parsed once: the core makes each transport's tenant caps from this table.
    tenants = tenant_limits(pyqmgr_cf, (pyqmgr_cf.get("tenant_key") or "none").strip(),
                            sites_on(pyqmgr_cf), log.warning)
    return DaemonSetup(
        policies, None, metrics_cf,
        # Delivery policy delegation: every form of its settings checked now.
        delegation.setup(pyqmgr_cf), fleet_cf,
        # The resident size is read through /proc/self/statm, opened before the chroot.
        MemoryGuard.open(log, memory.warning_limit(pyqmgr_cf)),
        # Sites' MX lookups run in a helper process, spawned now as root.
        sites.setup(pyqmgr_cf, policies.commands, cfg.get("relayhost") or "", bool(fleet_cf),
                    helper_user=cfg.mail_owner, config_dir=config_dir),
        # Classes' and tenants' tables are read now (hash: ones through postmap).
        classes.setup(pyqmgr_cf, policies, log.warning, config_dir,
                      mynetworks=cfg.mynetworks), tenants,
        # Source pools: members checked against master.cf, the warm-up plan read.
        source_settings(pyqmgr_cf, policies.commands),
        # Delivery events: the file's directory is opened now, outside the chroot.
        events=events_setup(pyqmgr_cf, cfg.mail_owner, fleet_cf))


def load_trusted_settings(cfg: QmgrConfig, log: MailLog) -> PyqmgrCf:
    """Read pyqmgr.cf and check that everything the daemon runs is root's alone.

    The check covers the interpreter, its import directories, the pyqmgr package,
    pyqmgr.cf itself, every ``module:PATH`` policy file it names, and the files of the
    modules already imported (they ran as root already: the check cannot undo that,
    but it names the file to fix and stops this start before anything else happens).
    The launcher (``__main__``) and pyqmgr.cf are judged as ``pyqmgr check`` judges
    them (:func:`trust.untrusted_installation`): the directories above
    daemon_directory and config_directory are Postfix's to answer for.
    Raises PyqmgrCfError or trust.UntrustedError, which :func:`main` logs as fatal.
    """
    settings = load_pyqmgr_cf(cfg.config_dir, cfg.lookup)
    for text in settings.warnings:
        log.warning(text)
    relative = settings.relative_module_paths()
    if relative:
        raise PyqmgrCfError(relative[0])
    for name, path in settings.module_paths().items():
        # A file that is not there is a setting's mistake, named as such, not a
        # trust problem.
        if not os.path.lexists(path):
            raise settings.error(name, f'policy module "{path}": no such file')
    files = [settings.path] if settings.exists else []
    files += settings.module_paths().values()
    modules = dict(sys.modules)
    main_module = modules.pop("__main__", None)
    problems = trust.untrusted_installation(
        sys.executable, trust.package_dir(), config_dir=cfg.config_dir,
        daemon_dir=cfg.daemon_directory, settings=files,
        launcher=trust.loaded_module_files([main_module]),
        extra=trust.loaded_module_files(list(modules.values())))
    if problems:
        raise trust.UntrustedError(problems)
    return settings


#: Allocations between young-generation collections (CPython's default is 700).
GC_THRESHOLD = 100_000
#: Young collections between two of the middle generation (CPython's default is 10).
GC_YOUNG_PER_MIDDLE = 50


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _drop_privileges(cfg: QmgrConfig, log: MailLog, service: str, *, chroot: bool,
                     unprivileged: bool) -> None:
    """setgid, initgroups, chroot, setuid: the order of Postfix's ``chroot_uid()``."""
    if not unprivileged:
        # Stock's qmgr stays root too with unpriv = n; said, because root then parses
        # every reply, request and notice pyqmgr reads (issue #31).
        log.warning(f"master.cf runs {service} with unpriv = n: pyqmgr keeps root "
                    f"privileges, as stock's qmgr would, and parses what delivery "
                    f"agents, the control socket and Redis send as root; set the unpriv "
                    f"column to - or y to run it as {cfg.mail_owner}")
    if not unprivileged and not chroot:
        return
    if unprivileged:
        try:
            pw = pwd.getpwnam(cfg.mail_owner)
        except KeyError as exc:
            raise UsageError(f"unknown mail_owner user: {cfg.mail_owner}") from exc
        os.setgid(pw.pw_gid)
        os.initgroups(pw.pw_name, pw.pw_gid)
    if chroot:
        os.chroot(cfg.queue_directory)
        os.chdir("/")
    if unprivileged:
        os.setuid(pw.pw_uid)


async def _serve(cfg: QmgrConfig, log: MailLog, status: MasterStatus | None,
                 flow: FlowControl | None, daemon: QueueManagerFactory,
                 setup: DaemonSetup, access: control.Access | None = None) -> int:
    loop = asyncio.get_running_loop()
    stopped: asyncio.Future[int] = loop.create_future()

    def master_gone() -> None:
        # Stock exits at once, even with deliveries in flight: the agents finish on
        # their own and the next qmgr recovers active/.
        if not stopped.done():
            stopped.set_result(0)

    profile_path = os.environ.get("PYQMGR_PROFILE")
    profiler = None
    if profile_path:
        # Opt-in, for performance work: add PYQMGR_PROFILE=/path to main.cf's
        # import_environment; stats are written when master lets us go.
        import cProfile

        # CPU time, not wall time: a qmgr waits in epoll most of its life, and what
        # costs is what it does between waits (system calls included).
        profiler = cProfile.Profile(time.process_time)
        profiler.enable()
    qmgr = daemon(cfg, log, flow, setup)
    metrics_cf = setup.metrics
    if isinstance(qmgr, Qmgr):
        # Before start(): recovered mail for a suspended destination must be held.
        qmgr.suspensions.restore()
        if qmgr.sources is not None:
            qmgr.sources.restore()
    server = None
    if status is not None:
        server = TriggerServer(loop, qmgr.trigger, master_gone, status)
        server.start()
    qmgr.start()
    if profiler is not None or isinstance(qmgr, Qmgr) and qmgr.fleet is not None:
        # A profile is written on the way out, which SIGTERM's default would skip.
        # ``postfix stop`` ends every process with SIGTERM, which ends stock's at once;
        # a fleet's node first gives back the sessions it keeps for next deliveries
        # (Fleet.give_back, at most half a second), or the other nodes would go short
        # of them until their leases end.
        loop.add_signal_handler(signal.SIGTERM, master_gone)
    if setup.memory is not None:
        setup.memory.start(loop)
    channel = None
    if access is not None and isinstance(qmgr, Qmgr):
        # After start(): a failure here is a warning and mail flows regardless.
        channel = await control.start(qmgr, access, log, cfg.mail_owner)
    exporter = None
    if isinstance(qmgr, Qmgr) and qmgr.metrics is not None and metrics_cf is not None:
        from pyqmgr.daemon import metrics_exporter  # imported before the chroot

        # Bound after start(), like the control channel: a failure is a warning.
        exporter = metrics_exporter.start(qmgr, qmgr.metrics, metrics_cf, log)
    code = await stopped
    if profiler is not None and profile_path:
        profiler.disable()
        with contextlib.suppress(OSError):
            profiler.dump_stats(f"{profile_path}.{os.getpid()}")
    if server is not None:
        server.close()
    if channel is not None:
        channel.close()
    if exporter is not None:
        exporter.close()
    with contextlib.suppress(Exception):
        qmgr.close()
    if isinstance(qmgr, Qmgr) and qmgr.sources is not None:
        with contextlib.suppress(Exception):
            qmgr.sources.close()
    if isinstance(qmgr, Qmgr) and qmgr.delegation is not None:
        with contextlib.suppress(Exception):
            qmgr.delegation.close()
    if isinstance(qmgr, Qmgr) and qmgr.fleet is not None:
        with contextlib.suppress(Exception):
            await qmgr.fleet.give_back()
        with contextlib.suppress(Exception):
            qmgr.fleet.close()
    os._exit(code)
