"""The spec's :class:`~spec.backend.Backend` in eager PyTorch: an independent second implementation.

No Triton: the KV write is an index assignment, block copies are index copies,
and attention gathers each sequence's K and V through its block table
(``slot = table[p // B] * B + p % B``) and runs softmax attention in float32,
one sequence at a time, each variant one line on the full score matrix: the
window a mask, a sink one more column of the softmax that is dropped after it.
An fp8 cache is written with torch's own fp8 cast (round to nearest even)
after a float32 division and a clamp, and read as ``stored.float() * scale``.
A latent cache (multi-head latent attention) is one tensor of rows a layer;
attention gathers the rows and attends with the whole row as the key and its
c_kv columns as the value, as :func:`spec.attention.latent_kv` defines.
Slow but obviously right, on CPU or any GPU, and a check on the Triton kernels
that shares none of their arithmetic. It does share code with them around it:
the cache plumbing in :mod:`backend_gpu._cache` (which takes the dtype
tables from :mod:`backend_gpu.dtypes`, imports no Triton, and checks every
argument by the spec's own rules: the batch by ``BatchMetadata.validate``,
slots by ``check_slot_mapping``, copies by ``check_copies``).

:func:`make_device_backend` builds the same backend under the device-resident
contract (``tensors="torch"``, :mod:`spec.backend`): it takes tensors on its
device, gathers through the device block tables the suite built for the step
(``arrays=``), and returns tensors. It reads every key from the cache, so the
``key=``/``value=`` of the step are only checked, not used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from backend_gpu._cache import Returned, TorchCacheBackend
from spec.attention import PLAIN, VARIANTS, AttentionVariant
from spec.backend import FloatArray
from spec.batch import BatchArrays, BatchMetadata
from spec.capabilities import Capabilities
from spec.errors import InvalidRequestError
from spec.kv_geometry import DTYPES, KV_DTYPES
from spec.quant import FP8_FORMATS


class TorchBackend(TorchCacheBackend):
    """Paged KV memory and attention with plain torch ops."""

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            name="torch",
            device=str(self.device),
            dtypes=frozenset(DTYPES),
            kv_dtypes=frozenset(KV_DTYPES),
            variants=frozenset(VARIANTS),
            kv_groups=True,
            latent=None,  # any (latent_dim, rope_dim)
            tensors=self.tensors,
        )

    def write_kv(
        self,
        layer: int,
        key: FloatArray | torch.Tensor,
        value: FloatArray | torch.Tensor,
        slot_mapping: Sequence[int] | torch.Tensor,
    ) -> None:
        k, v, slots, k_cache, v_cache = self._kv_inputs(layer, key, value, slot_mapping)
        n = slots.shape[0]
        cache = self._mem()
        keep = slots != -1
        kind = cache.geometry.kv_dtype
        scales = cache.scales(layer)
        for rows, target, scale in zip((k, v), (k_cache, v_cache), scales, strict=True):
            stored = rows[:n][keep]
            if kind is not None:  # spec.quant.quantize: float32 division, clamp, round to even
                top = FP8_FORMATS[kind].max_finite
                divisor = torch.tensor(scale, dtype=torch.float32, device=self.device)
                stored = (stored.float() / divisor).clamp(-top, top)
            target.view(-1, *target.shape[2:])[slots[keep]] = stored.to(
                target.dtype
            )  # latent: a view

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        cache = self._mem()
        pairs = self._copies(copies)
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for x in cache.storage:
            x[dst] = x[src]

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
    ) -> Returned:
        q, k_cache, v_cache, scale, variant = self._query_inputs(
            layer, query, batch, scale, variant
        )
        self._new_kv(batch, key, value)
        cache = self._mem()
        heads = q.shape[1]
        if heads % cache.geometry.num_kv_heads:
            raise InvalidRequestError(
                f"{heads} query heads do not divide into {cache.geometry.num_kv_heads} KV heads"
            )
        k_scale, v_scale = cache.scales(layer)
        width = cache.geometry.value_dim  # latent: the c_kv columns
        out = torch.empty(batch.num_tokens, heads, width, dtype=cache.dtype, device=self.device)
        group = cache.geometry.group_of(layer)  # the layer's KV cache group
        tables: Sequence[Sequence[int]] | torch.Tensor = batch.tables(group)
        if arrays is not None and self.device_resident:  # the step's device tables
            tables = arrays.group_tables[group]
        for i in range(batch.num_seqs):
            start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
            first = variant.first_visible(batch.seq_lens[i] - (end - start))  # released: unread
            k, v = self._gather(k_cache, v_cache, tables[i], batch.seq_lens[i], first)
            k, v = k.float() * k_scale, v.float() * v_scale  # dequantized (exact scales of 1.0)
            if cache.geometry.latent_dim is not None:  # the key is the whole row, V its c_kv
                k, v = torch.cat([k, v], dim=-1), k
            attended = _attend(q[start:end], k, v, batch.seq_lens[i], scale, variant)
            out[start:end] = attended.to(cache.dtype)
        return self._returned(out)

    def _gather(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        table: Sequence[int] | torch.Tensor,
        seq_len: int,
        first: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's K and V ``[seq_len, H_kv, D]`` in position order, via its table.

        Positions before ``first`` (before a window's first visible key, whose
        blocks may be released) are not read: they come back as zeros.
        """
        block_size, num_blocks = k_cache.shape[1], k_cache.shape[0]
        used = -(-seq_len // block_size)
        if used > len(table):
            raise InvalidRequestError(
                f"{seq_len} tokens need {used} blocks, the table has {len(table)}"
            )
        skip = first // block_size
        if isinstance(table, torch.Tensor):  # a row of the device tables: no host copy
            blocks = table[skip:used].to(torch.int64)
        else:
            blocks = torch.tensor(table[skip:used], dtype=torch.int64, device=self.device)
        if bool(((blocks < 0) | (blocks >= num_blocks)).any()):
            raise InvalidRequestError(
                f"block table {blocks.tolist()} has ids outside 0..{num_blocks - 1}"
            )
        pos = torch.arange(skip * block_size, seq_len, device=self.device)
        slots = blocks[pos // block_size - skip] * block_size + pos % block_size
        out = []
        for cache in (k_cache, v_cache):  # a latent cache's are c_kv and k_rope: two widths
            x = torch.zeros(seq_len, *cache.shape[2:], dtype=cache.dtype, device=self.device)
            x[skip * block_size :] = cache.view(-1, *cache.shape[2:])[slots]
            out.append(x)
        return out[0], out[1]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_len: int,
    scale: float,
    variant: AttentionVariant = PLAIN,
) -> torch.Tensor:
    """Causal attention in float32: query ``j`` of ``n`` is at position ``seq_len - n + j``."""
    n, heads = q.shape[0], q.shape[1]
    group = heads // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [t, H, D]: head h reads KV head h // group
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,thd->hnt", q.float(), kf) * scale
    pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]  # [n, 1]
    key = torch.arange(seq_len, device=q.device)[None, :]  # [1, t]
    if variant.softcap is not None:
        scores = variant.softcap * torch.tanh(scores / variant.softcap)
    if variant.alibi_slopes is not None:
        scores = scores + _per_head(variant.alibi_slopes, q.device) * (key - pos)[None]
    visible = key <= pos
    if variant.window is not None:
        visible = visible & (key > pos - variant.window)
    scores = scores.masked_fill(~visible[None], -math.inf)
    if variant.sinks is None:
        weights = torch.softmax(scores, dim=-1)
    else:  # one more column per head, in the softmax only: it takes weight, adds no value
        sink = _per_head(variant.sinks, q.device).expand(heads, n, 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hnt,thd->nhd", weights, vf)


def _per_head(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """One float32 value per query head, shaped ``[H, 1, 1]`` to broadcast over scores."""
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None, None]


def make_device_backend(device: str | torch.device | None = None) -> TorchBackend:
    """The torch backend under the device-resident contract (``tensors="torch"``).

    ``--backend backend_gpu.torch_backend:make_device_backend`` runs the suite
    through that contract (see :mod:`conformance.judges.device_contract`).
    """
    return TorchBackend(device, tensors="torch")
