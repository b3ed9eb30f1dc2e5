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
import sys
from collections.abc import Sequence
from pathlib import Path

from docs_tools.browser import NO_BROWSER, Browser, Serve, build_site, find_browser

ROOT = Path(__file__).resolve().parent.parent


def pages(site: Path) -> list[str]:
    """Every page of the built site, as a path relative to its root ('' for the home page)."""
    out = []
    for index in sorted(site.rglob("index.html")):
        rel = index.parent.relative_to(site).as_posix()
        if rel == "." or not rel.startswith(("assets", "search")):
            out.append("" if rel == "." else rel + "/")
    return out


def problems(browser: Browser) -> list[str]:
    """What :data:`_PROBLEMS_JS` finds on the page loaded last."""
    return [str(x) for x in browser.evaluate(_PROBLEMS_JS) or []]


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
    if browser_bin is None:
        raise SystemExit(NO_BROWSER)
    site = args.out / "site"
    build_site(site)
    chosen = [pg for pg in pages(site) if not args.page or any(s in pg for s in args.page)]
    server, browser = Serve(site), Browser(browser_bin, args.out / ".profile")
    try:
        for page in chosen:
            name = (page.strip("/").replace("/", "_") or "index") + ".png"
            browser.open(server.url + page, args.width)
            w, h = browser.screenshot(args.out / name)
            print(f"{args.out / name}  {w}x{h}")
            for problem in problems(browser):
                print(f"  {problem}")
    finally:
        browser.close()
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
