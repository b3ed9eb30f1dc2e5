"""``benchmarks.conformance --device-shapes``: each part of a step timed, in its own process."""

from __future__ import annotations

import pytest

from benchmarks.conformance import main
from benchmarks.conformance_device import KINDS, measure


@pytest.mark.parametrize("oracle", ["spec", "fast"])
def test_a_device_shape_step_splits_the_suites_time_and_measures_its_memory(oracle: str) -> None:
    kind = KINDS[0].scaled(64)  # a decode of 1 sequence at 32 tokens, 32/8 heads
    split = measure(kind, oracle)
    assert split.backend_s > 0 and split.reference_s > 0 and split.comparison_s > 0
    assert split.total_s >= split.backend_s + split.reference_s + split.comparison_s
    assert split.bookkeeping_s >= 0 and split.peak_bytes > 0


def test_the_scale_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--device-shapes", "--scale", "0"])
    assert "--scale must be at least 1" in capsys.readouterr().err
