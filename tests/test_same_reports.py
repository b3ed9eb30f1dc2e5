"""The report comparison a refactor is proved by: timings masked, anything else a difference."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.same_reports import differences, main


def test_timings_are_masked_and_anything_else_differs(tmp_path: Path) -> None:
    a, b, c = (tmp_path / f"{name}.txt" for name in "abc")
    a.write_text("PASSED\n  89 examples, 1134 steps, 37.5 s\n  ... job 1/2: 3 examples\n")
    b.write_text("PASSED\n  89 examples, 1134 steps, 41.0 s\n")
    c.write_text("PASSED\n  89 examples, 1135 steps, 37.5 s\n")
    assert differences(a, b) == [] and main([str(a), str(b)]) == 0
    assert any("1135 steps" in line for line in differences(a, c))
    assert main([str(a), str(c)]) == 1


def test_a_json_report_is_compared_without_its_timings(tmp_path: Path) -> None:
    first, second = tmp_path / "1.json", tmp_path / "2.json"
    report = {"verdict": "PASSED", "time_split": {"wall_s": 3.0}, "examples": 89}
    first.write_text(json.dumps(report))
    second.write_text(json.dumps({**report, "time_split": {"wall_s": 9.0}}))
    assert differences(first, second) == []
    second.write_text(json.dumps({**report, "examples": 90}))
    assert differences(first, second)
