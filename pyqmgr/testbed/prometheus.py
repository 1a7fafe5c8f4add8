"""A throwaway Prometheus server on loopback, for tests and the drain benchmark.

Tests of the metrics exporter are only worth something against the real consumer:
Debian's ``prometheus`` scrapes pyqmgr exactly as it would in production, and its HTTP
query API answers PromQL, so a test checks what an admin's dashboard would show, and
that every expression of the Grafana dashboard in contrib/ still runs.

The server gets a config file, a TSDB directory and a log file of its own in a temp
directory, listens on 127.0.0.1 only, and is always stopped: :meth:`stop` (also the
context manager's exit) sends SIGTERM to its process group, then SIGKILL, and removes
the directory. Every wait is bounded and its error says what was awaited, with the
server's log tail.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from pyqmgr.testbed.instance_base import TestbedError, file_tail, free_port, wait_until

PROMETHEUS = "/usr/bin/prometheus"


def available() -> bool:
    return os.access(PROMETHEUS, os.X_OK)


class PrometheusServer:
    """``/usr/bin/prometheus`` scraping ``targets`` (``host:port``) every ``interval`` s."""

    __test__ = False

    def __init__(self, targets: Sequence[str], interval: float = 1.0,
                 job: str = "pyqmgr") -> None:
        self.targets = list(targets)
        self.interval = interval
        self.job = job
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="pyqmgr-prom-")
        self.log_path = os.path.join(self.dir, "prometheus.log")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _config(self) -> str:
        seconds = f"{self.interval:g}s"
        targets = ", ".join(f"'{t}'" for t in self.targets)
        return (f"global:\n  scrape_interval: {seconds}\n  scrape_timeout: {seconds}\n"
                f"  evaluation_interval: {seconds}\n"
                f"scrape_configs:\n  - job_name: {self.job}\n    static_configs:\n"
                f"      - targets: [{targets}]\n")

    def start(self, timeout: float = 60) -> PrometheusServer:
        config = os.path.join(self.dir, "prometheus.yml")
        with open(config, "w") as f:
            f.write(self._config())
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}",
                 f"--storage.tsdb.path={os.path.join(self.dir, 'data')}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.dir, start_new_session=True)
        try:
            self.wait(self._ready, timeout, "prometheus to be ready")
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise TestbedError(f"prometheus exited ({self.proc.returncode}):\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def log_tail(self, n: int = 20) -> str:
        return file_tail(self.log_path, n)

    def wait(self, predicate: Callable[[], bool], timeout: float, what: str,
             interval: float = 0.25, detail: Callable[[], str] | None = None) -> None:
        """:func:`wait_until` whose error ends with ``detail`` and Prometheus's log tail,
        so a scrape that never came says why."""

        def extra() -> str:
            text = ""
            if detail is not None:
                try:
                    text = f"; {detail()}"
                except Exception as exc:  # the timeout must not be hidden
                    text = f"; (no detail: {exc})"
            return f"{text}; prometheus log:\n{self.log_tail()}"

        wait_until(predicate, timeout, what, interval, detail=extra)

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/PATH; the ``data`` member, or TestbedError with Prometheus's error."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                reply = json.load(r)
        except urllib.error.HTTPError as exc:
            reply = json.load(exc)
        if reply.get("status") != "success":
            raise TestbedError(f"prometheus {path} {params}: {reply.get('errorType')}: "
                               f"{reply.get('error')}")
        return reply["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (each item has ``metric`` and ``value``)."""
        data = self.api("query", query=expr)
        if data["resultType"] != "vector":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def targets_up(self) -> bool:
        """Every target scraped at least once, and the last scrape succeeded."""
        active = self.api("targets")["activeTargets"]
        return len(active) == len(self.targets) and all(t["health"] == "up" for t in active)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        try:
            if proc is not None and proc.poll() is None:
                for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        break
                    try:
                        proc.wait(wait)
                        break
                    except subprocess.TimeoutExpired:
                        continue
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
