"""pyqmgr installed as an admin installs it: ``pip install .``, no extras.

The development venv holds every extra, so nothing else in the suite would notice a
base command that imports aiosmtpd, matplotlib or prometheus_client on the way (as
``pyqmgr replay`` once did, through compare's figures and the sink). Here a fresh venv
from Debian's python gets the package alone, and its own ``pyqmgr`` runs the commands:
those that need no extra must work, and those that do must say in one line which extra
to install, never with a traceback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from pyqmgr.extras import ALL, EXTRAS, FEATURES
from tests.trust_helpers import trusted_dir

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: The interpreter ./dev builds .venv from, and the one an admin's venv comes from.
SYSTEM_PYTHON = "/usr/bin/python3"
OPTIONAL = ("aiosmtpd", "matplotlib", "prometheus_client", "dns", "inotify_simple", "redis")
#: pyproject.toml's distribution names whose module is named otherwise.
MODULE_OF = {"dnspython": "dns"}
#: The modules that may fail to import without the extras: each is reached only by a
#: command that checks for its extra first (demo, and the daemon with metrics_listen),
#: or is the test bed's (its Redis servers are driven with redis-py, the fleet extra).
NEEDS_AN_EXTRA = {"pyqmgr.demo", "pyqmgr.testbed.sink", "pyqmgr.testbed.content_filter",
                  "pyqmgr.daemon.metrics_exporter", "pyqmgr.daemon.fleet.metrics",
                  # The metrics' collectors of source pools and delivery events (#46).
                  "pyqmgr.daemon.metrics_sources", "pyqmgr.events.metrics",
                  "pyqmgr.testbed.redis", "pyqmgr.testbed.redis_common",
                  "pyqmgr.testbed.redis_cluster", "pyqmgr.testbed.redis_sentinel",
                  "pyqmgr.testbed.redis_tls", "pyqmgr.testbed.valkey"}
#: Every subprocess here is bounded; an install may build in an isolated environment.
INSTALL_TIMEOUT = 180
TIMEOUT = 60

#: One message as Postfix logs it: received, queued, delivered by smtp, removed.
MAILLOG = """\
Mar  3 10:00:01 mx postfix/smtpd[2101]: 4R7Xk12ZqLz1: client=client.example.net[192.0.2.10]
Mar  3 10:00:01 mx postfix/cleanup[2102]: 4R7Xk12ZqLz1: message-id=<20240303100001.1@client.example.net>
Mar  3 10:00:01 mx postfix/qmgr[900]: 4R7Xk12ZqLz1: from=<alice@example.org>, size=2048, nrcpt=1 (queue active)
Mar  3 10:00:02 mx postfix/smtp[2103]: 4R7Xk12ZqLz1: to=<bob@example.com>, relay=mx.example.com[198.51.100.7]:25, delay=0.62, delays=0.05/0.01/0.21/0.35, dsn=2.0.0, status=sent (250 2.0.0 Ok: queued as 9F8E7D6C5B)
Mar  3 10:00:02 mx postfix/qmgr[900]: 4R7Xk12ZqLz1: removed
"""  # noqa: E501  (log lines are as long as Postfix writes them)


@dataclass(frozen=True)
class BaseVenv:
    root: str
    python: str
    pyqmgr: str
    env: dict[str, str]
    #: The source tree it was installed from (``pip install SRC``).
    src: str

    def install(self, *extras: str) -> str:
        """The command pyqmgr names for adding ``extras`` here: this venv's pip and the
        checkout it was installed from (pip recorded it: direct_url.json)."""
        return f"{self.root}/bin/pip install '{self.src}[{','.join(extras)}]'"

    def run(self, *argv: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
        """Run in the venv's directory: ``python -c`` puts its cwd first on sys.path,
        and there the repository's own pyqmgr would stand in for the installed one."""
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              cwd=self.root, env=self.env, check=False)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run(self.pyqmgr, *args)


def _clean_env() -> dict[str, str]:
    """This process's environment without what would lead the venv to other packages
    (the development venv, a PYTHONPATH pointing at the repository)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE",
                        "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _copy_source(dest: str) -> str:
    """What an admin's checkout holds, copied: pip builds in the source tree (build/,
    pyqmgr.egg-info), and the repository is someone's work tree."""
    src = os.path.join(dest, "src")
    os.makedirs(src)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src)
    shutil.copytree(os.path.join(ROOT, "pyqmgr"), os.path.join(src, "pyqmgr"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return src


@pytest.fixture(scope="module")
def venv() -> Iterator[BaseVenv]:
    """The venv lives where root alone can write (tests/trust_helpers.py), as the README
    asks: its daemon and check then get past the trust check to the settings."""
    with trusted_dir("pyqmgr-base-install-") as top:
        yield from _base_venv(top)


def _base_venv(top: str) -> Iterator[BaseVenv]:
    try:
        env = _clean_env()
        src = _copy_source(top)
        root = os.path.join(top, "venv")
        made = subprocess.run([SYSTEM_PYTHON, "-m", "venv", root], capture_output=True,
                              text=True, timeout=TIMEOUT, env=env, check=False)
        assert made.returncode == 0, f"{SYSTEM_PYTHON} -m venv: {made.stderr}"
        pip = [os.path.join(root, "bin", "python"), "-m", "pip", "install", "-q"]
        # Offline with the venv's own setuptools first; older setuptools cannot build a
        # wheel without the wheel package, and then pip builds as usual, isolated.
        installed = subprocess.run([*pip, "--no-build-isolation", "--no-index", src],
                                   capture_output=True, text=True, cwd=top, env=env,
                                   timeout=INSTALL_TIMEOUT, check=False)
        if installed.returncode != 0:
            shutil.rmtree(os.path.join(src, "build"), ignore_errors=True)
            installed = subprocess.run([*pip, src], capture_output=True, text=True, cwd=top,
                                       env=env, timeout=INSTALL_TIMEOUT, check=False)
        assert installed.returncode == 0, f"pip install {src}: {installed.stderr}"
        yield BaseVenv(root, os.path.join(root, "bin", "python"),
                       os.path.join(root, "bin", "pyqmgr"), env, src)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a command that could not run, asserted as such."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_the_venv_is_a_base_install(venv):
    """Without this, a venv that somehow had the extras would pass everything below."""
    proc = venv.run(venv.python, "-c", (
        "import importlib.util, json, pyqmgr; print(json.dumps({'file': pyqmgr.__file__, "
        f"'found': [m for m in {OPTIONAL!r} if importlib.util.find_spec(m)]}}))"))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["found"] == []
    assert got["file"].startswith(venv.root + os.sep), got["file"]


def test_only_modules_behind_an_extra_need_one(venv):
    """Every module imports but those whose commands check for their extra first; a new
    module-level import of an optional package anywhere else fails here."""
    proc = venv.run(venv.python, "-c", (
        "import importlib, json, pkgutil, pyqmgr\n"
        "failed = {}\n"
        "for m in pkgutil.walk_packages(pyqmgr.__path__, 'pyqmgr.'):\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except ImportError as exc:\n"
        "        failed[m.name] = exc.name\n"
        "print(json.dumps(failed))\n"))
    assert proc.returncode == 0, proc.stderr
    failed = json.loads(proc.stdout)
    assert set(failed) == NEEDS_AN_EXTRA, failed
    assert set(failed.values()) <= set(OPTIONAL), failed


def test_every_subcommand_has_help(venv):
    top = venv.cli("--help")
    assert top.returncode == 0, top.stderr
    names = re.search(r"\{([a-z,]+)\}", top.stdout)
    assert names is not None, top.stdout
    commands = names.group(1).split(",")
    assert {"replay", "simulate", "compare", "check", "status"} <= set(commands)
    for command in commands:
        proc = venv.cli(command, "--help")
        assert proc.returncode == 0 and proc.stderr == "", (command, proc.stderr)
        assert proc.stdout.startswith(f"usage: pyqmgr {command}"), (command, proc.stdout)


def test_replay(venv):
    log = os.path.join(venv.root, "mail.log")
    with open(log, "w") as f:
        f.write(MAILLOG)
    proc = venv.cli("replay", log, "--year", "2024", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    report = json.loads(proc.stdout)
    [inst] = report["instances"]
    assert inst["figures"]["log"]["example.com"]["sent"] == 1

    text = venv.cli("replay", log, "--year", "2024")
    assert text.returncode == 0, text.stderr
    assert "example.com" in text.stdout

    # --compare says so before it simulates anything, and exits as a run not made.
    compare = venv.cli("replay", log, "--year", "2024", "--compare")
    assert compare.returncode == 4
    assert compare.stdout == ""
    assert one_line(compare) == ("pyqmgr replay: --compare needs the testbed extra: "
                                 + venv.install("testbed"))


def test_simulate(venv):
    scenario = os.path.join(ROOT, "scenarios", "preemption.toml")
    proc = venv.cli("simulate", scenario)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() and proc.stderr == ""

    png = os.path.join(venv.root, "plot.png")
    plot = venv.cli("simulate", scenario, "--plot", png)
    assert plot.returncode == 1
    assert one_line(plot) == ("pyqmgr simulate: --plot needs the plot extra: "
                              + venv.install("plot"))
    assert plot.stdout == "" and not os.path.exists(png)


def test_compare_names_the_extra(venv):
    workload = os.path.join(ROOT, "compat", "workloads", "dead-mx.toml")
    proc = venv.cli("compare", workload, "--out", os.path.join(venv.root, "cmp"))
    assert proc.returncode == 4
    assert proc.stdout == ""
    assert one_line(proc) == "pyqmgr compare: needs the testbed extra: " + venv.install("testbed")
    assert not os.path.exists(os.path.join(venv.root, "cmp"))


def test_demo_names_the_extra(venv):
    proc = venv.cli("demo")
    assert proc.returncode == 1
    assert one_line(proc) == "pyqmgr demo: needs the testbed extra: " + venv.install("testbed")


def _config_dir(venv: BaseVenv, name: str, pyqmgr_cf: str = "") -> str:
    """A configuration directory of its own (only main.cf, master.cf and pyqmgr.cf)."""
    config = os.path.join(venv.root, name)
    os.makedirs(config)
    with open(os.path.join(config, "main.cf"), "w") as f:
        # A queue directory of its own: no daemon can be answering there.
        f.write(f"compatibility_level = 3.6\nqueue_directory = {venv.root}/queue\n")
    shutil.copy("/usr/share/postfix/master.cf.dist" if os.path.exists(
        "/usr/share/postfix/master.cf.dist") else os.devnull,
        os.path.join(config, "master.cf"))
    if pyqmgr_cf:
        with open(os.path.join(config, "pyqmgr.cf"), "w") as f:
            f.write(pyqmgr_cf)
    return config


def test_check_and_status(venv):
    """check reads a configuration directory (through postconf) and judges this very
    venv, root's alone: no problem, exit 0. status finds no daemon: 69."""
    config = _config_dir(venv, "postfix")
    check = venv.cli("check", "--config-dir", config)
    status = venv.cli("status", "--config-dir", config)
    if shutil.which("postconf") is None:
        # Not a Postfix machine: check cannot check at all, and says so in one line.
        assert check.returncode == 2
        assert one_line(check).startswith("pyqmgr check: cannot run postconf")
        assert status.returncode == 69
        assert one_line(status).startswith("pyqmgr status: ")
        return
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stderr == ""
    assert f"config_dir  {config}" in check.stdout
    assert "ok: no problems found" in check.stdout
    assert status.returncode == 69
    # Its first line says so; what follows (what to do) is status's own business.
    assert "Traceback" not in status.stderr
    assert status.stderr.startswith("pyqmgr status: cannot connect to "), status.stderr


#: Each feature on, none of their libraries installed.
EVERY_FEATURE = ("metrics_listen = 9155\nsite_grouping = mx\n"
                 "message_classes = transactional bulk\n"
                 "shared_state = redis://127.0.0.1:6379\n")


def test_check_names_every_feature_whose_extra_is_missing(venv):
    """Each setting that turns on a feature without its library is a problem naming the
    parameter, the extra and the command that adds it to this installation (#43)."""
    config = _config_dir(venv, "features", EVERY_FEATURE)
    check = venv.cli("check", "--config-dir", config)
    assert check.returncode == 1, check.stdout + check.stderr
    assert "Traceback" not in check.stderr and check.stderr == ""
    cf = os.path.join(config, "pyqmgr.cf")
    problems = [ln.strip() for ln in check.stdout.splitlines() if ln.startswith("  ")]
    assert problems == [
        f"{cf}: parameter {f.parameter}: needs the {f.extra} extra ({f.library}), which is "
        f"not installed: {venv.install(f.extra)}" for f in FEATURES], check.stdout

    report = json.loads(venv.cli("check", "--config-dir", config, "--json").stdout)
    assert report["ok"] is False and report["problems"] == problems
    assert [(m["parameter"], m["extra"], m["command"]) for m in report["missing_extras"]] == [
        (f.parameter, f.extra, venv.install(f.extra)) for f in FEATURES]
    assert report["unknown_parameters"] == [] and report["unreadable_tables"] == []


def test_the_daemon_without_dnspython_says_so_in_a_fatal_line(venv, postfix_instance):
    """site_grouping = mx on a base install, on real Postfix: one fatal line naming the
    parameter, the extra and the command (it died with a traceback on stderr, which
    only master's "exit status 1" showed), and the mail waits in the queue."""
    pf = postfix_instance(qmgr="pyqmgr", qmgr_python=venv.python, start=False)
    # Written after install, which refuses such a file (check names the same problem).
    pf.write_pyqmgr_cf({"site_grouping": "mx"})
    pf.start()
    (qid,) = pf.smtp_send([("s@test.example", [pf.local_address])])
    (fatal,) = pf.maillog.wait_for(
        lambda ln: ln.program == "postfix/qmgr" and ln.severity == "fatal", timeout=30,
        what="the qmgr's fatal line")[:1]
    cf = os.path.join(pf.config_dir, "pyqmgr.cf")
    assert fatal.text == (f"fatal: {cf}: parameter site_grouping: needs the sites extra "
                          f"(dnspython), which is not installed: {venv.install('sites')}")
    assert pf.queue_path("incoming", qid) is not None, pf.queue_counts()


def test_metrics_without_prometheus_client(venv):
    """metrics_listen set, the library absent: the daemon's start-up check (what it
    logs as its fatal line) names the parameter and the extra."""
    proc = venv.run(venv.python, "-c", (
        "from pyqmgr.daemon import metrics\n"
        "from pyqmgr.postfix.config import QmgrConfig\n"
        "from pyqmgr.pyqmgr_cf import PyqmgrCfError, from_text\n"
        "try:\n"
        "    metrics.setup(from_text('metrics_listen = 9155\\n', '/etc/postfix/pyqmgr.cf'),\n"
        "                  QmgrConfig.from_text(''))\n"
        "except PyqmgrCfError as exc:\n"
        "    print(exc)\n"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("/etc/postfix/pyqmgr.cf: parameter metrics_listen: the "
                                  "prometheus_client library does not load"), proc.stdout
    assert f"install it ({venv.install('metrics')})" in proc.stdout


def test_message_classes_without_inotify_simple(venv):
    """message_classes set, the library absent: the start-up check names the parameter
    and the extra (pyqmgr reads incoming/'s new files as the kernel reports them)."""
    proc = venv.run(venv.python, "-c", (
        "from pyqmgr.daemon import classes\n"
        "from pyqmgr.daemon.policies import policy_setup\n"
        "from pyqmgr.postfix.config import QmgrConfig\n"
        "from pyqmgr.pyqmgr_cf import PyqmgrCfError, from_text\n"
        "cf = from_text('message_classes = transactional bulk\\n', '/etc/postfix/pyqmgr.cf')\n"
        "try:\n"
        "    classes.setup(cf, policy_setup(cf, QmgrConfig.from_text('')), print)\n"
        "except PyqmgrCfError as exc:\n"
        "    print(exc)\n"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("/etc/postfix/pyqmgr.cf: parameter message_classes: the "
                                  "inotify_simple library does not load"), proc.stdout
    assert f"install it ({venv.install('classes')})" in proc.stdout


def test_extras_match_pyproject():
    """The modules the commands check for are those of pyproject.toml's extras; every
    extra but the developers' (test) is known to pyqmgr.extras; ``all``, the README's,
    holds exactly the others; and each feature's module is its extra's."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        declared = tomllib.load(f)["project"]["optional-dependencies"]

    def modules(extra: str) -> set[str]:
        names = {re.split(r"[<>=!~ \[;]", req, maxsplit=1)[0].lower() for req in declared[extra]}
        return {MODULE_OF.get(n, n.replace("-", "_")) for n in names}

    for extra, wanted in EXTRAS.items():
        assert modules(extra) == set(wanted), (extra, modules(extra), wanted)
    assert set(declared) == {*EXTRAS, ALL, "test"}
    assert modules(ALL) == {m for extra in EXTRAS for m in modules(extra)}
    assert modules(ALL) <= modules("test")
    for feature in FEATURES:
        assert feature.module in EXTRAS[feature.extra], feature
    assert set(OPTIONAL) == {m for extra in EXTRAS for m in modules(extra)} - {"hiredis"}


def test_the_manual_pages_are_installed_with_the_package(venv):
    """`pip install .` ships pyqmgr(8) and pyqmgr(1) inside the package, where `pyqmgr
    install` takes them from (package data, not only files of the checkout)."""
    proc = venv.run(venv.python, "-c", (
        "import os, pyqmgr; d = os.path.join(os.path.dirname(pyqmgr.__file__), 'man'); "
        "print(d); print(sorted(os.listdir(d)))"))
    assert proc.returncode == 0, proc.stderr
    where, names = proc.stdout.splitlines()
    assert where.startswith(venv.root + os.sep)
    assert names == "['pyqmgr.1', 'pyqmgr.8']"
