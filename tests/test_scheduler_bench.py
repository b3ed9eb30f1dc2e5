"""The scheduler benchmark runs, prints its three scenarios with ratios, and refuses bad flags."""

from __future__ import annotations

import pytest

from benchmarks import scheduler as bench_scheduler


def test_bench_prints_each_scenario_with_a_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_scheduler.main(["--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line[:28].strip(): line.split() for line in lines[2:]}
    assert set(rows) == {s.name for s in bench_scheduler.SCENARIOS}
    assert rows["16 running"][-1] == "1.00"
    assert all(float(r[-1]) > 0 for r in rows.values())


def test_bench_refuses_a_bad_repeat_count() -> None:
    with pytest.raises(SystemExit) as info:
        bench_scheduler.main(["--repeats", "0"])
    assert info.value.code == 2
