"""``python -m tools.engine_demo`` prints a metrics table and the equivalence line, and exits 0."""

from __future__ import annotations

import pytest
import torch

from tools import engine_demo


def test_demo_runs_and_matches_unbatched(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        code = engine_demo.main(["--backend", "reference", "--requests", "16", "--baseline"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "identical to unbatched: 16/16 requests" in out
    assert "continuous batching on reference" in out and "static batching" in out
    assert "preemptions=" in out and "prefix_hit_rate=" in out
    for cls in ("chat", "document"):
        assert f"\n{cls} " in out, out
