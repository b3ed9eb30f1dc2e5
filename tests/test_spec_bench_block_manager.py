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


@pytest.mark.parametrize(
    "argv",
    [
        ["--sizes", "10"],
        ["--sizes", "0", "5"],
        ["--repeats", "0"],
        ["--integrity-sizes", "50", "50"],
        ["--integrity-repeats", "0"],
    ],
)
def test_bench_rejects_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench_block_manager.main(argv)
    assert exit_.value.code == 2


def test_bench_prints_check_integrity_against_linear_growth(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--sizes", "2", "5", "--repeats", "2", "--integrity-sizes", "20", "200"]
    assert bench_block_manager.main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("check_integrity"))
    assert "P = 20:" in line and "P = 200:" in line and "T(P=200) / (10 x T(P=20)) = " in line


def test_check_integrity_is_linear_in_pending_copies() -> None:
    """10x the pending copies costs about 10x (quadratic was 70x at these sizes); a loose bound."""
    small = min(bench_block_manager.integrity_seconds(300, 3) for _ in range(3))
    large = min(bench_block_manager.integrity_seconds(3_000, 3) for _ in range(2))
    assert large < 10 * small * 3, (small, large)
