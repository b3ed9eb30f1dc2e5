"""docs/scheduler-conformance.md: its worked example is the example's code and its real report.

The page's command outputs are ``<!-- output: ... -->`` blocks, which
``tests/test_docs.py`` runs and compares (``python -m docs_tools.outputs
--write docs/scheduler-conformance.md`` regenerates them); its ``>>>``
examples run there too. This file checks what ties them together: the
replay shown as Python is the one the broken variant's report prints, and
the code excerpts are the example scheduler's code.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from conformance.scheduler.workloads import Workload
from docs_tools.outputs import find_blocks
from spec.request import Request
from spec.scheduler import SchedulerConfig

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "scheduler-conformance.md"
EXAMPLE = ROOT / "tests" / "third_party_scheduler" / "my_scheduler.py"


def _section(title: str) -> str:
    text = PAGE.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def test_the_page_runs_the_worked_example_and_its_broken_variant() -> None:
    commands = [b.command for b in find_blocks(PAGE.read_text(), PAGE.name)]
    assert len(commands) == 2, commands
    assert "my_scheduler.py:MyScheduler " in commands[0]
    assert "my_scheduler.py:MyBrokenScheduler " in commands[1]


def _workload(source: str) -> Workload:
    """The workload a piece of Python (a replay script, an example) assigns to ``workload``."""
    statement = source[source.index("workload = Workload(") :]
    statement = statement[: statement.index("\n)\n") + 2]
    names: dict[str, Any] = {"Workload": Workload, "Request": Request}
    names["SchedulerConfig"] = SchedulerConfig
    exec(statement, names)
    assert isinstance(names["workload"], Workload)
    return names["workload"]


def test_the_replay_shown_as_python_is_the_reports_replay() -> None:
    report = find_blocks(PAGE.read_text(), PAGE.name)[1].body
    doctest = re.search(r"```pycon\n(.*?)```", _section("A worked example"), re.DOTALL)
    assert doctest is not None
    source = "\n".join(line[4:] for line in doctest[1].splitlines() if line[:4] in (">>> ", "... "))
    assert _workload(source + "\n") == _workload(report)
    violation = re.search(r"^VIOLATION of '.+' at step (\d+)\n  (.+)$", report, re.MULTILINE)
    assert violation is not None
    step, detail = violation.groups()
    assert doctest[1].rstrip().endswith(f"SchedulerInvariantError: step {step}: {detail}")


def test_the_code_excerpts_are_the_example_s_code() -> None:
    example = EXAMPLE.read_text()
    excerpts = re.findall(r"```python\n(.*?)```", _section("A worked example"), re.DOTALL)
    assert len(excerpts) == 2
    for excerpt in excerpts:
        assert excerpt.strip() in example, excerpt
