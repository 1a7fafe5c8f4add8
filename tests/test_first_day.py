"""README's first day, walked as a new admin walks it (issue #43).

The README's own commands, read out of README.md and run as written: a clone and a venv
made by section 2's lines under a 0700 directory of root's (the README allows /root),
`pyqmgr check`, `pyqmgr install`, mail sent, `status`, `explain` on an active, a
deferred and a held message, `top`, the metrics scraped, `pyqmgr uninstall`. Only what
the README cannot say for a test is changed: the configuration directory is a
throwaway instance's (standing for /etc/postfix, on loopback), the clone's source is
this checkout (with its uncommitted changes laid over the clone, so a developer tests
what they have; CI's checkout is clean), the manual pages go to a temporary directory,
and ``python3`` is Debian's (/usr/bin first on PATH), as on a fresh Debian machine.

Every feature is on at once (sites with MX records from a real DNS server, classes,
tenants, metrics, the fleet on a real redis-server, delegation to a real postfwd),
and the daemon runs with ``PYQMGR_IMPORT_AUDIT`` (main.cf's import_environment): an
audit hook and a meta-path finder name every module imported after privileges were
dropped (pyqmgr/daemon/late_imports.py). From a 0700 directory such an import fails;
dnspython's asyncio backend did, and no site was ever learnt. None may be named.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from pyqmgr.testbed import dns
from pyqmgr.testbed.instance import PostfixInstance, free_port
from pyqmgr.testbed.postfwd import Postfwd, find_postfwd2
from pyqmgr.testbed.redis import RedisServer
from pyqmgr.testbed.sink import SinkServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
#: Where the README puts the checkout (0700, root's).
HOME = os.path.expanduser("~root")
#: Bounds on the README's commands (pip fetches the extras: the slowest).
INSTALL_TIMEOUT = 300
COMMAND_TIMEOUT = 60

pytestmark = [
    pytest.mark.skipif(not dns.available(), reason="needs unbound (./dev installs it)"),
    pytest.mark.skipif(find_postfwd2() is None, reason="needs postfwd (./dev installs it)"),
    pytest.mark.skipif(shutil.which("redis-server") is None,
                       reason="needs redis-server (./dev installs it)"),
]

SITE = "mx.site.test"
DOMAINS = [f"d{i}.test" for i in range(10)]
RECORDS = [f"{SITE}. 300 IN A 127.0.0.1", *[f"{d}. 300 IN MX 10 {SITE}." for d in DOMAINS]]
SLOW = "slow.example"   # one message kept in delivery: explain on an active message
DEAD = "dead.example"   # nothing listens: explain on a deferred message


def readme_block(heading: str) -> list[str]:
    """The command lines of the first ```sh block after README's ``heading``."""
    text = open(README).read()
    at = text.index(heading)
    block = re.search(r"```sh\n(.*?)```", text[at:], re.S)
    assert block, f"README.md: no ```sh block after {heading!r}"
    return [line.split("  #")[0].rstrip() for line in block.group(1).splitlines()
            if line.strip() and not line.startswith("#")]


@dataclass
class Clone:
    """The admin's checkout and venv, made by the README's lines."""

    base: str
    dir: str
    env: dict[str, str]

    @property
    def pyqmgr(self) -> str:
        return os.path.join(self.dir, ".venv", "bin", "pyqmgr")

    def sh(self, line: str, timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["sh", "-c", line], cwd=self.dir, env=self.env, text=True,
                              capture_output=True, timeout=timeout, check=False,
                              stdin=subprocess.DEVNULL)

    def run(self, *args: str, timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.pyqmgr, *args], cwd=self.dir, env=self.env, text=True,
                              capture_output=True, timeout=timeout, check=False,
                              stdin=subprocess.DEVNULL)


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYTHON") and k not in ("VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")}
    env["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _lay_over_working_tree(clone_dir: str) -> None:
    """This checkout's uncommitted changes and new files, copied over the clone."""
    listed = subprocess.run(["git", "-C", ROOT, "ls-files", "-z", "--modified", "--others",
                             "--exclude-standard"], capture_output=True, text=True,
                            check=True, timeout=30).stdout
    for rel in filter(None, listed.split("\0")):
        src, dst = os.path.join(ROOT, rel), os.path.join(clone_dir, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy2(src, dst)
        elif os.path.lexists(dst) and not os.path.lexists(src):
            os.remove(dst)


@pytest.fixture(scope="module")
def clone() -> Iterator[Clone]:
    """Section 2: `git clone`, `python3 -m venv .venv && .venv/bin/pip install ...`."""
    base = tempfile.mkdtemp(prefix="pyqmgr-first-day-", dir=HOME)
    assert os.stat(base).st_mode & 0o777 == 0o700
    try:
        lines = readme_block("### 2. Get it and check")
        clone_line, venv_line = lines[0], lines[1]
        assert clone_line.startswith("git clone <this repository> /opt/pyqmgr"), clone_line
        target = os.path.join(base, "pyqmgr")
        env = _clean_env()
        made = subprocess.run(["git", "clone", "-q", ROOT, target], env=env, text=True,
                              capture_output=True, timeout=COMMAND_TIMEOUT, check=False)
        assert made.returncode == 0, made.stderr
        _lay_over_working_tree(target)
        c = Clone(base, target, env)
        installed = c.sh(venv_line, timeout=INSTALL_TIMEOUT)
        assert installed.returncode == 0, f"{venv_line}:\n{installed.stderr[-3000:]}"
        yield c
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_readme_first_day_every_feature_from_a_0700_checkout(clone: Clone, tmp_path) -> None:
    man_dir = str(tmp_path / "man")
    with dns.DnsServer(["test"], RECORDS) as server, \
            SinkServer(latency=0.05, client_limit=5) as site, \
            SinkServer(latency=lambda rcpt: 30.0 if SLOW in rcpt else 0.0) as slow, \
            RedisServer() as redis, Postfwd(["id=R1; action=dunno"]) as postfwd:
        dead_port = free_port()
        metrics_port = free_port()
        pf = PostfixInstance(
            qmgr="stock",
            transports={**{d: f"smtp:{d}:{site.port}" for d in DOMAINS},
                        SLOW: f"smtp:[127.0.0.1]:{slow.port}",
                        DEAD: f"smtp:[127.0.0.1]:{dead_port}"},
            main_cf={"smtp_host_lookup": "dns", "smtp_connection_cache_on_demand": "no",
                     "minimal_backoff_time": "3600s", "maximal_backoff_time": "3600s",
                     "import_environment": "MAIL_CONFIG MAIL_DEBUG MAIL_LOGTAG TZ LANG=C "
                                           "POSTLOG_SERVICE POSTLOG_HOSTNAME "
                                           "PYQMGR_IMPORT_AUDIT=1"})
        with pf:
            pf.start(prefix=server.start_prefix())
            master_cf = open(os.path.join(pf.config_dir, "master.cf"), "rb").read()
            _walk(clone, pf, man_dir, site, slow, redis, postfwd, metrics_port)
            assert open(os.path.join(pf.config_dir, "master.cf"), "rb").read() == master_cf, \
                "uninstall left master.cf as it was before install, byte for byte"


def _walk(clone: Clone, pf: PostfixInstance, man_dir: str, site: SinkServer,
          slow: SinkServer, redis: RedisServer, postfwd: Postfwd, metrics_port: int) -> None:
    etc = pf.config_dir
    # Section 2's last line: check, before anything is set.
    (check_line,) = [ln for ln in readme_block("### 2. Get it and check") if " check " in ln]
    checked = clone.sh(check_line.replace("/etc/postfix", etc))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "ok: no problems found" in checked.stdout

    # Every feature, as docs/ show each one; then check again.
    pf.write_pyqmgr_cf({
        "site_grouping": "mx", "site_concurrency_limit": "5",
        "message_classes": "transactional bulk",
        "message_class_maps": "inline:{ alerts@test.example=transactional }",
        "tenant_key": "sender_domain",
        "metrics_listen": f"127.0.0.1:{metrics_port}",
        "shared_state": redis.url, "smtp_fleet_destination_concurrency_limit": "20",
        "delivery_policy_service": postfwd.endpoint,
    })
    checked = clone.run("check", "--config-dir", etc)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    # Section 4: install.
    (install_line,) = readme_block("### 4. Install")
    installed = clone.sh(install_line.replace("/etc/postfix", etc) + f" --man-dir {man_dir}")
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert "reloaded" in installed.stdout
    launcher = pf.postconf("-Mf", "qmgr/unix").split()[-1]
    assert launcher.startswith("pyqmgr/") and launcher.endswith("/qmgr"), launcher
    with open(os.path.join(pf.daemon_dir, launcher)) as f:
        assert f.readline().startswith(f"#!{clone.dir}/.venv/bin/python"), "the clone's venv"

    # Section 5: verify, with mail of every kind.
    pf.smtp_send([("alerts@test.example" if i % 4 == 0 else f"news@t{i % 3}.example",
                  [f"r{i}@{DOMAINS[i % len(DOMAINS)]}"]) for i in range(60)])
    (slow_id,) = pf.smtp_send([("s@test.example", [f"a@{SLOW}"])])
    dead_id, held_id = pf.smtp_send([("s@test.example", [f"b@{DEAD}"]),
                                     ("s@test.example", [f"c@{DEAD}"])])
    pf.wait_until(lambda: site.delivered_count() >= 60, 60, "60 messages at the site's sink")
    for qid in (dead_id, held_id):
        pf.maillog.wait_for(lambda ln, q=qid: ln.queue_id == q and "status=deferred" in ln.text,
                            30, what=f"{qid} deferred")
    pf.wait_until(lambda: slow.snapshot().sessions >= 1, 20, "the slow delivery under way")
    # An admin holds a deferred message (its retry is an hour away: it stays put).
    pf.postsuper("-h", held_id)
    pf.wait_until(lambda: held_id in pf.queue_files("hold"), 20, f"{held_id} in hold/")

    st = site.snapshot()
    assert st.rejected_421 == 0 and st.max_concurrent <= 5, (st.rejected_421, st.max_concurrent)
    lines = [ln.text for ln in pf.maillog.lines() if ln.program.endswith("/qmgr")]
    assert not [t for t in lines if "MX lookup failed" in t]
    assert not [t for t in lines if "after dropping privileges" in t], \
        [t for t in lines if "after dropping privileges" in t]
    assert not [t for t in lines if t.startswith(("fatal:", "panic:"))]

    # Section 6: observe.
    (status_line, top_line, explain_line) = readme_block("### 6. Observe")
    status = clone.sh(status_line.replace(".venv/bin/pyqmgr status",
                                          f".venv/bin/pyqmgr status --config-dir {etc}"))
    assert status.returncode == 0, status.stderr
    assert "smtp" in status.stdout and "qmgr memory" in status.stdout
    reply = json.loads(clone.run("status", "--json", "--config-dir", etc).stdout)
    smtp = next(t for t in reply["transports"] if t["name"] == "smtp")
    assert smtp["delivery_policy"]["connections"] >= 1, "postfwd was asked"
    top = clone.run("top", "-n", "1", "--config-dir", etc)
    assert top.returncode == 0 and "TRANSPORT" in top.stdout, top.stdout + top.stderr

    explained = {qid: clone.run("explain", qid, "--config-dir", etc)
                 for qid in (slow_id, dead_id, held_id)}
    for qid, proc in explained.items():
        assert proc.returncode == 0, f"explain {qid}: {proc.stdout}{proc.stderr}"
        print(f"\n$ pyqmgr explain {qid}\n{proc.stdout}")
    assert "active" in explained[slow_id].stdout
    assert "deferred" in explained[dead_id].stdout
    assert "Connection refused" in explained[dead_id].stdout, explained[dead_id].stdout
    assert "held" in explained[held_id].stdout or "hold" in explained[held_id].stdout

    # Metrics, scraped as Prometheus would.
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        scrape = r.read().decode()
    assert "pyqmgr_deliveries_total" in scrape and "pyqmgr_fleet_" in scrape

    # Nothing late, after all of that either.
    time.sleep(1)
    late = [ln.text for ln in pf.maillog.lines()
            if ln.program.endswith("/qmgr") and "after dropping privileges" in ln.text]
    assert not late, late

    # Section 7: roll back.
    (uninstall_line,) = readme_block("### 7. Roll back")
    removed = clone.sh(uninstall_line.replace("/etc/postfix", etc) + f" --man-dir {man_dir}")
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert pf.postconf("-Mf", "qmgr/unix").split()[-1] == "qmgr"


def test_the_shipped_sites_comparison_from_the_0700_checkout(clone: Clone, tmp_path) -> None:
    """Section 3's `pyqmgr compare`, with the shipped sites workload: from /root the
    sites' lookups failed and pyqmgr deferred 85% (stock 87.5%), the report silent."""
    out = str(tmp_path / "report")
    proc = clone.run("compare", "compat/workloads/sites-one-server.toml", "--out", out,
                     timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(os.path.join(out, "report.json")) as f:
        report = json.load(f)
    ours, stock = report["runs"]["pyqmgr"], report["runs"]["stock"]
    print(f"\nsites from a 0700 checkout: pyqmgr deferred {ours['deferral_rate']:.1%}, "
          f"stock {stock['deferral_rate']:.1%}")
    assert ours["sent"] == ours["recipients"] == 200
    assert ours["deferral_rate"] < 0.01, ours["deferral_rate"]
    assert stock["deferral_rate"] > 0.2, "the control: stock meets the 421s"
    lookups_failed = [ln for ln in open(os.path.join(out, ours["run_dir"], "maillog"),
                                        errors="replace") if "MX lookup failed" in ln]
    assert not lookups_failed, lookups_failed[:3]
