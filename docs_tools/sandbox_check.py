"""Run the built sandbox page in headless Chromium, cell by cell, as a reader would.

``python -m docs_tools.sandbox_check [--screenshots DIR]``

Builds the site (``mkdocs build --strict``, the sandbox hook included), serves it
on a local port, opens the sandbox page, waits for Python to load, presses Run on
every cell (and Stop on the one that never ends), and prints what each showed.
``--screenshots DIR`` also saves pictures of cells after their run: the ones in
``docs/assets/screenshots/`` come from ``--screenshots docs/assets/screenshots``.
``tests/test_sandbox_page.py`` drives the page through :class:`SandboxPage` too.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from docs_tools.browser import NO_BROWSER, Browser, Serve, build_site, find_browser

ROOT = Path(__file__).resolve().parent.parent
CELLS = ROOT / "docs_tools" / "sandbox_cells"
PAGE = "sandbox/"
RUNAWAY = "runaway"  # the cell that never ends
SCREENSHOTS = {"grow": "sandbox-grow.png"}  # cell -> the picture of it the README shows


def cell_source(name: str) -> str:
    """A cell's code as the page shows it (the file the page includes, without its last newline)."""
    return (CELLS / f"{name}.py").read_text().rstrip("\n")


@dataclass(frozen=True)
class CellRun:
    """What a cell showed after one run."""

    name: str
    state: str  # done, error or stopped
    printed: str  # what it printed
    error: str  # the error shown under it ('' if none)
    pictures: tuple[str, ...]  # the SVG that Python drew, as text
    drawn: tuple[str, ...]  # the text of each picture as the page shows it (its <svg> elements)
    seconds: float  # from Run to the result, in the page


_CELL = 'document.querySelector(".sandbox-cell[data-cell=" + JSON.stringify({name}) + "]")'

_RUN_JS = """(async () => {{
  const cell = {cell};
  const runs = cell.dataset.runs;
  if ({code} !== null) {{
    const editor = cell.querySelector("textarea");
    editor.value = {code};
    editor.dispatchEvent(new Event("input"));  // as typing does: the colours follow
  }}
  cell.querySelector("button.sandbox-run").click();
  {wait}
}})()"""

_WAIT_JS = """const t0 = performance.now();
  while (cell.dataset.runs === runs) {{
    if (performance.now() - t0 > {ms}) throw new Error("no result: " + cell.dataset.state);
    await new Promise((r) => setTimeout(r, 25));
  }}"""

# Read after the next two frames, as a reader would: a redraw scheduled for a frame has happened.
_READ_JS = """(async () => {{
  const cell = {cell};
  const frame = () => new Promise((r) => requestAnimationFrame(r));
  await Promise.race([frame().then(frame), new Promise((r) => setTimeout(r, 500))]);
  const error = cell.querySelector(".sandbox-error");
  const printed = [...cell.querySelector(".sandbox-output").childNodes]
    .filter((n) => n.nodeType === Node.TEXT_NODE).map((n) => n.textContent).join("");
  return {{
    state: cell.dataset.state,
    printed,
    error: error ? error.textContent : "",
    pictures: cell.pictures || [],
    drawn: [...cell.querySelectorAll(".sandbox-picture svg")].map((s) => s.textContent),
    seconds: Number(cell.dataset.seconds || 0),
  }};
}})()"""


_COLOURS_JS = """(() => {{
  const code = {cell}.querySelector(".sandbox-layer pre");
  if (!code) return [];
  return [...code.childNodes].map((n) => [n.nodeType === Node.TEXT_NODE ? "" : n.className,
                                           n.textContent]);
}})()"""

_BOXES_JS = """(() => {{
  const cell = {cell};
  const props = ["font-family", "font-size", "line-height", "letter-spacing", "tab-size",
                 "padding-top", "padding-left", "border-top-width", "border-left-width",
                 "white-space"];
  const box = (el) => {{
    if (!el) return {{}};
    const s = getComputedStyle(el), r = el.getBoundingClientRect();
    const out = Object.fromEntries(props.map((p) => [p, s.getPropertyValue(p)]));
    out.left = String(r.left);  // the layer may be wider: it holds the longest line whole
    out.top = String(r.top);
    return out;
  }};
  return {{editor: box(cell.querySelector("textarea")),
           layer: box(cell.querySelector(".sandbox-layer pre"))}};
}})()"""

_SHOWN_JS = """(() => {
  let smallest = Infinity, where = "";
  for (const svg of document.querySelectorAll(".sandbox-picture svg")) {
    const scale = svg.getBoundingClientRect().width / svg.width.baseVal.value;
    for (const t of svg.querySelectorAll("text")) {
      const px = Number(t.getAttribute("font-size")) * scale;
      if (px < smallest) { smallest = px; where = t.textContent; }
    }
  }
  return {smallest, where, page: document.documentElement.scrollWidth, window: innerWidth};
})()"""


class SandboxPage:
    """The sandbox page open in a browser tab."""

    def __init__(self, browser: Browser, server: Serve, site: Path, width: int = 1100) -> None:
        self.browser, self.server, self.site = browser, server, site
        self.reopen(width)

    def reopen(self, width: int) -> None:
        """Load the page afresh in a ``width`` CSS pixels wide window (390: a phone)."""
        self.browser.open(self.server.url + PAGE, width=width)

    def wait_ready(self, timeout: float = 120) -> float:
        """Wait until Python has loaded; the seconds it took, as the page measured them."""
        status = 'document.querySelector("#sandbox-status")'
        state = self.browser.evaluate(
            f"""(async () => {{
              const s = {status}, t0 = performance.now();
              while (s.dataset.state === "loading") {{
                if (performance.now() - t0 > {timeout * 1000}) break;
                await new Promise((r) => setTimeout(r, 50));
              }}
              return [s.dataset.state, s.textContent, s.dataset.loadSeconds];
            }})()""",
            timeout=timeout + 10,
        )
        if state[0] != "ready":
            raise RuntimeError(f"Python did not load in the page: {state[1]}")
        return float(state[2])

    def restart_seconds(self) -> float:
        """From the last Stop to Python ready again, as the page measured it (0: never)."""
        got = self.browser.evaluate(
            'document.querySelector("#sandbox-status").dataset.restartSeconds'
        )
        return float(got or 0)

    def quiet(self) -> None:
        """Stop every cell that runs or waits, and wait until Python is ready."""
        self.browser.evaluate(
            """document.querySelectorAll(".sandbox-cell").forEach((c) => {
                 const stop = c.querySelector("button.sandbox-stop");
                 if (stop && !stop.disabled) stop.click();
               })"""
        )
        self.wait_ready()

    def colours(self, name: str) -> list[tuple[str, str]]:
        """The editor's coloured text: (class, text) pieces in order ('' where uncoloured)."""
        got = self.browser.evaluate(_COLOURS_JS.format(cell=_CELL.format(name=json.dumps(name))))
        return [(str(c), str(t)) for c, t in got]

    def editor_boxes(self, name: str) -> dict[str, dict[str, str]]:
        """Computed type and box of the editor and of the coloured text under it."""
        got = self.browser.evaluate(_BOXES_JS.format(cell=_CELL.format(name=json.dumps(name))))
        return {str(k): {str(p): str(v) for p, v in d.items()} for k, d in got.items()}

    def pictures_as_shown(self) -> dict[str, Any]:
        """The smallest text in the pictures as drawn (CSS px), and the page's own width."""
        got: dict[str, Any] = self.browser.evaluate(_SHOWN_JS)
        return got

    def status(self) -> str:
        return str(self.browser.evaluate('document.querySelector("#sandbox-status").textContent'))

    def cells(self) -> list[str]:
        """The cells on the page, in order."""
        names = self.browser.evaluate(
            '[...document.querySelectorAll(".sandbox-cell")].map((c) => c.dataset.cell)'
        )
        return [str(n) for n in names]

    def run(self, name: str, code: str | None = None, timeout: float = 60) -> CellRun:
        """Press Run (on ``code``, typed in first, if given) and wait for the result."""
        wait = _WAIT_JS.format(ms=int(timeout * 1000))
        self.browser.evaluate(self._run_js(name, code, wait), timeout=timeout + 10)
        return self.read(name)

    def start(self, name: str, code: str | None = None) -> None:
        """Press Run (on ``code``, typed in first, if given) and return at once."""
        self.browser.evaluate(self._run_js(name, code, ""))

    def wait_printed(self, name: str, text: str, timeout: float = 60) -> str:
        """Wait until the running cell has printed ``text``; what it printed so far."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            printed = self.read(name).printed
            if text in printed:
                return printed
            time.sleep(0.1)
        raise RuntimeError(f"{name} printed no {text!r} in {timeout} s")

    def stop(self, name: str) -> CellRun:
        cell = _CELL.format(name=json.dumps(name))
        self.browser.evaluate(f'{cell}.querySelector("button.sandbox-stop").click()')
        return self.read(name)

    def reset(self, name: str) -> str:
        """Press Reset; the code the editor then holds."""
        cell = _CELL.format(name=json.dumps(name))
        return str(
            self.browser.evaluate(
                f'(() => {{ const c = {cell}; c.querySelector("button.sandbox-reset").click();'
                ' return c.querySelector("textarea").value; })()'
            )
        )

    def read(self, name: str) -> CellRun:
        got = self.browser.evaluate(_READ_JS.format(cell=_CELL.format(name=json.dumps(name))))
        return CellRun(
            name,
            got["state"],
            got["printed"],
            got["error"].rstrip("\n"),
            tuple(got["pictures"]),
            tuple(got["drawn"]),
            got["seconds"],
        )

    def screenshot(self, name: str, path: Path) -> tuple[int, int]:
        """A PNG of the cell with the heading and text above it, after its run."""
        cell = _CELL.format(name=json.dumps(name))
        box = self.browser.evaluate(
            f"""(() => {{
              const c = {cell};
              let top = c;
              while (top.previousElementSibling && !/^H[12]$/.test(top.tagName)) {{
                top = top.previousElementSibling;
              }}
              const a = top.getBoundingClientRect(), b = c.getBoundingClientRect();
              return {{x: b.left - 16 + scrollX, y: a.top - 8 + scrollY,
                       width: b.width + 32, height: b.bottom - a.top + 16}};
            }})()"""
        )
        return self.browser.screenshot(path, box)

    def _run_js(self, name: str, code: str | None, wait: str) -> str:
        cell = _CELL.format(name=json.dumps(name))
        return _RUN_JS.format(cell=cell, code=json.dumps(code), wait=wait)


@contextmanager
def open_page(browser_bin: str, work: Path, site: Path | None = None) -> Iterator[SandboxPage]:
    """Serve ``site`` (built into ``work`` first when not given) and open the sandbox page."""
    if site is None:
        site = work / "site"
        build_site(site)
    server = Serve(site)
    browser = Browser(browser_bin, work / "profile")
    try:
        yield SandboxPage(browser, server, site)
    finally:
        browser.close()
        server.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m docs_tools.sandbox_check", description=__doc__.split("\n")[0]
    )
    p.add_argument("--screenshots", type=Path, help="save pictures of cells into this folder")
    p.add_argument("--no-install", action="store_true", help="never apt-get install chromium")
    args = p.parse_args(argv)
    browser_bin = find_browser(install=not args.no_install)
    if browser_bin is None:
        raise SystemExit(NO_BROWSER)
    with tempfile.TemporaryDirectory() as tmp, open_page(browser_bin, Path(tmp)) as page:
        print(f"Python loaded in {page.wait_ready():.2f} s: {page.status()}")
        for name in page.cells():
            if name == RUNAWAY:
                page.start(name)
                page.wait_printed(name, "rounds")
                run = page.stop(name)
                page.wait_ready()
                print(
                    f"== {name}: stopped after {run.seconds:.2f} s; Python ready again "
                    f"{page.restart_seconds():.2f} s after Stop"
                )
            else:
                run = page.run(name)
                print(
                    f"== {name}: {run.state} in {run.seconds:.2f} s, {len(run.pictures)} pictures"
                )
            print(run.printed + run.error)
            if args.screenshots and name in SCREENSHOTS:
                args.screenshots.mkdir(parents=True, exist_ok=True)
                w, h = page.screenshot(name, args.screenshots / SCREENSHOTS[name])
                print(f"wrote {args.screenshots / SCREENSHOTS[name]} ({w}x{h})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
