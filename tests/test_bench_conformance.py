"""The suite-cost benchmark runs end to end (tiny sizes) and prints its ratio table."""

from __future__ import annotations

import pytest

from benchmarks import conformance as bench_conformance


def test_bench_prints_suite_and_backend_time_per_step(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_conformance.main(["--seqs", "2", "--context", "20", "--decodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "| step | steps | suite ms/step | backend ms/step | suite / backend |" in out
    decode = next(line for line in out.splitlines() if line.startswith("| decode"))
    cells = [c.strip() for c in decode.strip("|").split("|")]
    assert cells[1] == "2" and float(cells[2]) > 0 and float(cells[3]) > 0 and float(cells[4]) > 0
