"""Every pass judged: one failure does not hide another, and each is reported.

A backend with two bugs, each visible in its own pass (outputs rounded toward
zero in the short examples, int32 element offsets in the large pool), fails
both. The rounding's cause is not isolated (no named mistake reproduces it, and
the workload fails without each of its features), so the short pass ends
there rather than guess one; the offsets' cause is the large pool (the
workload passes in a small one). The text, JSON and JUnit reports list both
causes; the run still fails (exit status 1 in the CLI: ``passed`` is false).
``every_pass=False`` stops at the first, as the self-test does. A NaN output
replays as the same failure.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.planted.hidden import NaNPastEightKeys, RoundingHidesOverflow
from conformance.reports.report import json_report, text_report, write_junit
from conformance.run.control import RunControl
from conformance.run.replay_check import _same_values
from conformance.run.result import RunResult
from conformance.run.runner import run_suite

SEED = 20240601
PASSES = ("short", "large pool")
REF = "conformance.planted.hidden:RoundingHidesOverflow"


def _run(every_pass: bool) -> RunResult:
    control = RunControl(shrink=False, every_pass=every_pass)
    return run_suite(
        RoundingHidesOverflow(), REF, run_seed=SEED, database=None, control=control, passes=PASSES
    )


@pytest.fixture(scope="module")
def both() -> RunResult:
    return _run(every_pass=True)


FAILING = ["short", "large pool"]


def test_a_failing_pass_does_not_stop_the_others(both: RunResult) -> None:
    assert not both.passed
    assert [f.pass_name for f in both.failures] == FAILING
    rounding, offsets = both.failures
    assert not rounding.isolated and rounding.cause and rounding.cause.startswith("not isolated")
    assert offsets.isolated and offsets.cause and offsets.cause.startswith("the large pool")
    assert both.difference is both.failures[0].difference  # the first is the headline
    assert both.nondeterminism is None


def test_the_reports_list_each_failure(both: RunResult, tmp_path: Path) -> None:
    text = text_report(both)
    assert "FAILURES: 2 distinct causes, in 2 failing passes" in text
    assert "pass short: outputs:" in text and "pass large pool: " in text
    assert "  1. cause not isolated" in text and "  2. cause: the large pool" in text
    data = json.loads(json.dumps(json_report(both)))
    assert [f["pass"] for f in data["failures"]] == FAILING
    assert data["distinct_failures"] == 2 and all(f["workload"] for f in data["failures"])
    assert [c["passes"] for c in data["causes"]] == [["short"], ["large pool"]]
    write_junit(both, tmp_path / "j.xml")
    suite = ET.parse(tmp_path / "j.xml").getroot()
    assert suite.get("failures") == "2"
    names = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None]
    assert names == ["lockstep", "lockstep (large pool)"]


def test_every_pass_off_stops_at_the_first_failure() -> None:
    first = _run(every_pass=False)
    assert [f.pass_name for f in first.failures] == ["short"]
    assert "FAILURES" not in text_report(first)


def test_a_nan_output_is_a_difference_not_nondeterminism() -> None:
    result = run_suite(
        NaNPastEightKeys(),
        "conformance.planted.hidden:NaNPastEightKeys",
        run_seed=SEED,
        database=None,
        control=RunControl(shrink=False, every_pass=False),
        passes=("short",),
    )
    assert not result.passed and result.nondeterminism is None
    assert "not deterministic" not in text_report(result)


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=6))
def test_replayed_values_compare_nan_aware(values: list[float]) -> None:
    assert _same_values(tuple(values), tuple(values))
    if values:
        changed = [*values[:-1], 1.5 if values[-1] != 1.5 else 2.5]
        assert not _same_values(tuple(values), tuple(changed))
