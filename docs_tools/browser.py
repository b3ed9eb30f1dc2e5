"""Headless Chromium for the docs: find (or install) it, build and serve the site, drive a page.

``python -m docs_tools.browser [--install]`` prints the Chromium it finds; with
``--install`` it first installs Debian's ``chromium`` package with apt-get when
none is found and it runs as root (``make test`` does this: the sandbox page's
test needs a browser). The browser is driven through its DevTools protocol over
a pipe (``--remote-debugging-pipe``), so no Python package and no port is needed;
every read of the pipe has a deadline, so a hung page fails a test instead of
hanging it. Every request a page and its workers make is recorded, and none
reaches another machine (a local proxy refuses them all). Used by
``docs_tools.screenshots`` and ``docs_tools.sandbox_check``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import functools
import http.server
import json
import os
import select
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

# Headless, and quiet on a machine with no network but the package registries: no
# background connections, no component or sync updates, no QUIC (each would be refused
# and retried), no GPU, no sandbox (the tests may run as root), and shared memory in
# files rather than a /dev/shm that a container may keep small.
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def find_browser(install: bool) -> str | None:
    """The first Chromium on the PATH; installs Debian's package as root when allowed."""
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    if install and shutil.which("apt-get") and os.geteuid() == 0:
        print("installing chromium with apt-get ...", file=sys.stderr)
        env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], check=True, env=env)
        return find_browser(install=False)
    return None


NO_BROWSER = (
    "no Chromium found: install it (Debian/Ubuntu: apt-get install chromium), "
    "or run `python -m docs_tools.browser --install` as root"
)


def build_site(site: Path) -> None:
    """``mkdocs build --strict`` into ``site`` (the sandbox hook included)."""
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or "mkdocs"
    env = os.environ | {"PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    subprocess.run(
        [mkdocs, "build", "--strict", "--quiet", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        check=True,
    )


class Serve:
    """A static file server for ``site`` on a free local port, in a daemon thread.

    ``requested`` lists the paths asked for, in order (a test can see where a page's
    files came from).
    """

    def __init__(self, site: Path) -> None:
        self.requested: list[str] = []
        handler = functools.partial(_QuietHandler, directory=str(site), seen=self.requested)
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def __init__(self, *args: Any, seen: list[str], **kwargs: Any) -> None:
        self._seen = seen  # before the base class, which handles the request at once
        super().__init__(*args, **kwargs)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        self._seen.append(self.path)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Refuse:
    """A proxy on a free local port that answers every request with 403, and notes it.

    The browser sends every request for another machine here (``--proxy-server``;
    loopback addresses bypass a proxy), so such a request fails at once instead of
    waiting on a network that may drop it, and the driven pages see the same thing on
    any machine. ``refused`` lists them (``CONNECT host:443`` for HTTPS): a page's, and
    the browser's own background ones too, so a test asks :meth:`Browser.requests`
    what a page fetched.
    """

    def __init__(self) -> None:
        self.refused: list[str] = []
        handler = functools.partial(_RefusingHandler, seen=self.refused)
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.address = f"127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _RefusingHandler(http.server.BaseHTTPRequestHandler):
    def __init__(self, *args: Any, seen: list[str], **kwargs: Any) -> None:
        self._seen = seen  # before the base class, which handles the request at once
        super().__init__(*args, **kwargs)

    def _refuse(self) -> None:
        self._seen.append(f"{self.command} {self.path}")
        self.send_error(403, "refused: the docs fetch nothing from outside the machine")

    do_GET = do_POST = do_HEAD = do_CONNECT = do_OPTIONS = _refuse

    def log_message(self, format: str, *args: Any) -> None:
        pass


class BrowserError(RuntimeError):
    """The browser answered a command with an error, closed its pipe, or took too long."""


class Browser:
    """Headless Chromium driven through ``--remote-debugging-pipe`` (fds 3 and 4), one tab."""

    def __init__(self, binary: str, profile: Path, *, timeout: float = 60.0) -> None:
        # The browser reads commands on fd 3 and writes replies on fd 4. Our ends are
        # moved above 10 first, so that placing them on 3 and 4 cannot clobber each other.
        self.timeout = timeout
        self.proxy = Refuse()
        to_browser_r, to_browser_w = os.pipe()
        from_browser_r, from_browser_w = os.pipe()
        child_r = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10)
        child_w = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10)
        for fd in (to_browser_r, from_browser_w):
            os.close(fd)
        args = [
            binary,
            *FLAGS,
            "--proxy-server=http://" + self.proxy.address,
            "--remote-debugging-pipe",
            "--user-data-dir=" + str(profile),
            "about:blank",
        ]

        def fds() -> None:
            os.dup2(child_r, 3)
            os.dup2(child_w, 4)

        self.proc = subprocess.Popen(
            args,
            preexec_fn=fds,
            pass_fds=(3, 4),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(child_r)
        os.close(child_w)
        self._out: IO[bytes] = os.fdopen(to_browser_w, "wb")
        self._in = from_browser_r
        self._next_id = 0
        self._buffer = b""
        self.events: list[dict[str, Any]] = []  # events read while waiting for replies
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        self.call("Page.enable", session=True)
        self.call("Runtime.enable", session=True)
        self.call("Network.enable", session=True)  # every request the page makes: requests()
        # and its workers' (the search index, Python): each waits to start until it is watched
        self.call(
            "Target.setAutoAttach",
            session=True,
            autoAttach=True,
            waitForDebuggerOnStart=True,
            flatten=True,
        )

    def call(
        self, method: str, *, session: bool = False, timeout: float | None = None, **params: Any
    ) -> dict[str, Any]:
        """Send one command and wait for its reply; events in between are kept in ``events``."""
        sent = self._send(method, self.session if session else None, params)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            reply = self._read(deadline, method)
            if reply.get("id") == sent:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result
            if "method" in reply:
                self.events.append(reply)

    def wait_event(self, method: str, timeout: float | None = None) -> dict[str, Any]:
        """The next event named ``method`` (earlier ones kept in ``events`` are skipped)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            event = self._read(deadline, method)
            if event.get("method") == method:
                return event
            if "method" in event:
                self.events.append(event)

    def _send(self, method: str, session: str | None, params: dict[str, Any]) -> int:
        """Write one command to the browser; its id, which its reply will carry."""
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session is not None:
            msg["sessionId"] = session
        self._out.write(json.dumps(msg).encode() + b"\0")
        self._out.flush()
        return self._next_id

    def _watch_worker(self, event: dict[str, Any]) -> None:
        """A worker the page started waits, paused, until its requests are watched too.

        Its replies are not awaited: they arrive among the events, and ``call`` skips them.
        """
        session = event["params"]["sessionId"]
        self._send("Network.enable", session, {})
        self._send("Runtime.runIfWaitingForDebugger", session, {})

    def _read(self, deadline: float, waiting_for: str) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise BrowserError(f"no answer to {waiting_for} in time")
            chunk = os.read(self._in, 1 << 16)
            if not chunk:
                raise BrowserError("the browser closed its pipe")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        message: dict[str, Any] = json.loads(raw)
        if message.get("method") == "Target.attachedToTarget":
            self._watch_worker(message)
        return message

    def open(self, url: str, width: int, height: int = 900) -> None:
        """Load ``url`` in a ``width`` x ``height`` CSS-pixel viewport; return once it loaded."""
        self.call(
            "Emulation.setDeviceMetricsOverride",
            session=True,
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        self.events.clear()
        self.call("Page.navigate", session=True, url=url)
        self.wait_event("Page.loadEventFired")

    def evaluate(self, expression: str, *, timeout: float | None = None) -> Any:
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        reply = self.call(
            "Runtime.evaluate",
            session=True,
            timeout=timeout,
            expression=expression,
            awaitPromise=True,
            returnByValue=True,
        )
        if "exceptionDetails" in reply:
            details = reply["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise BrowserError(f"the page threw: {text}")
        return reply["result"].get("value")

    def screenshot(self, path: Path, clip: dict[str, float] | None = None) -> tuple[int, int]:
        """Save the page (all of it, or the ``clip`` rectangle in page pixels) as a PNG."""
        if clip is None:
            width, height = self.evaluate(
                "[document.documentElement.clientWidth, document.documentElement.scrollHeight]"
            )
            clip = {"x": 0, "y": 0, "width": width, "height": height}
        shot = self.call(
            "Page.captureScreenshot",
            session=True,
            format="png",
            captureBeyondViewport=True,
            clip=clip | {"scale": 1},
        )
        # imported here: the sandbox's cells and tests read this module where numpy is absent
        from conformance.output_files import write_output

        write_output(path, base64.b64decode(shot["data"]))  # the one rule for an output path
        return int(clip["width"]), int(clip["height"])

    def refused(self) -> list[str]:
        """Every request for another machine, from the page, its workers or the browser."""
        return list(self.proxy.refused)

    def requests(self) -> list[str]:
        """The URL of every request the page has made since it was opened, in order."""
        return [
            str(event["params"]["request"]["url"])
            for event in self.events
            if event.get("method") == "Network.requestWillBeSent"
        ]

    def console_errors(self) -> list[str]:
        """Uncaught exceptions and ``console.error`` lines seen so far on the page."""
        out = []
        for event in self.events:
            if event.get("method") == "Runtime.exceptionThrown":
                details = event["params"]["exceptionDetails"]
                out.append(details.get("exception", {}).get("description") or details["text"])
            elif event.get("method") == "Runtime.consoleAPICalled" and (
                event["params"]["type"] == "error"
            ):
                args = event["params"]["args"]
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in args))
        return out

    def close(self) -> None:
        with contextlib.suppress(BrowserError, OSError):
            self.call("Browser.close", timeout=10)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
        os.close(self._in)
        self.proxy.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m docs_tools.browser", description=__doc__.split("\n")[0]
    )
    p.add_argument("--install", action="store_true", help="apt-get install chromium if absent")
    args = p.parse_args(argv)
    path = find_browser(install=args.install)
    print(path or NO_BROWSER)
    return 0


if __name__ == "__main__":
    sys.exit(main())
