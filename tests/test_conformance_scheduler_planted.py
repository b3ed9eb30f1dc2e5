"""Every planted scheduler bug: exit status 1, a shrunk workload, and a replay that fails too.

Each bug runs through the command line under the quick profile with
shrinking, with a seed that finds and shrinks it quickly (other seeds find
them too: ``python -m conformance selftest`` uses one seed for all). The
replay script from the JSON report is then run as it is and must raise the
same violation. The rule that catches each bug is the one the docs page's
table names.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conformance.cli import main
from conformance.planted.schedulers import ENGINE_ONLY, PLANTED
from conformance.scheduler.engine import EQUIVALENCE
from conformance.scheduler.rules import SchedulerInvariantError

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "scheduler-conformance.md"

SEEDS = {  # seeds that find and shrink each bug quickly
    "budget per sequence, not per step": 0,
    "max_num_seqs + 2 running": 0,
    "admits the newest waiting request first (LIFO)": 5,
    "feeds the prompt from its start after a prefix-cache hit": 4,
    "a finished sequence keeps its blocks": 0,
    "preempts a victim already scheduled this step": 4,
    "skips the next running sequence after a preemption": 0,
    "copy-on-write copies left out of the batch": 1,
    "swap-in drops the last partial block": 6,
    "a fork's samples read row 0's logits": 1,
    "speculative decode counted as one token in the budget": 0,
    "rejected drafts kept as verified in memory": 0,
}


def _documented_rules() -> dict[str, str]:
    """The docs page's table of planted bugs: ``| bug | the rule that catches it |``."""
    rows = re.findall(r"^\| (.+?) \| `(.+?)` \|$", PAGE.read_text(), flags=re.MULTILINE)
    return dict(rows)


def test_every_planted_bug_has_a_seed_and_a_row_in_the_docs() -> None:
    assert set(SEEDS) == set(PLANTED) == set(_documented_rules())
    assert len(PLANTED) >= 10 and len(set(PLANTED.values())) == len(PLANTED)
    for make in PLANTED.values():
        assert make.__doc__, f"{make} must say what it breaks"


@pytest.mark.heavy
@pytest.mark.parametrize("label", list(PLANTED))
def test_a_planted_bug_fails_with_a_shrunk_replay_that_fails_too(
    label: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make = PLANTED[label]
    ref = f"conformance.planted.schedulers:{getattr(make, '__name__', '')}"
    report = tmp_path / "report.json"
    argv = ["scheduler", "--scheduler", ref, "--seed", str(SEEDS[label]), "--no-database"]
    assert main([*argv, "--report", str(report)]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "SHRUNK FAILING WORKLOAD" in out and "with shrinking" in out
    data = json.loads(report.read_text())
    failure = data["failure"]
    assert failure["rule"] == _documented_rules()[label]
    assert (failure["rule"] == EQUIVALENCE) == (make in ENGINE_ONLY)
    assert data["examples"] > data["first_failure_example"]  # shrinking ran
    assert len(failure["workload"]["requests"]) <= 6 and not failure["flaky"]
    with pytest.raises(SchedulerInvariantError) as replayed:
        exec(compile(failure["replay_script"], "replay.py", "exec"), {})
    assert replayed.value.rule == failure["rule"] and str(replayed.value) == (
        f"step {failure['step']}: {failure['detail']}"
    )
