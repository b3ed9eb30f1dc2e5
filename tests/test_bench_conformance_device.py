"""``benchmarks.conformance --device-shapes``: each part of a step timed, in its own process."""

from __future__ import annotations

import pytest

from benchmarks.conformance import main
from benchmarks.conformance_device import (
    BLOCK,
    DECODES,
    KINDS,
    ORACLES,
    SETUP_TOKENS,
    _setup_steps,
    measure,
)


def test_a_device_shape_step_splits_the_suites_time_and_measures_its_memory() -> None:
    """Each oracle: the parts timed, and the KV sent to its device: every block read by the
    step when sent afresh, only the blocks written when resident, nothing when read in place."""
    kind = KINDS[0].scaled(32)  # a decode of 2 sequences at 64 tokens, 32/8 heads
    sent = {}
    for oracle in ORACLES:
        split = measure(kind, oracle)
        assert split.backend_s > 0 and split.reference_s > 0 and split.comparison_s > 0
        assert split.total_s >= split.backend_s + split.reference_s + split.comparison_s
        assert split.bookkeeping_s >= 0 and split.peak_bytes > 0
        sent[oracle] = split.sent_bytes
    row = BLOCK * 8 * 128  # one block of one layer's K or V
    assert sent["spec"] == sent["fast"] == 0
    # K and V (float64) of every block read: 4 per sequence at 64 tokens, then 5 (65 to 67)
    blocks = [-(-(64 + i) // BLOCK) for i in range(DECODES)]
    assert sent["sent"] == 2 * 2 * row * 8 * sum(blocks) / DECODES
    assert sent["resident"] == 2 * 2 * row * 4  # the block each decode wrote, float32


def test_the_scale_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--device-shapes", "--scale", "0"])
    assert "--scale must be at least 1" in capsys.readouterr().err


def test_the_oracles_must_be_known(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--device-shapes", "--oracles", "fast,gpu"])
    assert "--oracles: expected some of spec, sent, fast, resident, got 'fast,gpu'" in (
        capsys.readouterr().err
    )


def test_the_untimed_state_is_built_in_steps_of_bounded_tokens() -> None:
    """Each prompt's first ``done`` tokens, in order, one chunk per sequence a step, at most
    ``SETUP_TOKENS`` tokens a step (the backend's own prefill then peaks no higher)."""
    prompts = {s: list(range(100 * s, 100 * s + 90)) for s in range(5)}
    steps = _setup_steps(prompts, 70)
    seen: dict[int, list[int]] = {s: [] for s in prompts}
    for work in steps:
        assert sum(len(chunk) for _, chunk in work) <= SETUP_TOKENS
        assert len({s for s, _ in work}) == len(work)
        for s, chunk in work:
            seen[s] += chunk
    assert seen == {s: p[:70] for s, p in prompts.items()}
    assert _setup_steps(prompts, 0) == []
    many = _setup_steps({0: list(range(3 * SETUP_TOKENS))}, 2 * SETUP_TOKENS + 5)
    assert [len(w[0][1]) for w in many] == [SETUP_TOKENS, SETUP_TOKENS, 5]
