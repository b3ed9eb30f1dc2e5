"""The copy-on-write bookkeeping benchmark runs, says what it measured, and keeps its state at P."""

from __future__ import annotations

import pytest

from benchmarks import block_manager as bench_block_manager


def test_bench_prints_each_operation_at_each_p_with_the_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench_block_manager.main(["--sizes", "2", "50", "--repeats", "5"]) == 0
    out = capsys.readouterr().out
    assert "with P copy-on-write copies pending" in out
    assert "| P = 2" in out and "| P = 50" in out and "ratio P=50 / P=2" in out
    for op in bench_block_manager.OPERATIONS:
        row = next(line for line in out.splitlines() if line.startswith(op))
        assert row.rstrip().endswith("x"), row


def test_measure_keeps_p_copies_pending() -> None:
    times, setup = bench_block_manager.measure(7, repeats=3)  # asserts P copies at the end
    assert set(times) == set(bench_block_manager.OPERATIONS) and setup > 0


@pytest.mark.parametrize("argv", [["--sizes", "10"], ["--sizes", "0", "5"], ["--repeats", "0"]])
def test_bench_rejects_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench_block_manager.main(argv)
    assert exit_.value.code == 2
