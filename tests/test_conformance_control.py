"""Run control: no shrinking, a shrink time limit, the long examples, a time budget, the knobs.

The same knobs come as flags (``python -m conformance run``) and as
``PAGED_SPEC_*`` environment variables (the pytest ways); both are tested here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.cli import main
from conformance.errors import SetupError
from conformance.planted.backends import CopiesKeyOnly
from conformance.run.control import RunControl, environment_options
from conformance.run.runner import run_suite
from conformance.testing import _merge
from spec.backend import ReferenceBackend
from spec.capabilities import Capabilities

BROKEN = "conformance.planted.backends:CopiesKeyOnly"


def _json(tmp_path: Path, *argv: str) -> tuple[int, dict[str, object], str]:
    report = tmp_path / "r.json"
    status = main(["run", *argv, "--seed", "7", "--no-database", "--report", str(report)])
    return status, json.loads(report.read_text()), report.read_text()


def test_time_budget_stops_early_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--backend", "reference", "--max-examples", "100000", "--time-budget", "1"]
    status, data, _ = _json(tmp_path, *argv)
    out = capsys.readouterr().out
    examples = data["examples"]
    assert status == 3  # PARTIAL: not a pass of the profile unless --budget-passes says so
    assert f"PARTIAL: passed within the time budget: {examples} examples" in out
    assert "this is not a full run" in out and "PASSED" not in out
    assert data["complete"] is False and data["stopped"] == "time budget"
    assert isinstance(examples, int) and 1 <= examples < 100000


def test_no_shrink_reports_the_workload_as_found(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--backend", BROKEN, "--seed", "7", "--no-database", "--no-shrink"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "FAILING WORKLOAD, not shrunk (--no-shrink)" in out
    assert "examples in all" in out  # no shrinking examples


@pytest.mark.heavy
def test_shrink_time_bounds_shrinking_and_keeps_the_smallest_failure() -> None:
    timed = run_suite(
        CopiesKeyOnly(), BROKEN, run_seed=7, database=None, control=RunControl(shrink_time_s=0.2)
    )
    assert timed.difference is not None and timed.shrunk
    assert "shrinking stopped at its 0.2 s limit" in timed.shrink_note
    full = run_suite(CopiesKeyOnly(), BROKEN, run_seed=7, database=None)
    assert full.stats.examples > timed.stats.examples  # the limit cut shrinking short
    assert not full.shrink_note


@pytest.mark.parametrize("long", [0, 2])
def test_long_examples_sets_the_long_context_pass(long: int) -> None:
    result = run_suite(
        ReferenceBackend(),
        "reference",
        run_seed=3,
        database=None,
        max_examples=2,
        control=RunControl(long_examples=long),
    )
    assert result.passed and result.requested == (2, long)
    long_shapes = sum(n for shape, n in result.stats.configs.items() if "long-context" in shape)
    assert (long_shapes > 0) == (long > 0)


@pytest.mark.parametrize(
    "flag",
    [
        ["--time-budget", "0"],
        ["--time-budget", "nan"],
        ["--shrink-time", "-1"],
        ["--call-timeout", "soon"],
        ["--long-examples", "-1"],
    ],
)
def test_bad_run_control_is_a_usage_error(
    flag: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["run", "--backend", "reference", *flag])
    assert exited.value.code == 2
    assert flag[0] in capsys.readouterr().err


def test_run_control_rejects_impossible_values() -> None:
    with pytest.raises(SetupError, match="time_budget_s"):
        RunControl(time_budget_s=0)
    with pytest.raises(SetupError, match="long_examples"):
        RunControl(long_examples=-2)


def test_environment_knobs_parse_and_name_a_bad_variable() -> None:
    env = {
        "PAGED_SPEC_PROFILE": "standard",
        "PAGED_SPEC_SEED": "12",
        "PAGED_SPEC_EXAMPLES": "4",
        "PAGED_SPEC_DTYPES": "float16, float32",
        "PAGED_SPEC_LONG_EXAMPLES": "0",
        "PAGED_SPEC_TIME_BUDGET": "30",
        "PAGED_SPEC_NO_SHRINK": "yes",
        "PAGED_SPEC_SHRINK_TIME": "5",
        "PAGED_SPEC_CALL_TIMEOUT": "0",
    }
    options = environment_options(env)
    assert (options.profile, options.seed, options.max_examples) == ("standard", 12, 4)
    assert options.dtypes == ("float16", "float32")
    assert options.control == RunControl(
        shrink=False, shrink_time_s=5, long_examples=0, time_budget_s=30, call_timeout_s=None
    )
    assert environment_options({}).control == RunControl()
    for name, value in (
        ("PAGED_SPEC_SEED", "x"),
        ("PAGED_SPEC_TIME_BUDGET", "-3"),
        ("PAGED_SPEC_NO_SHRINK", "maybe"),
    ):
        with pytest.raises(SetupError, match=name):
            environment_options({name: value})


def test_environment_knobs_override_class_attributes_and_keep_the_rest() -> None:
    ours = RunControl(shrink=False, time_budget_s=50)
    env = RunControl(time_budget_s=5)
    assert _merge(ours, env) == RunControl(shrink=False, time_budget_s=5)
    assert _merge(None, env) == env


def test_a_backend_that_vetoes_every_workload_is_a_setup_error() -> None:
    class VetoesAll(ReferenceBackend):
        @property
        def capabilities(self) -> Capabilities:
            return Capabilities("vetoes", excludes=lambda *_: "never")

    with pytest.raises(SetupError, match=r"vetoes every shape|could not draw one workload"):
        run_suite(VetoesAll(), "vetoes", run_seed=1, database=None, max_examples=2)
