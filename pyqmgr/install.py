"""Switch a Postfix instance's qmgr service to pyqmgr and back.

master(8) runs ``$daemon_directory/<command>`` and Postfix's log tag is the basename of
argv[0]; so the launcher is a file named ``qmgr`` in ``$daemon_directory/pyqmgr/`` and
the master.cf command becomes ``pyqmgr/qmgr``: log lines keep reading
``postfix/qmgr[pid]``. Only the command word of the ``qmgr unix`` line changes, through
``postconf -F``, so every other column and ``-o`` option stays as the admin wrote it.
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


class InstallError(Exception):
    """The directory is not a usable Postfix configuration; nothing was changed."""


def _postconf(config_dir: str, *args: str) -> str:
    proc = subprocess.run(["postconf", "-c", config_dir, *args], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise InstallError(f"postconf {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def _check(config_dir: str) -> str:
    """Return the current qmgr command field, or refuse a non-Postfix directory."""
    for name in ("main.cf", "master.cf"):
        if not os.path.isfile(os.path.join(config_dir, name)):
            raise InstallError(f"{config_dir} is not a Postfix configuration directory "
                               f"(no {name})")
    out = _postconf(config_dir, "-F", "qmgr/unix/command").strip()
    if not out:
        raise InstallError(f"{config_dir}/master.cf has no qmgr/unix service")
    return out.partition("=")[2].strip()


def launcher_text(python: str | None = None) -> str:
    """The launcher: this interpreter, isolated mode, straight into the daemon."""
    return (
        f"#!{python or sys.executable} -I\n"
        "# Written by 'pyqmgr install': master(8) runs this as the qmgr service.\n"
        "import sys\n"
        "from pyqmgr.daemon import main\n"
        "sys.exit(main(sys.argv))\n"
    )


def _write_launcher(daemon_dir: str) -> tuple[str, bool]:
    directory = os.path.join(daemon_dir, LAUNCHER_DIR)
    path = os.path.join(directory, LAUNCHER_NAME)
    text = launcher_text()
    try:
        with open(path) as f:
            if f.read() == text:
                return path, False
    except OSError:
        pass
    os.makedirs(directory, mode=0o755, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
    return path, True


def _running(config_dir: str) -> bool:
    proc = subprocess.run(["postfix", "-c", config_dir, "status"], capture_output=True,
                          check=False)
    return proc.returncode == 0


def _set_command(config_dir: str, current: str, new_word: str) -> None:
    words = current.split()
    words[0] = new_word
    _postconf(config_dir, "-F", f"qmgr/unix/command={' '.join(words)}")


def _reload(config_dir: str, done: list[str]) -> None:
    if _running(config_dir):
        proc = subprocess.run(["postfix", "-c", config_dir, "reload"], capture_output=True,
                              text=True, check=False)
        if proc.returncode != 0:
            raise InstallError(f"postfix reload failed: {proc.stderr.strip()}")
        done.append("reloaded the running instance")


def install(config_dir: str) -> list[str]:
    current = _check(config_dir)
    daemon_dir = _postconf(config_dir, "-xh", "daemon_directory").strip()
    done: list[str] = []
    path, written = _write_launcher(daemon_dir)
    done.append(f"{'wrote' if written else 'kept'} launcher {path}")
    if current.split()[0] == PYQMGR_COMMAND:
        done.append("qmgr service already runs pyqmgr")
        return done
    master_cf = os.path.join(config_dir, "master.cf")
    backup = master_cf + BACKUP_SUFFIX
    if not os.path.exists(backup):
        shutil.copy2(master_cf, backup)
        done.append(f"saved {backup}")
    _set_command(config_dir, current, PYQMGR_COMMAND)
    done.append(f"qmgr service command: {PYQMGR_COMMAND}")
    _reload(config_dir, done)
    return done


def uninstall(config_dir: str) -> list[str]:
    current = _check(config_dir)
    done: list[str] = []
    if current.split()[0] == STOCK_COMMAND:
        done.append("qmgr service already runs stock qmgr")
        return done
    _set_command(config_dir, current, STOCK_COMMAND)
    done.append(f"qmgr service command: {STOCK_COMMAND}")
    _reload(config_dir, done)
    return done
