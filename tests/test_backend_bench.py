"""The benchmark script runs end to end on CPU (tiny case) and says its figures mean nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import attention as bench_attention


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is long; run it by hand")
def test_bench_runs_on_cpu_and_disclaims_its_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.md"
    assert bench_attention.main(["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "NOT performance figures" in printed
    assert "Correctness vs the spec's float64 reference: passed" in printed
    text = out.read_text()
    assert text.strip() == printed.strip() and "| decode b=2 ctx=64 | float16 |" in text
