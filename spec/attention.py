"""Reference paged attention, in float64: what every backend must compute.

For each scheduled query token at position ``p`` of its sequence, attention
reads that sequence's keys and values at positions ``0 .. p`` (causal), found
through its block table, never assuming they are contiguous. Query head ``h``
reads KV head ``h // (H / H_kv)``: grouped-query attention, where
``H / H_kv`` query heads share one KV head (multi-query attention when
``H_kv = 1``). Scores are scaled by ``1 / sqrt(head_dim)`` unless told otherwise.

>>> from spec.block_manager import BlockManager
>>> from spec.batch import build_batch
>>> from spec.kv_memory import KVMemory
>>> m = BlockManager(num_blocks=4, block_size=2)
>>> _ = m.add_sequence(0, [1, 2, 3])
>>> slots = m.append_slots(0, [1, 2, 3])
>>> mem = KVMemory(1, 4, 2, num_kv_heads=1, head_dim=1)
>>> kv = np.array([[[0.0]], [[0.0]], [[6.0]]])
>>> mem.write(0, kv, kv, slots)
>>> out = paged_attention(np.zeros((3, 1, 1)), build_batch(m, [(0, 3)]), mem, layer=0)
>>> out[:, 0, 0].tolist()    # uniform weights over 1, 2 and 3 visible keys
[0.0, 0.0, 2.0]
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from spec.batch import BatchMetadata
from spec.errors import InvalidRequestError
from spec.kv_memory import KVMemory

F64 = NDArray[np.float64]


def paged_attention(
    query: F64, batch: BatchMetadata, memory: KVMemory, layer: int, scale: float | None = None
) -> F64:
    """Attention output ``[num_tokens, num_heads, head_dim]`` for every token of the batch."""
    num_kv_heads, head_dim = memory.shape[2], memory.shape[3]
    if query.ndim != 3 or query.shape[0] < batch.num_tokens or query.shape[2] != head_dim:
        raise InvalidRequestError(
            f"query has shape {query.shape}, expected [{batch.num_tokens}, H, {head_dim}]"
        )
    if batch.block_size != memory.shape[1]:
        raise InvalidRequestError(
            f"the batch was laid out for block size {batch.block_size}, "
            f"but the KV memory has blocks of {memory.shape[1]}"
        )
    num_heads = query.shape[1]
    if num_heads % num_kv_heads:
        raise InvalidRequestError(f"{num_heads} query heads do not divide into {num_kv_heads}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = np.zeros((batch.num_tokens, num_heads, head_dim))
    for i in range(batch.num_seqs):
        start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
        k, v = memory.gather(layer, batch.block_tables[i], batch.seq_lens[i])
        positions = np.asarray(batch.positions[start:end])
        out[start:end] = attend(query[start:end].astype(np.float64), k, v, positions, scale)
    return out


def attend(query: F64, key: F64, value: F64, positions: NDArray[np.int64], scale: float) -> F64:
    """Causal attention over one sequence's contiguous K and V.

    ``query`` is ``[n, H, D]`` for tokens at ``positions``; ``key`` and
    ``value`` are ``[t, H_kv, D]`` for positions ``0 .. t - 1``.
    """
    group = query.shape[1] // key.shape[1]
    k = np.repeat(key, group, axis=1)  # [t, H, D]: query head h reads KV head h // group
    v = np.repeat(value, group, axis=1)
    scores = np.einsum("nhd,thd->hnt", query, k) * scale
    visible = np.arange(key.shape[0])[None, :] <= positions[:, None]  # [n, t]
    scores = np.where(visible[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    out: F64 = np.einsum("hnt,thd->nhd", weights, v)
    return out
