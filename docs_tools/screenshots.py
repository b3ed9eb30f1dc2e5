"""Build the docs site and save a full-page screenshot of every page in headless Chromium.

``python -m docs_tools.screenshots [--out out/screenshots] [--width 1280] [--page blocks]``

Not part of CI: it needs a browser. If ``chromium`` is not on the PATH and the
script runs as root on Debian or Ubuntu, it installs Debian's ``chromium``
package with apt-get; otherwise it says what to install. The site is built
with ``mkdocs build --strict`` into ``OUT/site``, served on a local port, and
each page is captured at ``--width`` CSS pixels and its full height, through
the browser's DevTools protocol over a pipe (no extra Python package). Look at
the PNGs: clipped code lines, escaped characters and illegible figures show
there and in no test.
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
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_browser(install: bool) -> str:
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
    raise SystemExit(
        "no Chromium found: install it (Debian/Ubuntu: apt-get install chromium) "
        "or rerun as root to let this script install it"
    )


def build_site(site: Path) -> None:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or "mkdocs"
    env = os.environ | {"PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    subprocess.run(
        [mkdocs, "build", "--strict", "--quiet", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        check=True,
    )


def pages(site: Path) -> list[str]:
    """Every page of the built site, as a path relative to its root ('' for the home page)."""
    out = []
    for index in sorted(site.rglob("index.html")):
        rel = index.parent.relative_to(site).as_posix()
        if rel == "." or not rel.startswith(("assets", "search")):
            out.append("" if rel == "." else rel + "/")
    return out


class _Serve:
    """A static file server for ``site`` on a free local port, in a daemon thread."""

    def __init__(self, site: Path) -> None:
        handler = functools.partial(_QuietHandler, directory=str(site))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Browser:
    """Headless Chromium driven through ``--remote-debugging-pipe`` (fds 3 and 4)."""

    def __init__(self, binary: str, profile: Path) -> None:
        # The browser reads commands on fd 3 and writes replies on fd 4. Our ends are
        # moved above 10 first, so that placing them on 3 and 4 cannot clobber each other.
        to_browser_r, to_browser_w = os.pipe()
        from_browser_r, from_browser_w = os.pipe()
        child_r = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10)
        child_w = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10)
        for fd in (to_browser_r, from_browser_w):
            os.close(fd)
        args = [
            binary,
            "--headless=new",
            "--remote-debugging-pipe",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
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
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        self.call("Page.enable", session=True)

    def call(self, method: str, *, session: bool = False, **params: Any) -> dict[str, Any]:
        """Send one command and wait for its reply (events in between are dropped)."""
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        self._out.write(json.dumps(msg).encode() + b"\0")
        self._out.flush()
        while True:
            reply = self._read()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result

    def wait_event(self, method: str) -> None:
        while self._read().get("method") != method:
            pass

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            chunk = os.read(self._in, 1 << 16)
            if not chunk:
                raise RuntimeError("the browser closed its pipe")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        message: dict[str, Any] = json.loads(raw)
        return message

    def screenshot(self, url: str, width: int, path: Path) -> tuple[int, int]:
        """Load ``url`` at ``width`` CSS pixels and save the whole page as a PNG."""
        self.call(
            "Emulation.setDeviceMetricsOverride",
            session=True,
            width=width,
            height=900,
            deviceScaleFactor=1,
            mobile=False,
        )
        self.call("Page.navigate", session=True, url=url)
        self.wait_event("Page.loadEventFired")
        height = self.call(
            "Runtime.evaluate",
            session=True,
            expression="document.documentElement.scrollHeight",
            returnByValue=True,
        )["result"]["value"]
        shot = self.call(
            "Page.captureScreenshot",
            session=True,
            format="png",
            captureBeyondViewport=True,
            clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1},
        )
        path.write_bytes(base64.b64decode(shot["data"]))
        return width, int(height)

    def problems(self) -> list[str]:
        """What :data:`_PROBLEMS_JS` finds on the page loaded last."""
        found = self.call(
            "Runtime.evaluate", session=True, expression=_PROBLEMS_JS, returnByValue=True
        )["result"].get("value", [])
        return [str(x) for x in found]

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, OSError):
            self.call("Browser.close")
        self.proc.wait(timeout=30)
        self._out.close()
        os.close(self._in)


_PROBLEMS_JS = r"""
(() => {
  const out = [];
  for (const code of document.querySelectorAll("pre > code")) {
    if (code.scrollWidth > code.clientWidth + 1) {
      const lines = code.innerText.split("\n");
      const longest = lines.reduce((a, b) => (b.length > a.length ? b : a), "");
      out.push(`clipped code (${longest.length} chars, ${code.clientWidth}px shown): ` +
               longest.trim().slice(0, 70));
    }
  }
  const text = document.querySelector("article").innerText;
  for (const literal of ["<BLANKLINE>", "\\|"]) {
    if (text.includes(literal)) out.push(`literal ${literal} in the page text`);
  }
  for (const img of document.querySelectorAll("article img")) {
    if (img.naturalWidth && img.clientWidth < 0.75 * img.naturalWidth) {
      out.push(`figure shrunk to ${Math.round(100 * img.clientWidth / img.naturalWidth)}%: ` +
               img.getAttribute("src"));
    }
  }
  return out;
})()
"""
"""What the eye would catch, found in the rendered page: code wider than its block,
a literal ``<BLANKLINE>`` or ``\\|``, and figures drawn at under 3/4 of their size."""


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m docs_tools.screenshots", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", type=Path, default=ROOT / "out" / "screenshots")
    p.add_argument("--width", type=int, default=1280, help="viewport width, CSS pixels")
    p.add_argument("--page", action="append", help="only pages whose path contains this")
    p.add_argument("--no-install", action="store_true", help="never apt-get install chromium")
    args = p.parse_args(argv)
    if args.width < 320:
        p.error(f"argument --width: must be at least 320, got {args.width}")
    browser_bin = find_browser(install=not args.no_install)
    site = args.out / "site"
    build_site(site)
    chosen = [pg for pg in pages(site) if not args.page or any(s in pg for s in args.page)]
    server, browser = _Serve(site), _Browser(browser_bin, args.out / ".profile")
    try:
        for page in chosen:
            name = (page.strip("/").replace("/", "_") or "index") + ".png"
            w, h = browser.screenshot(server.url + page, args.width, args.out / name)
            print(f"{args.out / name}  {w}x{h}")
            for problem in browser.problems():
                print(f"  {problem}")
    finally:
        browser.close()
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
