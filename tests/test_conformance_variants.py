"""What the suite draws for attention variants and fp8 KV, and how it reports them.

Only declared variants and KV dtypes are drawn; the values make each variant
matter (windows several times shorter than long contexts, so whole 64-key
tiles lie before them; fp8 scales at which values saturate); and a failure
names the variant and KV dtype of the failing layer.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from variant_workloads import VARIANT_WORKLOADS

from conformance.judges.dtypes import round_to
from conformance.lockstep import variants
from conformance.lockstep.configs import configs
from conformance.lockstep.driver import ConformanceFailure, Lockstep
from conformance.lockstep.numpy_backend import NumpyPagedBackend
from conformance.lockstep.plan import plan_for
from conformance.lockstep.workload import LONG_PROMPTS, WorkloadConfig, tie_values
from conformance.planted.variants import Fp8NoSaturation, WindowOffByOne
from conformance.run.runner import run_suite
from spec.attention import VARIANTS
from spec.backend import ReferenceBackend
from spec.capabilities import Capabilities
from spec.kv_geometry import KV_DTYPES
from spec.quant import FP8_FORMATS, quantize, quantize_range, round_fp8

TILE = 64  # keys per tile of the Triton kernel on the CPU path, and of OnlineSoftmaxNoRescale


@settings(max_examples=50, deadline=None)
@given(
    declared=st.sets(st.sampled_from(VARIANTS)),
    kv_dtypes=st.sets(st.sampled_from(KV_DTYPES)),
    long_context=st.booleans(),
    data=st.data(),
)
def test_only_declared_variants_and_kv_dtypes_are_drawn(
    declared: set[str], kv_dtypes: set[str], long_context: bool, data: st.DataObject
) -> None:
    caps = Capabilities("x", variants=declared, kv_dtypes=kv_dtypes)
    plan = plan_for(caps)
    plan = plan if not long_context else replace(plan, kind="long")
    config: WorkloadConfig = data.draw(configs(plan))
    for layer in range(config.geometry.num_layers):
        v = config.variant(layer)
        assert v.features <= declared
        if v.window is not None:
            assert v.window in (variants.LONG_WINDOWS if long_context else variants.WINDOWS)
    kv = config.geometry.kv_dtype
    assert kv is None or kv in kv_dtypes


def test_long_windows_leave_whole_tiles_before_them() -> None:
    """Every long window is shorter than the shortest long prompt, and the longest prompt
    leaves at least three whole 64-key tiles before every long window."""
    assert max(variants.LONG_WINDOWS) < LONG_PROMPTS[0]
    assert min(variants.LONG_WINDOWS) * 4 <= LONG_PROMPTS[0]  # several times shorter
    for w in variants.LONG_WINDOWS:
        assert (LONG_PROMPTS[1] - w + 1) // TILE >= 3


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("level", variants.FP8_SATURATION)
def test_fp8_scales_are_powers_of_two_that_saturate_at_their_level(
    kv_dtype: str, level: float
) -> None:
    k_scale, v_scale = variants.fp8_scales(kv_dtype, level)
    assert k_scale == v_scale and math.frexp(k_scale)[0] == 0.5
    assert FP8_FORMATS[kv_dtype].max_finite * k_scale == level
    share = float(np.mean(np.abs(np.random.default_rng(0).standard_normal(100_000)) > level))
    assert 0.0004 < share < 0.4, "some unit-variance values saturate, most do not"


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_drawn_scales_differ_and_put_a_reciprocal_on_the_other_side_of_each_tie(
    kv_dtype: str,
) -> None:
    """K and V scales differ and are 7/8 of a power of two; at each, every tie value divides to
    an fp8 tie (so the spec rounds it to even) and multiplying by the float32 reciprocal
    instead rounds it the other way, which the spec accepts too; and each tie value is exact in
    bfloat16."""
    k_scale, v_scale = variants.drawn_scales(kv_dtype, 1.75, 0.875)
    assert k_scale != v_scale
    for scale in (k_scale, v_scale):
        assert math.frexp(scale)[0] != 0.5
        ties = np.array(tie_values(kv_dtype, scale))
        assert (round_to(ties, "bfloat16") == ties).all()
        right = quantize(ties, scale, kv_dtype)
        inverse = np.float32(1.0) / np.float32(scale)
        other = round_fp8(ties.astype(np.float32) * inverse, kv_dtype)
        assert (right != other).all()
        low, high = quantize_range(ties, scale, kv_dtype)
        assert ((other == low) | (other == high)).all()


def test_sinks_and_slopes_differ_per_head_and_layer() -> None:
    sinks = [variants.sink_values(1.0, 16.0, 8, layer) for layer in range(3)]
    assert all(len(set(s)) == 8 for s in sinks)
    assert all(len({s[h] for s in sinks}) == 3 for h in range(8)), "each head's sink moves"


@settings(max_examples=60, deadline=None)
@given(spread=st.sampled_from([1.0, 16.0]), data=st.data())
def test_draws_relative_to_the_spread_of_the_scores(spread: float, data: st.DataObject) -> None:
    caps = Capabilities("x", variants=set(VARIANTS))
    (v,) = data.draw(variants.layer_variants(caps, 1, 4, False, spread))
    if v.softcap is not None:
        assert v.softcap / spread in variants.SOFTCAPS
    if v.sinks is not None:  # head 1 sits at the level, heads 0 and 2 half a spread around it
        assert v.sinks == variants.sink_values(v.sinks[1] / spread, spread, 4)
        level = v.sinks[1] / spread
        assert level in variants.SINK_LEVELS
        assert v.sinks[0] == spread * (level - 0.5) and v.sinks[2] == spread * (level + 0.5)
    if v.alibi_slopes is not None:
        assert v.alibi_slopes[0] / spread in variants.ALIBI_STEEPEST


def test_a_failure_names_the_layers_variant_and_kv_dtype() -> None:
    workload, config, _ = VARIANT_WORKLOADS["WindowOffByOne"]
    with pytest.raises(ConformanceFailure) as caught:
        workload(Lockstep(WindowOffByOne(), config))
    assert "[layer 0: attention with window 3; KV float32]" in caught.value.difference.describe()
    workload, config, _ = VARIANT_WORKLOADS["Fp8NoSaturation"]
    with pytest.raises(ConformanceFailure) as caught:
        workload(Lockstep(Fp8NoSaturation(), config))
    described = caught.value.difference.describe()
    assert "[layer 0: plain attention; KV fp8_e4m3 (k_scale 2^-8, v_scale 2^-8)]" in described


def test_a_run_lists_variants_and_kv_dtypes_among_its_shapes() -> None:
    result = run_suite(ReferenceBackend(), "reference", run_seed=3, database=None, max_examples=30)
    assert result.passed
    shapes = " ".join(result.stats.configs)
    assert "fp8_e" in shapes and any(name in shapes for name in ("window", "softcap", "sinks"))


def test_a_backend_without_variants_gets_plain_unquantized_workloads() -> None:
    result = run_suite(
        _PlainOnly(), "plain-only", run_seed=5, database=None, max_examples=10, shrink=False
    )
    assert result.passed
    assert not any(" fp8_" in s or "window" in s for s in result.stats.configs)


class _PlainOnly(NumpyPagedBackend):
    """The numpy backend declaring what a backend written before variants declared."""

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(name="plain-only", device="cpu")
