"""Every pass judged: one failure does not hide another, and each is reported.

A backend with two bugs, each visible in its own pass (outputs rounded toward
zero in the short examples, int32 element offsets in the large pool), fails
both, and the short pass, drawn again without the first failure's cause
(float16), fails in bfloat16 too; the text, JSON and JUnit reports list all
three; the run still fails (exit status 1 in the CLI: ``passed`` is false).
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
from conformance.run.runner import RunResult, _same_values, run_suite

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


ALSO_IN_BFLOAT16 = "short, without dtype float16"
"""The short pass drawn again without float16 (the first failure's cause): the rounding
bug shows in bfloat16 too, a failure of its own."""
FAILING = ["short", ALSO_IN_BFLOAT16, "large pool"]


def test_a_failing_pass_does_not_stop_the_others(both: RunResult) -> None:
    assert not both.passed
    assert [f.pass_name for f in both.failures] == FAILING
    assert [f.cause for f in both.failures][:2] == ["dtype float16", "dtype bfloat16"]
    assert both.difference is both.failures[0].difference  # the first is the headline
    assert both.nondeterminism is None


def test_the_reports_list_each_failure(both: RunResult, tmp_path: Path) -> None:
    text = text_report(both)
    assert "FAILURES: 3 distinct, in 3 failing passes" in text
    assert "pass short: outputs:" in text and "pass large pool: " in text
    assert f"pass {ALSO_IN_BFLOAT16}: outputs:" in text and "cause: dtype bfloat16" in text
    data = json.loads(json.dumps(json_report(both)))
    assert [f["pass"] for f in data["failures"]] == FAILING
    assert data["distinct_failures"] == 3 and all(f["workload"] for f in data["failures"])
    write_junit(both, tmp_path / "j.xml")
    suite = ET.parse(tmp_path / "j.xml").getroot()
    assert suite.get("failures") == "3"
    names = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None]
    assert names == ["lockstep", f"lockstep ({ALSO_IN_BFLOAT16})", "lockstep (large pool)"]


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
