"""``python -m conformance scheduler``: passing runs, reports, setup errors, the engine opt-out.

The planted bugs are in ``test_conformance_scheduler_planted.py``; the docs
page's worked example in ``test_conformance_scheduler_docs.py`` (its command
outputs are checked by ``test_docs.py``, like every page's).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from pathlib import Path

import pytest

from conformance.cli import main
from conformance.errors import SetupError
from conformance.planted.schedulers import BudgetPerSequence, _Wrapped
from conformance.scheduler.engine import EQUIVALENCE, MODEL, EngineExecutor
from conformance.scheduler.invariants import run_checked
from conformance.scheduler.report import replay_script, reproduce_command
from conformance.scheduler.rules import SchedulerInvariantError
from conformance.scheduler.suite import (
    PROFILES,
    SchedulerRunResult,
    SuiteStats,
    check_workload,
    load_scheduler,
    run_scheduler_suite,
)
from conformance.scheduler.workloads import Workload
from paged_spec.engine.tiny_model import generate_alone
from spec.request import Request
from spec.scheduler import (
    ContinuousScheduler,
    FinishedRequest,
    SchedulerConfig,
    SchedulerOutput,
    StaticScheduler,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "tests" / "third_party_scheduler" / "my_scheduler.py"
CONTINUOUS = "spec.scheduler:ContinuousScheduler"


def test_continuous_scheduler_passes_and_writes_both_reports(tmp_path: Path) -> None:
    """The command itself, in a fresh interpreter (the seed decides the run given its imports)."""
    report, junit = tmp_path / "r.json", tmp_path / "new" / "dir" / "r.xml"  # dirs made
    argv = ["scheduler", "--scheduler", CONTINUOUS, "--seed", "2", "--max-examples", "40"]
    argv += ["--no-database", "--report", str(report), "--junit", str(junit)]
    done = subprocess.run(
        [sys.executable, "-m", "conformance", *argv],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert f"scheduler {CONTINUOUS!r} (profile quick, seed 2): PASSED" in out
    assert "paths exercised" in out and "invariants checked" in out and "skipped:" not in out
    data = json.loads(report.read_text())
    assert data["passed"] is True and data["seed"] == 2 and data["failure"] is None
    assert data["examples"] == 40 and data["invariants"][EQUIVALENCE] > 0
    for path in ("preemptions by recomputation", "preemptions by swapping", "forked samples"):
        assert data["paths"][path] > 0, path
    assert data["paths"]["copy-on-write copies"] > 0 and data["paths"]["prefix-cache hit tokens"]
    assert {"3", "5", "6", "12", "48"} & set(data["block_sizes"])
    suite = ET.parse(junit).getroot()
    assert suite.get("failures") == "0" and suite.get("tests") == "2"
    assert [c.get("name") for c in suite.iter("testcase")] == ["invariants", EQUIVALENCE]


def test_the_static_scheduler_and_the_outside_example_pass() -> None:
    for ref in ("spec.scheduler:StaticScheduler", f"{EXAMPLE}:MyScheduler"):
        result = run_scheduler_suite(load_scheduler(ref), ref, run_seed=4, max_examples=25)
        assert result.passed, result.failure


def test_a_module_factory_loads_from_sys_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    make = load_scheduler("my_scheduler:MyScheduler")
    assert type(make(SchedulerConfig(num_blocks=2, block_size=2))).__name__ == "MyScheduler"


def test_a_failure_writes_the_violation_into_both_reports(tmp_path: Path) -> None:
    report, junit = tmp_path / "r.json", tmp_path / "r.xml"
    ref = "conformance.planted.schedulers:BudgetPerSequence"
    argv = ["scheduler", "--scheduler", ref, "--seed", "3", "--no-database", "--no-shrink"]
    assert main([*argv, "--report", str(report), "--junit", str(junit)]) == 1
    failure = json.loads(report.read_text())["failure"]
    assert failure["rule"] == "token budget" and "tokens scheduled, budget" in failure["detail"]
    assert failure["workload"]["config"]["max_num_batched_tokens"] >= 1
    assert f"--scheduler {ref} --profile quick --seed 3" in failure["reproduce"]
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert cases["invariants"].find("failure") is not None
    assert cases[EQUIVALENCE].find("failure") is None


_MISSING_MEMBERS = """
def make(config):
    return object()
"""


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("spec.scheduler", "is not module:factory"),
        ("spec.scheduler:NoSuchFactory", "has no callable"),
        ("no_such_module_xyz:make", "importing no_such_module_xyz raised"),
        ("spec.scheduler:SchedulerConfig", "calling SchedulerConfig(SchedulerConfig(num_blocks=4"),
        ("missing/file.py:make", "no file missing/file.py"),
        ("{tmp}/no_members.py:make", "which lacks config, manager, metrics, submit"),
    ],
)
def test_setup_errors_exit_2_and_say_what_to_fix(
    ref: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "no_members.py").write_text(_MISSING_MEMBERS)
    ref = ref.format(tmp=tmp_path)
    assert main(["scheduler", "--scheduler", ref, "--no-database"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--profile", "forever"],
        ["--max-examples", "0"],
        ["--max-examples", "many"],
        ["--seed", "x"],
        ["--no-such-flag"],
    ],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["scheduler", "--scheduler", CONTINUOUS, *argv])
    assert exited.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_a_missing_scheduler_argument_exits_2() -> None:
    with pytest.raises(SystemExit) as exited:
        main(["scheduler"])
    assert exited.value.code == 2


def test_the_python_api_rejects_bad_settings() -> None:
    with pytest.raises(SetupError, match="at least 1"):
        run_scheduler_suite(ContinuousScheduler, "x", max_examples=0, database=None)
    with pytest.raises(SetupError, match="unknown profile 'forever'"):
        run_scheduler_suite(ContinuousScheduler, "x", profile="forever", database=None)
    assert [p.max_examples for p in PROFILES.values()] == [300, 1500, 8000]


@pytest.mark.parametrize("flag", ["--report", "--junit"])
def test_an_unwritable_report_is_a_setup_error_before_the_run(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    target = blocker / "r.out"  # a file where a folder must be
    argv = ["scheduler", "--scheduler", CONTINUOUS, "--seed", "1", "--max-examples", "2"]
    assert main([*argv, "--no-database", flag, str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # found before the run: nothing ran
    assert f"cannot write the report {target}" in captured.err


_COSTS_ONLY = """
from spec.scheduler import ContinuousScheduler


class CostsOnly(ContinuousScheduler):
    engine_loop_unsupported = "it only costs batches for a simulator"
"""


def test_a_scheduler_without_an_engine_loop_is_reported_as_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, junit = tmp_path / "costs_only.py", tmp_path / "r.xml"
    path.write_text(_COSTS_ONLY)
    argv = ["scheduler", "--scheduler", f"{path}:CostsOnly", "--seed", "2", "--max-examples", "5"]
    assert main([*argv, "--no-database", "--junit", str(junit)]) == 0
    out = capsys.readouterr().out
    why = "token-exact equivalence: it only costs batches for a simulator"
    assert f"  skipped:\n    {why}" in out and EQUIVALENCE + "\n" not in out
    case = [c for c in ET.parse(junit).getroot().iter("testcase")][1]
    skipped = case.find("skipped")
    assert skipped is not None and skipped.get("message") == why


def test_a_saved_failure_replays_first_on_the_next_run(tmp_path: Path) -> None:
    ref = "conformance.planted.schedulers:BudgetPerSequence"
    first = run_scheduler_suite(BudgetPerSequence, ref, run_seed=3, database=tmp_path, shrink=False)
    assert first.stats.first_failure_example is not None and first.stats.first_failure_example > 1
    again = run_scheduler_suite(BudgetPerSequence, ref, run_seed=9, database=tmp_path, shrink=False)
    assert again.stats.first_failure_example == 1 and any(tmp_path.iterdir())


def test_the_replay_of_a_file_scheduler_runs_from_any_directory() -> None:
    ref = "tests/x_scheduler.py:make"
    w = Workload(SchedulerConfig(num_blocks=1, block_size=1), (), {}, {})
    result = SchedulerRunResult(ref, "quick", 5, SuiteStats(), workload=w)
    result.failure = SchedulerInvariantError("token budget", 0, "2 tokens scheduled, budget 1")
    absolute = f"{Path('tests/x_scheduler.py').resolve()}:make"
    assert f"load_scheduler({absolute!r})" in replay_script(result)
    assert f"--scheduler {absolute} " in reproduce_command(result)


# -- the checks themselves ---------------------------------------------------------------

_PRESSURE = SchedulerConfig(
    num_blocks=8,
    block_size=3,
    max_num_batched_tokens=8,
    max_num_seqs=4,
    preemption="swap",
    num_host_blocks=12,
    enable_prefix_caching=True,
)
_REQUESTS = tuple(
    Request(request_id=i, prompt=(9, 8, 7, 6) + (i,) * (i % 3), max_new_tokens=6, n=1 + i % 2)
    for i in range(6)
)
_WORKLOAD = Workload(_PRESSURE, _REQUESTS, {i: i // 2 for i in range(6)}, {})


def test_the_fixed_workload_takes_every_path_and_matches_alone() -> None:
    stats = SuiteStats()
    check_workload(ContinuousScheduler, _WORKLOAD, stats)
    for path in (
        "preemptions by swapping",
        "swap-ins",
        "forked samples",
        "copy-on-write copies",
        "prefix-cache hit tokens",
        "multi-token rows (prefill chunks)",
    ):
        assert stats.paths[path] > 0, path
    assert stats.checks[EQUIVALENCE] == sum(r.n for r in _REQUESTS)


def test_batching_changes_nothing_the_model_generates() -> None:
    report = run_checked(
        StaticScheduler, _PRESSURE, _REQUESTS, _WORKLOAD.arrivals, executor=EngineExecutor
    )
    for r in _REQUESTS:
        assert report.results[r.request_id].outputs == tuple(
            generate_alone(MODEL, r, i) for i in range(r.n)
        )


class _SharedIds(_Wrapped):
    """Reports one made-up sequence id as every request's sequence."""

    def update(self, sampled: Mapping[int, int]) -> list[FinishedRequest]:
        return [dataclasses.replace(d, seq_ids=(999,)) for d in super().update(sampled)]


class _HostOutOfRange(_Wrapped):
    """Swaps out into host blocks past the host pool."""

    def rewrite(self, out: SchedulerOutput, before: set[int]) -> SchedulerOutput:
        far = self.config.num_host_blocks
        swaps = tuple(
            dataclasses.replace(s, host_blocks=tuple(far + h for h in s.host_blocks))
            for s in out.swap_out
        )
        return dataclasses.replace(out, swap_out=swaps)


@pytest.mark.parametrize(
    ("broken", "rule", "message"),
    [
        (_SharedIds, "sequence ids unique to one request", "sequence 999 belongs to requests"),
        (_HostOutOfRange, "decisions the engine can execute", "outside the host pool of 12"),
    ],
)
def test_the_last_checks_catch_what_they_are_for(broken: type, rule: str, message: str) -> None:
    check_workload(ContinuousScheduler, _WORKLOAD)
    with pytest.raises(SchedulerInvariantError) as info:
        check_workload(broken, _WORKLOAD)
    assert info.value.rule == rule and message in str(info.value)


def test_the_seed_alone_decides_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not which modules were imported, nor their constants (Hypothesis draws from those)."""

    def run() -> tuple[int, int, dict[str, int]]:
        result = run_scheduler_suite(
            ContinuousScheduler, "x", run_seed=8, max_examples=20, database=None
        )
        return result.stats.steps, result.stats.requests, dict(result.stats.paths)

    before = run()
    (tmp_path / "many_constants.py").write_text(f"VALUES = {list(range(-3, 4000, 7))}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__("many_constants")
    assert run() == before
