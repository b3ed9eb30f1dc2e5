"""``--jobs N``: one run in N processes side by side, each example run once, in the first
process to claim it; the merged result is the one-process run's, whoever ran what."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conformance.cli import main
from conformance.run.discovery import load_backend
from conformance.run.runner import run_suite
from conformance.run.shard import Claims

ROOT = Path(__file__).resolve().parents[1]
SEGFAULTS = f"{ROOT / 'tests' / 'misbehaving_backends.py'}:SegfaultsInWriteKV"
BROKEN = "conformance.planted.backends:WritesPaddingSlot"
TIMING = ("jobs", "wall_time_s", "slowest_call", "time_split")  # how it ran, not what it checked


def _report(tmp_path: Path, name: str, *argv: str) -> tuple[int, dict[str, Any]]:
    path = tmp_path / f"{name}.json"
    status = main(["run", "--no-database", "--report", str(path), *argv])
    return status, json.loads(path.read_text())


def test_two_jobs_check_exactly_what_one_process_checks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every count of the report (examples, steps, rules, invariants, shapes, coverage,
    margins) is the one-process run's: each example ran once, in one of the jobs."""
    argv = ("--backend", "reference", "--seed", "3", "--max-examples", "4")
    one_status, one = _report(tmp_path, "one", *argv)
    two_status, two = _report(tmp_path, "two", *argv, "--jobs", "2")
    assert one_status == two_status == 0
    assert two["jobs"] == 2 and one["jobs"] == 1
    differ = sorted(k for k in one if one[k] != two[k] and k not in TIMING)
    assert differ == [], {k: (one[k], two[k]) for k in differ}
    assert one["examples"] > 8 and one["coverage"]["pairs"]["not_reached"] == []
    assert "(profile quick, seed 3, in 2 jobs): PASSED" in capsys.readouterr().out


def test_an_example_claimed_by_one_process_is_only_drawn_by_another(tmp_path: Path) -> None:
    """The first process claims every example it reaches and runs them all; a second one
    sharing its claims runs none, and draws every example through the spec alone."""
    claims = Claims(tmp_path)

    def run() -> int:
        backend = load_backend("reference")
        result = run_suite(
            backend, "reference", run_seed=5, database=None, max_examples=3, claims=claims
        )
        assert result.passed, result.difference
        return result.stats.examples

    first = run()
    assert first > 3 and len(list(tmp_path.iterdir())) >= first
    assert run() == 0


def test_a_failure_found_in_one_job_is_the_run_s_with_the_command_that_reproduces_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, data = _report(
        tmp_path, "r", "--backend", BROKEN, "--seed", "7", "--no-shrink", "--jobs", "2"
    )
    out = capsys.readouterr().out
    assert status == 1
    assert "(profile quick, seed 7, in 2 jobs): FAILED" in out
    assert "--seed 7 --jobs 2" in out, "the reproduce command runs the same jobs"
    assert data["jobs"] == 2 and data["failure"]["kind"] == "K"
    assert data["failure"]["replay_script"].count("ls = Lockstep(") == 1


def test_a_job_that_crashes_fails_the_run_and_its_stack_is_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, data = _report(
        tmp_path, "r", "--backend", SEGFAULTS, "--seed", "1", "--max-examples", "2", "--jobs", "2"
    )
    out = capsys.readouterr().out
    assert status == 1
    assert "killed by signal SIGSEGV (Segmentation fault) during" in out
    assert "WHAT THE BACKEND PROCESS PRINTED LAST" in out
    assert data["failure"]["kind"] == "crash" and data["failure"]["diagnostics"]


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--jobs", "0"], "--jobs: must be at least 1, got 0"),
        (["--jobs", "two"], "--jobs: 'two' is not an integer"),
        (["--jobs", "65"], "--jobs: at most 64 processes side by side, got 65"),
        (["--jobs", "2", "--in-process"], "--in-process runs it in this one: drop one of them"),
    ],
)
def test_bad_jobs_are_usage_errors_naming_the_problem(
    argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--backend", "reference", *argv])
    assert exit_.value.code == 2
    assert problem in capsys.readouterr().err
