"""The sandbox page's cells, in CPython: each is a file, runs alone, and says what the page says.

The page (docs/sandbox.md) includes each cell from ``docs_tools/sandbox_cells/NAME.py``;
``paged_spec.cells.run`` runs one in a namespace of its own, as the page does in the
browser (tests/test_sandbox_page.py checks the browser against these same runs).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import paged_spec.cells
from docs_tools.sandbox_check import CELLS, RUNAWAY, cell_source
from docs_tools.sandbox_site import bundle
from paged_spec.cells import Result, run, run_json, show
from spec.block_manager import BlockManager
from spec.errors import ArgumentTypeError

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "sandbox.md"


def page_cells() -> list[tuple[str, str]]:
    """(data-cell name, included file) for every cell on the page, in order."""
    cell = r'<div class="sandbox-cell" data-cell="(\w+)" markdown>'
    return re.findall(cell + r'\s+```python\s+--8<-- "([^"]+)"', PAGE.read_text())


NAMES = [name for name, _ in page_cells()]


def run_printed(code: str) -> tuple[str, Result]:
    """What a cell prints, and its result: as the page shows it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = run(code)
    return out.getvalue(), result


def test_every_cell_on_the_page_is_its_own_file() -> None:
    cells = page_cells()
    assert len(cells) == PAGE.read_text().count('class="sandbox-cell"') >= 8
    assert [path for _, path in cells] == [f"docs_tools/sandbox_cells/{n}.py" for n in NAMES]
    assert {p.stem for p in CELLS.glob("*.py")} - {"conftest"} == set(NAMES)
    assert NAMES[:2] == ["grow", "fork"]  # the toy comes first
    assert RUNAWAY in NAMES


@pytest.mark.parametrize("name", [n for n in NAMES if n != RUNAWAY])
def test_each_cell_runs_alone(name: str) -> None:
    printed, result = run_printed(cell_source(name))
    if name == "out_of_blocks":
        assert result.error.endswith(
            "spec.errors.OutOfBlocksError: sequence 0 needs 3 blocks for 10 tokens, 2 available"
        ), result.error
        assert 'File "<cell>", line 7, in <module>' in result.error
        assert "block_manager.py" not in result.error  # only the cell's own lines
    else:
        assert result.error == "", result.error
        assert result.pictures and all(p.startswith("<svg") for p in result.pictures)
    assert printed or result.error


def test_the_toy_numbers() -> None:
    printed, _ = run_printed(cell_source("grow"))
    assert "10 tokens of block size 4: 3 blocks, table [0, 1, 2]" in printed
    assert "empty slots in the last block: 2" in printed
    printed, result = run_printed(cell_source("fork"))
    assert "seq 0: block table [0, 1, 2]\nseq 1: block table [0, 1, 2]\n" in printed
    assert "reference counts: [2, 2, 2]" in printed
    assert result.pictures[0].count(">ref 2<") == 3
    printed, _ = run_printed(cell_source("waste"))
    assert "block size 16: 20 tokens hold 2 blocks, 12 slots empty" in printed
    printed, _ = run_printed(cell_source("beams"))
    assert "with copy-on-write: 2\n" in printed and "would hold: 8\n" in printed


def test_what_the_page_says_to_try() -> None:
    """The edits the page suggests do what it says they do."""
    no_step = run(cell_source("fork").replace("m.take_copies()", "pass"))
    assert "StepBoundaryError: parent_id must name a sequence with no tokens in" in no_step.error
    budget = cell_source("scheduler_step").replace("batched_tokens=8,", "batched_tokens=16,")
    printed, _ = run_printed(budget)
    assert "scheduled (sequence, new tokens): ((0, 10), (1, 3))\n" in printed
    printed, result = run_printed(cell_source("out_of_blocks").replace("=2,", "=3,"))
    assert (printed, result.error) == ("table: (0, 1, 2)\n", "")


def test_a_cell_starts_from_nothing_and_its_pictures_are_its_own() -> None:
    assert run("x = 1").error == ""
    assert run("print(x)").error.endswith("NameError: name 'x' is not defined")
    drew = run("from paged_spec.cells import show\nimport spec\nshow(spec.BlockManager(4, 4))")
    assert len(drew.pictures) == 1
    assert run("pass").pictures == ()  # the next run starts with none


def test_errors_read_as_python_prints_them() -> None:
    syntax = run("x = [1,\n2").error
    assert syntax.startswith('  File "<cell>", line 1') and "SyntaxError" in syntax
    assert "Traceback" not in syntax  # a syntax error has no frames
    nested = run("def f():\n    raise ValueError('boom')\nf()").error
    assert nested.count('File "<cell>"') == 2 and nested.endswith("ValueError: boom")
    assert run("raise SystemExit(3)").error.endswith("SystemExit: 3")
    assert '"error": ""' in run_json("pass")


def test_show_checks_its_arguments() -> None:
    with pytest.raises(ArgumentTypeError, match="manager must be a BlockManager"):
        show("m")  # type: ignore[arg-type]
    m = BlockManager(4, 4)
    with pytest.raises(ArgumentTypeError, match="title must be a str"):
        show(m, title=3)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="code must be a str"):
        run(b"pass")  # type: ignore[arg-type]


@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.integers(1, 8))
def test_show_draws_every_sequence_and_block(lengths: list[int], block_size: int) -> None:
    """Whatever the manager holds, the picture names each sequence and each pool block."""
    blocks = sum(-(-n // block_size) for n in lengths) + 1
    m = BlockManager(blocks, block_size)
    for sid, n in enumerate(lengths):
        m.add_sequence(sid, [])
        m.append_slots(sid, [7] * n)
    paged_spec.cells._pictures.clear()
    show(m)
    [svg] = paged_spec.cells._pictures
    assert all(f">seq {sid}<" in svg for sid in range(len(lengths)))
    assert all(f">block {b}<" in svg for b in range(blocks))
    assert f"{m.pool.num_held} of {blocks} blocks held" in svg


def test_the_bundle_is_all_the_cells_need(tmp_path: Path) -> None:
    """spec.zip, the spec as the page gets it, runs every cell in a Python that has nothing
    else: no site-packages (so no numpy), not this repository."""
    data = bundle()
    assert bundle() == data  # the same bytes for the same files
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert "spec/block_manager.py" in names and "paged_spec/cells.py" in names
    assert all(n.startswith(("spec/", "paged_spec/")) for n in names)
    assert "paged_spec/engine/__init__.py" not in names  # only the tools the cells use
    (tmp_path / "spec.zip").write_bytes(data)
    codes = {name: cell_source(name) for name in NAMES if name != RUNAWAY}
    script = f"""
import contextlib, io, json, sys
sys.path.insert(0, "spec.zip")
from paged_spec.cells import run
got = {{}}
for name, code in json.loads({json.dumps(json.dumps(codes))}).items():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        r = run(code)
    got[name] = [out.getvalue(), r.error.splitlines()[-1:], list(r.pictures)]
print(json.dumps([got, "numpy" in sys.modules, [p for p in sys.path if "site-packages" in p]]))
"""
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, numpy, site_packages = json.loads(proc.stdout)
    assert numpy is False and site_packages == []
    for name, code in codes.items():
        printed, result = run_printed(code)
        assert got[name] == [printed, result.error.splitlines()[-1:], list(result.pictures)], name


NO_INPUT = (
    "EOFError: input() has nothing to read here: a cell runs without a keyboard. "
    "Put the value in the code instead."
)


def test_input_shows_its_prompt_and_says_there_is_no_keyboard() -> None:
    """A cell has no standard input: input() prints its prompt, then says so in our words."""
    printed, result = run_printed('name = input("your name? ")')
    assert printed == "your name? "
    assert result.error.endswith(NO_INPUT), result.error
    assert 'File "<cell>", line 1' in result.error and "cells.py" not in result.error
    printed, result = run_printed("try:\n    input()\nexcept EOFError:\n    print('no input')")
    assert (printed, result.error) == ("no input\n", "")  # the usual end of input, caught


def test_a_keyboard_interrupt_is_the_cells_own() -> None:
    """Every exception a cell raises, KeyboardInterrupt too, ends the cell, not the runner."""
    try:
        result = run("raise KeyboardInterrupt")
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt left paged_spec.cells.run, with the runner's frames")
    assert result.error.endswith("KeyboardInterrupt"), result.error
    assert 'File "<cell>", line 1' in result.error and "cells.py" not in result.error


def _texts_and_fills(
    svg: str,
) -> tuple[list[tuple[float, float, float, str]], list[tuple[float, float, float]]]:
    """The picture's texts (x, y, size, text), and its slot fills' right edges (x, top, bottom)."""
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    texts = [
        (float(t.get("x", 0)), float(t.get("y", 0)), float(t.get("font-size", 0)), t.text or "")
        for t in root.iter(ns + "text")
    ]
    edges = []
    for r in root.iter(ns + "rect"):
        if r.get("fill") in ("#ffffff", "#f9fafb", None) or r.get("width") == "100%":
            continue  # a white box, a table entry, the background: no fill
        top = float(r.get("y", 0))
        edges.append(
            (float(r.get("x", 0)) + float(r.get("width", 0)), top, top + float(r.get("height", 0)))
        )
    return texts, edges


@pytest.mark.parametrize("used", range(1, 17))
def test_a_large_blocks_count_is_never_crossed_by_its_fill(used: int) -> None:
    """A block of more than 8 slots is a bar that fills as it holds tokens; the edge of the
    fill never runs through its "N/B slots" count (DejaVu Sans: under 0.62 em a character)."""
    m = BlockManager(2, 16)
    m.add_sequence(0, [])
    m.append_slots(0, [7] * used)
    paged_spec.cells._pictures.clear()
    show(m)
    texts, edges = _texts_and_fills(paged_spec.cells._pictures[0])
    counts = [(x, y, size, s) for x, y, size, s in texts if s.endswith("/16 slots")]
    assert len(counts) == 2  # the sequence's block and the same block in the pool
    for x, y, size, s in counts:
        half = 0.62 * size * len(s) / 2
        crossing = [
            e
            for e, top, bottom in edges
            if x - half - 1 <= e <= x + half + 1 and top <= y <= bottom
        ]
        assert crossing == [], f"the fill's edge at x={crossing} runs through {s!r} at {y}"
