"""The sandbox page, live: the built site opened in headless Chromium, every cell run in it.

One test, so that one worker builds the site and starts the browser once: it
builds the site (the Pyodide runtime and the spec go in by the docs build),
serves it on localhost, opens the sandbox page, waits for Python to load in the
page, and presses Run on every cell. Each cell must print and draw exactly what
the same cell prints and draws in CPython (``paged_spec.cells.run``); the toy's
numbers must be the page's own; an edit must redraw the picture; errors must
show the spec's message; the cell that never ends must stop, and Python come
back. Nothing is fetched from outside the machine: the page has only the site.

Needs Debian's ``chromium`` (``make test`` installs it when run as root, as CI
is); elsewhere the test is skipped and says so. In CI a missing browser fails.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from docs_tools.browser import NO_BROWSER, find_browser
from docs_tools.sandbox_check import RUNAWAY, CellRun, SandboxPage, cell_source, open_page
from paged_spec.cells import Result, run

ROOT = Path(__file__).resolve().parent.parent


def cpython(code: str) -> tuple[str, Result]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = run(code)
    return out.getvalue(), result


def svg_text(svg: str) -> str:
    """The text a picture shows, whitespace aside."""
    return re.sub(r"\s+", "", "".join(ET.fromstring(svg).itertext()))


def same_as_cpython(got: CellRun, code: str) -> None:
    """The page printed and drew what CPython does for ``code``, and showed what it drew."""
    printed, expected = cpython(code)
    assert got.printed == printed, f"{got.name}: printed\n{got.printed}\nnot\n{printed}"
    assert got.error.splitlines()[-1:] == expected.error.splitlines()[-1:], got.error
    assert got.pictures == expected.pictures, f"{got.name}: another picture"
    shown = tuple(re.sub(r"\s+", "", text) for text in got.drawn)
    assert shown == tuple(map(svg_text, expected.pictures)), f"{got.name}: not what was drawn"
    assert got.state == ("error" if expected.error else "done"), got.state


@pytest.fixture
def browser_bin() -> str:
    found = find_browser(install=False)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{NO_BROWSER} (make test installs it when run as root)")
        pytest.skip(NO_BROWSER)
    return found


def test_the_sandbox_page_runs_every_cell_in_chromium(browser_bin: str, tmp_path: Path) -> None:
    with open_page(browser_bin, tmp_path) as page:
        site = tmp_path / "site" / "assets" / "sandbox"
        assert (site / "pyodide" / "pyodide.asm.wasm").is_file() and (site / "spec.zip").is_file()
        seconds = page.wait_ready()
        assert 0 < seconds < 120
        for path in ("pyodide/pyodide.asm.wasm", "pyodide/python_stdlib.zip", "spec.zip"):
            assert f"/assets/sandbox/{path}" in page.server.requested, page.server.requested
        assert "Pyodide" in page.status()
        names = page.cells()
        assert names[:2] == ["grow", "fork"] and RUNAWAY in names

        for name in names:
            if name != RUNAWAY:
                same_as_cpython(page.run(name), cell_source(name))
        _the_toy_is_the_pages_own(page)
        _an_edit_redraws(page)
        _errors_show_the_message(page)
        _a_runaway_cell_stops(page)
        assert page.screenshot("grow", tmp_path / "grow.png")[1] > 300
        assert page.browser.console_errors() == []


def _the_toy_is_the_pages_own(page: SandboxPage) -> None:
    """The toy's numbers come from the spec running in the page, in Pyodide, without numpy."""
    grow, fork = page.read("grow"), page.read("fork")
    assert "10 tokens of block size 4: 3 blocks, table [0, 1, 2]\n" in grow.printed
    assert "seq 0: block table [0, 1, 2]\nseq 1: block table [0, 1, 2]\n" in fork.printed
    assert "reference counts: [2, 2, 2]\n" in fork.printed
    assert re.sub(r"\s+", "", fork.drawn[0]).count("ref2") == 3
    where = page.run("grow", "import sys\nprint(sys.platform, sys.implementation.name)")
    assert where.printed == "emscripten cpython\n", where
    numpy = page.run("grow", "import spec.kv_memory")  # as the page says
    assert numpy.error.endswith("ModuleNotFoundError: No module named 'numpy'"), numpy.error


def _an_edit_redraws(page: SandboxPage) -> None:
    before = page.run("grow", cell_source("grow")).pictures
    edited = cell_source("grow").replace("block_size, tokens = 4, 10", "block_size, tokens = 4, 13")
    after = page.run("grow", edited)
    assert "13 tokens of block size 4: 4 blocks, table [0, 1, 2, 3]\n" in after.printed
    assert after.pictures != before
    same_as_cpython(after, edited)
    assert page.reset("grow") == cell_source("grow")


def _errors_show_the_message(page: SandboxPage) -> None:
    out = page.read("out_of_blocks")
    assert out.state == "error"
    assert out.error.endswith(
        "spec.errors.OutOfBlocksError: sequence 0 needs 3 blocks for 10 tokens, 2 available"
    )
    typo = cell_source("grow").replace("m = BlockManager(", "m = BlokManager(")
    got = page.run("grow", typo)
    assert got.state == "error" and got.printed == ""
    assert "NameError: name 'BlokManager' is not defined" in got.error, got.error
    fixed = page.run("out_of_blocks", cell_source("out_of_blocks").replace("=2,", "=3,"))
    assert fixed.state == "done" and fixed.printed == "table: (0, 1, 2)\n", fixed


def _a_runaway_cell_stops(page: SandboxPage) -> None:
    page.start(RUNAWAY)
    page.wait_printed(RUNAWAY, "rounds, and still 8 free blocks")
    stopped = page.stop(RUNAWAY)
    assert stopped.state == "stopped", stopped
    page.wait_ready()  # a fresh Python
    again = page.run("fork")
    same_as_cpython(again, cell_source("fork"))
