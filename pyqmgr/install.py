"""Switch a Postfix instance's qmgr service to pyqmgr and back.

master(8) runs ``$daemon_directory/<command>`` and Postfix's log tag is the basename of
argv[0]; so the launcher is a file named ``qmgr`` in ``$daemon_directory/pyqmgr/`` and
the master.cf command becomes ``pyqmgr/qmgr``: log lines keep reading
``postfix/qmgr[pid]``. Only the command word of the ``qmgr unix`` line changes, through
``postconf -F``, so every other column and ``-o`` option stays as the admin wrote it.

The launcher is shared by every instance that uses the same daemon_directory (the
usual case: one Postfix installation), which is why uninstall leaves it in place; it
is a two-line script that does nothing unless master.cf names it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

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
    done: list[str] = []
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
    _reload(config_dir, done)
    return done
