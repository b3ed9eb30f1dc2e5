"""Run one cell of the live sandbox page: the code a reader edits there, on the spec.

The sandbox page (``docs/sandbox.md``) runs Python in the reader's browser and
calls :func:`run_json` each time Run is pressed. A cell runs in a fresh
namespace, so every cell stands alone; what it prints goes to standard output as
it runs (the page streams it under the cell); an exception ends the cell and
comes back as Python would print it, with only the cell's own lines in the
traceback, so the reader sees the spec's own message; each :func:`show` draws a
block manager's tables and pool, and the page redraws its picture from them. A
cell has no keyboard: ``input()`` prints its prompt and raises ``EOFError``, saying so.

>>> r = run('''
... from spec.block_manager import BlockManager
... m = BlockManager(num_blocks=2, block_size=4)
... m.add_sequence(0, [])
... m.append_slots(0, list(range(10)))
... ''')
>>> print(r.error)
Traceback (most recent call last):
  File "<cell>", line 5, in <module>
    m.append_slots(0, list(range(10)))
spec.errors.OutOfBlocksError: sequence 0 needs 3 blocks for 10 tokens, 2 available
>>> r = run("m = BlockManager(8, 4)\\nshow(m)")
>>> r.error.splitlines()[-1]
"NameError: name 'BlockManager' is not defined"
>>> run("from spec.block_manager import BlockManager\\nfrom paged_spec.cells import show\\n"
...     "show(BlockManager(8, 4))").pictures[0][:4]
'<svg'
"""

from __future__ import annotations

import json
import linecache
import sys
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from paged_spec.svg import capture, draw_memory
from spec.block_manager import BlockManager
from spec.validate import check_instance, check_str

__all__ = ["CELL", "NO_INPUT", "Result", "run", "run_json", "show"]

CELL = "<cell>"  # the file name a cell's code runs under, as its tracebacks show it
NO_INPUT = (
    "input() has nothing to read here: a cell runs without a keyboard. "
    "Put the value in the code instead."
)

_pictures: list[str] = []  # what show() drew since the current cell started


@dataclass(frozen=True)
class Result:
    """What one run of a cell left: its error as Python prints it ('' if none), its pictures."""

    error: str  # the traceback, cut to the cell's own lines; '' when the cell finished
    pictures: tuple[str, ...]  # one SVG per show(), in order


def show(
    manager: BlockManager,
    labels: Mapping[int, str] | None = None,
    *,
    title: str | None = None,
    copies: Sequence[tuple[int, int]] = (),
) -> None:
    """Draw ``manager``'s block tables and pool under the cell (the picture redraws each run).

    ``labels`` picks the sequences and names them (all of them, as ``seq N``, by
    default); ``copies`` are the copy-on-write copies to draw as arrows (what
    :meth:`~spec.block_manager.BlockManager.take_copies` returned).
    """
    manager = check_instance("manager", manager, BlockManager)
    if labels is None:
        labels = {sid: f"seq {sid}" for sid in manager.sequence_ids()}
    pool = manager.pool
    if title is None:
        title = f"block size {manager.block_size}: {pool.num_held} of {pool.num_blocks} blocks held"
    state = capture(manager, labels, copies)
    _pictures.append(draw_memory(check_str("title", title), [("", state)]))


def run(code: str) -> Result:
    """Run ``code`` as a cell, in a namespace of its own; its prints go to standard output."""
    code = check_str("code", code)
    _pictures.clear()
    lines = code.splitlines(keepends=True)
    linecache.cache[CELL] = (len(code), None, lines, CELL)  # tracebacks quote the cell's lines
    namespace: dict[str, object] = {"__name__": "__main__", "input": _no_input}
    try:
        exec(compile(code, CELL, "exec"), namespace)
    except BaseException as e:  # KeyboardInterrupt too: whatever the cell raises ends the cell
        return Result(_describe(e), tuple(_pictures))
    finally:
        sys.stdout.flush()  # a last line without its newline belongs to this cell
        sys.stderr.flush()
    return Result("", tuple(_pictures))


def _no_input(prompt: object = "") -> str:
    """A cell's ``input()``: the prompt is shown, and the end of input comes at once.

    The page has no standard input to read (Pyodide's would fail with an ``OSError``);
    ``EOFError`` is what ``input()`` raises at the end of input, so code that expects it
    still works.
    """
    print(prompt, end="", flush=True)
    raise EOFError(NO_INPUT)


def run_json(code: str) -> str:
    """:func:`run`, its :class:`Result` as JSON: what the page's worker hands the page."""
    return json.dumps(asdict(run(code)))


def _describe(e: BaseException) -> str:
    """The traceback Python would print, without the frames of this runner."""
    report = traceback.TracebackException.from_exception(e)
    frames = [f for f in report.stack if f.filename == CELL]
    report.stack = traceback.StackSummary.from_list(frames)
    text = "".join(report.format(chain=False)).rstrip("\n")
    return text if frames else text.replace("Traceback (most recent call last):\n", "", 1)
