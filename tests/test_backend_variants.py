"""Attention variants and fp8 KV in the kernels and both torch backends, against the spec.

The KV write must store exactly what :func:`spec.quant.quantize` gives (compared
as bytes), block copies must move fp8 bytes unchanged, and attention with every
variant must match the float64 reference of the dequantized values token by
token, single pass and split-KV, including windowed contexts several times
longer than the window (so key tiles wholly before it exist) and tables whose
blocks before the window are released or poisoned. Tensors and backends are on
:data:`devices.DEVICE` (the CPU interpreted, the GPU compiled).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from backend_helpers import (
    TORCH_DTYPES,
    Scenario,
    assert_attention_close,
    assert_cache_equal,
    fewer_examples,
    make_scenario,
)
from devices import DEVICE
from hypothesis import given
from hypothesis import strategies as st

from backend_gpu.dtypes import FP8_TORCH
from backend_gpu.kernels import choose_num_splits, copy_blocks, paged_attention, reshape_and_cache
from backend_gpu.kernels.target import TARGET_ENV
from backend_gpu.torch_backend import TorchBackend
from backend_gpu.triton_backend import TritonBackend
from spec.attention import PLAIN, VARIANTS, AttentionVariant, alibi_slopes
from spec.attention import paged_attention as reference_attention
from spec.backend import Backend, ReferenceBackend
from spec.batch import PAD_BLOCK, BatchMetadata
from spec.errors import SpecError
from spec.kv_geometry import KV_DTYPES, KVGeometry
from spec.quant import FP8_FORMATS, quantize

FEW = fewer_examples(4, minimum=4)
HEADS = 4  # two KV heads, two query heads each

SCALES = {"fp8_e4m3": (1 / 256, 3 / 448), "fp8_e5m2": (2.0**-15, 3 / 57344)}
"""(k_scale, v_scale) per format: values beyond 1.75 (K) and 3 (V) saturate; V's is not a power
of two, so the division's rounding matters."""

VARIANT_CASES = {
    "window 1 (only itself)": AttentionVariant(window=1),
    "window 5": AttentionVariant(window=5),
    "window 16 (one tile)": AttentionVariant(window=16),
    "window 17": AttentionVariant(window=17),
    "softcap 2": AttentionVariant(softcap=2.0),
    "sinks": AttentionVariant(sinks=(-2.0, 0.0, 3.0, 8.0)),
    "alibi x4": AttentionVariant(alibi_slopes=tuple(4 * x for x in alibi_slopes(HEADS))),
    "window + softcap + sinks": AttentionVariant(window=7, softcap=5.0, sinks=(1.0, 2.0, 0.0, 4.0)),
    "window + softcap + alibi": AttentionVariant(
        window=20, softcap=3.0, alibi_slopes=alibi_slopes(HEADS)
    ),
}

# Contexts several times longer than the windows: long decodes, a chunk after a long context,
# a whole prefill, a short decode. With 16-key tiles, tiles wholly before a window exist.
LONG_WORK = [(99, 1), (0, 40), (70, 9), (2, 1), (63, 1)]


def _cache_tensors(s: Scenario) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference memory in the cache dtype (fp8 values exactly); unwritten slots NaN."""
    dt = FP8_TORCH[s.memory.kv_dtype] if s.memory.kv_dtype else TORCH_DTYPES[s.dtype]
    k = torch.from_numpy(s.memory.k[0]).to(DEVICE, dt).contiguous()
    v = torch.from_numpy(s.memory.v[0]).to(DEVICE, dt).contiguous()
    return k, v


def _per_head(values: tuple[float, ...] | None) -> torch.Tensor | None:
    return None if values is None else torch.tensor(values, dtype=torch.float32, device=DEVICE)


def _tensors(batch: BatchMetadata) -> tuple[torch.Tensor, ...]:
    a = batch.arrays()
    return tuple(
        torch.from_numpy(x).to(DEVICE) for x in (a.query_start_loc, a.seq_lens, a.block_tables)
    )


def _check(
    s: Scenario,
    variant: AttentionVariant,
    num_splits: int,
    *,
    scale: float = 0.37,
    block_n: int = 16,
    batch: BatchMetadata | None = None,
) -> None:
    """Kernel output == reference for every real row; padding rows of ``out`` stay NaN."""
    batch = s.batch if batch is None else batch
    k, v = _cache_tensors(s)
    qsl, lens, tables = _tensors(batch)
    t, dt = batch.num_tokens, TORCH_DTYPES[s.dtype]
    q = torch.zeros(t + 2, s.num_heads, s.memory.shape[3], dtype=dt, device=DEVICE)
    q[:t] = torch.from_numpy(s.queries[0]).to(DEVICE, dt)
    out = torch.full_like(q, float("nan"))
    k_scale, v_scale = s.memory.kv_scales[0] if s.memory.kv_dtype else (1.0, 1.0)
    paged_attention(
        q, k, v, qsl, lens, tables, scale, out=out, num_splits=num_splits, block_n=block_n,
        window=variant.window, softcap=variant.softcap, sinks=_per_head(variant.sinks),
        alibi_slopes=_per_head(variant.alibi_slopes), k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    want = reference_attention(s.queries[0], batch, s.memory, 0, scale, variant=variant)
    what = f"{variant}, {s.memory.kv_dtype or 'unquantized'} KV, {num_splits} splits"
    assert_attention_close(out[:t].float().cpu().numpy(), want, s.dtype, batch, 0, what)
    assert bool(out[t:].isnan().all()), "the kernel wrote padding rows past the batch's tokens"


def _scenario(
    seed: int, work: list[tuple[int, int]], *, block_size: int = 3, dtype: str = "float16",
    kv_dtype: str | None = None,
) -> Scenario:  # fmt: skip
    scales = [SCALES[kv_dtype]] if kv_dtype else []
    return make_scenario(
        seed, work, block_size=block_size, num_kv_heads=2, group=HEADS // 2, head_dim=16,
        dtype=dtype, kv_dtype=kv_dtype, kv_scales=scales,
    )  # fmt: skip


# -- fp8 KV write and block copy --------------------------------------------------------------


def _fp8_values(gen: torch.Generator, rows: int) -> torch.Tensor:
    """Values over many magnitudes (subnormal to saturating), signed zeros, and fp8 ties."""
    x = torch.randn(rows, 2, 24, generator=gen)
    x *= 10.0 ** torch.randint(-6, 3, (rows, 2, 24), generator=gen).float()
    x[:, 0, :4] = torch.tensor([0.0, -0.0, 1e30, -1e30])  # in every row
    return x


@FEW
@given(
    seed=st.integers(0, 2**31 - 1),
    fmt=st.sampled_from(KV_DTYPES),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    scale=st.sampled_from([1 / 256, 3 / 448, 0.01, 2.0**-15, 2.5]),
    num_tokens=st.integers(0, 20),
    block_size=st.sampled_from([1, 3, 16]),
)
def test_kv_write_stores_the_specs_fp8_bytes(
    seed: int, fmt: str, dtype: str, scale: float, num_tokens: int, block_size: int
) -> None:
    """Division in float32, ties to even, saturation: byte for byte what spec.quant says."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 8
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots = torch.where(torch.rand(len(slots), generator=gen) < 0.2, -1, slots)
    rows = len(slots) + 2  # two padding rows past the slot mapping
    key = _fp8_values(gen, rows).to(TORCH_DTYPES[dtype])
    value = -_fp8_values(gen, rows).to(TORCH_DTYPES[dtype])
    fp8 = FP8_TORCH[fmt]
    k_cache = torch.full((num_blocks, block_size, 2, 24), float("nan"), dtype=fp8)
    v_cache = k_cache.clone()
    want_k = np.full(k_cache.shape, np.nan)
    want_v = want_k.copy()
    for i, slot in enumerate(slots.tolist()):
        if slot != -1:
            b, o = divmod(slot, block_size)
            want_k[b, o] = quantize(key[i].double().numpy(), scale, fmt)
            want_v[b, o] = quantize(value[i].double().numpy(), 2 * scale, fmt)
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    reshape_and_cache(
        key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots.to(DEVICE),
        k_scale=scale, v_scale=2 * scale,
    )  # fmt: skip
    assert_cache_equal(k_cache.float().cpu().numpy(), want_k, "K", 0, f"{fmt} KV write")
    assert_cache_equal(v_cache.float().cpu().numpy(), want_v, "V", 0, f"{fmt} KV write")
    written = bool((slots != -1).any())
    assert bool((k_cache.float() == FP8_FORMATS[fmt].max_finite).any()) == written


@pytest.mark.parametrize("fmt", KV_DTYPES)
def test_copy_blocks_moves_fp8_bytes_unchanged(fmt: str) -> None:
    """Every byte pattern, NaN included, survives a copy; other blocks are untouched."""
    gen = torch.Generator().manual_seed(1)
    shape = (6, 4, 2, 8)
    ks = [torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8) for _ in range(2)]
    vs = [torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8) for _ in range(2)]
    copies = [(0, 3), (0, 4), (5, 1)]
    want = [x.clone() for x in (*ks, *vs)]
    for x in want:
        for src, dst in copies:
            x[dst] = x[src]
    fp8 = FP8_TORCH[fmt]
    k_caches = [x.to(DEVICE).view(fp8) for x in ks]
    v_caches = [x.to(DEVICE).view(fp8) for x in vs]
    copy_blocks(k_caches, v_caches, copies)
    for i, (got, exp) in enumerate(zip((*k_caches, *v_caches), want, strict=True)):
        assert torch.equal(got.view(torch.uint8).cpu(), exp), f"{'KV'[i // 2]} of layer {i % 2}"


# -- attention with variants -------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("case", list(VARIANT_CASES))
def test_attention_variants_over_long_contexts(case: str, num_splits: int) -> None:
    _check(_scenario(7, LONG_WORK), VARIANT_CASES[case], num_splits, scale=1.2)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_attention_every_variant_at_once_every_dtype(dtype: str) -> None:
    variant = AttentionVariant(window=9, softcap=4.0, sinks=(0.5, -1.0, 2.0, 0.0))
    s = _scenario(3, [(40, 1), (0, 11), (30, 6)], block_size=16, dtype=dtype)
    for splits in (1, 2):
        _check(s, variant, splits, scale=0.9)


def _released(batch: BatchMetadata, window: int, replacement: int) -> BatchMetadata:
    """The batch with each row's blocks wholly before its first query's window replaced."""
    b, rows = batch.block_size, []
    for i, row in enumerate(batch.block_tables):
        first_query = batch.seq_lens[i] - batch.query_len(i)
        first = max(0, first_query - window + 1) // b
        rows.append(tuple(replacement if j < first else x for j, x in enumerate(row)))
    return dataclasses.replace(batch, block_tables=tuple(rows))


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_a_windowed_kernel_never_reads_the_tiles_before_the_window(
    block_size: int, num_splits: int
) -> None:
    """Tables whose blocks wholly before the window are released (-1), or point at a block
    of NaN: a kernel that loaded those tiles and masked the scores would read out of bounds
    or turn 0 * NaN into NaN. A decode reads ceil(min(w, p + 1) / 16) tiles here."""
    window = 6
    s = _scenario(5, [(80, 1), (47, 1), (60, 5), (3, 1)], block_size=block_size)
    used = {x for row in s.batch.block_tables for x in row}
    poison = next(x for x in range(s.memory.shape[0]) if x not in used)  # never written: NaN
    assert np.isnan(s.memory.k[0][poison]).all()
    for replacement in (PAD_BLOCK, poison):
        batch = _released(s.batch, window, replacement)
        assert batch.block_tables != s.batch.block_tables
        _check(s, AttentionVariant(window=window, sinks=(0.0,) * HEADS), num_splits, batch=batch)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 16])
def test_split_kv_counts_a_sink_once(num_splits: int) -> None:
    """Heavy sinks, and more splits than some sequences have keys (empty splits)."""
    s = _scenario(9, [(0, 1), (2, 1), (50, 1), (33, 1)], block_size=4)
    _check(s, AttentionVariant(sinks=(4.0, 6.0, -1.0, 2.0)), num_splits, scale=0.5)
    _check(s, AttentionVariant(window=3, sinks=(4.0, 6.0, -1.0, 2.0)), num_splits, scale=0.5)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("fmt", KV_DTYPES)
def test_attention_reads_fp8_kv_dequantized(fmt: str, dtype: str, num_splits: int) -> None:
    s = _scenario(2, [(45, 1), (0, 13), (20, 4)], dtype=dtype, kv_dtype=fmt)
    assert (np.abs(s.memory.k[0]) == FP8_FORMATS[fmt].max_finite).any(), "nothing saturated"
    _check(s, PLAIN, num_splits)
    _check(s, AttentionVariant(window=8, softcap=3.0, sinks=(0.0, 1.0, 2.0, -1.0)), num_splits)


_RANDOM_VARIANTS = st.builds(
    AttentionVariant,
    window=st.one_of(st.none(), st.integers(1, 40)),
    softcap=st.one_of(st.none(), st.sampled_from([1.0, 4.0, 30.0])),
    sinks=st.one_of(st.none(), st.tuples(*[st.sampled_from([-3.0, 0.0, 2.5])] * HEADS)),
    alibi_slopes=st.one_of(st.none(), st.just(tuple(2 * x for x in alibi_slopes(HEADS)))),
)


@FEW
@given(
    seed=st.integers(0, 2**31 - 1),
    variant=_RANDOM_VARIANTS,
    kv_dtype=st.sampled_from([None, *KV_DTYPES]),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    block_size=st.sampled_from([1, 3, 16]),
    num_splits=st.sampled_from([1, 2, 5]),
    block_n=st.sampled_from([16, 64]),
    work=st.lists(st.tuples(st.integers(0, 90), st.integers(1, 12)), min_size=1, max_size=4),
)
def test_attention_matches_reference_with_random_variants(
    seed: int,
    variant: AttentionVariant,
    kv_dtype: str | None,
    dtype: str,
    block_size: int,
    num_splits: int,
    block_n: int,
    work: list[tuple[int, int]],
) -> None:
    s = _scenario(seed, work, block_size=block_size, dtype=dtype, kv_dtype=kv_dtype)
    _check(s, variant, num_splits, scale=1 / math.sqrt(16) * 3, block_n=block_n)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda a: a.update(window=0), "window must be >= 1, got 0"),
        (lambda a: a.update(softcap=-1.0), "softcap must be finite and > 0"),
        (lambda a: a.update(sinks=torch.zeros(3, device=DEVICE)), "sinks has 3 entries, but"),
        (
            lambda a: a.update(alibi_slopes=torch.zeros(4, device=DEVICE).double()),
            "alibi_slopes has dtype",
        ),
        (lambda a: a.update(k_scale=0.0), "k_scale must be finite and > 0"),
        (lambda a: a.update(v_scale=float("inf")), "v_scale must be finite and > 0"),
        (lambda a: a.update(query=a["query"].half()), "query dtype"),
    ],
)
def test_variant_arguments_are_checked(
    change: Callable[[dict[str, object]], None], match: str
) -> None:
    s = _scenario(1, [(4, 2)])
    k, v = _cache_tensors(s)
    qsl, lens, tables = _tensors(s.batch)
    q = torch.from_numpy(s.queries[0]).to(DEVICE, torch.float32)
    args: dict[str, object] = {
        "query": q, "k_cache": k.float(), "v_cache": v.float(),
        "query_start_loc": qsl, "seq_lens": lens, "block_tables": tables,
    }  # fmt: skip
    change(args)
    with pytest.raises(SpecError, match=match):
        paged_attention(**args, scale=0.5)  # type: ignore[arg-type]


def test_a_fp8_cache_takes_any_float_query_and_checks_released_entries() -> None:
    s = _scenario(4, [(30, 1)], kv_dtype="fp8_e4m3")
    k, v = _cache_tensors(s)
    qsl, lens, tables = _tensors(s.batch)
    q = torch.from_numpy(s.queries[0]).to(DEVICE, torch.bfloat16)
    out = paged_attention(q, k, v, qsl, lens, tables, 0.5, window=4)
    assert out.dtype == torch.bfloat16
    released = _tensors(_released(s.batch, 4, PAD_BLOCK))[2]
    paged_attention(q, k, v, qsl, lens, released, 0.5, window=4)  # entries before: not read
    with pytest.raises(SpecError, match="block -1 is outside"):
        paged_attention(q, k, v, qsl, lens, released, 0.5, window=30)  # now they would be


def test_a_short_window_over_a_long_context_needs_no_split(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Splits divide what one query tile sees: the window, not the context (the interpreter
    plans for an H200 by default, and by its own plan on request)."""
    cpu = torch.device("cpu")
    monkeypatch.setenv(TARGET_ENV, "h200")
    assert choose_num_splits(1, 8, 32, 128, 1, 32768, cpu) == 33
    assert choose_num_splits(1, 8, 32, 128, 1, 32768, cpu, window=128) == 1
    assert choose_num_splits(1, 8, 32, 128, 1, 32768, cpu, window=8192) == 16
    monkeypatch.setenv(TARGET_ENV, "interpreter")
    assert choose_num_splits(1, 8, 32, 128, 1, 1100, cpu, window=64) == 1


# -- the backends, through the contract --------------------------------------------------------

BACKENDS: dict[str, Callable[[], Backend]] = {
    "triton": lambda: TritonBackend(DEVICE),
    "triton-split": lambda: TritonBackend(DEVICE, num_splits=3),
    "torch": lambda: TorchBackend(DEVICE),
}


def _run(
    backend: Backend, s: Scenario, geometry: KVGeometry, variants: list[AttentionVariant]
) -> list[np.ndarray]:
    """Context writes, then this step's (with a -1 slot and padding rows), then attention."""
    backend.create_cache(geometry)
    for layer, k, v, slots in s.context_writes:
        backend.write_kv(layer, k.astype(np.float32), v.astype(np.float32), slots)
    outs = []
    for layer, variant in enumerate(variants):
        pad = np.full((2, *s.keys[layer].shape[1:]), 1e6)
        k = np.concatenate([s.keys[layer], pad]).astype(np.float32)
        v = np.concatenate([s.values[layer], -pad]).astype(np.float32)
        backend.write_kv(layer, k, v, [*s.batch.slot_mapping, -1])
        extra = {} if variant.is_plain else {"variant": variant}
        q = s.queries[layer].astype(np.float32)
        outs.append(backend.attention(layer, q, s.batch, 0.8, **extra))
    return outs


@pytest.mark.parametrize("kv_dtype", [None, *KV_DTYPES])
@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_backends_match_the_reference_with_variants_and_fp8(
    backend_name: str, kv_dtype: str | None
) -> None:
    """Three layers (windowed + sinks, soft-capped + ALiBi, plain), then a block copy."""
    variants = [
        AttentionVariant(window=6, sinks=(1.0, -1.0, 3.0, 0.0)),
        AttentionVariant(softcap=2.0, alibi_slopes=alibi_slopes(HEADS)),
        PLAIN,
    ]
    s = make_scenario(
        6, [(50, 1), (0, 9), (21, 4)], block_size=4, num_kv_heads=2, group=2, head_dim=16,
        dtype="bfloat16", num_layers=3,
    )  # fmt: skip
    scales = tuple(SCALES[kv_dtype] for _ in range(3)) if kv_dtype else ()
    geometry = KVGeometry(*s.geometry_args, dtype=s.dtype, kv_dtype=kv_dtype, kv_scales=scales)
    backend, ref = BACKENDS[backend_name](), ReferenceBackend()
    outs, want = _run(backend, s, geometry, variants), _run(ref, s, geometry, variants)
    for layer, (got, exp) in enumerate(zip(outs, want, strict=True)):
        what = f"{backend_name}, {kv_dtype or 'unquantized'}, {variants[layer]}"
        assert_attention_close(got, exp.astype(np.float64), s.dtype, s.batch, layer, what)
    used = {x for row in s.batch.block_tables for x in row}
    spare = next(x for x in range(geometry.num_blocks) if x not in used)
    for b in (backend, ref):
        b.copy_blocks([(s.batch.block_tables[0][0], spare)])
    for layer in range(3):
        for name, g, w in zip("KV", backend.read_cache(layer), ref.read_cache(layer), strict=True):
            assert_cache_equal(g, w, name, layer, f"{backend_name} read_cache ({kv_dtype})")


@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_backends_declare_every_variant_and_fp8(backend_name: str) -> None:
    caps = BACKENDS[backend_name]().capabilities
    assert caps.variants == frozenset(VARIANTS) and caps.kv_dtypes == frozenset(KV_DTYPES)
    geometry = KVGeometry(1, 4, 3, 2, 24, kv_dtype="fp8_e5m2", kv_scales=((0.5, 0.25),))
    every = AttentionVariant(4, 2.0, (0.0,) * 4, (0.5,) * 4)
    assert caps.unsupported(geometry, num_heads=4, variant=every) == []


@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_backends_refuse_a_variant_with_the_wrong_number_of_heads(backend_name: str) -> None:
    s = _scenario(1, [(4, 2)])
    backend = BACKENDS[backend_name]()
    backend.create_cache(KVGeometry(*s.geometry_args, dtype=s.dtype))
    with pytest.raises(SpecError, match="sinks has 2 entries, but there are 4"):
        backend.attention(0, s.queries[0], s.batch, 0.5, variant=AttentionVariant(sinks=(0.0, 1.0)))  # type: ignore[call-arg]
