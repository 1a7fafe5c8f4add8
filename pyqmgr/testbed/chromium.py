"""Open a page in Debian's headless Chromium and report what a user's browser would show.

The page is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
JSON messages ended by a NUL byte on file descriptors 3 and 4), not by reading
Chromium's log output: every console call, uncaught exception, browser log entry
(a resource that failed to load, a blocked request) and network request arrives as a
protocol event, so "no console errors" and "nothing fetched" are checked from the
source rather than from log formats that change between versions. No port is opened.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

#: Flags for a quiet, offline, throwaway browser (no first-run, sync, updates, QUIC).
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--mute-audio", "--hide-scrollbars")


class ChromiumError(RuntimeError):
    """Chromium is missing, did not start, or did not answer in time."""


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclass
class PageReport:
    """What happened while the page loaded."""

    #: (type, text) of every console call: ("error", "boom"), ("log", ...).
    console: list[tuple[str, str]] = field(default_factory=list)
    #: Uncaught exceptions' descriptions.
    exceptions: list[str] = field(default_factory=list)
    #: (level, text) of browser log entries (failed loads, violations...).
    log: list[tuple[str, str]] = field(default_factory=list)
    #: URL of every request the page made (the page itself included).
    requests: list[str] = field(default_factory=list)
    #: The screenshot, if one was asked for.
    screenshot: bytes = b""
    title: str = ""
    #: What the ``evaluate`` expression returned (JSON-able), once the page loaded.
    evaluated: Any = None

    def fetched(self, page: str) -> list[str]:
        """Requests beyond the page itself and its inline data: URLs."""
        return [u for u in self.requests if u != page and not u.startswith("data:")]

    def errors(self) -> list[str]:
        """Everything a developer console would show as an error or warning."""
        out = [f"console.{t}: {text}" for t, text in self.console
               if t in ("error", "warning", "assert")]
        out += [f"exception: {e}" for e in self.exceptions]
        out += [f"log {lv}: {text}" for lv, text in self.log if lv in ("error", "warning")]
        return out


class _Pipe:
    def __init__(self, proc: subprocess.Popen[bytes], to_chrome: int, from_chrome: int) -> None:
        self.proc = proc
        self.wfd = to_chrome
        self.rfd = from_chrome
        self.buf = b""
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def send(self, method: str, params: dict[str, Any] | None = None,
             session: str | None = None, timeout: float = 30) -> dict[str, Any]:
        self.next_id += 1
        msg: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.wfd, json.dumps(msg).encode() + b"\0")
        want = self.next_id
        deadline = time.monotonic() + timeout
        while True:
            reply = None
            # Keep every other message of the read, those after the reply too: a page
            # that loads at once has its load event in the navigation reply's read (seen
            # under load in CI: the event was dropped and the wait for it timed out).
            for m in self._read(deadline):
                if m.get("id") == want and reply is None:
                    reply = m
                else:
                    self.events.append(m)
            if reply is not None:
                if "error" in reply:
                    raise ChromiumError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))

    def wait_event(self, method: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for m in self.events[seen:]:
                if m.get("method") == method:
                    return m
            seen = len(self.events)
            self.events.extend(self._read(deadline))

    def drain(self, seconds: float) -> None:
        """Collect events for a while (late console messages)."""
        deadline = time.monotonic() + seconds
        try:
            while True:
                self.events.extend(self._read(deadline))
        except ChromiumError:
            pass

    def _read(self, deadline: float) -> list[dict[str, Any]]:
        while b"\0" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChromiumError("no answer from chromium in time")
            ready, _, _ = select.select([self.rfd], [], [], left)
            if not ready:
                continue
            chunk = os.read(self.rfd, 1 << 20)
            if not chunk:
                raise ChromiumError(f"chromium closed the pipe (exit {self.proc.poll()})")
            self.buf += chunk
        *msgs, self.buf = self.buf.split(b"\0")
        return [json.loads(m) for m in msgs if m]


def _collect(events: list[dict[str, Any]], report: PageReport) -> None:
    """The page's console calls, exceptions, log entries and requests, from the
    protocol's events."""
    for ev in events:
        method, params = ev.get("method"), ev.get("params", {})
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", "")))
                            for a in params.get("args", []))
            report.console.append((params.get("type", ""), text))
        elif method == "Runtime.exceptionThrown":
            det = params.get("exceptionDetails", {})
            report.exceptions.append(str(det.get("exception", {}).get("description")
                                         or det.get("text", "")))
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            report.log.append((entry.get("level", ""), entry.get("text", "")))
        elif method == "Network.requestWillBeSent":
            report.requests.append(params.get("request", {}).get("url", ""))


def open_page(url: str, screenshot: bool = True, width: int = 1280, height: int = 2000,
              timeout: float = 60, settle: float = 1.0,
              evaluate: str | None = None) -> PageReport:
    """Load ``url`` in a fresh headless Chromium; return what it saw (and a screenshot).

    The screenshot is of the whole page, up to 12,000 pixels high. ``evaluate`` is a
    JavaScript expression run in the laid-out page at that size (where elements are,
    for cropping a screenshot to them), its value in ``evaluated``.
    """
    binary = chromium_path()
    if binary is None:
        raise ChromiumError("chromium is not installed (Debian: apt-get install chromium)")
    profile = tempfile.mkdtemp(prefix="pyqmgr-chromium-")
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    # bash puts our pipe ends on 3 and 4, where --remote-debugging-pipe wants them, by
    # way of 100 and 101 in case the pipes themselves were given 3 or 4.
    cmd = (f'exec 100<&{to_r} 101>&{from_w} && exec {to_r}<&- {from_w}>&- && '
           'exec "$0" "$@" 3<&100 4>&101 100<&- 101>&-')
    proc = subprocess.Popen(
        ["/bin/bash", "-c", cmd, binary, *FLAGS, f"--user-data-dir={profile}",
         "--remote-debugging-pipe", f"--window-size={width},{height}", "about:blank"],
        pass_fds=(to_r, from_w), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    os.close(to_r)
    os.close(from_w)
    pipe = _Pipe(proc, to_w, from_r)
    report = PageReport()
    try:
        target = pipe.send("Target.createTarget", {"url": "about:blank"}, timeout=timeout)
        session = pipe.send("Target.attachToTarget", {"targetId": target["targetId"],
                                                      "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Network", "Page"):
            pipe.send(f"{domain}.enable", session=session)
        pipe.send("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            session=session)
        pipe.send("Page.navigate", {"url": url}, session=session)
        pipe.wait_event("Page.loadEventFired", timeout)
        pipe.drain(settle)
        if screenshot:
            metrics = pipe.send("Page.getLayoutMetrics", session=session)
            size = metrics.get("cssContentSize") or metrics.get("contentSize") or {}
            full = int(min(12000, max(height, size.get("height", height))))
            pipe.send("Emulation.setDeviceMetricsOverride", {
                "width": width, "height": full, "deviceScaleFactor": 1, "mobile": False},
                session=session)
            shot = pipe.send("Page.captureScreenshot", {"format": "png"}, session=session,
                             timeout=timeout)
            report.screenshot = base64.b64decode(shot["data"])
        if evaluate is not None:
            value = pipe.send("Runtime.evaluate", {"expression": evaluate,
                                                   "returnByValue": True}, session=session)
            if "exceptionDetails" in value:
                raise ChromiumError(f"evaluate: {value['exceptionDetails'].get('text')}")
            report.evaluated = value.get("result", {}).get("value")
        title = pipe.send("Runtime.evaluate", {"expression": "document.title",
                                               "returnByValue": True}, session=session)
        report.title = str(title.get("result", {}).get("value", ""))
        pipe.drain(0.2)
        _collect(pipe.events, report)
        try:
            pipe.send("Browser.close", timeout=5)
        except ChromiumError:
            pass
    finally:
        os.close(to_w)
        os.close(from_r)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(5)
        shutil.rmtree(profile, ignore_errors=True)
    return report
