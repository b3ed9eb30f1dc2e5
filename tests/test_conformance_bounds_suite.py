"""``--check-bounds`` through the suite: planted kernels flagged, the Triton backend passes.

The planted backends (:mod:`conformance.planted.kernels`) return right outputs,
so only the bounds check fails them; each run here is small (a few short
examples, no long ones) because every kernel runs under Triton's interpreter.
"""

from __future__ import annotations

# First: on a CPU-only machine this sets TRITON_INTERPRET, before triton is imported.
import backend_gpu  # noqa: F401

# isort: split
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from backend_gpu.kernels._checks import interpreting
from backend_gpu.triton_backend import TritonBackend
from benchmarks import bounds as bench_bounds
from conformance.bounds.checker import CONTRACT, BoundsChecker
from conformance.cli import main
from conformance.errors import SetupError
from conformance.lockstep.driver import ConformanceFailure, Lockstep
from conformance.lockstep.workload import WorkloadConfig
from conformance.planted.kernels import (
    PLANTED_BOUNDS,
    ReadsOnePastARow,
    ReadsPastTheTable,
)
from conformance.reports.report import replay_script, summary_lines, text_report
from conformance.run.control import RunControl, environment_options
from conformance.run.replay_check import same_outcome
from conformance.run.result import RunResult
from conformance.run.runner import run_suite
from conformance.testing import _merge
from spec.backend import Backend, ReferenceBackend
from spec.batch import PADDING_RULE
from spec.kv_geometry import KVGeometry

pytestmark = pytest.mark.skipif(
    not interpreting(), reason="the bounds checker needs TRITON_INTERPRET=1 (a CPU run)"
)
PAST_TABLE = "conformance.planted.kernels:ReadsPastTheTable"
PAST_ROW = "conformance.planted.kernels:ReadsOnePastARow"
SMALL = ["--max-examples", "3", "--long-examples", "0", "--no-database", "--seed", "7"]


def _short_run(backend: Backend, ref: str, mode: str | None, passes: tuple[str, ...]) -> RunResult:
    control = RunControl(shrink=False, long_examples=0, check_bounds=mode)
    return run_suite(
        backend,
        ref,
        run_seed=20240601,
        database=None,
        max_examples=3,
        control=control,
        passes=passes,
    )


# -- planted kernels, through the CLI -------------------------------------------------------------


@pytest.mark.heavy
def test_a_read_past_the_table_fails_an_isolated_run_as_bounds_in_every_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The option travels to the child; the child's replay reproduces the failure."""
    report, junit = tmp_path / "r.json", tmp_path / "r.xml"
    argv = ["run", "--backend", PAST_TABLE, "--check-bounds", *SMALL, "--no-shrink"]
    assert main([*argv, "--report", str(report), "--junit", str(junit)]) == 1
    out = capsys.readouterr().out
    assert "FAILED: a kernel accessed memory out of bounds" in out
    assert "backend calls in a child process" in out
    assert "  bounds check (default): " in out and f"PADDING_RULE): {CONTRACT}" in out
    first = out.split("FIRST DIFFERENCE\n")[1].splitlines()[0]
    for part in ("kernel _planted_attention", "nearest table_ptr", "load", "past the end"):
        assert part in first, (part, first)
    data = json.loads(report.read_text())
    failure = data["failure"]
    assert failure["kind"] == "bounds" and failure["nondeterministic"] is False
    assert failure["reproduce"].endswith("--check-bounds default")
    assert "bounds=BoundsChecker(strict=False)" in failure["replay_script"]
    assert data["control"]["check_bounds"] == "default"
    bounds = data["bounds"]
    assert bounds["mode"] == "default" and bounds["launches"] > 0 and bounds["violations"] >= 1
    props = {p.get("name"): p.get("value") for p in ET.parse(junit).getroot().iter("property")}
    assert str(props["bounds"]).startswith("bounds check (default): ")


def test_a_read_one_past_a_row_fails_strict_mode() -> None:
    result = _short_run(ReadsOnePastARow(), PAST_ROW, "strict", ("short",))
    out = text_report(result)
    assert not result.passed and result.difference is not None
    assert result.difference.what == "bounds"
    assert "block-table padding in table_ptr" in out and "bounds check (strict)" in out


@pytest.mark.heavy
def test_default_mode_allows_reading_padding_and_the_unchecked_suite_passes_both() -> None:
    """The contract allows a padding read; outputs are right, so only the check sees either bug."""
    padding = _short_run(ReadsOnePastARow(), PAST_ROW, "default", ("short",))
    assert padding.passed and padding.bounds is not None and padding.bounds.launches > 0
    for cls, _ in PLANTED_BOUNDS.values():
        assert _short_run(cls(), cls.__name__, None, ("short",)).passed
    assert "allowed by default, flagged in strict mode" in PADDING_RULE == CONTRACT


# -- correct kernels -------------------------------------------------------------------------------


def test_the_triton_backend_passes_strict_mode_through_the_suite() -> None:
    result = _short_run(TritonBackend(device="cpu"), "triton", "strict", ("short", "wide"))
    assert result.passed, text_report(result)
    b = result.bounds
    assert b is not None and b.mode == "strict" and b.violations == 0
    assert b.launches > 0 and b.accesses > 0
    assert b.notes == (), b.notes  # the block table was recognised: padding reads were checked
    assert any(line.startswith("  bounds check (strict): ") for line in summary_lines(result))


# -- the lockstep and the replay -------------------------------------------------------------------


def _config() -> WorkloadConfig:
    return WorkloadConfig(KVGeometry(1, 8, 4, 1, 8, "float32"), 2, 0.35, 1)


def _nine_tokens(ls: Lockstep) -> None:
    """A 9-token prompt with block size 4: a table row of 3, which the whole tile reads as 4."""
    ls.add(0, list(range(9)))
    ls.step([(0, list(range(9)))])
    ls.finish()


def test_the_lockstep_fails_a_call_with_a_violation_as_kind_bounds() -> None:
    _nine_tokens(Lockstep(ReadsPastTheTable(), _config()))  # unchecked: right outputs, a pass
    checker = BoundsChecker()
    ls = Lockstep(ReadsPastTheTable(), _config(), bounds=checker)
    assert ls.log[0].endswith(", bounds=BoundsChecker(strict=False))")
    with pytest.raises(ConformanceFailure) as caught:
        _nine_tokens(ls)
    diff = caught.value.difference
    assert (diff.what, diff.step, diff.layer) == ("bounds", 1, 0)
    assert checker.violations[0].describe() in diff.detail
    assert diff.describe().startswith("the backend failed at step 1, layer 0: a kernel accessed")
    assert checker.launches > 0  # the priming writes, the step's write, copy and attention


def test_the_replay_script_reproduces_the_bounds_failure_and_only_with_the_checker() -> None:
    result = _short_run(ReadsOnePastARow(), PAST_ROW, "strict", ("short",))
    assert result.difference is not None and result.difference.what == "bounds"
    assert result.nondeterminism is None  # the run's own replay gave the same outcome
    script = replay_script(result).replace(f"load_backend({PAST_ROW!r})", "ReadsOnePastARow()")
    script = "from conformance.planted.kernels import ReadsOnePastARow\n" + script
    assert "bounds=BoundsChecker(strict=True)" in script
    with pytest.raises(ConformanceFailure) as caught:
        exec(compile(script, "replay.py", "exec"), {})
    assert same_outcome(result.difference, caught.value.difference)
    unchecked = script.replace(", bounds=BoundsChecker(strict=True)", "")
    exec(compile(unchecked, "replay.py", "exec"), {"print": lambda *_: None})  # passes


# -- bad input and what cannot be checked ----------------------------------------------------------


def test_a_bad_mode_is_a_usage_error_naming_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["run", "--backend", "reference", "--check-bounds", "loose"])
    assert exited.value.code == 2
    assert "'loose' is not a bounds-check mode: choose from default, strict" in (
        capsys.readouterr().err
    )
    with pytest.raises(SetupError, match="check_bounds must be None or one of default, strict"):
        RunControl(check_bounds="loose")
    with pytest.raises(SetupError, match="PAGED_SPEC_CHECK_BOUNDS='loose'"):
        environment_options({"PAGED_SPEC_CHECK_BOUNDS": "loose"})
    with pytest.raises(ValueError, match="bounds-check mode 'loose': choose from default, strict"):
        BoundsChecker.for_mode("loose")
    with pytest.raises(TypeError, match="takes a bool"):
        BoundsChecker(strict="strict")  # type: ignore[arg-type]
    assert repr(BoundsChecker.for_mode("strict")) == "BoundsChecker(strict=True)"


@pytest.mark.parametrize(
    ("value", "mode"), [("strict", "strict"), ("default", "default"), ("1", "default"), ("0", None)]
)
def test_the_environment_knob_sets_the_mode_for_the_pytest_ways(value: str, mode: str) -> None:
    env = environment_options({"PAGED_SPEC_CHECK_BOUNDS": value}).control
    assert env.check_bounds == mode
    assert _merge(RunControl(shrink=False), env).check_bounds == mode


def test_without_the_interpreter_a_checked_run_is_refused_before_it_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(SetupError, match=r"TRITON_INTERPRET is not set.*compute-sanitizer"):
        _short_run(TritonBackend(device="cpu"), "triton", "default", ("short",))


def test_a_backend_without_triton_kernels_is_refused_when_no_example_launched_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["run", "--backend", "reference", "--check-bounds", *SMALL, "--in-process"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "setup error: --check-bounds: the run's " in err
    assert "launched no Triton kernel under the interpreter" in err
    with pytest.raises(SetupError, match="nothing could be checked"):
        _short_run(ReferenceBackend(), "reference", "strict", ("short",))


def test_the_suite_benchmark_prints_each_mode_against_the_unchecked_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench_bounds.main(["--suite", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("the suite on the Triton backend: ")
    assert [line.split()[0] for line in lines[1:]] == ["unchecked", "default", "strict"]
    assert "1.00x unchecked" in lines[1] and "0 violations" in lines[3]
    with pytest.raises(SystemExit):
        bench_bounds.main(["--suite", "0"])
