"""The device envelope, run on this machine at reduced scale, and deterministic drawing.

``--envelope device --scale N`` draws the device envelope's shapes (every
head count to 8, production shapes of 32/8 heads at head dim 128, chunked
long prompts, wide mixed steps) for a CPU backend, with lengths and widths
divided by ``N``: the machinery of a GPU run, end to end, at CI cost.

A seed must draw the same workload every time, on every envelope: Hypothesis
replays a failing example to report it, and a replay that draws differently
is reported as an unreliable run, blaming a correct backend.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend_gpu.torch_backend import TorchBackend
from backend_gpu.triton_backend import TritonBackend
from conformance.cli import main
from conformance.lockstep.envelope import CPU, DEVICE, Envelope
from conformance.lockstep.envelope_scale import MIN_LONG, MIN_WIDE, scaled
from conformance.reports.report import text_report
from conformance.run.control import RunControl
from conformance.run.result import RunResult
from conformance.run.runner import run_suite
from spec.backend import Backend

SCALE = 64
"""The CI scale: long prompts of 64 to 512 tokens, wide steps of 4 sequences."""


@settings(max_examples=30, deadline=None)
@given(env=st.sampled_from((CPU, DEVICE)), factor=st.integers(1, 256))
def test_a_scaled_envelope_divides_lengths_and_widths_and_keeps_shapes(
    env: Envelope, factor: int
) -> None:
    small = scaled(env, factor)
    lo, hi = small.long_prompts
    assert MIN_LONG <= lo <= hi <= max(env.long_prompts[1], MIN_LONG)
    assert all(lo <= n <= hi for n in small.long_lengths)
    assert all(c >= MIN_LONG for c in small.long_chunks) or factor == 1
    assert all(MIN_WIDE <= w <= max(env.wide_seqs) for w in small.wide_seqs) or factor == 1
    assert small.long_pool_tokens >= hi
    kept = ("head_dims", "block_sizes", "kv_heads", "gqa_ratios", "layers", "production")
    assert all(getattr(small, k) == getattr(env, k) for k in kept)


def _run(backend: Backend, envelope: str, passes: tuple[str, ...], seed: int = 1) -> RunResult:
    control = RunControl(envelope=envelope, envelope_scale=SCALE, shrink=False)
    return run_suite(
        backend, "x", run_seed=seed, database=None, max_examples=1, passes=passes, control=control
    )


def test_the_device_envelope_runs_at_reduced_scale_for_the_torch_backend() -> None:
    result = _run(TorchBackend(), "device", ("wide", "long"))
    assert result.passed, text_report(result)
    assert result.envelope == "device" and result.stats.steps > 0
    assert any(f"divided by {SCALE}" in note for note in result.notes)
    assert "long prompt, 64..512 tokens" in " ".join(result.stats.rules)


def test_the_device_envelope_runs_at_reduced_scale_for_the_triton_backend() -> None:
    result = _run(TritonBackend(), "device", ("wide",))
    assert result.passed, text_report(result)
    assert result.stats.coverage.widest_step >= 4


@pytest.mark.parametrize("envelope", ["cpu", "device"])
def test_a_seed_draws_the_same_workload_twice_on_every_envelope(envelope: str) -> None:
    """Replay an example: the same configurations, rules and steps, draw for draw."""
    first, second = (_run(TorchBackend(), envelope, ("wide", "long"), seed=7) for _ in range(2))
    assert first.passed and second.passed
    assert first.stats.configs == second.stats.configs
    assert first.stats.rules == second.stats.rules
    assert (first.stats.steps, first.stats.longest) == (second.stats.steps, second.stats.longest)
    assert first.stats.checks == second.stats.checks


def test_the_envelope_and_scale_options_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--backend", "torch", "--envelope", "gpu"])
    with pytest.raises(SystemExit):
        main(["run", "--backend", "torch", "--scale", "0"])
    assert "--scale" in capsys.readouterr().err
