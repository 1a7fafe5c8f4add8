"""Switch a Postfix instance's qmgr service to pyqmgr and back.

master(8) runs ``$daemon_directory/<command>`` and Postfix's log tag is the basename of
argv[0]; so the launcher is a file named ``qmgr`` in ``$daemon_directory/pyqmgr/`` and
the master.cf command becomes ``pyqmgr/qmgr``: log lines keep reading
``postfix/qmgr[pid]``. Only the command word of the ``qmgr unix`` line changes, through
``postconf -F``, so every other column and ``-o`` option stays as the admin wrote it.

The launcher is shared by every instance that uses the same daemon_directory (the
usual case: one Postfix installation), which is why uninstall leaves it in place; it
is a two-line script that does nothing unless master.cf names it.

Before anything is written, install runs the same inspection as ``pyqmgr check``
(:func:`check_installation`): master(8) will run the launcher as root, so install
refuses while the interpreter, the package, pyqmgr.cf or a policy module can be
changed by anyone but root, or while pyqmgr.cf does not parse. Neither install nor
uninstall writes or removes pyqmgr.cf: it is the admin's file, and keeping it across
an uninstall makes switching back a one-command affair.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

from pyqmgr import trust
from pyqmgr.postfix.config import ConfigError, QmgrConfig
from pyqmgr.postfix.master_cf import load_master_cf
from pyqmgr.pyqmgr_cf import PYQMGR_CF, PyqmgrCf, PyqmgrCfError
from pyqmgr.pyqmgr_cf import load as load_pyqmgr_cf

LAUNCHER_DIR = "pyqmgr"
LAUNCHER_NAME = "qmgr"
PYQMGR_COMMAND = f"{LAUNCHER_DIR}/{LAUNCHER_NAME}"
STOCK_COMMAND = "qmgr"
BACKUP_SUFFIX = ".pyqmgr-backup"
# Linux reads at most this much of a "#!" line (BINPRM_BUF_SIZE, 256 with the newline).
_SHEBANG_MAX = 255


class InstallError(Exception):
    """The directory is not a usable Postfix configuration; nothing was changed."""


def _postconf(config_dir: str, *args: str) -> str:
    try:
        proc = subprocess.run(["postconf", "-c", config_dir, *args], capture_output=True,
                              text=True, check=False, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InstallError(f"cannot run postconf: {exc}") from exc
    if proc.returncode != 0:
        raise InstallError(f"postconf {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def _check(config_dir: str) -> str:
    """Return the current qmgr command field, or refuse a non-Postfix directory.

    Only reads: every refusal happens before anything is written.
    """
    for name in ("main.cf", "master.cf"):
        if not os.path.isfile(os.path.join(config_dir, name)):
            raise InstallError(f"{config_dir} is not a Postfix configuration directory "
                               f"(no {name})")
    out = _postconf(config_dir, "-F", "qmgr/unix/command").strip()
    if not out:
        raise InstallError(f"{config_dir}/master.cf has no qmgr/unix service "
                           "(is it commented out?)")
    return out.partition("=")[2].strip()


def launcher_text(python: str | None = None) -> str:
    """The launcher: this interpreter, isolated mode, straight into the daemon.

    ``-I`` keeps PYTHON* variables, the user site and the current directory out of the
    daemon's import path: it runs as root until it drops privileges.
    """
    return (
        f"#!{python or sys.executable} -I\n"
        "# Written by 'pyqmgr install': master(8) runs this as the qmgr service.\n"
        "import sys\n"
        "# Only local sockets, never TLS: keep OpenSSL (4 MiB resident) out of the daemon.\n"
        "sys.modules['ssl'] = None\n"
        "from pyqmgr.daemon import main\n"
        "sys.exit(main(sys.argv))\n"
    )


def launcher_path(daemon_dir: str) -> str:
    return os.path.join(daemon_dir, LAUNCHER_DIR, LAUNCHER_NAME)


def _check_interpreter(python: str) -> None:
    # The kernel splits a "#!" line at whitespace and truncates it; either would run
    # something other than this interpreter.
    if not python or any(c.isspace() for c in python):
        raise InstallError(f"cannot write a launcher for interpreter path {python!r} "
                           "(empty or contains whitespace)")
    if len(f"#!{python} -I") > _SHEBANG_MAX:
        raise InstallError(f"interpreter path too long for a #! line: {python}")


def _write_launcher(daemon_dir: str) -> tuple[str, bool]:
    """Write the launcher unless it already says the same; return (path, written)."""
    path = launcher_path(daemon_dir)
    text = launcher_text()
    try:
        with open(path) as f:
            if f.read() == text and os.access(path, os.X_OK):
                return path, False
    except OSError:
        pass
    tmp = path + ".tmp"
    try:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        with open(tmp, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)  # a running master never sees a half-written file
    except OSError as exc:
        raise InstallError(f"cannot write launcher {path}: {exc}") from exc
    return path, True


# -- the inspection shared by `pyqmgr check` and install ------------------------------------


@dataclass
class CheckReport:
    """What ``pyqmgr check`` found; ``problems`` empty means install may proceed.

    ``problems`` are the reasons to refuse (each names a path); ``notes`` are facts
    worth knowing that are not wrong (no launcher yet, a pyqmgr.cf warning).
    """

    config_dir: str
    daemon_directory: str
    launcher: str
    launcher_installed: bool
    launcher_interpreter: str | None
    python: str
    venv: str | None
    package_dir: str
    pyqmgr_cf: str
    pyqmgr_cf_exists: bool
    pyqmgr_cf_parameters: list[str] = field(default_factory=list)
    pyqmgr_cf_error: str | None = None
    policy_modules: dict[str, str] = field(default_factory=dict)
    paths_checked: int = 0
    check_seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_json(self) -> dict[str, object]:
        """A stable, script-friendly shape (``pyqmgr check --json``)."""
        return {
            "config_dir": self.config_dir,
            "ok": self.ok,
            "problems": self.problems,
            "notes": self.notes,
            "daemon_directory": self.daemon_directory,
            "launcher": {"path": self.launcher, "installed": self.launcher_installed,
                         "interpreter": self.launcher_interpreter},
            "python": self.python,
            "venv": self.venv,
            "package_dir": self.package_dir,
            "pyqmgr_cf": {"path": self.pyqmgr_cf, "exists": self.pyqmgr_cf_exists,
                          "parses": self.pyqmgr_cf_error is None,
                          "error": self.pyqmgr_cf_error,
                          "parameters": self.pyqmgr_cf_parameters},
            "policy_modules": self.policy_modules,
            "paths_checked": self.paths_checked,
            "check_milliseconds": round(self.check_seconds * 1000, 3),
        }


def _shebang_interpreter(path: str) -> str | None:
    """The interpreter a launcher names on its ``#!`` line (without running anything)."""
    try:
        with open(path, "rb") as f:
            first = f.readline(_SHEBANG_MAX + 1).decode("utf-8", "surrogateescape")
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    words = first[2:].split()
    return words[0] if words else None


def _same_interpreter(a: str, b: str) -> bool:
    """``venv/bin/python`` and ``venv/bin/python3`` are one interpreter in one venv.

    Both the venv (found from the unresolved path) and the real binary must match.
    """
    return (trust.venv_root(a) == trust.venv_root(b)
            and os.path.realpath(a) == os.path.realpath(b))


def _main_lookup(config_dir: str, report: CheckReport) -> QmgrConfig | None:
    """main.cf as the daemon will see it (with the qmgr service's -o overrides)."""
    overrides: tuple[tuple[str, str], ...] = ()
    try:
        service = load_master_cf(config_dir).find("qmgr")
        if service is not None:
            overrides = service.overrides
    except ConfigError:
        pass  # postconf -F already vouched for master.cf's qmgr line
    try:
        return QmgrConfig.load(config_dir, overrides, check_accounts=False)
    except ConfigError as exc:
        report.problems.append(f"{config_dir}/main.cf: the daemon would refuse it: {exc}")
        return None


def inspect_installation(config_dir: str, daemon_dir: str) -> CheckReport:
    """Everything ``pyqmgr check`` reports, for a known daemon_directory; read-only.

    The paths are judged by :func:`trust.untrusted_installation`, exactly as the daemon
    judges them at start-up (the directories above daemon_directory and
    config_directory are Postfix's; everything pyqmgr brings is judged up to /).
    main.cf is read as the daemon reads it, with the qmgr service's ``-o`` overrides,
    so that ``$name`` in pyqmgr.cf expands the same way.
    """
    launcher = launcher_path(daemon_dir)
    installed = os.path.lexists(launcher)
    report = CheckReport(
        config_dir=config_dir, daemon_directory=daemon_dir, launcher=launcher,
        launcher_installed=installed,
        launcher_interpreter=_shebang_interpreter(launcher) if installed else None,
        python=sys.executable, venv=trust.venv_root(sys.executable),
        package_dir=trust.package_dir(),
        pyqmgr_cf=os.path.join(config_dir, PYQMGR_CF), pyqmgr_cf_exists=False)
    if not installed:
        report.notes.append(f"no launcher at {launcher} yet: 'pyqmgr install' writes it")
    elif (report.launcher_interpreter is not None
          and not _same_interpreter(report.launcher_interpreter, sys.executable)):
        report.notes.append(
            f"the launcher runs {report.launcher_interpreter}, not this pyqmgr's "
            f"interpreter {sys.executable}; what was checked is this one "
            "('pyqmgr install' would rewrite the launcher to use it)")

    cfg = _main_lookup(config_dir, report)
    settings: PyqmgrCf | None = None
    try:
        settings = load_pyqmgr_cf(config_dir, cfg.lookup if cfg is not None else
                                  (lambda name: None))
    except PyqmgrCfError as exc:
        report.pyqmgr_cf_exists = os.path.lexists(report.pyqmgr_cf)
        report.pyqmgr_cf_error = str(exc)
        report.problems.append(str(exc))
    files: list[str] = []
    if settings is not None:
        report.pyqmgr_cf_exists = settings.exists
        report.pyqmgr_cf_parameters = settings.names()
        report.policy_modules = settings.module_paths()
        report.notes += [f"pyqmgr.cf: {text}" for text in settings.warnings]
        report.problems += settings.relative_module_paths()
        files += [p for p in report.policy_modules.values() if os.path.isabs(p)]
    if report.pyqmgr_cf_exists:
        files.insert(0, report.pyqmgr_cf)

    started = time.perf_counter()
    ours = [p for p in (os.path.dirname(launcher), launcher) if os.path.lexists(p)]
    report.problems += trust.untrusted_installation(
        sys.executable, report.package_dir, config_dir=config_dir, daemon_dir=daemon_dir,
        settings=files, launcher=ours)
    report.check_seconds = time.perf_counter() - started
    report.paths_checked = len(trust.daemon_paths(sys.executable, report.package_dir,
                                                  files)) + len(ours)
    if settings is not None and cfg is not None and not report.problems:
        # The values, as the daemon's start-up judges them: policies, shaping, rules
        # files, retry, metrics and delivery policy delegation settings. Only once
        # everything is trusted, since a module: policy is code that this imports.
        report.problems += _settings_problems(settings, cfg)
    return report


def _settings_problems(settings: PyqmgrCf, cfg: QmgrConfig) -> list[str]:
    from pyqmgr.daemon import delegation, metrics
    from pyqmgr.daemon.policies import policy_setup
    from pyqmgr.scheduler.policy import PolicyError

    problems: list[str] = []
    for check in (lambda: policy_setup(settings, cfg), lambda: metrics.setup(settings, cfg),
                  lambda: delegation.setup(settings)):
        try:
            check()
        except (PyqmgrCfError, PolicyError, ConfigError) as exc:
            problems.append(f"the daemon would refuse to start: {exc}")
    return problems


def check_installation(config_dir: str) -> CheckReport:
    """``pyqmgr check``: read-only; InstallError if config_dir is not a Postfix one."""
    for name in ("main.cf", "master.cf"):
        if not os.path.isfile(os.path.join(config_dir, name)):
            raise InstallError(f"{config_dir} is not a Postfix configuration directory "
                               f"(no {name})")
    daemon_dir = _postconf(config_dir, "-xh", "daemon_directory").strip()
    return inspect_installation(config_dir, daemon_dir)


def _refuse_untrusted(config_dir: str, daemon_dir: str) -> CheckReport:
    report = inspect_installation(config_dir, daemon_dir)
    if report.problems:
        listing = "\n".join(f"  {text}" for text in report.problems)
        raise InstallError(f"refusing to install: master(8) would run pyqmgr as root "
                           f"with these problems (see 'pyqmgr check --config-dir "
                           f"{config_dir}'):\n{listing}")
    return report


def _running(config_dir: str) -> bool:
    try:
        proc = subprocess.run(["postfix", "-c", config_dir, "status"], capture_output=True,
                              check=False, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def _set_command(config_dir: str, current: str, new_word: str) -> None:
    # Replace the program word only; its arguments (-o ...) follow unchanged.
    first = current.split(maxsplit=1)[0]
    _postconf(config_dir, "-F", f"qmgr/unix/command={new_word}{current[len(first):]}")


def _reload(config_dir: str, done: list[str]) -> None:
    """Reload a running instance so master forks the new qmgr at once.

    Reload closes the qmgr's status channel and qmgr exits; master then starts the
    new command. A stopped instance picks the change up when it starts.
    """
    if not _running(config_dir):
        done.append("instance not running: the change applies at its next start")
        return
    proc = subprocess.run(["postfix", "-c", config_dir, "reload"], capture_output=True,
                          text=True, check=False, timeout=60)
    if proc.returncode != 0:
        raise InstallError(f"master.cf was changed but postfix reload failed: "
                           f"{proc.stderr.strip()}")
    done.append("reloaded the running instance")


def install(config_dir: str) -> list[str]:
    """Make the qmgr service run pyqmgr; return what was done, one line per action.

    Idempotent: a second call finds the launcher and the command in place and changes
    nothing (no reload either).
    """
    current = _check(config_dir)
    daemon_dir = _postconf(config_dir, "-xh", "daemon_directory").strip()
    if not os.path.isdir(daemon_dir):
        raise InstallError(f"daemon_directory {daemon_dir!r} is not a directory")
    _check_interpreter(sys.executable)
    report = _refuse_untrusted(config_dir, daemon_dir)
    done: list[str] = []
    if report.pyqmgr_cf_exists:
        done.append(f"left {report.pyqmgr_cf} as it is")
    path, written = _write_launcher(daemon_dir)
    done.append(f"{'wrote' if written else 'kept'} launcher {path}")
    word = current.split()[0]
    if word == PYQMGR_COMMAND:
        done.append("qmgr service already runs pyqmgr")
        return done
    master_cf = os.path.join(config_dir, "master.cf")
    backup = master_cf + BACKUP_SUFFIX
    if not os.path.exists(backup):
        try:
            shutil.copy2(master_cf, backup)
        except OSError as exc:
            raise InstallError(f"cannot save {backup}: {exc}") from exc
        done.append(f"saved {backup}")
    if word != STOCK_COMMAND:
        done.append(f"note: the qmgr service ran {word!r}, not stock qmgr; "
                    "uninstall will restore 'qmgr'")
    _set_command(config_dir, current, PYQMGR_COMMAND)
    done.append(f"qmgr service command: {PYQMGR_COMMAND}")
    _reload(config_dir, done)
    return done


def uninstall(config_dir: str) -> list[str]:
    """Give the qmgr service back to stock qmgr (arguments kept); idempotent.

    The launcher stays: other instances sharing daemon_directory may use it.
    """
    current = _check(config_dir)
    done: list[str] = []
    word = current.split()[0]
    if word == STOCK_COMMAND:
        done.append("qmgr service already runs stock qmgr")
        return done
    if word != PYQMGR_COMMAND:
        # Not ours to undo: an admin's own choice (oqmgr, a wrapper...) stays.
        done.append(f"qmgr service runs {word!r}, not pyqmgr: nothing to undo")
        return done
    _set_command(config_dir, current, STOCK_COMMAND)
    done.append(f"qmgr service command: {STOCK_COMMAND}")
    settings = os.path.join(config_dir, PYQMGR_CF)
    if os.path.lexists(settings):
        done.append(f"kept {settings} (stock qmgr ignores it; install uses it again)")
    _reload(config_dir, done)
    return done
