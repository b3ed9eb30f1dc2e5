"""The device-contract benchmark runs end to end (tiny sizes) and prints both contracts' ratio."""

from __future__ import annotations

import pytest
import torch

from benchmarks import device_contract as bench_device_contract


def test_bench_prints_time_per_step_under_each_contract(
    capsys: pytest.CaptureFixture[str],
) -> None:
    threads = torch.get_num_threads()
    argv = ["--seqs", "2", "--context", "20", "--decodes", "2", "--layers", "1", "--repeats", "1"]
    assert bench_device_contract.main(argv) == 0
    assert torch.get_num_threads() == threads, "the thread count is restored"
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "ms/step" not in line]
    assert [r.split("|")[1].strip() for r in rows] == [
        c[0] for c in bench_device_contract.CONTRACTS
    ]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[1].split()[0]) > 0 and float(cells[3]) > 0 and float(cells[4]) > 0
    assert rows[-1].rstrip().endswith("| 1.00 | 1.00 |")  # the device row is the baseline
