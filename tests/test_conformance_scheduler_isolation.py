"""No scheduler can end a scheduler-suite run silently: exits, crashes, hangs, types, mutation.

Each misbehaving scheduler of ``tests/misbehaving_schedulers.py`` runs
through ``python -m conformance scheduler`` (its child process) and must end
with status 1, the problem named in the text report, and the JSON and JUnit
reports written. Runs are short: three workloads, unshrunk, and a one-second
call timeout for the hangs.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conformance.cli import main
from conformance.scheduler.invariants import run_checked
from conformance.scheduler.rules import CALLS, CONFIG, RETURNS, SchedulerInvariantError
from conformance.scheduler.suite import CRASH, HANG, INTERNAL, run_scheduler_suite
from spec.request import Request
from spec.scheduler import SchedulerConfig

ROOT = Path(__file__).resolve().parents[1]
SCHEDULERS = ROOT / "tests" / "misbehaving_schedulers.py"


@pytest.mark.parametrize(
    ("name", "rule", "named"),
    [
        ("ExitsInStep", CALLS, "step() called sys.exit(0)"),
        ("ExitsHardInStep", CRASH, "exited with status 0 during scheduler.step() at step 1"),
        ("SegfaultsInStep", CRASH, "killed by signal SIGSEGV (Segmentation fault) during sc"),
        ("HangsInStep", HANG, "scheduler.step() at step 1 did not return within 1 s"),
        ("HangsInUpdate", HANG, "scheduler.update() at step 0 did not return within 1 s"),
        ("HangsInFactory", HANG, "the scheduler's factory (building one for a workload) did no"),
        ("ReturnsNoneFromStep", RETURNS, "step() returned None (NoneType), not a SchedulerOutput"),
        ("RaisesBaseException", CALLS, "update() raised Escapes: a BaseException of the sched"),
        ("RaisesItsOwnSeats", CONFIG, "the scheduler's config changed"),
    ],
)
def test_a_misbehaving_scheduler_fails_the_run_with_every_report(
    name: str, rule: str, named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report, junit = tmp_path / "r.json", tmp_path / "r.xml"
    argv = ["scheduler", "--scheduler", f"{SCHEDULERS}:{name}", "--seed", "1", "--no-database"]
    argv += ["--max-examples", "3", "--no-shrink", "--call-timeout", "1"]
    status = main([*argv, "--report", str(report), "--junit", str(junit)])
    out = capsys.readouterr().out
    assert status == 1, out
    assert named in out and "FAILED" in out
    data = json.loads(report.read_text())
    assert data["passed"] is False and data["failure"]["rule"] == rule, data["failure"]
    assert ET.parse(junit).getroot().get("failures") == "1"
    if rule in (HANG, CRASH) and name != "HangsInFactory":  # the workload it was running
        assert "check_workload(make, workload)" in data["failure"]["replay_script"]


def test_a_crash_report_shows_what_the_scheduler_process_printed_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["scheduler", "--scheduler", f"{SCHEDULERS}:SegfaultsInStep", "--seed", "1"]
    assert main([*argv, "--no-database", "--max-examples", "2"]) == 1
    out = capsys.readouterr().out
    assert "WHAT THE SCHEDULER PROCESS PRINTED LAST" in out and "Fatal Python error" in out
    assert "FAILING WORKLOAD, not shrunk: the scheduler process crashed" in out


def test_in_process_a_hang_a_base_exception_and_a_mutated_config_are_failures() -> None:
    from misbehaving_schedulers import HangsInUpdate, RaisesBaseException, RaisesItsOwnSeats

    for make, rule in ((HangsInUpdate, HANG), (RaisesBaseException, CALLS)):
        result = run_scheduler_suite(
            make,
            make.__name__,
            run_seed=1,
            database=None,
            max_examples=2,
            shrink=False,
            call_timeout_s=1.0,
        )
        assert result.failure is not None and result.failure.rule == rule
    result = run_scheduler_suite(
        RaisesItsOwnSeats, "seats", run_seed=1, database=None, max_examples=2, shrink=False
    )
    assert result.failure is not None and result.failure.rule == CONFIG


@pytest.mark.parametrize(
    ("name", "rule", "named"),
    [
        ("ReturnsNoneFromStep", RETURNS, "step() returned None (NoneType), not a SchedulerOutput"),
        ("ReturnsIntsFromUpdate", RETURNS, "update() returned a list holding 5 (int), not a Fini"),
        ("ReturnsNoneFromHasUnfinished", RETURNS, "has_unfinished() returned None (NoneType)"),
        ("RaisesBaseException", CALLS, "update() raised Escapes"),
        ("ExitsInStep", CALLS, "step() called sys.exit(0)"),
        (
            "RaisesItsOwnSeats",
            CONFIG,
            "it was built with SchedulerConfig(num_blocks=4, block_size=2,",
        ),
    ],
)
def test_the_checker_names_each_misbehaviour_at_its_step(name: str, rule: str, named: str) -> None:
    import misbehaving_schedulers

    make = getattr(misbehaving_schedulers, name)
    config = SchedulerConfig(num_blocks=4, block_size=2)
    requests = [Request(request_id=0, prompt=(1, 2, 3), max_new_tokens=3)]
    with pytest.raises(SchedulerInvariantError) as caught:
        run_checked(make, config, requests)
    assert caught.value.rule == rule and named in str(caught.value), caught.value
    assert config == SchedulerConfig(num_blocks=4, block_size=2)  # the caller's copy unchanged


def test_an_error_the_checks_stop_with_is_a_reported_failure_not_a_traceback() -> None:
    from misbehaving_schedulers import ReturnsOutputWithoutBatch

    result = run_scheduler_suite(
        ReturnsOutputWithoutBatch,
        "no-batch",
        run_seed=1,
        database=None,
        max_examples=2,
        shrink=False,
    )
    assert result.failure is not None and result.failure.rule == INTERNAL
    assert "the checks stopped with AttributeError" in result.failure.detail
    assert result.kind == "internal" and result.workload is not None  # replayable
