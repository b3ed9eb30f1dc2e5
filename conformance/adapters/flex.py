"""PyTorch's paged attention on FlexAttention, as its ``_paged_attention`` module builds it:
eager on the CPU, ``torch.compile``d on CUDA (``torch.nn.attention.experimental``).

Each call sets a :class:`PagedAttention`'s two tables from the batch's block
tables (``page_table[row, logical block] = physical page``,
``physical_to_logical[row, page] = logical block``; it allocates pages itself,
so an outside block manager sets them directly), builds the logical block mask
with ``create_block_mask`` (causal, and the window), converts it with
``convert_logical_block_mask`` (whose ``get_mask_mod`` maps physical KV indices
back to positions and masks pages a row does not hold), wraps the score
modification with ``get_score_mod`` (soft-capping, then ALiBi ``slope * (k - p)``),
and calls ``flex_attention(q, k_cache, v_cache, block_mask=..., score_mod=...,
enable_gqa=True)`` on the cache viewed as ``[1, H_kv, num_blocks * B, D]``.
Flex has no sink term: with sinks it returns its log-sum-exp (``AuxRequest(lse=True)``)
and the output is scaled by ``exp(lse) / (exp(lse) + exp(sink))``, ``sigmoid(lse - sink)``.

Rows are the block mask's batch rows ``0 .. n - 1``: ``get_mask_mod`` reads
``physical_to_logical[b]`` and ``kv_len[b]`` by the mask's own batch index,
not by ``convert_logical_block_mask``'s ``batch_idx``, so a call on a subset of
a bigger table's rows would mask by the wrong rows (a quirk of that code, which
the adapter steps around by giving each call tables of its own rows).

**Eager (the CPU).** ``flex_attention`` without ``torch.compile`` runs
``math_attention`` (``torch/_higher_order_ops/flex_attention.py``): scores of
every query against *every slot of the pool* in float32, the mask and score
mods applied to all of them, a float32 softmax, then
``post_mod_scores.to(query.dtype) @ value.to(query.dtype)``. Hence:

* ``products="normalised"``: the probabilities are normalised, then rounded to
  float16 or bfloat16 before ``P @ V`` (float32 unchanged);
* a slot no token owns is multiplied by a zero weight, so NaN anywhere in the
  pool makes every output NaN: the suite fails it under its default NaN
  poison, rightly; ``--poison finite`` judges the rest;
* each call is one sequence (its queries in chunks, so a chunk's scores stay
  under :data:`SCORES_LIMIT` elements), and a pool of more than
  :data:`POOL_LIMIT` elements a layer is refused through ``excludes``: every
  call converts and scores all of it.

**Compiled (CUDA).** ``torch.compile(flex_attention)`` generates Triton kernels
that walk only the pages the converted block mask lists (compiled on the CPU,
inductor's C++ template does the same, and still multiplies the masked tail of
a row's last page); P is kept unnormalised there, so ``products`` is
``"exact"``. Page sizes are multiples of the template's key tile (64), head
dims powers of two from 16: what its templates tile. Not run in this project's
CI, which has no GPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.attention import flex_attention as flex_module
from torch.nn.attention.experimental._paged_attention import PagedAttention
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from conformance.adapters._common import AdapterBase
from spec.attention import VARIANTS, AttentionVariant
from spec.backend import FloatArray
from spec.batch import BatchArrays, BatchMetadata
from spec.capabilities import Capabilities
from spec.kv_geometry import DTYPES, KVGeometry

POOL_LIMIT = 1 << 25
"""Elements of a layer's K (or V) the eager path may convert and score at every call."""
SCORES_LIMIT = 1 << 24
"""Elements of one eager call's score matrix (heads x queries x pool slots) at most."""
GPU_BLOCK_SIZES = frozenset({64, 128, 256})
GPU_HEAD_DIMS = frozenset({16, 32, 64, 128, 256})
Q_BLOCK = 128  # create_block_mask's default query block

EXPLAINED = {
    "slots no token owns": (
        "the eager path multiplies every slot of the pool by its weight, masked ones by zero: "
        "`post_mod_scores.to(query.dtype) @ value.to(query.dtype)` "
        "(torch/_higher_order_ops/flex_attention.py, `math_attention`), and 0 x NaN is NaN"
    ),
}
"""One line per cause a run may report, citing the kernel's line that makes it. A key is
words of the cause, then ``|`` and words of its first failure (``benchmarks.matrix`` prints
the line beside a cause the run found, and only then)."""

_AUX: Any = getattr(flex_module, "AuxRequest", None)
"""``AuxRequest`` (recent torch): how flex returns its log-sum-exp; ``return_lse`` before it."""


def _eager_limit(
    geometry: KVGeometry, num_heads: int, variant: AttentionVariant | None
) -> str | None:
    """On the CPU: a pool the eager path cannot convert and score at every call."""
    if geometry.latent_dim is not None:
        return "a latent layout (not adapted)"
    elements = geometry.num_blocks * geometry.block_size * geometry.num_kv_heads * geometry.head_dim
    if elements > POOL_LIMIT:
        return (
            f"a pool of {elements:,} elements a layer: flex's eager path converts and scores "
            f"the whole pool at every call (at most {POOL_LIMIT:,} here)"
        )
    return None


def _latent(geometry: KVGeometry, num_heads: int, variant: AttentionVariant | None) -> str | None:
    return "a latent layout (not adapted)" if geometry.latent_dim is not None else None


class FlexBackend(AdapterBase):
    """PyTorch's ``PagedAttention`` over ``flex_attention``, on the contract's cache."""

    def __init__(self, device: str | torch.device | None = None, *, tensors: str = "torch") -> None:
        super().__init__(device, tensors=tensors)
        self.compiled = self.device.type == "cuda"
        if self.compiled:  # every new shape compiles anew: past dynamo's default limit (8) it
            # would fall back to the eager path without saying so, and judge another kernel
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, 1 << 16)
        self._flex: Any = (
            torch.compile(flex_attention, dynamic=False) if self.compiled else flex_attention
        )
        self._path: str | None = None

    @property
    def capabilities(self) -> Capabilities:
        gpu = self.compiled
        return Capabilities(
            name="flex",
            device=str(self.device),
            dtypes=frozenset(DTYPES),
            block_sizes=GPU_BLOCK_SIZES if gpu else None,
            head_dims=GPU_HEAD_DIMS if gpu else None,
            variants=frozenset(VARIANTS),
            kv_groups=True,
            products="exact" if gpu else "normalised",
            tensors=self.tensors,
            excludes=_latent if gpu else _eager_limit,
        )

    def write_kv(
        self,
        layer: int,
        key: FloatArray | torch.Tensor,
        value: FloatArray | torch.Tensor,
        slot_mapping: Sequence[int] | torch.Tensor,
    ) -> None:
        """``PagedAttention.assign``'s store: ``cache[:, :, addr, :] = val`` at each token's
        slot (``-1`` writes nothing), on the cache's token-major view."""
        k, v, slots, k_cache, v_cache = self._kv_inputs(layer, key, value, slot_mapping)
        keep = slots != -1
        n = slots.shape[0]
        for rows, cache in ((k, k_cache), (v, v_cache)):
            cache.view(-1, *cache.shape[2:])[slots[keep]] = rows[:n][keep]

    def attention_path(self) -> str | None:
        """Eager flex runs one dense pass per call; the compiled path is not named here."""
        return self._path

    def attention(
        self,
        layer: int,
        query: FloatArray | torch.Tensor,
        batch: BatchMetadata,
        scale: float,
        *,
        variant: AttentionVariant | None = None,
        arrays: BatchArrays[torch.Tensor] | None = None,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> Any:
        q, k_cache, v_cache, scale, var = self._query_inputs(layer, query, batch, scale, variant)
        self._new_kv(batch, key, value)
        cache = self._mem()
        g = cache.geometry
        tables = batch.tables(g.group_of(layer))
        k = k_cache.view(-1, g.num_kv_heads, g.head_dim).permute(1, 0, 2).unsqueeze(0)
        v = v_cache.view(-1, g.num_kv_heads, g.head_dim).permute(1, 0, 2).unsqueeze(0)
        out = torch.empty_like(q[: batch.num_tokens])
        rows = list(range(batch.num_seqs))
        if self.compiled:
            self._call(out, q, k, v, batch, tables, rows, scale, var)
            self._path = None
        else:
            pool = k.shape[2]
            chunk = max(1, SCORES_LIMIT // (q.shape[1] * pool))
            for i in rows:
                n = batch.query_len(i)
                for first in range(0, n, chunk):
                    self._call(out, q, k, v, batch, tables, [i], scale, var, first, chunk)
            decodes = sum(batch.query_len(i) == 1 for i in rows)
            self._path = (
                "single-pass decode"
                if decodes == len(rows)
                else ("prefill" if decodes == 0 else "mixed")
            )
        return self._returned(out)

    def _call(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: BatchMetadata,
        tables: tuple[tuple[int, ...], ...],
        rows: list[int],
        scale: float,
        var: AttentionVariant,
        first: int = 0,
        chunk: int | None = None,
    ) -> None:
        """One ``flex_attention`` call on sequences ``rows`` (their query tokens ``first ..
        first + chunk - 1``), written into ``out``."""
        page = batch.block_size
        pages = k.shape[2] // page
        lens = [batch.seq_lens[i] for i in rows]
        qlen = [batch.query_len(i) for i in rows]
        take = [min(n - first, chunk or n) for n in qlen]
        width = max(take)
        dev = self.device
        paged = PagedAttention(pages, page, len(rows), device=str(dev))
        for r, i in enumerate(rows):
            used = -(-lens[r] // page)
            for j, block in enumerate(tables[i][:used]):
                if block >= 0:  # a window's released entry is padding: no page
                    paged.page_table[r, j] = block
                    paged.physical_to_logical[r, block] = j
        offsets = torch.tensor(
            [n - m + first for n, m in zip(lens, qlen, strict=True)], device=dev
        )  # position of query row 0 of each row
        kv_len = torch.tensor(lens, device=dev)
        qs = torch.zeros(len(rows), q.shape[1], width, q.shape[2], dtype=q.dtype, device=dev)
        for r, i in enumerate(rows):
            start = batch.query_start_loc[i] + first
            qs[r, :, : take[r]] = q[start : start + take[r]].transpose(0, 1)
        mask = _mask_mod(offsets, var.window)
        logical = max(-(-n // page) for n in lens) * page
        block_mask: BlockMask = create_block_mask(
            mask, len(rows), None, width, logical, device=str(dev), BLOCK_SIZE=(Q_BLOCK, page)
        )
        converted = paged.convert_logical_block_mask(block_mask, None, kv_len)
        score_mod = paged.get_score_mod(_score_mod(offsets, var, dev), kv_len)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*without torch.compile.*")
            warnings.filterwarnings("ignore", message=".*return_lse is deprecated.*")
            result = self._flex(
                qs, k, v, block_mask=converted, score_mod=score_mod, scale=scale,
                enable_gqa=True, **_lse_request(var.sinks is not None),
            )  # fmt: skip
        attended = result[0] if isinstance(result, tuple) else result
        if var.sinks is not None:  # softmax with a sink: the same weights times sigmoid(lse - s)
            lse = result[1].lse if hasattr(result[1], "lse") else result[1]
            sinks = torch.tensor(var.sinks, dtype=torch.float32, device=dev)
            attended = (attended.float() * torch.sigmoid(lse - sinks[None, :, None])[..., None]).to(
                q.dtype
            )
        for r, i in enumerate(rows):
            start = batch.query_start_loc[i] + first
            out[start : start + take[r]] = attended[r, :, : take[r]].transpose(0, 1)


def _lse_request(wanted: bool) -> dict[str, Any]:
    if not wanted:
        return {}
    return {"return_aux": _AUX(lse=True)} if _AUX is not None else {"return_lse": True}


def _mask_mod(offsets: torch.Tensor, window: int | None) -> Callable[..., torch.Tensor]:
    """Causal, and the window: key ``k`` is visible to the query at ``p`` iff ``p - w < k <= p``."""

    def mask(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv: torch.Tensor) -> Any:
        p = offsets[b] + q_idx
        visible = kv <= p
        if window is not None:
            visible = visible & (kv > p - window)
        return visible

    return mask


def _score_mod(
    offsets: torch.Tensor, var: AttentionVariant, device: torch.device
) -> Callable[..., torch.Tensor]:
    """Soft-capping ``c * tanh(s / c)``, then ALiBi ``slope * (k - p)``."""
    slopes = None
    if var.alibi_slopes is not None:
        slopes = torch.tensor(var.alibi_slopes, dtype=torch.float32, device=device)
    cap = var.softcap

    def score(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: Any) -> Any:
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        if slopes is not None:
            s = s + slopes[h] * (kv - (offsets[b] + q))
        return s

    return score


class EagerFlexBackend(FlexBackend):
    """The eager path, under the numpy contract and without ``read_blocks``.

    Without ``read_blocks`` the suite leaves out its large-pool pass (a pool past
    2^31 elements, read back by blocks): the eager path converts and scores the
    whole pool at every call, which it cannot do for such a pool (its
    ``excludes`` says so too, for a pool past :data:`POOL_LIMIT`).
    """

    read_blocks = None  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__("cpu", tensors="numpy")


def make_backend() -> FlexBackend:
    """The entry point ``flex``: compiled on CUDA (the device contract), eager on the CPU."""
    if torch.cuda.is_available():
        return FlexBackend("cuda")
    return EagerFlexBackend()


__all__ = ["EXPLAINED", "EagerFlexBackend", "FlexBackend", "make_backend"]
