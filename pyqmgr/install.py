"""Switch a Postfix instance's qmgr service to pyqmgr and back.

master(8) runs ``$daemon_directory/<command>`` and Postfix's log tag is the basename of
argv[0]; so the launcher is a file named ``qmgr`` and the master.cf command becomes
``pyqmgr/<venv>/qmgr``: log lines keep reading ``postfix/qmgr[pid]``. Only the command
word of the ``qmgr unix`` line changes, in place, so every other byte of master.cf stays
as the admin wrote it; uninstall gives master.cf back byte for byte when nothing else
changed in it, and otherwise keeps the admin's later edits (:mod:`pyqmgr.rollback`).

Each installation (one interpreter, one venv) has a launcher of its own,
``$daemon_directory/pyqmgr/<venv name>-<hash of its path>/qmgr``: a second checkout,
a demo or a test run installing from another venv writes another file and never
switches a production instance's qmgr to its interpreter. Releases up to 0.x wrote
one shared ``pyqmgr/qmgr``; that command is still recognised (uninstall undoes it,
install replaces it). Uninstall removes its launcher when no instance of this
Postfix (the configuration directory and its ``multi_instance_directories``) names
it any more.

Before anything is written, install runs the same inspection as ``pyqmgr check``
(:func:`check_installation`): master(8) will run the launcher as root, so install
refuses while the interpreter, the package, pyqmgr.cf or a policy module can be
changed by anyone but root, or while pyqmgr.cf does not parse. Neither install nor
uninstall writes or removes pyqmgr.cf: it is the admin's file, and keeping it across
an uninstall makes switching back a one-command affair.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field

from pyqmgr import build, rollback, trust
from pyqmgr.postfix.config import ConfigError, QmgrConfig
from pyqmgr.postfix.master_cf import load_master_cf
from pyqmgr.pyqmgr_cf import PYQMGR_CF, PyqmgrCf, PyqmgrCfError
from pyqmgr.pyqmgr_cf import load as load_pyqmgr_cf
from pyqmgr.settings_check import SettingsFindings, settings_problems, unknown_names_only

LAUNCHER_DIR = "pyqmgr"
LAUNCHER_NAME = "qmgr"
#: The one launcher older installs shared; recognised, never written.
SHARED_COMMAND = f"{LAUNCHER_DIR}/{LAUNCHER_NAME}"
STOCK_COMMAND = "qmgr"
BACKUP_SUFFIX = rollback.BACKUP_SUFFIX
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


#: Debian's template for a main.cf, which its "No configuration" choice leaves uncopied.
DEBIAN_MAIN_CF = "/usr/share/postfix/main.cf.debian"


def require_postfix_dir(config_dir: str) -> None:
    """InstallError unless ``config_dir`` holds main.cf and master.cf.

    Debian's postfix package installed with "No configuration" (debconf's choice, or
    what a non-interactive install picks) has master.cf and no main.cf: Postfix itself
    does not run there yet, and the message says how to give it one.
    """
    for name in ("main.cf", "master.cf"):
        if not os.path.isfile(os.path.join(config_dir, name)):
            why = f"{config_dir} is not a Postfix configuration directory (no {name})"
            if name == "main.cf" and os.path.isfile(os.path.join(config_dir, "master.cf")):
                why += ("; Postfix was installed without a configuration (Debian's "
                        "\"No configuration\"): run 'dpkg-reconfigure postfix' and choose a "
                        "mail configuration type")
                if os.path.isfile(DEBIAN_MAIN_CF):
                    why += f", or start from 'cp {DEBIAN_MAIN_CF} {config_dir}/main.cf'"
                why += ", then start Postfix and run this again"
            raise InstallError(why)


def _check(config_dir: str) -> str:
    """Return the current qmgr command field, or refuse a non-Postfix directory.

    Only reads: every refusal happens before anything is written.
    """
    require_postfix_dir(config_dir)
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


def launcher_tag(python: str | None = None) -> str:
    """This installation's name among launchers: its venv's name and a hash of its path.

    The hash tells apart two venvs both called ``.venv``; the name is for the admin
    reading master.cf.
    """
    python = python or sys.executable
    home = trust.venv_root(python) or os.path.dirname(os.path.dirname(
        os.path.realpath(python)))
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", os.path.basename(home.rstrip("/"))).strip(".-")
    digest = hashlib.sha256(os.path.abspath(home).encode("utf-8", "surrogateescape"))
    return f"{name[:32] or 'python'}-{digest.hexdigest()[:8]}"


def pyqmgr_command(python: str | None = None) -> str:
    """The master.cf command word of this installation's launcher."""
    return f"{LAUNCHER_DIR}/{launcher_tag(python)}/{LAUNCHER_NAME}"


def is_pyqmgr_command(word: str) -> bool:
    """Is this qmgr command one of pyqmgr's launchers (any installation's)?"""
    return word == SHARED_COMMAND or bool(
        re.fullmatch(rf"{LAUNCHER_DIR}/[A-Za-z0-9_.-]+/{LAUNCHER_NAME}", word))


def launcher_path(daemon_dir: str, python: str | None = None) -> str:
    return os.path.join(daemon_dir, pyqmgr_command(python))


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
    #: ``pure Python`` or ``compiled (mypyc)`` (:mod:`pyqmgr.build`).
    build: str
    pyqmgr_cf_exists: bool
    pyqmgr_cf_parameters: list[str] = field(default_factory=list)
    pyqmgr_cf_error: str | None = None
    policy_modules: dict[str, str] = field(default_factory=dict)
    paths_checked: int = 0
    check_seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: pyqmgr.cf's unknown names, unreadable tables and missing extras (also among
    #: ``problems``), by kind for ``--json``.
    findings: SettingsFindings = field(default_factory=SettingsFindings)

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
            "build": self.build,
            "pyqmgr_cf": {"path": self.pyqmgr_cf, "exists": self.pyqmgr_cf_exists,
                          "parses": self.pyqmgr_cf_error is None,
                          "error": self.pyqmgr_cf_error,
                          "parameters": self.pyqmgr_cf_parameters},
            "policy_modules": self.policy_modules,
            "paths_checked": self.paths_checked,
            "check_milliseconds": round(self.check_seconds * 1000, 3),
            **self.findings.as_json(self.pyqmgr_cf),
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
        package_dir=trust.package_dir(), build=build.name(),
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
    ours = [p for p in (os.path.join(daemon_dir, LAUNCHER_DIR), os.path.dirname(launcher),
                        launcher) if os.path.lexists(p)]
    report.problems += trust.untrusted_installation(
        sys.executable, report.package_dir, config_dir=config_dir, daemon_dir=daemon_dir,
        settings=files, launcher=ours)
    report.check_seconds = time.perf_counter() - started
    report.paths_checked = len(trust.daemon_paths(sys.executable, report.package_dir,
                                                  files)) + len(ours)
    if settings is not None and cfg is not None and not report.problems:
        # The values, as the daemon's start-up judges them: policies, shaping, rules
        # files, retry, metrics, delivery policy delegation, fleet and memory
        # settings. Only once everything is trusted, since a module: policy is code
        # that this imports. Names nothing reads, tables that cannot be read and
        # missing extras are problems too (pyqmgr.settings_check).
        report.problems += settings_problems(settings, cfg, report.findings)
        report.notes += report.findings.notes
    elif settings is not None:
        report.problems += unknown_names_only(settings, config_dir, report.findings)
    return report


def _settings_problems(settings: PyqmgrCf, cfg: QmgrConfig) -> list[str]:
    """pyqmgr.cf's values as ``check`` judges them (:mod:`pyqmgr.settings_check`)."""
    return settings_problems(settings, cfg)


def check_installation(config_dir: str) -> CheckReport:
    """``pyqmgr check``: read-only; InstallError if config_dir is not a Postfix one."""
    require_postfix_dir(config_dir)
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
    """Replace the program word only, in place; its arguments (-o ...) follow unchanged.

    ``postconf -F`` only if this reader does not find the entry where postconf did
    (it then rewrites the entry in its own layout).
    """
    first = current.split(maxsplit=1)[0]
    try:
        if rollback.set_command(os.path.join(config_dir, "master.cf"), first, new_word):
            return
    except rollback.RollbackError as exc:
        raise InstallError(str(exc)) from None
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
    ours = pyqmgr_command()
    if word == ours:
        done.append("qmgr service already runs pyqmgr")
        return done
    try:
        done += rollback.save_backup(os.path.join(config_dir, "master.cf"),
                                     is_pyqmgr_command(word))
    except rollback.RollbackError as exc:
        raise InstallError(f"cannot save master.cf's backup: {exc}") from None
    if is_pyqmgr_command(word):
        done.append(f"note: the qmgr service ran another pyqmgr installation ({word}); "
                    "it now runs this one")
    elif word != STOCK_COMMAND:
        done.append(f"note: the qmgr service ran {word!r}, not stock qmgr; "
                    f"uninstall will restore {word!r}")
    _set_command(config_dir, current, ours)
    done.append(f"qmgr service command: {ours}")
    done += _who_can_run(config_dir)
    _reload(config_dir, done)
    return done


def _closed_directory(paths: list[str]) -> tuple[str, int] | None:
    """The first directory above ``paths`` that users other than root cannot enter."""
    for path in paths:
        parts = os.path.abspath(path).split(os.sep)[1:-1]
        for depth in range(len(parts) + 1):
            directory = os.sep + os.path.join(*parts[:depth]) if depth else os.sep
            try:
                mode = os.stat(directory).st_mode
            except OSError:
                continue
            if not mode & 0o001:
                return directory, stat.S_IMODE(mode)
    return None


def _who_can_run(config_dir: str) -> list[str]:
    """A note when this pyqmgr lies where only root can run it.

    ``pyqmgr status`` and ``explain`` are for the users authorized_mailq_users
    allows, but they run this interpreter and package themselves: under a 0700
    directory (/root) they cannot even start it, and nothing pyqmgr does at run
    time can change that. Said at install, where the admin can still move it.
    """
    try:
        allowed = _postconf(config_dir, "-xh", "authorized_mailq_users").strip()
    except InstallError:
        allowed = "static:anyone"
    script = os.path.join(os.path.dirname(sys.executable), "pyqmgr")
    closed = _closed_directory([script, os.path.realpath(sys.executable),
                                os.path.join(trust.package_dir(), "__init__.py")])
    if not allowed or closed is None:
        return []
    directory, mode = closed
    return [f"note: {directory} is mode {mode:04o}, so only root can run {script}: the "
            f"users authorized_mailq_users allows ({allowed}) cannot run 'pyqmgr status' "
            "or 'pyqmgr explain' from it. For them, put the checkout and its venv "
            "under /opt (README.md, section 6)"]


def _instances(config_dir: str) -> list[str]:
    """The configuration directories of this Postfix: this one, the default one if it
    shares daemon_directory, and every ``multi_instance_directories`` of either."""
    found = [config_dir]
    default = "/etc/postfix"
    try:
        default = _postconf(config_dir, "-dh", "config_directory").strip() or default
    except InstallError:
        pass
    candidates = [default]
    for directory in (config_dir, default):
        try:
            listed = _postconf(directory, "-xh", "multi_instance_directories")
        except InstallError:
            continue
        candidates += listed.replace(",", " ").split()
    for directory in candidates:
        if directory not in found and os.path.isfile(os.path.join(directory, "master.cf")):
            found.append(directory)
    return found


def _remove_unused_launcher(config_dir: str, daemon_dir: str, word: str,
                            done: list[str]) -> None:
    """Remove the launcher ``word`` names unless an instance still runs it."""
    for directory in _instances(config_dir):
        try:
            if directory != config_dir and _postconf(directory, "-xh", "daemon_directory"
                                                     ).strip() != daemon_dir:
                continue
            command = _postconf(directory, "-F", "qmgr/unix/command").partition("=")[2]
        except InstallError:
            continue
        if command.split()[:1] == [word]:
            done.append(f"kept launcher {os.path.join(daemon_dir, word)}: "
                        f"{directory}/master.cf runs it")
            return
    path = os.path.join(daemon_dir, word)
    if not os.path.lexists(path) or not rollback.remove_noted(os.unlink, path,
                                                             f"launcher {path}", done):
        return
    for directory in (os.path.dirname(path), os.path.join(daemon_dir, LAUNCHER_DIR)):
        if directory != daemon_dir:
            with contextlib.suppress(OSError):
                os.rmdir(directory)  # only when empty


def _restore_master_cf(config_dir: str, current: str, word: str) -> list[str]:
    """The qmgr command back to the backup's (stock ``qmgr`` without one), and
    master.cf back to the backup's bytes when nothing else changed in it."""
    master_cf = os.path.join(config_dir, "master.cf")
    try:
        stock = rollback.stock_word(master_cf, is_pyqmgr_command, STOCK_COMMAND)
        done = rollback.restore(master_cf, word, stock)
    except rollback.RollbackError as exc:
        raise InstallError(str(exc)) from None
    if done is None:
        _set_command(config_dir, current, stock)
        done = [f"qmgr service command: {stock}",
                f"edited the qmgr line of {master_cf} with postconf -F (its layout is "
                "postconf's); the backup, if any, is kept"]
    return done


def _leftovers(config_dir: str, pids: list[int]) -> list[str]:
    """Remove the daemon's own directories (:func:`rollback.remove_state`)."""
    try:
        queue_dir = _postconf(config_dir, "-xh", "queue_directory").strip()
        data_dir = _postconf(config_dir, "-xh", "data_directory").strip()
    except InstallError:
        return []
    return rollback.remove_state(queue_dir, data_dir, pids)


def uninstall(config_dir: str) -> list[str]:
    """Give the qmgr service back to stock qmgr (arguments kept); idempotent.

    master.cf comes back byte for byte when nothing else in it changed since
    install; otherwise only the qmgr command word changes and the admin's edits
    stay (:mod:`pyqmgr.rollback`). The launcher goes too unless another instance
    of this Postfix still names it, and so do the daemon's own directories (the
    control socket's, the suspensions') once it has exited.
    """
    current = _check(config_dir)
    done: list[str] = []
    word = current.split()[0]
    if word == STOCK_COMMAND:
        done.append("qmgr service already runs stock qmgr")
        return done + _leftovers(config_dir, [])
    if not is_pyqmgr_command(word):
        # Not ours to undo: an admin's own choice (oqmgr, a wrapper...) stays.
        done.append(f"qmgr service runs {word!r}, not pyqmgr: nothing to undo")
        return done
    daemon_dir = _postconf(config_dir, "-xh", "daemon_directory").strip()
    queue_dir = _postconf(config_dir, "-xh", "queue_directory").strip()
    pids = rollback.daemon_pids(queue_dir, os.path.join(daemon_dir, word))
    done += _restore_master_cf(config_dir, current, word)
    _remove_unused_launcher(config_dir, daemon_dir, word, done)
    settings = os.path.join(config_dir, PYQMGR_CF)
    if os.path.lexists(settings):
        done.append(f"kept {settings} (stock qmgr ignores it; install uses it again)")
    _reload(config_dir, done)
    return done + _leftovers(config_dir, pids)


# -- manual pages ---------------------------------------------------------------------------

#: The pages shipped in the package (pyqmgr/man), by section.
MAN_PAGES = {"pyqmgr.8": "man8", "pyqmgr.1": "man1"}


def _shipped_page(name: str) -> bytes:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "man", name)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise InstallError(f"the manual page {path} is missing from this installation: "
                           f"{exc}") from exc


def install_man_pages(man_dir: str) -> list[str]:
    """Put pyqmgr(8) and pyqmgr(1) where man finds them; unchanged pages are kept."""
    done = []
    for name, section in MAN_PAGES.items():
        text = _shipped_page(name)
        path = os.path.join(man_dir, section, name)
        try:
            with open(path, "rb") as f:
                if f.read() == text:
                    done.append(f"kept manual page {path}")
                    continue
        except OSError:
            pass
        try:
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            tmp = path + ".tmp"
            with open(tmp, "wb") as f:
                f.write(text)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except OSError as exc:
            raise InstallError(f"cannot write manual page {path}: {exc}") from exc
        done.append(f"installed manual page {path}")
    return done


def remove_man_pages(man_dir: str, config_dir: str) -> list[str]:
    """Remove the pages that install put there, once no launcher of any installation
    is left in this Postfix's daemon_directory (they document every installation)."""
    daemon_dir = _postconf(config_dir, "-xh", "daemon_directory").strip()
    launchers = os.path.join(daemon_dir, LAUNCHER_DIR)
    if os.path.isdir(launchers) and any(os.scandir(launchers)):
        return []
    done = []
    for name, section in MAN_PAGES.items():
        path = os.path.join(man_dir, section, name)
        try:
            with open(path, "rb") as f:
                ours = f.read() == _shipped_page(name)
        except OSError:
            continue
        if not ours:
            done.append(f"kept manual page {path}: not the one this pyqmgr installs")
            continue
        rollback.remove_noted(os.unlink, path, f"manual page {path}", done)
    return done
