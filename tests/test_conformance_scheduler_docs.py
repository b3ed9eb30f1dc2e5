"""docs/scheduler-conformance.md shows only output that its commands print today.

Every ``console`` block on the page that shows output holds one command; the
test runs it, in a fresh interpreter from the repository root, and compares
what it prints with the page (doctest's ``...`` matches anything, and wall
times are not compared). So the worked example's
passing run, its broken variant's report, and the replay of that report are
all real. Blocks with commands and no output are left alone.
"""

from __future__ import annotations

import doctest
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "scheduler-conformance.md"
_TIME = re.compile(r"\b\d+\.\d s\b")


def _blocks() -> list[tuple[str, str]]:
    """``(command, shown output)`` of every console block that shows output."""
    found = []
    for body in re.findall(r"```console\n(.*?)```", PAGE.read_text(), flags=re.DOTALL):
        lines = body.splitlines()
        commands = [line for line in lines if line.startswith("$ ")]
        shown = [line for line in lines if not line.startswith("$ ")]
        if shown:
            assert len(commands) == 1 and lines[0] == commands[0], body
            found.append((commands[0][2:], "\n".join(shown) + "\n"))
    return found


def _same(shown: str, printed: str) -> bool:
    checker = doctest.OutputChecker()
    flags = doctest.ELLIPSIS
    return checker.check_output(_TIME.sub("T s", shown), _TIME.sub("T s", printed), flags)


def _replay_from(report: str) -> str:
    """The replay script a failure report prints, as the page tells a reader to save it."""
    body = report.split("(save as replay.py, run: python replay.py)\n", 1)[1]
    return body.split("\nreproduce the run:", 1)[0]


def test_the_page_shows_the_worked_example_and_its_broken_variant() -> None:
    commands = [command for command, _ in _blocks()]
    assert len(commands) == 3, commands
    assert "my_scheduler.py:MyScheduler" in commands[0]
    assert "my_scheduler.py:MyBrokenScheduler" in commands[1]
    assert commands[2] == "python replay.py"


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a command as a reader would, in a fresh interpreter.

    Not in this process: Hypothesis draws some values from constants of the
    modules already imported, so the same seed gives the same run only with
    the same imports.
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *argv[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_every_printed_output_on_the_page_is_what_the_command_prints(tmp_path: Path) -> None:
    report = ""
    for command, shown in _blocks():
        argv = shlex.split(command)
        if argv[:3] == ["python", "-m", "conformance"]:
            done = _run(argv, ROOT)
            printed = report = done.stdout  # progress lines go to stderr
            assert done.returncode in (0, 1), done.stderr
        else:
            assert argv == ["python", "replay.py"], command
            (tmp_path / "replay.py").write_text(_replay_from(report))
            done = _run(argv, tmp_path)
            assert done.returncode == 1
            printed = done.stdout + done.stderr
        assert _same(shown, printed), (
            f"the page shows for `{command}`:\n{shown}\nit prints:\n{printed}"
        )


def test_the_code_excerpts_are_the_example_s_code() -> None:
    example = (ROOT / "tests" / "third_party_scheduler" / "my_scheduler.py").read_text()
    excerpts = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)
    assert excerpts
    for excerpt in excerpts:
        for chunk in excerpt.split("    ...\n"):
            assert chunk.strip() in example, chunk
