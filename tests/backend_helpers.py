"""Shared scaffolding for the backend tests: scenarios built by the spec, and error reports.

A scenario is one step of a batch laid out by the spec (:class:`BlockManager`
over a pool whose free order is shuffled, so tables hold scattered ids, and
:func:`build_batch`), with K, V and queries drawn from a seeded
``torch.Generator`` and rounded to the cache dtype, so the float64 reference and
the backend see the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import settings
from numpy.typing import NDArray

from benchmarks._batches import context_step
from spec.batch import BatchMetadata
from spec.block_manager import BlockManager
from spec.kv_budget import cdiv
from spec.kv_memory import KVMemory

F64 = NDArray[np.float64]

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

TOLERANCES = {
    "float32": (2e-5, 1e-4),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
}
"""``(atol, rtol)`` of attention output vs the float64 reference, per dtype.

Inputs are exact in every dtype (they are drawn rounded), so the error is the
kernel's arithmetic plus rounding the output to the dtype: half an ulp of an
output near 2 is 5e-4 in float16 and 4e-3 in bfloat16, and float16/bfloat16
products on a GPU add about as much again. float32 has no output rounding to
speak of; 1e-4 relative leaves room for a different summation order.
"""


@dataclass
class Scenario:
    """One step: the batch, the float64 reference memory, and per-layer inputs."""

    batch: BatchMetadata
    memory: KVMemory
    num_heads: int
    dtype: str
    keys: list[F64]  # per layer: [T, H_kv, D] new-token K of this step (rounded)
    values: list[F64]
    queries: list[F64]  # per layer: [T, H, D]
    context_writes: list[tuple[int, F64, F64, list[int]]]  # earlier steps' (layer, K, V, slots)

    @property
    def geometry_args(self) -> tuple[int, int, int, int, int]:
        """``(num_layers, num_blocks, block_size, num_kv_heads, head_dim)``."""
        n, b, h, d = self.memory.shape
        return self.memory.num_layers, n, b, h, d


def fewer_examples(divisor: int, minimum: int) -> settings:
    """The active profile's example count divided by ``divisor``: kernels are slow on CPU."""
    return settings(max_examples=max(minimum, settings().max_examples // divisor))


def rounded(gen: torch.Generator, shape: Sequence[int], dtype: str) -> F64:
    """Standard normal values, rounded to ``dtype``, as float64."""
    x = torch.randn(*shape, generator=gen).to(TORCH_DTYPES[dtype]).to(torch.float64)
    out: F64 = x.numpy()
    return out


def shuffled_manager(num_blocks: int, block_size: int, seed: int) -> BlockManager:
    """A manager whose free list is in random order, so tables get scattered block ids."""
    m = BlockManager(num_blocks, block_size)
    held = [m.pool.allocate() for _ in range(num_blocks)]
    for i in np.random.default_rng(seed).permutation(num_blocks):
        m.pool.decref(held[int(i)])
    return m


def make_scenario(
    seed: int,
    work: Sequence[tuple[int, int]],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: str = "float32",
    num_layers: int = 1,
    spare_blocks: int = 3,
    kv_dtype: str | None = None,
    kv_scales: Sequence[tuple[float, float]] = (),
) -> Scenario:
    """Sequences of ``(context, new)`` tokens: context written earlier, ``new`` in this step.

    With ``kv_dtype``, the reference memory is quantized (it holds fp8 values).
    """
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(cdiv(c + n, block_size) for c, n in work) + spare_blocks
    m = shuffled_manager(num_blocks, block_size, seed)
    mem = KVMemory(
        num_layers,
        num_blocks,
        block_size,
        num_kv_heads,
        head_dim,
        kv_dtype=kv_dtype,
        kv_scales=kv_scales,
    )
    context_writes: list[tuple[int, F64, F64, list[int]]] = []
    batch, context_slots = context_step(m, work)
    for (context, _), slots in zip(work, context_slots, strict=True):
        for layer in range(num_layers):
            if context:
                k = rounded(gen, (context, num_kv_heads, head_dim), dtype)
                v = rounded(gen, (context, num_kv_heads, head_dim), dtype)
                mem.write(layer, k, v, slots)
                context_writes.append((layer, k, v, slots))
    t, h = batch.num_tokens, num_kv_heads * group
    keys = [rounded(gen, (t, num_kv_heads, head_dim), dtype) for _ in range(num_layers)]
    values = [rounded(gen, (t, num_kv_heads, head_dim), dtype) for _ in range(num_layers)]
    queries = [rounded(gen, (t, h, head_dim), dtype) for _ in range(num_layers)]
    for layer in range(num_layers):
        mem.write(layer, keys[layer], values[layer], batch.slot_mapping)
    return Scenario(batch, mem, h, dtype, keys, values, queries, context_writes)


def where_is(batch: BatchMetadata, row: int) -> str:
    """Which sequence and token position row ``row`` of the flattened batch is."""
    i = int(np.searchsorted(np.asarray(batch.query_start_loc), row, side="right")) - 1
    return f"sequence {batch.seq_ids[i]} (row {i}), token at position {batch.positions[row]}"


def assert_attention_close(
    got: NDArray[np.floating], want: F64, dtype: str, batch: BatchMetadata, layer: int, what: str
) -> None:
    """``got`` matches ``want`` within the dtype's tolerance, or a report of where it does not."""
    atol, rtol = TOLERANCES[dtype]
    got64 = np.asarray(got, dtype=np.float64)
    assert got64.shape == want.shape, f"{what}: shape {got64.shape} != {want.shape}"
    err = np.abs(got64 - want)
    err = np.where(np.isfinite(got64), err, np.inf)
    excess = err - (atol + rtol * np.abs(want))
    if (excess > 0).any():
        t, h, d = np.unravel_index(int(np.argmax(excess)), excess.shape)
        rel = err / np.maximum(np.abs(want), 1e-12)
        raise AssertionError(
            f"{what} ({dtype}, atol {atol}, rtol {rtol}): {int((excess > 0).sum())} values off; "
            f"max abs error {float(err.max()):.3g}, max rel error {float(rel.max()):.3g}; "
            f"worst at {where_is(batch, int(t))}, head {h}, dim {d}, layer {layer}: "
            f"got {got64[t, h, d]!r}, want {want[t, h, d]!r}"
        )


def bits(x: torch.Tensor) -> torch.Tensor:
    """``x``'s raw bits, so that equality is exact and NaN equals the same NaN."""
    return x.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[x.element_size()])


def assert_cache_equal(
    got: NDArray[np.floating], want: NDArray[np.floating], name: str, layer: int, what: str
) -> None:
    """Two ``[num_blocks, B, H_kv, D]`` caches are equal bit for bit (NaN equal to NaN, and the
    sign of zero counts), or a report naming the first block, offset, head and K or V that differ.
    """
    g, w = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert g.shape == w.shape, f"{what}: {name} cache shape {g.shape} != {w.shape}"
    same = ((g == w) & (np.signbit(g) == np.signbit(w))) | (np.isnan(g) & np.isnan(w))
    if not same.all():
        block, offset, head, dim = (int(i) for i in np.argwhere(~same)[0])
        raise AssertionError(
            f"{what}: {name} of layer {layer} differs in {int((~same).sum())} values; first at "
            f"block {block}, offset {offset}, KV head {head}, dim {dim}: "
            f"got {g[block, offset, head, dim]!r}, want {w[block, offset, head, dim]!r}"
        )
