"""A headless Chromium driven through chromedriver's W3C WebDriver HTTP API, with the
standard library only (urllib): open a page, run JavaScript in it, move the pointer onto
an element, read the browser console, take a full-page screenshot.

Needs the Debian packages `chromium` and `chromium-driver` (`make test` installs them
when missing: `make system-packages`). `missing()` says what is absent.
"""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage"]
ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # W3C key of an element reference


def missing() -> list[str]:
    return [p for p in (CHROMIUM, CHROMEDRIVER) if shutil.which(p) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WebDriverError(RuntimeError):
    pass


class Browser:
    """with Browser(profile_dir) as b: b.open(url); b.run("return 1")"""

    def __init__(self, profile_dir: Path, width: int = 1400, height: int = 1000, timeout: float = 30.0):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.timeout = timeout
        self.log_path = Path(profile_dir) / "chromedriver.log"
        Path(profile_dir).mkdir(parents=True, exist_ok=True)
        self._driver = subprocess.Popen(
            [CHROMEDRIVER, f"--port={self.port}", f"--log-path={self.log_path}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.session = None
        try:
            self._wait_ready()
            caps = {"browserName": "chrome",
                    "goog:chromeOptions": {"binary": CHROMIUM, "args": FLAGS + [
                        f"--user-data-dir={Path(profile_dir) / 'profile'}",
                        f"--window-size={width},{height}"]},
                    "goog:loggingPrefs": {"browser": "ALL"}}
            value = self._call("POST", "/session", {"capabilities": {"alwaysMatch": caps}})
            self.session = value["sessionId"]
        except BaseException:
            self.close()
            raise

    # ---- plumbing ----------------------------------------------------------------------
    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self._driver.poll() is not None:
                raise WebDriverError(f"chromedriver exited with {self._driver.returncode}; see {self.log_path}")
            try:
                if self._call("GET", "/status").get("ready"):
                    return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.1)
        raise WebDriverError(f"chromedriver not ready after {self.timeout}s; see {self.log_path}")

    def _call(self, method: str, path: str, body: dict | None = None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read() or b"{}").get("value")
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            raise WebDriverError(f"{method} {path}: HTTP {e.code}: {detail[:2000]}") from e

    def _session(self, method: str, path: str, body: dict | None = None):
        return self._call(method, f"/session/{self.session}{path}", body)

    # ---- what tests use ------------------------------------------------------------------
    def open(self, url: str) -> None:
        self._session("POST", "/url", {"url": url})

    def run(self, script: str, *args):
        """Run `script` (a function body; `arguments` holds args) and return its result."""
        return self._session("POST", "/execute/sync", {"script": script, "args": list(args)})

    def hover(self, element: dict) -> None:
        """Move the pointer to the centre of `element` (a reference returned by run())."""
        self._session("POST", "/actions", {"actions": [{
            "type": "pointer", "id": "mouse", "parameters": {"pointerType": "mouse"},
            "actions": [{"type": "pointerMove", "duration": 0, "origin": element, "x": 0, "y": 0}]}]})

    def click(self, element: dict) -> None:
        self._session("POST", f"/element/{element[ELEMENT]}/click", {})

    def console(self) -> list[dict]:
        """Browser console entries since the last call: {"level", "message", "timestamp"}."""
        return self._session("POST", "/se/log", {"type": "browser"})

    def screenshot(self, path: Path) -> Path:
        """The whole page (beyond the viewport) as a PNG."""
        size = self.run("return [document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
        shot = self._session("POST", "/goog/cdp/execute", {
            "cmd": "Page.captureScreenshot",
            "params": {"format": "png", "captureBeyondViewport": True,
                       "clip": {"x": 0, "y": 0, "width": size[0], "height": size[1], "scale": 1}}})
        Path(path).write_bytes(base64.b64decode(shot["data"]))
        return Path(path)

    def close(self) -> None:
        if self.session is not None:
            try:
                self._call("DELETE", f"/session/{self.session}")
            except (WebDriverError, urllib.error.URLError, ConnectionError):
                pass
            self.session = None
        if self._driver.poll() is None:
            self._driver.terminate()
            try:
                self._driver.wait(10)
            except subprocess.TimeoutExpired:
                self._driver.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
