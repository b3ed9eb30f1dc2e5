"""Attention variants and fp8 KV in the spec: against explicit loops, and torch's fp8 casts."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from spec.attention import AttentionVariant, alibi_slopes, attend
from spec.errors import ArgumentTypeError, ArgumentValueError, SpecError
from spec.kv_geometry import KVGeometry
from spec.kv_memory import KVMemory
from spec.quant import FP8_FORMATS, dequantize, quantize, round_fp8


def _loop_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    pos: int,
    scale: float,
    variant: AttentionVariant,
    head: int,
) -> np.ndarray:
    """One query head at ``pos`` over keys 0..pos of one KV head, each rule written out."""
    logits = {}
    for t in range(pos + 1):
        if variant.window is not None and not pos - variant.window < t:
            continue
        s = float(q @ k[t]) * scale
        if variant.softcap is not None:
            s = variant.softcap * math.tanh(s / variant.softcap)
        if variant.alibi_slopes is not None:
            s += variant.alibi_slopes[head] * (t - pos)
        logits[t] = s
    sink = None if variant.sinks is None else variant.sinks[head]
    top = max([*logits.values(), *([] if sink is None else [sink])])
    total = sum(math.exp(s - top) for s in logits.values())
    if sink is not None:
        total += math.exp(sink - top)
    return sum(math.exp(s - top) / total * v[t] for t, s in logits.items())  # type: ignore[no-any-return]


_VARIANTS = st.builds(
    lambda window, softcap, sinks, alibi, heads: AttentionVariant(
        window=window,
        softcap=softcap,
        sinks=None if sinks is None else tuple(sinks + i for i in range(heads)),
        alibi_slopes=alibi_slopes(heads) if alibi else None,
    ),
    st.one_of(st.none(), st.integers(1, 9)),
    st.one_of(st.none(), st.sampled_from([0.5, 2.0, 30.0])),
    st.one_of(st.none(), st.sampled_from([-3.0, 0.0, 4.0])),
    st.booleans(),
    st.just(4),
)


@given(
    variant=_VARIANTS, seed=st.integers(0, 2**32 - 1), n=st.integers(1, 5), ctx=st.integers(0, 12)
)
def test_attend_with_variants_matches_loops(
    variant: AttentionVariant, seed: int, n: int, ctx: int
) -> None:
    """Four query heads over two KV heads, a chunk of ``n`` queries after ``ctx`` keys."""
    rng = np.random.default_rng(seed)
    t = ctx + n
    q = rng.standard_normal((n, 4, 8)) * 2
    k, v = rng.standard_normal((t, 2, 8)), rng.standard_normal((t, 2, 8))
    positions = np.arange(ctx, t)
    out = attend(q, k, v, positions, 0.7, variant)
    for j, pos in enumerate(positions):
        for h in range(4):
            want = _loop_attention(q[j, h], k[:, h // 2], v[:, h // 2], int(pos), 0.7, variant, h)
            np.testing.assert_allclose(
                out[j, h], want, rtol=1e-10, atol=1e-12, err_msg=f"{variant}, token {pos}, head {h}"
            )


def test_a_window_reads_only_what_it_sees() -> None:
    """Gathering from the window's start equals masking the full context."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s) for s in ((3, 2, 4), (20, 1, 4), (20, 1, 4)))
    positions = np.arange(17, 20)
    variant = AttentionVariant(window=5)
    full = attend(q, k, v, positions, 0.5, variant)
    first = variant.first_visible(17)
    part = attend(q, k[first:], v[first:], positions, 0.5, variant, first_key=first)
    np.testing.assert_allclose(part, full, rtol=1e-13)
    assert first == 13


def test_variant_arguments_are_checked() -> None:
    with pytest.raises(ArgumentValueError, match="window must be >= 1, got 0"):
        AttentionVariant(window=0)
    with pytest.raises(ArgumentTypeError, match="window must be an int"):
        AttentionVariant(window=True)
    with pytest.raises(ArgumentValueError, match="softcap must be finite and > 0"):
        AttentionVariant(softcap=float("nan"))
    with pytest.raises(ArgumentValueError, match="sinks must be a non-empty tuple"):
        AttentionVariant(sinks=[0.0])  # type: ignore[arg-type]
    with pytest.raises(ArgumentValueError, match=r"alibi_slopes\[1\] must be finite"):
        AttentionVariant(alibi_slopes=(0.5, float("inf")))
    with pytest.raises(ArgumentValueError, match="sinks has 2 entries, but there are 4"):
        AttentionVariant(sinks=(0.0, 1.0)).check_heads(4)
    assert AttentionVariant().is_plain
    assert AttentionVariant(window=4, sinks=(1.0,)).features == {"window", "sinks"}


def test_alibi_slopes_follow_the_paper() -> None:
    assert alibi_slopes(8) == tuple(2.0 ** (-i) for i in range(1, 9))
    twelve = alibi_slopes(12)
    assert twelve[:8] == alibi_slopes(8)
    assert twelve[8:] == tuple(2.0 ** (-i / 2) for i in (1, 3, 5, 7))
    with pytest.raises(ArgumentValueError):
        alibi_slopes(0)


@pytest.mark.parametrize(
    ("fmt", "torch_dtype"),
    [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)],
)
def test_fp8_rounding_matches_torch_bit_for_bit(fmt: str, torch_dtype: torch.dtype) -> None:
    """Every float32 magnitude from subnormal to past the maximum, both signs, and ties."""
    top = FP8_FORMATS[fmt].max_finite
    rng = np.random.default_rng(0)
    spread = [rng.standard_normal(20_000) * 10.0**e for e in range(-7, 6)]
    # every fp8 value and every midpoint between neighbours (the ties)
    grid = np.unique(round_fp8(np.linspace(-top, top, 200_001), fmt))
    edges = [grid, (grid[1:] + grid[:-1]) / 2, np.array([0.0, -0.0, top * 1.5, -top * 3])]
    x = np.concatenate(spread + edges).astype(np.float32)
    ours = round_fp8(x, fmt)
    theirs = torch.from_numpy(x).clamp(-top, top).to(torch_dtype).to(torch.float64).numpy()
    same = (ours == theirs) & (np.signbit(ours) == np.signbit(theirs))
    assert same.all(), f"{fmt}: {x[~same][:5]} -> ours {ours[~same][:5]}, torch {theirs[~same][:5]}"


def test_fp8_saturates_and_keeps_nan() -> None:
    stored = round_fp8(np.array([1e6, -1e6, np.inf, np.nan]), "fp8_e4m3")
    assert stored[:3].tolist() == [448.0, -448.0, 448.0] and np.isnan(stored[3])
    assert round_fp8(np.array([1e9]), "fp8_e5m2").tolist() == [57344.0]


def test_quantize_divides_in_float32_then_rounds() -> None:
    x = np.array([0.1, -3.0, 1000.0])
    scale = 0.01
    want = round_fp8(x.astype(np.float32) / np.float32(scale), "fp8_e4m3")
    assert quantize(x, scale, "fp8_e4m3").tolist() == want.tolist()
    assert dequantize(want, scale).tolist() == (want * float(np.float32(scale))).tolist()
    with pytest.raises(ArgumentValueError, match="scale must be finite and > 0"):
        quantize(x, 0.0, "fp8_e4m3")
    with pytest.raises(ArgumentValueError, match="fmt must be one of"):
        round_fp8(x, "fp8")


@pytest.mark.parametrize("scale", [1e-50, 1e39, 0.0, float("nan")])
def test_fp8_scales_must_be_positive_and_finite_in_float32(scale: float) -> None:
    """A scale float32 rounds to 0 or infinity would make every stored value inf or NaN."""
    with pytest.raises(ArgumentValueError, match="scale"):
        quantize(np.ones(2), scale, "fp8_e4m3")
    with pytest.raises(ArgumentValueError, match=r"kv_scales\[0\]\[1\]"):
        KVGeometry(1, 2, 2, 1, 2, kv_dtype="fp8_e4m3", kv_scales=((1.0, scale),))
    with pytest.raises(ArgumentValueError, match=r"kv_scales\[0\]\[0\]"):
        KVMemory(1, 2, 2, 1, 2, kv_dtype="fp8_e5m2", kv_scales=((scale, 1.0),))
    assert quantize(np.ones(1), 1e-30, "fp8_e4m3").tolist() == [448.0]  # tiny but a float32


def test_quantized_memory_stores_fp8_and_gathers_dequantized() -> None:
    mem = KVMemory(2, 2, 2, 1, 2, kv_dtype="fp8_e5m2", kv_scales=((0.5, 2.0), (1.0, 1.0)))
    x = np.array([[[0.3, 200000.0]]])
    mem.write(0, x, x, [1])
    assert mem.k[0][0, 1, 0].tolist() == round_fp8(x[0, 0] / 0.5, "fp8_e5m2").tolist()
    k, v = mem.gather(0, [0], 2, start=1)
    assert k.tolist() == [[(round_fp8(x[0, 0] / 0.5, "fp8_e5m2") * 0.5).tolist()]]
    assert v[0, 0, 1] == 57344.0 * 2.0  # saturated, then scaled back
    with pytest.raises(ArgumentValueError, match="kv_scales needs 2"):
        KVMemory(2, 2, 2, 1, 2, kv_dtype="fp8_e5m2", kv_scales=((0.5, 2.0),))
    with pytest.raises(ArgumentValueError, match="only for a quantized"):
        KVMemory(1, 2, 2, 1, 2, kv_scales=((0.5, 2.0),))


def test_memory_refuses_bad_writes_and_copies_and_changes_nothing() -> None:
    mem = KVMemory(1, 3, 2, 1, 1)
    mem.write(0, np.ones((6, 1, 1)), np.ones((6, 1, 1)), list(range(6)))
    before = (mem.k[0].copy(), mem.v[0].copy())
    z = np.zeros((1, 1, 1))
    floats: list[Any] = [1.0]
    strings: list[Any] = ["3"]
    bad_calls: list[tuple[Callable[[], None], str]] = [
        (lambda: mem.write(0, np.zeros((2, 1, 1)), np.zeros((2, 1, 1)), [1, 1]), "twice"),
        (lambda: mem.write(0, z, z, floats), "must be an int"),
        (lambda: mem.write(0, z, z, strings), "must be an int"),
        (lambda: mem.write(True, z, z, [0]), "layer"),
        (lambda: mem.copy_blocks([(True, 2)]), r"copies\[0\]\[0\] must be an int"),
        (lambda: mem.copy_blocks([(0, 1), (2, 1)]), "destination block 1 appears twice"),
        (lambda: mem.copy_blocks([(0, 1), (1, 2)]), "both a source and a destination"),
        (lambda: mem.copy_blocks([(0, 1), (0, 7)]), "outside 0..2"),
    ]
    for call, message in bad_calls:
        with pytest.raises(SpecError, match=message):
            call()
        assert np.array_equal(mem.k[0], before[0]) and np.array_equal(mem.v[0], before[1])
