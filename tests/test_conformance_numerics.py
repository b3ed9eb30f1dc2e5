"""Numerics judged beside a same-precision reference; large pools allocated lazily and compared."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backend_gpu.torch_backend import TorchBackend
from conformance.judges.dtypes import round_to
from conformance.judges.numerics import (
    BIAS_LIMIT_ULPS,
    ExampleErrors,
    ExampleMeter,
    output_errors,
    same_precision,
    ulp,
)
from conformance.lockstep.driver import ConformanceFailure, Lockstep
from conformance.lockstep.numpy_backend import F32, NumpyPagedBackend
from conformance.lockstep.workload import WorkloadConfig, geometry_for, large_pool_base, scale_for
from conformance.planted.backends import Fp16Accumulation, RoundsTowardZero, WritesPaddingSlot
from conformance.run.runner import run_suite
from spec.attention import paged_attention
from spec.attention_batched import paged_attention_batched
from spec.backend import ReferenceBackend
from spec.kv_geometry import KVGeometry
from spec.kv_memory import KVMemory


class RoundsPLikeAGpu(NumpyPagedBackend):
    """An honest half-precision kernel: online softmax over 32-key tiles, P rounded before P @ V."""

    def attention_path(self) -> str:
        return "online softmax, 32-key tiles"

    def _weighted_sum(self, scores: F32, v: F32) -> F32:
        dtype = self._geo().dtype
        n = scores.shape[0]
        m = np.full(n, -np.inf, np.float32)
        total = np.zeros(n, np.float32)
        acc = np.zeros((n, v.shape[1]), np.float32)
        for lo in range(0, scores.shape[1], 32):
            s = scores[:, lo : lo + 32]
            m_new = np.maximum(m, s.max(axis=1))
            alpha, p = np.exp(m - m_new), np.exp(s - m_new[:, None])
            total = total * alpha + p.sum(axis=1)
            rounded = p if dtype == "float32" else round_to(p, dtype).astype(np.float32)
            acc = acc * alpha[:, None] + rounded @ v[lo : lo + 32]
            m = m_new
        out: F32 = acc / total[:, None]
        return out


def _config(dtype: str, base: int = 0, large: bool = False) -> WorkloadConfig:
    geometry, heads = geometry_for(16, 2, 2, 32, dtype, 1)
    base = large_pool_base(geometry) if base else 0
    return WorkloadConfig(geometry, heads, scale_for(32, large), 3, block_base=base)


def _long_run(ls: Lockstep, length: int = 200) -> None:
    prompt = [t % 64 for t in range(length)]
    ls.add(0, prompt)
    ls.add(1, prompt[:40])
    cut = length * 3 // 5
    ls.step([(0, prompt[:cut]), (1, prompt[:40])])
    ls.step([(0, prompt[cut:]), (1, [7])])
    for t in range(3):
        ls.step([(0, [t]), (1, [t])])
    ls.finish()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("large", [False, True])
def test_an_honest_kernel_that_rounds_p_passes_and_truncation_does_not(
    dtype: str, large: bool
) -> None:
    _long_run(Lockstep(RoundsPLikeAGpu(), _config(dtype, large=large)))
    with pytest.raises(ConformanceFailure) as caught:
        _long_run(Lockstep(RoundsTowardZero(), _config(dtype, large=large)))
    diff = caught.value.difference
    assert diff.what == "outputs" and diff.example is not None and not diff.example.unbiased
    assert diff.example.mean_outward_ulps < -0.3 and "toward zero" in diff.describe()


def test_fp16_accumulation_fails_with_a_report_that_says_by_how_much_and_against_what() -> None:
    with pytest.raises(ConformanceFailure) as caught:
        _long_run(Lockstep(Fp16Accumulation(), _config("float16")))
    diff = caught.value.difference
    assert diff.numerics is not None or diff.example is not None
    if diff.numerics is not None:
        text = diff.describe()
        assert "x the allowed" in text and "same-precision reference" in text
        assert "p99" in text and "mean signed" in text and "scale regime: usual" in text
        assert diff.numerics.p99_error is not None and diff.numerics.excess > 1


def test_a_failure_names_the_path_the_backend_took() -> None:
    class WrongScale(RoundsPLikeAGpu):
        def _scale(self, scale: float, head_dim: int) -> float:
            return scale * 1.5

    with pytest.raises(ConformanceFailure) as caught:
        _long_run(Lockstep(WrongScale(), _config("float32", large=True)))
    text = caught.value.difference.describe()
    # no launch to read and no name the suite knows: the plan's path, and the backend's own name
    assert "attention path: " in text and "(the suite's plan, not observed)" in text
    assert "the backend calls it 'online softmax, 32-key tiles'" in text
    assert "scale regime: large logits" in text


@settings(max_examples=20)
@given(
    exact=st.lists(st.floats(-4, 4, allow_subnormal=False), min_size=1, max_size=40),
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
)
def test_rounding_to_nearest_is_within_half_an_ulp_and_passes(
    exact: list[float], dtype: str
) -> None:
    x = np.asarray(exact)
    rounded = round_to(x, dtype)
    assert (np.abs(rounded - x) <= 0.5 * ulp(x, dtype) * (1 + 1e-12)).all()
    assert output_errors(x, rounded, rounded, dtype).passed


def test_same_precision_reference_rounds_like_a_half_precision_kernel() -> None:
    memory_config = _config("float16")
    ls = Lockstep(ReferenceBackend(), memory_config)
    ls.add(0, list(range(30)))
    ls.step([(0, list(range(30)))])
    q = np.random.default_rng(0).standard_normal((30, 4, 32))
    g = memory_config.geometry
    mem: KVMemory = ls.memory
    from spec.batch import build_batch  # a fresh batch of the same sequence, for the reference

    ls.manager.append_slots(0, [1])
    batch = build_batch(ls.manager, [(0, 1)])
    exact = paged_attention(q[:1], batch, mem, 0, 0.3)
    same = paged_attention_batched(
        q[:1], batch, mem, 0, 0.3, precision=same_precision(g.dtype, False)
    )
    assert 0 < np.abs(round_to(same, "float16") - exact).max() < 4 * ulp(exact, "float16").max()


def test_the_example_meter_needs_enough_outputs_to_judge() -> None:
    meter = ExampleMeter("float16")
    x = np.linspace(0.1, 0.9, 100)
    meter.add(x, x + 0.4 * ulp(x, "float16"), round_to(x, "float16"))
    assert meter.result().passed  # 100 outputs: too few to call a lean
    meter.add(np.repeat(x, 5), np.repeat(x + 0.4 * ulp(x, "float16"), 5), np.repeat(x, 5))
    assert not meter.result().unbiased


# -- large pools ------------------------------------------------------------------------------


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("backend", [ReferenceBackend, NumpyPagedBackend, TorchBackend])
def test_a_pool_past_2_31_elements_costs_only_what_is_touched(backend: type) -> None:
    config = _config("float16", base=1)
    g = config.geometry
    before = _resident_bytes()
    ls = Lockstep(backend(), config)
    _long_run(ls, length=60)
    assert ls.backend_geometry.num_elements > 2**31
    assert ls.coverage.max_offset >= 2**31
    assert _resident_bytes() - before < 512 * 2**20, "the large pool was touched whole"
    assert ls.checks["guard blocks around a large pool unchanged"] > 0
    assert ls.backend_geometry.num_blocks == config.block_base + g.num_blocks + 1


def test_torch_cache_fills_small_pools_with_nan_and_reads_blocks() -> None:
    backend = TorchBackend()
    backend.create_cache(KVGeometry(1, 4, 2, 1, 2, "float16"))
    k, _ = backend.read_blocks(0, [3, 1])
    assert k.shape == (2, 2, 1, 2) and np.isnan(k).all()
    backend.write_kv(0, np.ones((1, 1, 2), np.float32), np.ones((1, 1, 2), np.float32), [6])
    k, _ = backend.read_blocks(0, [3])
    assert k[0, 0].tolist() == [[1.0, 1.0]] and torch.isnan(backend._mem().k[0][0]).all()


@settings(max_examples=25)
@given(
    writes=st.lists(st.tuples(st.integers(0, 23), st.floats(-2, 2)), max_size=12),
    copies=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=2),
)
def test_a_lazy_memory_reads_exactly_like_a_dense_one(
    writes: list[tuple[int, float]], copies: list[tuple[int, int]]
) -> None:
    dense, lazy = KVMemory(2, 6, 4, 1, 2), KVMemory(2, 6, 4, 1, 2, lazy=True)
    for slot, x in dict(writes).items():
        row = np.full((1, 1, 2), x)
        for mem in (dense, lazy):
            mem.write(1, row, -row, [slot])
    pairs = [(s, d) for s, d in copies if s != d][:1]
    for mem in (dense, lazy):
        mem.copy_blocks(pairs)
    for layer in (0, 1):
        for a, b in zip(
            dense.read_blocks(layer, range(6)), lazy.read_blocks(layer, range(6)), strict=True
        ):
            assert np.array_equal(a, b, equal_nan=True)
    slots = sorted(dict(writes))[:3]
    if slots:
        table = sorted({s // 4 for s in slots})
        n = len(table) * 4
        for a, b in zip(dense.gather(1, table, n), lazy.gather(1, table, n), strict=True):
            assert np.array_equal(a, b, equal_nan=True)


def test_a_stray_write_into_a_large_pool_is_found_by_the_sweep_and_the_end() -> None:
    """Above WHOLE_POOL_SLOTS only written blocks are compared each step: the end still sees all."""
    config = _config("float16")
    ls = Lockstep(WritesPaddingSlot(), config, whole_pool_slots=0)
    ls.add(0, [1, 2, 3])
    ls.step([(0, [1, 2, 3])])  # the padding row lands in the last slot: far from block 0
    with pytest.raises(ConformanceFailure) as caught:
        ls.finish()
    assert caught.value.difference.block == config.geometry.num_blocks - 1
    assert caught.value.log[-1] == "ls.finish()"
    result = run_suite(
        WritesPaddingSlot(), "conformance.planted.backends:WritesPaddingSlot", run_seed=2,
        database=None, max_examples=3, passes=("wide",), shrink=False,
    )  # fmt: skip
    assert result.difference is not None and result.difference.what == "K"


_LEANS = st.floats(-8.0, 8.0, allow_nan=False)


@given(reference=_LEANS, share=st.floats(0.0, 1.0), beyond=st.floats(0.0, 4.0))
def test_a_lean_between_none_and_the_references_passes_and_beyond_it_is_measured_from_its_edge(
    reference: float, share: float, beyond: float
) -> None:
    """The declared precision is what a kernel may do: a TF32 kernel computing one path in
    full float32 leans less than its reference, and is not biased for it."""
    inside = share * reference  # between exact arithmetic (0) and the reference's own lean
    away = -1.0 if reference > 0 else 1.0  # the side of 0 away from the reference
    for lean, want in ((inside, 0.0), (reference - away * beyond, beyond), (away * beyond, beyond)):
        e = ExampleErrors("float32", 1.0, 1.0, lean, lean, 600, reference, reference)
        assert e.lean == pytest.approx(want, abs=1e-9), (lean, reference)
        assert e.unbiased == (e.lean <= BIAS_LIMIT_ULPS["float32"])
