"""The sandbox page, live: the built site opened in headless Chromium, every cell run in it.

The site is built once (the Pyodide runtime and the spec go in by the docs build) and
read for outside references, with no browser: nothing in it may make a page fetch from
another machine (``docs_tools.offline`` says which references count, and why a link a
reader clicks does not). Then one test serves it on localhost, opens the sandbox page,
waits for Python to load in the page, and presses Run on every cell. Each cell must
print and draw exactly what the same cell prints and draws in CPython
(``paged_spec.cells.run``); the toy's numbers must be the page's own; an edit must
redraw the picture; errors must show the spec's message. Then each way a reader was
seen to be misled is a check of its own (:data:`CHECKS`): all of them run, and the test
fails with the list of those that failed. No request may leave the machine, the page's
workers' included.

Needs Debian's ``chromium`` (``make test`` installs it when run as root, as CI
is); elsewhere the browser test is skipped and says so. In CI a missing browser fails.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pygments.lexers import PythonLexer  # type: ignore[import-untyped]
from pygments.token import STANDARD_TYPES  # type: ignore[import-untyped]

from docs_tools.browser import NO_BROWSER, build_site, find_browser
from docs_tools.offline import outside_references, unused_known
from docs_tools.sandbox_check import RUNAWAY, CellRun, SandboxPage, cell_source, open_page
from paged_spec.cells import Result, run

ROOT = Path(__file__).resolve().parent.parent
OUT_OF_BLOCKS = "spec.errors.OutOfBlocksError: sequence 0 needs 3 blocks for 10 tokens, 2 available"
NO_INPUT = (
    "EOFError: input() has nothing to read here: a cell runs without a keyboard. "
    "Put the value in the code instead."
)


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


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The docs site, built once for this module's tests."""
    built = tmp_path_factory.mktemp("docs") / "site"
    build_site(built)
    return built


@pytest.fixture
def browser_bin() -> str:
    found = find_browser(install=False)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{NO_BROWSER} (make test installs it when run as root)")
        pytest.skip(NO_BROWSER)
    return found


def test_the_built_site_references_nothing_outside_itself(site: Path) -> None:
    """Every src, href, srcset, @import and url() of every page, stylesheet and script stays
    on the site, but for links a reader follows by clicking (``<a href>``: nothing is fetched
    when the page loads; a stylesheet, script, image or font is never such a link). An
    outside address in a script's code is allowed only if ``NEVER_FETCHED`` says why this
    site never fetches it, and the reasons that this site decides are checked here."""
    found = outside_references(site)
    assert found == [], "\n".join(map(str, found[:20]))
    assert unused_known(site) == []  # the list of exceptions names only what is there
    pages = [p.read_text() for p in site.rglob("*.html")]
    assert len(pages) > 30
    assert not any('class="mermaid"' in page for page in pages)  # no Mermaid diagram
    assert not any('data-md-component="source"' in page for page in pages)  # no repo_url
    assert "packageBaseUrl" in (ROOT / "docs" / "assets" / "sandbox" / "worker.js").read_text()


def test_the_sandbox_page_runs_every_cell_in_chromium(
    browser_bin: str, site: Path, tmp_path: Path
) -> None:
    with open_page(browser_bin, tmp_path, site) as page:
        sandbox = site / "assets" / "sandbox"
        assert (sandbox / "pyodide" / "pyodide.asm.wasm").is_file()
        assert (sandbox / "spec.zip").is_file()
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
        failed = [f"{check.__name__}: {why}" for check, why in _failures(page, CHECKS)]
        assert failed == [], "\n\n".join(failed)
        assert page.screenshot("grow", tmp_path / "grow.png")[1] > 300
        assert page.browser.console_errors() == []


def _failures(
    page: SandboxPage, checks: tuple[Callable[[SandboxPage], None], ...]
) -> Iterator[tuple[Callable[[SandboxPage], None], str]]:
    """Each check that fails, with its assertion's message; each starts on a quiet page."""
    for check in checks:
        page.quiet()
        try:
            check(page)
        except AssertionError as e:
            yield check, str(e)


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
    assert out.error.endswith(OUT_OF_BLOCKS)
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


# -- what a reader was seen to meet: each a check of its own ------------------------------


def _an_error_after_a_print_stays(page: SandboxPage) -> None:
    """A cell that prints, then raises, shows both, every time (no later redraw drops the
    error); the page's own invitation, other block sizes in the fragmentation cell, too."""
    code = 'print("about to grow")\n' + cell_source("out_of_blocks")
    for _ in range(5):
        got = page.run("out_of_blocks", code)
        assert got.printed == "about to grow\n", got
        assert got.error.endswith(OUT_OF_BLOCKS), f"the error is gone: {got.error!r}"
        assert got.state == "error", got.state
    for sizes in ("(16, 2)", "(8, 2)"):
        waste = cell_source("waste").replace("in (16, 4):", f"in {sizes}:")
        got = page.run("waste", waste)
        assert "OutOfBlocksError" in got.error, f"waste at {sizes}: the error is gone"
        same_as_cpython(got, waste)


def _output_stays_in_its_cell(page: SandboxPage) -> None:
    """What a cell prints is shown under it, a line without its newline and input()'s
    prompt included, never under the cell that runs next."""
    partial = page.run("grow", 'print("PARTIAL", end="")')
    assert partial.printed == "PARTIAL", f"a line without its newline: {partial.printed!r}"
    after = page.run("fork", 'print("next cell")')
    assert after.printed == "next cell\n", f"the next cell shows {after.printed!r}"
    asked = page.run("grow", 'name = input("your name? ")\nprint("hello", name)')
    assert asked.printed == "your name? ", f"input()'s prompt: {asked.printed!r}"
    assert asked.error.endswith(NO_INPUT), f"input() says: {asked.error.splitlines()[-1:]}"
    same_as_cpython(asked, 'name = input("your name? ")\nprint("hello", name)')
    after = page.run("fork", 'print("next cell")')
    assert after.printed == "next cell\n", f"after input(), the next cell shows {after.printed!r}"


def _a_new_run_clears_the_last_picture(page: SandboxPage) -> None:
    """Run clears the last run's picture at once, and Stop leaves none: a picture under a
    cell is always what its code drew."""
    assert len(page.run(RUNAWAY, cell_source("grow")).drawn) == 1
    page.start(RUNAWAY, cell_source(RUNAWAY))
    page.wait_printed(RUNAWAY, "rounds")
    running = page.read(RUNAWAY)
    assert running.drawn == (), "the last run's picture stays while a new run is in progress"
    stopped = page.stop(RUNAWAY)
    assert stopped.state == "stopped", stopped.state
    assert stopped.drawn == () and stopped.pictures == (), "a picture stays after Stop"


def _stop_then_run(page: SandboxPage) -> None:
    """Stop records how long the run ran and how long Python took to come back (the
    checker prints both); then the cell runs again, on the fresh Python."""
    started = time.monotonic()
    page.start(RUNAWAY, cell_source(RUNAWAY))
    page.wait_printed(RUNAWAY, "rounds")
    stopped = page.stop(RUNAWAY)
    ran = time.monotonic() - started
    assert stopped.state == "stopped", stopped.state
    assert 0.5 * ran <= stopped.seconds <= ran, f"Stop recorded {stopped.seconds} s of {ran:.2f}"
    page.wait_ready()
    restart = page.restart_seconds()
    assert 0 < restart < 120, f"no time from Stop to Python ready again: {restart}"
    again = page.run(RUNAWAY, cell_source("grow"))
    same_as_cpython(again, cell_source("grow"))


def _reset_after_a_run(page: SandboxPage) -> None:
    """Reset brings the cell back as it was: its code, and no output or picture of an edit."""
    edited = cell_source("grow").replace("block_size, tokens = 4, 10", "block_size, tokens = 4, 17")
    assert "17 tokens of block size 4: 5 blocks" in page.run("grow", edited).printed
    assert page.reset("grow") == cell_source("grow")
    after = page.read("grow")
    assert (after.printed, after.error, after.drawn) == ("", "", ()), (
        f"Reset kept the edit's output under the original code: {after.printed[:60]!r}"
    )
    assert after.state == "idle", after.state


def _keyboard_interrupt_is_the_cells_own(page: SandboxPage) -> None:
    """A cell that raises KeyboardInterrupt shows its own line, not the runner's frames."""
    got = page.run("grow", "raise KeyboardInterrupt")
    assert "paged_spec/cells.py" not in got.error, f"the runner's frames: {got.error}"
    assert got.error.endswith("line 1, in <module>\n    raise KeyboardInterrupt\nKeyboardInterrupt")
    assert got.state == "error", got.state


SNIPPET = '''@dataclass
class Box(object):
    """A docstring."""

    def size(self, n: int = 0x1F) -> float | None:
        return 1.5e3 if n in (1, 2) and not False else print(r"\\d", b"\\n", f"{n!r:>{n}} {{x}}")
'''


def _the_editors_are_coloured_as_the_code(page: SandboxPage) -> None:
    """Each editor colours each character as the static code on the other pages does
    (Pygments, and the theme's colour for each of its classes), after an edit too."""
    groups = _theme_colours(page.site)
    for name in page.cells():
        assert page.reset(name) == cell_source(name)  # earlier checks typed into some
        pieces = page.colours(name)
        assert "".join(text for _, text in pieces) == cell_source(name), f"{name}: other text"
        got = _by_character(pieces, groups)
        assert got == _pygments(cell_source(name), groups), (
            f"{name}: {_first_difference(got, _pygments(cell_source(name), groups))}"
        )
    page.run("grow", SNIPPET)
    got = _by_character(page.colours("grow"), groups)
    assert got == _pygments(SNIPPET, groups), (
        f"an edit: {_first_difference(got, _pygments(SNIPPET, groups))}"
    )
    boxes = page.editor_boxes("grow")
    editor, layer = boxes["editor"], boxes["layer"]
    assert editor == layer, "the coloured text is not under the editor's"
    page.reset("grow")


def _pictures_readable_on_a_phone(page: SandboxPage) -> None:
    """At 390 px wide, no picture shrinks its text below 9 px (a picture scrolls in its own
    box instead), and the page itself does not scroll sideways."""
    page.reopen(390)
    page.wait_ready()
    for name in ("grow", "fork", "waste", "beams", "copy_on_write", "prefix"):
        assert page.run(name).state == "done", name
    shown = page.pictures_as_shown()
    assert shown["smallest"] >= 9, f"text drawn at {shown['smallest']:.1f} px: {shown['where']}"
    assert shown["page"] <= shown["window"], f"the page is {shown['page']} px wide"


def _no_request_leaves_the_machine(page: SandboxPage) -> None:
    """Everything the page and its workers asked for came from the site's own server."""
    outside = [
        url
        for url in page.browser.requests()
        if not url.startswith((page.server.url, "data:", "blob:"))
    ]
    refused = page.browser.refused()  # the browser's own requests among them: context only
    assert outside == [], f"requests outside the site: {outside} (the proxy refused {refused})"


CHECKS = (
    _no_request_leaves_the_machine,
    _an_error_after_a_print_stays,
    _output_stays_in_its_cell,
    _a_new_run_clears_the_last_picture,
    _stop_then_run,
    _reset_after_a_run,
    _keyboard_interrupt_is_the_cells_own,
    _the_editors_are_coloured_as_the_code,
    _pictures_readable_on_a_phone,  # last: it reloads the page
)


def _theme_colours(site: Path) -> dict[str, str]:
    """Pygments class -> the colour the theme gives it, read from the built site's stylesheet
    ('plain' where it is the code's own colour, as for a class the theme does not colour)."""
    [css] = (site / "assets" / "stylesheets").glob("main.*.min.css")
    text = css.read_text()
    values: dict[str, str] = {}
    for name, value in re.findall(r"--md-code-hl-([a-z]+)-color:([^;}]+)", text):
        values.setdefault(name, value)  # the default scheme's, which comes first
    rules = re.findall(
        r"((?:\.highlight \.[a-z0-9]+,?)+)\{color:var\(--md-code-hl-([a-z]+)-color\)", text
    )
    return {
        cls: "plain" if values[name] == "var(--md-code-fg-color)" else values[name]
        for selectors, name in rules
        for cls in re.findall(r"\.highlight \.([a-z0-9]+)", selectors)
    }


def _by_character(pieces: list[tuple[str, str]], groups: dict[str, str]) -> list[tuple[str, str]]:
    """(character, colour) for every character that is not white space."""
    return [
        (ch, groups.get(cls, "plain")) for cls, text in pieces for ch in text if not ch.isspace()
    ]


def _pygments(code: str, groups: dict[str, str]) -> list[tuple[str, str]]:
    """What the docs' static code shows for ``code``, as :func:`_by_character` reads it."""
    return _by_character([(_css_class(t), v) for t, v in PythonLexer().get_tokens(code)], groups)


def _css_class(token: Any) -> str:
    """The class Pygments' HTML gives a token: its type's, or the nearest parent type's."""
    while token not in STANDARD_TYPES:
        token = token.parent
    return str(STANDARD_TYPES[token])


def _first_difference(got: list[tuple[str, str]], want: list[tuple[str, str]]) -> str:
    at = next(
        (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
        min(len(got), len(want)),
    )
    text = "".join(ch for ch, _ in want)
    return (
        f"at {text[max(0, at - 20) : at + 20]!r}: {got[at : at + 3]} instead of {want[at : at + 3]}"
    )
