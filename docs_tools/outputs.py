"""Every command output shown on a docs page is what the command prints today.

A page shows a command's output in a ``console`` block right under a marker
comment that names the command:

    <!-- output: python -m paged_spec.capacity --model hybrid-27b -->
    ```console
    $ python -m paged_spec.capacity --model hybrid-27b
    == hybrid-27b
    ...
    ```

The block is the command line after ``$ `` and then exactly its standard
output. ``tests/test_docs.py`` runs every marked command from the repository
root and fails if a block differs; it also fails on any ``console``, ``text``
or ``output`` block without a marker, so no printed output can be typed in by
hand. (``>>>`` examples are doctests, run by the same test file; commands a
reader types without output go in ``sh`` blocks.)

Options follow the command, each after a ``;``:

* ``exit N``: the status the command must exit with (default 0), for example
  1 for a conformance report of a planted bug;
* ``vary REGEX``: parts that legitimately change from run to run (wall-clock
  times); they are masked on both sides before comparing, and ``--write``
  still records the latest values.

A command starts with ``python`` (this interpreter) or ``pytest``, after
optional ``NAME=value`` environment settings; it runs with ``PYTHONPATH`` set
to the repository root and ``COLUMNS=100``.

``python -m docs_tools.outputs`` checks every page and prints a diff for each
stale block; ``--write`` rewrites the stale blocks in place.

>>> page = "Hi\\n<!-- output: python -c 'print(6 * 7)' -->\\n```console\\n$ python ...\\n```\\n"
>>> [(b.command, b.line) for b in find_blocks(page)]
[("python -c 'print(6 * 7)'", 3)]
>>> block = find_blocks(page)[0]
>>> render(block, run_command(block)).splitlines()  # the fresh block, fences included
['```console', "$ python -c 'print(6 * 7)'", '42', '```']
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
OUTPUT_LANGS = frozenset({"console", "text", "output"})
_MARKER = re.compile(r"^<!-- output: (?P<spec>.+?) -->$")
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<lang>[\w+-]*)")
TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    """One marked output block: the command, its options, and where the block sits."""

    command: str
    exit_status: int
    vary: str | None
    line: int  # 1-based line of the opening fence
    start: int  # index of the opening fence line
    end: int  # index of the closing fence line
    body: str  # the block's text between the fences


def _parse_spec(spec: str, where: str) -> tuple[str, int, str | None]:
    command, *options = (part.strip() for part in re.split(r";\s*(?=(?:exit|vary) )", spec))
    exit_status, vary = 0, None
    for option in options:
        key, _, value = option.partition(" ")
        if key == "exit" and value.strip().isdigit():
            exit_status = int(value)
        elif key == "vary" and value.strip():
            vary = value.strip()
        else:
            raise ValueError(f"{where}: unknown output option {option!r} (exit N, vary REGEX)")
    return command, exit_status, vary


def _fence_end(lines: Sequence[str], start: int) -> int:
    fence = _FENCE.match(lines[start])
    assert fence is not None
    for i in range(start + 1, len(lines)):
        if lines[i].strip() == fence["fence"]:
            return i
    raise ValueError(f"line {start + 1}: unclosed code block")


def _scan(text: str, where: str) -> tuple[list[Block], list[int]]:
    """Walk the page's code blocks: the marked output blocks, and unmarked output-like ones.

    Markers count only outside code blocks, so a page may show one as an example.
    """
    lines = text.splitlines()
    blocks: list[Block] = []
    unmarked: list[int] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = _fence_end(lines, i)
        marker = _MARKER.match(lines[i - 1].strip()) if i > 0 else None
        if marker is not None:
            if fence["lang"] != "console":
                raise ValueError(
                    f"{where}:{i}: an output marker must sit right above a console block"
                )
            command, status, vary = _parse_spec(marker["spec"], f"{where}:{i}")
            blocks.append(
                Block(command, status, vary, i + 1, i, end, "\n".join(lines[i + 1 : end]))
            )
        elif fence["lang"] in OUTPUT_LANGS:
            unmarked.append(i + 1)
        i = end + 1
    return blocks, unmarked


def find_blocks(text: str, where: str = "page") -> list[Block]:
    """The marked output blocks of a page, in order."""
    return _scan(text, where)[0]


def unmarked_blocks(text: str) -> list[int]:
    """1-based lines of output-looking code blocks (console/text/output) with no marker."""
    return _scan(text, "page")[1]


def _argv(command: str) -> tuple[list[str], dict[str, str]]:
    words = shlex.split(command)
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if not words or words[0] not in ("python", "pytest"):
        raise ValueError(f"an output command starts with python or pytest: {command!r}")
    prefix = [sys.executable] if words[0] == "python" else [sys.executable, "-m", "pytest"]
    return prefix + words[1:], env


def run_command(block: Block) -> str:
    """Run the block's command from the repository root; return its standard output."""
    argv, extra = _argv(block.command)
    env = os.environ | {"PYTHONPATH": str(ROOT), "COLUMNS": "100"} | extra
    env.pop("PYTEST_ADDOPTS", None)  # a reader's own pytest options would change what it prints
    proc = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    if proc.returncode != block.exit_status:
        raise RuntimeError(
            f"`{block.command}` exited {proc.returncode}, expected {block.exit_status}:\n"
            f"{proc.stderr[-3000:]}"
        )
    return proc.stdout


def render(block: Block, stdout: str) -> str:
    """The console block for ``stdout``: the command line, then the output, trailing blanks cut."""
    lines = [f"$ {block.command}", *(line.rstrip() for line in stdout.rstrip().splitlines())]
    return "```console\n" + "\n".join(lines) + "\n```"


def _masked(text: str, vary: str | None) -> str:
    return text if vary is None else re.sub(vary, "…", text, flags=re.MULTILINE)


def stale(block: Block, fresh: str) -> str | None:
    """A diff if the page's block differs from ``fresh`` (masking ``vary``), else None."""
    want = _masked(fresh, block.vary).splitlines()
    have = _masked("```console\n" + block.body + "\n```", block.vary).splitlines()
    if want == have:
        return None
    return "\n".join(difflib.unified_diff(have, want, "page", "command", lineterm=""))


def check_page(path: Path, *, write: bool = False) -> tuple[list[str], list[str]]:
    """A page's stale blocks (diffs) and unmarked blocks; with ``write``, rewrite the stale ones."""
    text = path.read_text()
    blocks, unmarked = _scan(text, path.name)
    missing = [f"{path.name}:{n}: a console/text block without an output marker" for n in unmarked]
    lines = text.splitlines()
    diffs: list[str] = []
    for block in reversed(blocks):  # from the end, so that earlier indices stay valid
        fresh = render(block, run_command(block))
        diff = stale(block, fresh)
        if diff is not None:
            diffs.insert(
                0, f"{path.name}:{block.line}: `{block.command}` prints otherwise:\n{diff}"
            )
            lines[block.start : block.end + 1] = fresh.splitlines()
    if write and diffs:
        path.write_text("\n".join(lines) + "\n")
    return diffs, missing


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m docs_tools.outputs", description=__doc__.split("\n")[0]
    )
    p.add_argument("pages", nargs="*", type=Path, help="pages to check (default: docs/*.md)")
    p.add_argument("--write", action="store_true", help="rewrite stale blocks in place")
    args = p.parse_args(argv)
    failed = False
    for page in args.pages or sorted(DOCS.glob("*.md")):
        diffs, missing = check_page(page, write=args.write)
        for problem in missing + diffs:
            print(problem)
        failed |= bool(missing) or (bool(diffs) and not args.write)
        if args.write and diffs:
            print(f"{page}: rewrote {len(diffs)} block(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
