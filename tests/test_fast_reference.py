"""The fast reference against the spec: the same arithmetic, within a few float64 ulps.

:mod:`conformance.judges.fast_reference` is trusted as an oracle only because
these tests compare it with :func:`spec.attention.paged_attention` over every
variant and combination, fp8 formats, GQA ratios, block sizes, KV cache groups
with released blocks, window edges inside a tile, and contexts of many tiles
(small tiles, so that a short context spans many). Two planted bugs prove the
comparison can fail: a window one token too wide and a sink left out.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from conformance.judges import fast_reference as fr
from conformance.judges.device_precision import round_to_dtype
from conformance.judges.dtypes import round_to
from conformance.judges.numerics import same_precision as numpy_same_precision
from conformance.judges.numerics import ulp
from conformance.judges.tile_plan import MemoryLimitError, split_items
from spec.attention import AttentionVariant, alibi_slopes
from spec.attention_batched import paged_attention_batched as paged_attention
from spec.batch import PAD_BLOCK, BatchMetadata, GroupLayout
from spec.errors import InvalidRequestError, UnknownBlockError
from spec.kv_memory import KVMemory
from spec.quant import dequantize

F64_EPS = 2.0**-52
F32_EPS = 2.0**-23
EXACT_ULPS = 8.0
"""Allowed |fast - spec| in float64 ulps of the step's scale (see :func:`_scale_of`)."""
SAME_ULPS = 64.0
"""The same for the same-precision arithmetic, in float32 ulps, where no rounding of P flips."""


@dataclass(frozen=True)
class Example:
    """One step: a batch over a paged memory, its query, and how attention is computed."""

    batch: BatchMetadata
    memory: KVMemory
    query: np.ndarray[Any, np.dtype[np.float64]]
    layer: int  # also the KV cache group
    scale: float
    variant: AttentionVariant
    dtype: str | None  # None: the exact arithmetic; else the same-precision one of this dtype
    tiles: fr.Tiles
    memory_limit: int


def _table(blocks: list[int], released: int, width: int) -> tuple[int, ...]:
    row = [PAD_BLOCK] * released + blocks[released:]
    return tuple(row + [PAD_BLOCK] * (width - len(row)))


@st.composite
def examples(draw: st.DrawFn, *, window: bool | None = None, sinks: bool | None = None) -> Example:
    """A step of decodes and prefill chunks; ``window``/``sinks`` True forces them in."""
    b = draw(st.sampled_from([1, 2, 3, 4, 16]))
    kv_heads, ratio = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
    heads, d = kv_heads * ratio, draw(st.sampled_from([1, 4, 8, 16]))
    lens = draw(st.lists(st.integers(1, 160), min_size=1, max_size=4))
    counts = [draw(st.sampled_from([1, min(n, draw(st.integers(1, 48)))])) for n in lens]
    tiles = fr.Tiles(draw(st.sampled_from([1, 3, 8, 1024])), draw(st.sampled_from([2, 5, 8, 4096])))
    w = None if window is False else draw(st.none() | st.integers(1, 40))
    w = draw(st.integers(1, 40)) if window and w is None else w
    group = 1 if w is not None and draw(st.booleans()) else 0
    sink_values = st.tuples(*[st.floats(-4, 6) for _ in range(heads)])
    variant = AttentionVariant(
        window=w,
        softcap=draw(st.none() | st.floats(0.5, 30.0)),
        sinks=draw(sink_values if sinks else st.none() | sink_values),
        alibi_slopes=draw(st.none() | st.just(alibi_slopes(heads))),
    )
    kv_dtype = draw(st.sampled_from([None, "fp8_e4m3", "fp8_e5m2"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    batch, memory = _layout(rng, lens, counts, b, kv_heads, d, w if group else None, kv_dtype)
    dtype = draw(st.sampled_from([None, "float32", "float16", "bfloat16"]))
    query = rng.normal(size=(batch.num_tokens, heads, d))
    query = query if dtype is None else round_to(query, dtype)
    large = draw(st.booleans())
    return Example(
        batch,
        memory,
        query,
        group,
        (16.0 if large else 1.0) / math.sqrt(d),
        variant,
        dtype,
        tiles,
        draw(st.sampled_from([fr.DEFAULT_MEMORY_LIMIT, 1 << 16])),
    )


def _layout(
    rng: np.random.Generator,
    lens: list[int],
    counts: list[int],
    b: int,
    kv_heads: int,
    d: int,
    window: int | None,
    kv_dtype: str | None,
) -> tuple[BatchMetadata, KVMemory]:
    """Group 0's blocks, then group 1's (a windowed group releases whole blocks before its window),
    all shuffled over one pool; layer ``g`` holds group ``g``'s K and V."""
    need = [math.ceil(n / b) for n in lens]
    pool = rng.permutation(2 * sum(need) + 2).tolist()
    scales = ((0.04, 0.02), (0.5, 0.01)) if kv_dtype else ()
    memory = KVMemory(2, len(pool), b, kv_heads, d, kv_dtype=kv_dtype, kv_scales=scales)
    tables: list[list[tuple[int, ...]]] = [[], []]
    slots: list[list[int]] = [[], []]
    for n, count in zip(lens, counts, strict=True):
        first = n - count
        released = 0 if window is None else max(0, first - window + 1) // b
        for g in (0, 1):
            blocks = [pool.pop() for _ in range(math.ceil(n / b))]
            tables[g].append(_table(blocks, released if g else 0, max(need)))
            keep = range((released if g else 0) * b, n)
            all_slots = [blocks[p // b] * b + p % b for p in keep]
            kv = rng.normal(size=(2, len(all_slots), kv_heads, d))
            memory.write(g, kv[0], kv[1], all_slots)
            slots[g].extend(all_slots[-count:])
    starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
    positions = [p for n, c in zip(lens, counts, strict=True) for p in range(n - c, n)]
    batch = BatchMetadata(
        b,
        tuple(range(len(lens))),
        tuple(starts),
        tuple(lens),
        tuple(tables[0]),
        tuple(slots[0]),
        tuple(positions),
        extra_groups=(GroupLayout(tuple(tables[1]), tuple(slots[1])),),
    )
    return batch, memory


def _both(ex: Example) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The spec's output and the fast reference's, in the example's arithmetic."""
    spec_precision = (
        {}
        if ex.dtype is None
        else {"precision": numpy_same_precision(ex.dtype, ex.memory.kv_dtype is not None)}
    )
    want = paged_attention(
        ex.query,
        ex.batch,
        ex.memory,
        ex.layer,
        ex.scale,
        variant=ex.variant,
        group=ex.layer,
        **spec_precision,
    )
    precision = (
        fr.EXACT
        if ex.dtype is None
        else fr.same_precision(ex.dtype, ex.memory.kv_dtype is not None)
    )
    got = fr.paged_attention(
        ex.query,
        ex.batch,
        fr.PagedKV.from_memory(ex.memory, ex.layer, "cpu"),
        ex.scale,
        variant=ex.variant,
        group=ex.layer,
        precision=precision,
        memory_limit=ex.memory_limit,
        tiles=ex.tiles,
    )
    return want, got.numpy()


def _v_max(ex: Example) -> float:
    _, v = ex.memory.read_blocks(ex.layer, list(range(ex.memory.shape[0])))
    if ex.memory.kv_dtype is not None:
        v = dequantize(np.nan_to_num(v), ex.memory.kv_scales[ex.layer][1])
    return float(np.nanmax(np.abs(v)))


def _scale_of(ex: Example) -> float:
    """The size an output's rounding errors scale with: the largest |V| times the largest |score|.

    A score's rounding error ``eps * |s|`` moves its weight by the same
    relative amount, so errors grow with the logits' size.
    """
    _, v = ex.memory.read_blocks(ex.layer, list(range(ex.memory.shape[0])))
    k, _ = ex.memory.read_blocks(ex.layer, list(range(ex.memory.shape[0])))
    if ex.memory.kv_dtype is not None:
        ks, vs = ex.memory.kv_scales[ex.layer]
        k, v = dequantize(np.nan_to_num(k), ks), dequantize(np.nan_to_num(v), vs)
    v_max, k_max = float(np.nanmax(np.abs(v))), float(np.nanmax(np.abs(k)))
    q_max = float(np.abs(ex.query).max())
    logits = ex.scale * q_max * k_max * ex.query.shape[2]
    if ex.variant.alibi_slopes is not None:
        logits += max(ex.variant.alibi_slopes) * max(ex.batch.seq_lens)
    return float(v_max * (1.0 + logits))


def check_example(ex: Example) -> None:
    """The fast reference's output against the spec's, in the example's arithmetic.

    Exact: within ``EXACT_ULPS`` float64 ulps of :func:`_scale_of`. Same
    precision: within ``SAME_ULPS`` float32 ulps, plus, for the outputs where
    a rounding of P fell the other way (the libraries' float32 ``exp`` differ
    in the last bit, so ``exp(s - max)`` may land on either side of a
    rounding boundary), one dtype ulp of the largest V.
    """
    want, got = _both(ex)
    assert got.shape == want.shape
    err = np.abs(got - want)
    scale = _scale_of(ex)
    if ex.dtype is None:
        assert err.max(initial=0.0) <= EXACT_ULPS * F64_EPS * scale, err.max() / F64_EPS / scale
        return
    over = err > SAME_ULPS * F32_EPS * scale
    if ex.dtype == "float32":
        assert not over.any(), err.max() / F32_EPS / scale
        return
    # A flip moves an output by at most ulp(p) * |v| / total <= one dtype ulp of 1 times max |V|.
    flip = float(ulp(np.array(1.0), ex.dtype)) * _v_max(ex)
    assert (err[over] <= SAME_ULPS * F32_EPS * scale + flip).all(), err.max() / flip


@given(examples())
def test_matches_the_spec(ex: Example) -> None:
    check_example(ex)


# -- the comparison can fail: two planted bugs ------------------------------------------------


@contextmanager
def _planted(monkeypatch: pytest.MonkeyPatch, bug: str) -> Iterator[None]:
    """The fast reference with ``bug``: "window+1" (every window one token wider, in the
    keys gathered and in the mask) or "no sink" (the sink neither in the maximum nor the sum)."""
    with monkeypatch.context() as m:
        if bug == "window+1":
            split, init = split_items, fr._Launcher.__init__

            def wide_split(starts: Any, lens: Any, window: int | None, q_tile: int) -> Any:
                return split(starts, lens, None if window is None else window + 1, q_tile)

            def wide_init(self: Any, *args: Any) -> None:
                init(self, *args)
                self.window = None if self.window is None else self.window + 1

            m.setattr(fr, "split_items", wide_split)
            m.setattr(fr._Launcher, "__init__", wide_init)
        else:
            m.setattr(fr._Launcher, "_top", lambda self, top: top)
            m.setattr(fr._Launcher, "_with_sink", lambda self, total, top: total)
        yield


@pytest.mark.parametrize(
    ("bug", "strategy"),
    [
        ("window+1", examples(window=True)),
        ("no sink", examples(sinks=True)),
    ],
)
def test_a_planted_bug_is_caught(
    monkeypatch: pytest.MonkeyPatch, bug: str, strategy: st.SearchStrategy[Example]
) -> None:
    @settings(max_examples=50, database=None, phases=[Phase.generate], deadline=None)
    @given(strategy)
    def run(ex: Example) -> None:
        check_example(ex)

    # A window one wider may also read a block its group released: refused, so caught too.
    with _planted(monkeypatch, bug), pytest.raises((AssertionError, UnknownBlockError)):
        run()


# -- where the spec rounds: the same roundings, bit for bit ----------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_rounding_is_the_judges_bit_for_bit(dtype: str) -> None:
    """Ties, subnormals, overflow and ordinary values round as :func:`round_to` rounds them."""
    rng = np.random.default_rng(1)
    x = np.concatenate(
        [
            rng.normal(size=4096) * 10.0 ** rng.integers(-12, 6, 4096),
            [
                1 + 2**-8,
                1 + 3 * 2**-8,
                1 + 2**-11,
                1 + 3 * 2**-11,
                2**-24 * 1.5,
                2**-140,
                7e4,
                4e38,
            ],
            np.nextafter(np.float32(1 + 2**-11), np.float32(2)).astype(np.float64)[None],
        ]
    )
    got = round_to_dtype(torch.from_numpy(x), dtype).to(torch.float64).numpy()
    with np.errstate(over="ignore"):  # 4e38 overflows float32, as it does in torch
        np.testing.assert_array_equal(got, round_to(x, dtype))
    spec = numpy_same_precision(dtype, quantized_kv=True)
    ours = fr.same_precision(dtype, quantized_kv=True)
    assert ours.round_kv == dtype and (ours.round_p is None) == (spec.round_p is None)
    assert ours.compute == spec.compute


def test_an_fp8_cache_in_torch_float8_reads_as_the_spec() -> None:
    """The stored fp8 values as torch float8 tensors, dequantised on the device: the same output."""
    rng = np.random.default_rng(2)
    batch, memory = _layout(rng, [30, 9], [30, 1], 4, 2, 8, None, "fp8_e4m3")
    query = rng.normal(size=(batch.num_tokens, 4, 8))
    k, v = memory.read_blocks(0, list(range(memory.shape[0])))
    f8 = fr.PagedKV(
        torch.from_numpy(np.nan_to_num(k)).to(torch.float8_e4m3fn),
        torch.from_numpy(np.nan_to_num(v)).to(torch.float8_e4m3fn),
        memory.kv_scales[0],
    )
    got = fr.paged_attention(query, batch, f8, tiles=fr.Tiles(3, 5)).numpy()
    want = paged_attention(query, batch, memory, 0)
    assert np.abs(got - want).max() <= 16 * F64_EPS * np.abs(want).max()


# -- bad input: specific errors naming it, nothing changed -----------------------------------


def _small() -> tuple[BatchMetadata, KVMemory, np.ndarray[Any, np.dtype[np.float64]], fr.PagedKV]:
    rng = np.random.default_rng(3)
    batch, memory = _layout(rng, [12, 5], [4, 1], 4, 2, 8, None, None)
    return (
        batch,
        memory,
        rng.normal(size=(batch.num_tokens, 4, 8)),
        fr.PagedKV.from_memory(memory, 0, "cpu"),
    )


def test_a_memory_limit_too_small_for_one_tile_is_named() -> None:
    batch, _, query, kv = _small()
    with pytest.raises(MemoryLimitError, match="memory limit 100 bytes is too small for one tile"):
        fr.paged_attention(query, batch, kv, memory_limit=100)


@pytest.mark.parametrize("device", ["cuda:7", "cuda:999", "tpu", "not a device"])
def test_a_device_this_machine_lacks_is_named(device: str) -> None:
    if device.startswith("cuda") and torch.cuda.device_count() > int(device.split(":")[1]):
        pytest.fail(f"this test needs a machine without {device}")
    with pytest.raises(fr.DeviceUnavailableError, match=repr(device).replace("'", "'?")):
        fr.resolve_device(device)
    _, memory, _, _ = _small()
    with pytest.raises(fr.DeviceUnavailableError):
        fr.PagedKV.from_memory(memory, 0, device)


def test_bad_shapes_dtypes_and_devices_are_named() -> None:
    batch, memory, query, kv = _small()
    before = query.copy()
    cases: list[tuple[Any, fr.PagedKV, dict[str, Any], str]] = [
        (query[:, :, :4], kv, {}, r"query has shape \(5, 4, 4\), expected \[5, H, 8\]"),
        (query[:3], kv, {}, "query has shape"),
        (query.astype(np.int64), kv, {}, "query must hold floats"),
        (torch.zeros(6, 4, 8, dtype=torch.int32), kv, {}, "query must be a float tensor"),
        (torch.from_numpy(query).to("meta"), kv, {}, "query is on meta, the KV cache on cpu"),
        (query[:, :3], kv, {}, "3 query heads do not divide into 2"),
        (query, kv, {"variant": AttentionVariant(sinks=(1.0,))}, "sinks has 1 entries"),
        (query, kv, {"group": 2}, "group 2 is outside 0..1"),
        (query, kv, {"scale": -1.0}, "scale"),
    ]
    for q, cache, kwargs, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            fr.paged_attention(q, batch, cache, **kwargs)
    np.testing.assert_array_equal(query, before)
    with pytest.raises(InvalidRequestError, match="block size 4, but the KV cache has blocks of 2"):
        fr.paged_attention(
            query, batch, fr.PagedKV(kv.key.view(-1, 2, 2, 8), kv.value.view(-1, 2, 2, 8))
        )
    with pytest.raises(InvalidRequestError, match="key and value differ"):
        fr.PagedKV(kv.key, kv.value.float())
    with pytest.raises(InvalidRequestError, match="4-D float tensor"):
        fr.PagedKV(kv.key[0], kv.value[0])
    with pytest.raises(InvalidRequestError, match="needs its \\(k_scale, v_scale\\)"):
        fr.PagedKV(kv.key.to(torch.float8_e4m3fn), kv.value.to(torch.float8_e4m3fn))
    with pytest.raises(UnknownBlockError, match="is read but is not a block of the KV cache"):
        last = max(b for g in range(2) for row in batch.tables(g) for b in row)  # only it
        part = fr.PagedKV.from_memory(memory, 0, "cpu", blocks=[last])
        fr.paged_attention(query, batch, part)


def test_an_upload_of_only_the_blocks_read_gives_the_same_output() -> None:
    batch, memory, query, kv = _small()
    used = [b for row in batch.block_tables for b in row if b >= 0]
    part = fr.PagedKV.from_memory(memory, 0, "cpu", blocks=used)
    assert part.key.shape[0] == len(set(used))
    got = fr.paged_attention(query, batch, part)
    assert torch.equal(got, fr.paged_attention(query, batch, kv))
