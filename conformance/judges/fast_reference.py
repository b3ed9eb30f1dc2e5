"""The spec's paged attention in torch float64, tiled, on the backend's device: a fast exact oracle.

:func:`spec.attention.paged_attention` is the definition, and the oracle for
small steps; at production shapes it costs seconds a layer and, for a long
prefill chunk, a score matrix of a hundred gigabytes. This module computes the
same arithmetic on a torch device (CUDA beside a GPU backend, the CPU
otherwise) in tiles whose temporaries stay under a memory limit
(:mod:`conformance.judges.tile_plan`), whatever the shape:

* every variant in the spec's order: scale, soft-cap, ALiBi, causal and
  window visibility, a softmax whose maximum and denominator include the sink;
* fp8 dequantisation (``stored * float32(scale)``, per layer for K and V), GQA,
  any KV cache group's block tables;
* the same-precision arithmetic :mod:`conformance.judges.numerics` judges with
  (:func:`same_precision`): float32 products and sums, K and V read rounded
  to the activation dtype, the unnormalised probabilities ``exp(s - max)``
  rounded before ``P @ V`` and divided by their unrounded sum.

**One tile in the spec's order; more, by two passes or one.** An item whose
keys fit in one tile (every decode at the envelope's context lengths) is
computed in the spec's order. Over several key tiles, the same-precision
arithmetic walks them twice: the first walk finds each row's maximum score
(with the sink), the second computes ``exp(s - max)`` against it, so every
probability, and every rounding of one to the activation dtype, is the
spec's. The float64 arithmetic rounds no probability, so it walks the tiles
once with an online softmax: a row's running sum and ``sum(p v)`` are
rescaled by ``exp(old - new)`` when its maximum grows (a pass of matrix
products fewer). Both differ from the spec only in the order of sums and
those rescalings, and divide ``sum(p v)`` by the total once at the end
instead of normalising first: in float64 that moves outputs by a few ulps, in
float32 by a few float32 ulps, as any honest kernel's order does.

It is trusted because it is checked: ``tests/test_fast_reference.py`` compares
it with the spec over every variant, dtype, GQA ratio, block size, window
edge, sink, fp8 format and contexts of many tiles.

>>> import torch
>>> from spec.block_manager import BlockManager
>>> from spec.batch import build_batch
>>> from spec.kv_memory import KVMemory
>>> m = BlockManager(num_blocks=4, block_size=2)
>>> _ = m.add_sequence(0, [1, 2, 3])
>>> slots = m.append_slots(0, [1, 2, 3])
>>> mem = KVMemory(1, 4, 2, num_kv_heads=1, head_dim=1)
>>> kv = np.array([[[0.0]], [[0.0]], [[6.0]]])
>>> mem.write(0, kv, kv, slots)
>>> cache = PagedKV.from_memory(mem, layer=0, device="cpu")
>>> out = paged_attention(np.zeros((3, 1, 1)), build_batch(m, [(0, 3)]), cache)
>>> out[:, 0, 0].tolist()    # uniform weights over 1, 2 and 3 visible keys, as the spec
[0.0, 0.0, 2.0]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from conformance.judges.device_precision import (
    EXACT,
    DevicePrecision,
    DeviceUnavailableError,
    import_torch,
    resolve_device,
    round_to_dtype,
    same_precision,
    truncate_to_tf32,
)
from conformance.judges.tile_plan import (
    DEFAULT_MEMORY_LIMIT,
    HeadShape,
    Items,
    Tiles,
    choose_tiles,
    plan_launches,
    split_items,
)
from spec.attention import PLAIN, AttentionVariant
from spec.batch import BatchMetadata
from spec.errors import ArgumentTypeError, InvalidRequestError, UnknownBlockError
from spec.kv_memory import KVMemory
from spec.quant import check_fp8_scale
from spec.validate import check_instance, check_int, check_scale

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_MEMORY_LIMIT",
    "EXACT",
    "DevicePrecision",
    "DeviceUnavailableError",
    "PagedKV",
    "Tiles",
    "paged_attention",
    "resolve_device",
    "same_precision",
]

DEFAULT_TILES = Tiles()
"""The largest tiles :func:`paged_attention` uses, before the memory limit shrinks them."""


@dataclass(frozen=True)
class PagedKV:
    """One layer's K and V cache on a device, in the paged layout, as the spec's memory holds it.

    ``key`` and ``value`` are ``[num_blocks, block_size, H_kv, D]`` of any
    float dtype whose values are the stored ones (float64 from
    :class:`~spec.kv_memory.KVMemory`; float16, bfloat16 or float8 tensors are
    exact too). ``scales`` is the layer's ``(k_scale, v_scale)`` for an fp8
    cache: K is read as ``stored * float32(k_scale)``, as
    :func:`spec.quant.dequantize` does. ``block_ids``, when given, names the
    pool block that row ``j`` of the tensors holds, in any order, each once
    (an upload of only the blocks a step reads, from a lazy pool of millions
    of blocks; or the blocks kept on the device, :mod:`conformance.judges.resident_kv`).

    A latent memory (:mod:`spec.kv_memory`'s latent layout) is read as
    attention reads it (:func:`spec.attention.latent_kv`): ``key`` is the whole
    row ``[.., 1, latent_dim + rope_dim]`` and ``value`` its first
    ``latent_dim`` columns, a view of ``key`` (:attr:`latent`); the output is
    ``latent_dim`` wide.
    """

    key: torch.Tensor
    value: torch.Tensor
    scales: tuple[float, float] | None = None
    block_ids: tuple[int, ...] | None = None
    pool_size: int | None = None  # blocks in the pool, when only some are uploaded

    def __post_init__(self) -> None:
        torch = import_torch()
        for name in ("key", "value"):
            x = getattr(self, name)
            if not isinstance(x, torch.Tensor):
                raise ArgumentTypeError(f"PagedKV.{name} must be a torch tensor, got {type(x)}")
            if x.ndim != 4 or not x.dtype.is_floating_point:
                raise InvalidRequestError(
                    f"PagedKV.{name} must be a 4-D float tensor [num_blocks, block_size, H_kv, D], "
                    f"got {x.dtype} of shape {tuple(x.shape)}"
                )
        k, v = self.key, self.value
        narrower = k.shape[:3] == v.shape[:3] and v.shape[3] < k.shape[3]  # latent: c_kv of k
        if (k.shape != v.shape and not narrower) or k.dtype != v.dtype or k.device != v.device:
            raise InvalidRequestError(
                f"PagedKV key and value differ: {k.dtype} {tuple(k.shape)} on {k.device} against "
                f"{v.dtype} {tuple(v.shape)} on {v.device}"
            )
        if self.scales is not None:
            for name, s in zip(("k_scale", "v_scale"), self.scales, strict=True):
                check_fp8_scale(name, s)
        elif k.dtype.itemsize == 1:
            raise InvalidRequestError(f"PagedKV of {k.dtype} needs its (k_scale, v_scale)")
        if self.block_ids is not None and len(self.block_ids) != k.shape[0]:
            raise InvalidRequestError(
                f"PagedKV.block_ids names {len(self.block_ids)} blocks for {k.shape[0]} rows"
            )
        if self.block_ids is not None and len(set(self.block_ids)) != len(self.block_ids):
            twice = sorted(b for b in set(self.block_ids) if self.block_ids.count(b) > 1)
            raise InvalidRequestError(f"PagedKV.block_ids names block {twice[0]} twice")

    @classmethod
    def from_memory(
        cls, memory: KVMemory, layer: int, device: object, blocks: Sequence[int] | None = None
    ) -> PagedKV:
        """The spec's ``memory`` of ``layer`` on ``device``: every block, or only ``blocks``.

        Every block of a memory held whole (not lazy) on the CPU is not copied: the
        cache is then a view of the memory (and shows its later writes).
        """
        torch = import_torch()
        dev = resolve_device(device)
        layer = check_int("layer", layer, low=0, high=memory.num_layers - 1)
        scales = memory.kv_scales[layer] if memory.kv_dtype is not None else None
        ids = None if blocks is None else tuple(sorted(set(blocks)))
        if ids is None and memory.lazy:
            raise InvalidRequestError("a lazy KV memory is uploaded by the blocks a step reads")
        latent = memory.latent_dim
        if ids is None and dev.type == "cpu":
            if latent is not None:  # the rows, read in place; V is their c_kv columns
                rows = torch.from_numpy(memory.rows[layer])
                return cls(rows, rows[..., :latent], scales)
            return cls(torch.from_numpy(memory.k[layer]), torch.from_numpy(memory.v[layer]), scales)
        k, v = memory.read_blocks(layer, list(range(memory.shape[0]) if ids is None else ids))
        if latent is not None:  # c_kv and k_rope: the rows again
            rows = torch.from_numpy(np.concatenate([k, v], axis=-1)).to(dev)
            return cls(rows, rows[..., :latent], scales, ids, memory.shape[0])
        return cls(
            torch.from_numpy(k).to(dev), torch.from_numpy(v).to(dev), scales, ids, memory.shape[0]
        )

    @property
    def device(self) -> torch.device:
        return self.key.device

    @property
    def latent(self) -> bool:
        """Whether this is a latent layer: V narrower than K, its first columns."""
        return bool(self.value.shape[3] < self.key.shape[3])

    @property
    def pool_blocks(self) -> int:
        """Blocks of the pool the tables index: the rows, else the pool's size or the last named."""
        if self.block_ids is None:
            return int(self.key.shape[0])
        return self.pool_size or max(self.block_ids, default=0) + 1


def paged_attention(
    query: Any,
    batch: BatchMetadata,
    kv: PagedKV,
    scale: float | None = None,
    *,
    variant: AttentionVariant | None = None,
    group: int = 0,
    precision: DevicePrecision = EXACT,
    memory_limit: int = DEFAULT_MEMORY_LIMIT,
    tiles: Tiles = DEFAULT_TILES,
) -> torch.Tensor:
    """:func:`spec.attention.paged_attention` on ``kv``'s device: ``[T, H, D]`` float64
    (``[T, H, latent_dim]`` for a latent layer).

    ``query`` is a ``[>= T, H, D]`` float tensor on ``kv``'s device (a numpy
    array is moved there). Temporaries stay under ``memory_limit`` bytes
    (:func:`conformance.judges.tile_plan.tile_bytes`); the output, ``T x H x
    D`` float64, is the caller's. Bad input raises the spec's errors, naming
    what is wrong; a limit too small for one tile raises
    :class:`~conformance.judges.tile_plan.MemoryLimitError`.
    """
    check_instance("precision", precision, DevicePrecision)  # before any work: named, as such
    th = import_torch()
    q = _check_query(th, query, batch, kv)
    num_heads, num_kv_heads, head_dim = q.shape[1], kv.key.shape[2], kv.key.shape[3]
    if batch.block_size != kv.key.shape[1]:
        raise InvalidRequestError(
            f"the batch was laid out for block size {batch.block_size}, "
            f"but the KV cache has blocks of {kv.key.shape[1]}"
        )
    if num_heads % num_kv_heads:
        raise InvalidRequestError(f"{num_heads} query heads do not divide into {num_kv_heads}")
    batch.validate(kv.pool_blocks)
    variant = PLAIN if variant is None else variant
    variant.check_heads(num_heads)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else check_scale("scale", scale)
    shape = HeadShape(num_heads, num_kv_heads, head_dim)
    out: torch.Tensor = th.empty(
        (batch.num_tokens, num_heads, kv.value.shape[3]), dtype=th.float64, device=q.device
    )
    if batch.num_seqs == 0:
        return out
    starts = np.asarray(batch.query_start_loc, dtype=np.int64)
    seq_lens = np.asarray(batch.seq_lens, dtype=np.int64)
    max_keys = (
        int(seq_lens.max())
        if variant.window is None
        else min(int(seq_lens.max()), variant.window + tiles.queries)
    )
    q_tile, k_tile = choose_tiles(
        shape,
        int(np.diff(starts).max()),
        max_keys,
        check_int("memory_limit", memory_limit, low=1),
        tiles,
    )
    items = split_items(starts, seq_lens, variant.window, q_tile)
    tables = _tables(th, batch, group, kv, items)
    run = _Launcher(th, q, kv, tables, shape, scale, variant, precision)
    for launch in plan_launches(items, shape, k_tile, memory_limit):
        rows, values = run(launch, k_tile)
        out[rows] = values
    return out


def _check_query(torch: Any, query: Any, batch: BatchMetadata, kv: PagedKV) -> Any:
    """``query`` as a float tensor on ``kv``'s device, with the spec's shape checks."""
    if isinstance(query, np.ndarray):
        if query.dtype.kind != "f":
            raise InvalidRequestError(f"query must hold floats, got {query.dtype}")
        query = torch.from_numpy(np.ascontiguousarray(query)).to(kv.device)
    if not isinstance(query, torch.Tensor) or not query.dtype.is_floating_point:
        raise InvalidRequestError(f"query must be a float tensor, got {type(query).__name__}")
    if query.device != kv.device:
        raise InvalidRequestError(f"query is on {query.device}, the KV cache on {kv.device}")
    head_dim, value_dim = kv.key.shape[3], kv.value.shape[3]
    if query.ndim != 3 or query.shape[0] < batch.num_tokens or query.shape[2] != head_dim:
        parts = f" (q_latent {value_dim} + q_rope {head_dim - value_dim})" if kv.latent else ""
        raise InvalidRequestError(
            f"query has shape {tuple(query.shape)}, expected [{batch.num_tokens}, H, {head_dim}]"
            + parts
        )
    return query


def _tables(torch: Any, batch: BatchMetadata, group: int, kv: PagedKV, items: Items) -> Any:
    """Group ``group``'s tables as rows of ``kv``, each block an item reads checked to be one."""
    batch.tables(check_int("group", group, low=0))  # the spec's error for a group it lacks
    table = batch.arrays().group_tables[group]
    rows = table.astype(np.int64)
    if kv.block_ids is not None:  # pool block -> row, the rows in any order
        ids = np.asarray(kv.block_ids, dtype=np.int64)
        order = np.argsort(ids, kind="stable")
        ordered = ids[order]
        where = np.clip(np.searchsorted(ordered, rows), 0, max(len(ids) - 1, 0))
        found = (rows >= 0) & (ordered[where] == rows) if len(ids) else np.zeros_like(rows, bool)
        rows = np.where(found, order[where] if len(ids) else where, np.where(rows >= 0, -2, rows))
    b = batch.block_size
    for j in range(len(items)):
        s, lo, hi = int(items.seq[j]), int(items.lo[j]), int(items.hi[j])
        used = rows[s, lo // b : -(-hi // b)]
        if (used < 0).any():
            k = int(np.argmax(used < 0)) + lo // b
            raise UnknownBlockError(
                f"group {group}, sequence {batch.seq_ids[s]}: block table entry {k} "
                f"({table[s, k]}) is read but is not a block of the KV cache uploaded"
            )
    return torch.from_numpy(rows).to(kv.device)


_ITEM_FIELDS = ("seq", "row", "count", "first", "lo", "hi")


class _Launcher:
    """Runs launches of items against one layer's cache: the arithmetic of the spec, tiled."""

    def __init__(
        self,
        torch: Any,
        query: Any,
        kv: PagedKV,
        tables: Any,
        shape: HeadShape,
        scale: float,
        variant: AttentionVariant,
        precision: DevicePrecision,
    ) -> None:
        self.t = torch
        self.dev = query.device
        self.cdt = getattr(torch, precision.compute)
        self.query, self.tables, self.shape, self.precision = query, tables, shape, precision
        b, h_kv, d = kv.key.shape[1], kv.key.shape[2], kv.key.shape[3]
        self.block = b
        self.k_flat = kv.key.reshape(-1, d)  # row slot * H_kv + h: one head of one slot
        self.value_dim = kv.value.shape[3]
        self.v_flat = self.k_flat if kv.latent else kv.value.reshape(-1, d)  # latent: V in K
        self.kv_head = torch.arange(h_kv, device=self.dev).view(1, -1, 1)
        self.kv_scales = None if kv.scales is None else tuple(_f32(s) for s in kv.scales)
        self.scale = _f32(scale) if precision.compute == "float32" else scale
        self.window = variant.window
        cap = variant.softcap
        self.cap = None if cap is None else (_f32(cap) if precision.compute == "float32" else cap)
        self.sinks = self._per_head(variant.sinks)
        self.slopes = self._per_head(variant.alibi_slopes)

    def _per_head(self, values: tuple[float, ...] | None) -> Any:
        if values is None:
            return None
        return self.t.tensor(values, dtype=self.cdt, device=self.dev).view(1, -1, 1, 1)

    def __call__(self, items: Items, k_tile: int) -> tuple[Any, Any]:
        """The rows of the output the launch's items fill, and their values (float64)."""
        t, sh = self.t, self.shape
        dev = self.dev
        arrays = {name: t.from_numpy(getattr(items, name)).to(dev) for name in _ITEM_FIELDS}
        s, n = len(items), int(items.count.max())
        g = sh.heads // sh.kv_heads
        step = t.minimum(t.arange(n, device=dev)[None], arrays["count"][:, None] - 1)  # [S, n]
        rows, qpos = arrays["row"][:, None] + step, arrays["first"][:, None] + step
        q = self._operand(self.query[rows].to(self.cdt), self.precision.round_q)  # [S, n, H, D]
        q = q.view(s, n, sh.kv_heads, g, sh.head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(s, sh.kv_heads, g * n, sh.head_dim)
        span = int((items.hi - items.lo).max())
        k_tile = min(k_tile, span)
        ctx = _Tile(arrays, qpos, q, s, n, k_tile)
        num_tiles = -(-span // k_tile)
        if num_tiles == 1:
            mixed = self._one_tile(ctx)
        elif self.precision.p_normalised:
            mixed = self._normalised(ctx, num_tiles)
        elif self.precision.round_p is None and not self.precision.tf32:
            mixed = self._online(ctx, num_tiles)
        else:
            mixed = self._two_passes(ctx, num_tiles)
        out = mixed.view(s, sh.kv_heads, g, n, self.value_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(s, n, sh.heads, self.value_dim)
        keep = t.arange(n, device=dev)[None] < arrays["count"][:, None]
        return rows[keep], out[keep].to(t.float64)

    def _one_tile(self, ctx: _Tile) -> Any:
        """Keys in one tile: the spec's order exactly (normalise, then ``P @ V``)."""
        scores, kpos, valid = self._scores(ctx, 0)
        top = self._top(scores.amax(dim=-1, keepdim=True))
        p = scores.sub_(top).exp_()
        total = self._with_sink(p.sum(dim=-1, keepdim=True), top)
        v = self._gather(self.v_flat, ctx, kpos, valid, 1)
        if self.precision.round_p is None and not self.precision.tf32:
            return p.div_(total).view(ctx.s, self.shape.kv_heads, -1, ctx.k_tile) @ v
        if self.precision.p_normalised:
            return self._mix(p.div_(total), v, ctx)
        return self._mix(p, v, ctx) / total.view(ctx.s, self.shape.kv_heads, -1, 1)

    def _normalised(self, ctx: _Tile, num_tiles: int) -> Any:
        """An eager softmax over several tiles: each row's maximum, then its sum, then ``P @ V``
        with the normalised probabilities rounded (``"normalised"`` products)."""
        t = self.t
        top = self._row_max(ctx, num_tiles)
        total = t.zeros_like(top)
        for j in range(num_tiles):
            total += self._scores(ctx, j)[0].sub_(top).exp_().sum(dim=-1, keepdim=True)
        total = self._with_sink(total, top)
        acc = None
        for j in range(num_tiles):
            scores, kpos, valid = self._scores(ctx, j)
            p = scores.sub_(top).exp_().div_(total)
            part = self._mix(p, self._gather(self.v_flat, ctx, kpos, valid, 1), ctx)
            acc = part if acc is None else acc.add_(part)
        return acc

    def _row_max(self, ctx: _Tile, num_tiles: int) -> Any:
        """Each row's maximum score over every tile (and the sink: :meth:`_top`)."""
        top = None
        for j in range(num_tiles):
            tile_max = self._scores(ctx, j)[0].amax(dim=-1, keepdim=True)
            top = tile_max if top is None else self.t.maximum(top, tile_max)
        return self._top(top)

    def _two_passes(self, ctx: _Tile, num_tiles: int) -> Any:
        """Pass 1: each row's maximum over every tile and the sink; pass 2: exp, sums, ``P @ V``."""
        t = self.t
        top = self._row_max(ctx, num_tiles)
        total, acc = t.zeros_like(top), None
        for j in range(num_tiles):
            scores, kpos, valid = self._scores(ctx, j)
            p = scores.sub_(top).exp_()
            total += p.sum(dim=-1, keepdim=True)
            v = self._gather(self.v_flat, ctx, kpos, valid, 1)
            part = self._mix(p, v, ctx)
            acc = part if acc is None else acc.add_(part)
        total = self._with_sink(total, top)
        return acc / total.view(ctx.s, self.shape.kv_heads, -1, 1)

    def _online(self, ctx: _Tile, num_tiles: int) -> Any:
        """One walk: running maxima, sums and ``P @ V``, rescaled by ``exp(old - new)`` as a
        row's maximum grows (no probability is rounded, so a rescaled one is as good)."""
        t = self.t
        rows = (ctx.s, self.shape.heads, ctx.n, 1)
        top = self._top(t.full(rows, -math.inf, dtype=self.cdt, device=self.dev))
        total, acc = t.zeros_like(top), None
        for j in range(num_tiles):
            scores, kpos, valid = self._scores(ctx, j)
            new = t.maximum(top, scores.amax(dim=-1, keepdim=True))
            shift = new.masked_fill(new == -math.inf, 0.0)  # a row that sees no key yet
            p = scores.sub_(shift).exp_()
            grow = (top - shift).exp_()  # 1 where the maximum held, 0 before the first key
            total.mul_(grow).add_(p.sum(dim=-1, keepdim=True))
            v = self._gather(self.v_flat, ctx, kpos, valid, 1)
            part = self._mix(p, v, ctx)
            grow = grow.view(ctx.s, self.shape.kv_heads, -1, 1)
            acc = part if acc is None else acc.mul_(grow).add_(part)
            top = new
        total = self._with_sink(total, top)
        return acc / total.view(ctx.s, self.shape.kv_heads, -1, 1)

    def _mix(self, p: Any, v: Any, ctx: _Tile) -> Any:
        """``P @ V`` for one tile, ``P`` rounded to the activation dtype first when asked (and
        both operands to TF32, for a kernel that declares so)."""
        p = self._operand(p, self.precision.round_p)
        if self.precision.tf32:
            v = truncate_to_tf32(v)
        return p.view(ctx.s, self.shape.kv_heads, -1, ctx.k_tile) @ v

    def _operand(self, x: Any, dtype: str | None) -> Any:
        """A product's operand: rounded to ``dtype`` if given, then to TF32 if declared."""
        if dtype is not None:
            x = self._round(x, dtype)
        return truncate_to_tf32(x) if self.precision.tf32 else x

    def _top(self, top: Any) -> Any:
        """Each row's maximum score, raised to its head's sink (finite: every query sees itself)."""
        return top if self.sinks is None else self.t.maximum(top, self.sinks)

    def _with_sink(self, total: Any, top: Any) -> Any:
        return total if self.sinks is None else total + (self.sinks - top).exp()

    def _round(self, x: Any, dtype: str) -> Any:
        return round_to_dtype(x, dtype).to(self.cdt)

    def _scores(self, ctx: _Tile, j: int) -> tuple[Any, Any, Any]:
        """Tile ``j``'s scores ``[S, H, n, k]``, every variant applied, invisible ones -inf."""
        t, sh = self.t, self.shape
        kpos = ctx.arrays["lo"][:, None] + j * ctx.k_tile + t.arange(ctx.k_tile, device=self.dev)
        valid = kpos < ctx.arrays["hi"][:, None]  # [S, k_tile]
        k = self._gather(self.k_flat, ctx, kpos, valid, 0)  # [S, H_kv, k, D]
        if self.precision.tf32:
            k = truncate_to_tf32(k)
        if self.precision.round_qk_products is None:
            scores = ctx.q @ k.transpose(-1, -2)
        else:  # each q_d * k_d rounded before the sum: [S, H_kv, rows, D, k], then summed
            products = ctx.q[..., :, :, None] * k.transpose(-1, -2)[..., None, :, :]
            scores = self._round(products, self.precision.round_qk_products).sum(dim=-2)
        scores = scores.view(ctx.s, sh.heads, ctx.n, ctx.k_tile)
        del k
        scores.mul_(self.scale)
        if self.cap is not None:
            scores.div_(self.cap).tanh_().mul_(self.cap)
        if self.slopes is not None:
            distance = (kpos[:, None, :] - ctx.qpos[:, :, None]).to(self.cdt)  # [S, n, k]
            scores.add_(self.slopes * distance[:, None])
        visible = (kpos[:, None, :] <= ctx.qpos[:, :, None]) & valid[:, None, :]  # [S, n, k]
        if self.window is not None:
            visible &= kpos[:, None, :] > ctx.qpos[:, :, None] - self.window
        if not bool(visible.all()):  # most tiles of a long prefill lie wholly in view
            scores.masked_fill_(~visible[:, None], -math.inf)
        return scores, kpos, valid

    def _gather(self, flat: Any, ctx: _Tile, kpos: Any, valid: Any, which: int) -> Any:
        """K or V at ``kpos``, ``[S, H_kv, k, D]`` in the compute dtype, as read: dequantised,
        rounded, 0 past ``hi``.

        Gathered head-major, one row of ``D`` per slot and head, so that ``q @ k^T`` and
        ``P @ V`` are plain batched products: gathering by slot and then transposing the
        tile cost more than both products. Only a scaled or rounded read goes through
        float64; a float16, bfloat16 or float32 value is exact in either compute dtype.
        """
        t = self.t
        table = self.tables[ctx.arrays["seq"]]  # [S, W]
        column = (kpos // self.block).clamp(max=table.shape[1] - 1)
        slot = t.where(valid, table.gather(1, column) * self.block + kpos % self.block, 0)
        rows = (slot[:, None, :] * self.shape.kv_heads + self.kv_head).reshape(-1)
        x = flat.index_select(0, rows).view(ctx.s, self.shape.kv_heads, ctx.k_tile, -1)
        if which == 1:
            x = x[..., : self.value_dim]  # a latent row's c_kv columns (all of an ordinary V)
        if self.kv_scales is not None or self.precision.round_kv is not None:
            x = x.to(t.float64)
            if self.kv_scales is not None:
                x = x * self.kv_scales[which]
            if self.precision.round_kv is not None:
                x = self._round(x, self.precision.round_kv)
        x = x.to(self.cdt)
        if which == 1:  # a key past ``hi`` is masked; a value there gets weight 0, so make it 0
            x.masked_fill_(~valid[:, None, :, None], 0.0)
        return x


@dataclass(frozen=True)
class _Tile:
    """One launch's tensors: its items (on the device), query positions and query tile."""

    arrays: dict[str, Any]
    qpos: Any  # [S, n] each query's position (padded queries repeat the last)
    q: Any  # [S, H_kv, g * n, D] in the compute dtype
    s: int
    n: int
    k_tile: int


def _f32(x: float) -> float:
    """``x`` rounded to float32: the spec's float32 arithmetic multiplies by ``float32(x)``."""
    return float(np.float32(x))
