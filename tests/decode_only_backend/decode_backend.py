"""A decode-only backend, as a flash-decoding kernel is: one new token per sequence, nothing else.

Written the way an outside project would wire such a kernel (it imports only
``spec``): attention for a single-token query per sequence, computed over the
context in chunks of 16 keys whose partial results are merged by their
log-sum-exp (split-KV), and a hard refusal of anything else. It declares
``max_query_len=1``, so the conformance suite never hands it a prefill: the
prompts' KV is still written through ``write_kv`` and compared, and the
report lists prefill attention as skipped, with the reason and how often.

>>> backend = make_backend()
>>> backend.capabilities.max_query_len
1
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from spec.backend import FloatArray
from spec.batch import BatchMetadata
from spec.capabilities import Capabilities
from spec.kv_geometry import KVGeometry

CHUNK = 16
"""Keys per split: each chunk's softmax is computed alone, then the chunks are merged."""


class DecodeOnlyBackend:
    """Paged KV memory in numpy, and a split-KV decode attention."""

    def __init__(self) -> None:
        self.k: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        self.dtype: type[np.floating] = np.float32
        self.block_size = 0

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            name="decode-only",
            dtypes=frozenset({"float32", "float16"}),
            max_query_len=1,
        )

    def create_cache(self, geometry: KVGeometry) -> None:
        g = geometry
        shape = (g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
        self.dtype = np.float16 if g.dtype == "float16" else np.float32
        self.k = [np.zeros(shape, self.dtype) for _ in range(g.num_layers)]
        self.v = [np.zeros(shape, self.dtype) for _ in range(g.num_layers)]
        self.block_size = g.block_size

    def write_kv(
        self, layer: int, key: FloatArray, value: FloatArray, slot_mapping: Sequence[int]
    ) -> None:
        for row, slot in enumerate(slot_mapping):
            if slot != -1:
                block, offset = divmod(slot, self.block_size)
                self.k[layer][block, offset] = key[row]
                self.v[layer][block, offset] = value[row]

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        for layer in range(len(self.k)):
            for src, dst in copies:
                self.k[layer][dst] = self.k[layer][src]
                self.v[layer][dst] = self.v[layer][src]

    def attention(
        self, layer: int, query: FloatArray, batch: BatchMetadata, scale: float
    ) -> FloatArray:
        if batch.max_query_len > 1:
            raise ValueError("a decode-only kernel was handed a prefill (query_len > 1)")
        out = np.zeros((batch.num_tokens, *query.shape[1:]), np.float32)
        for i in range(batch.num_seqs):
            seq_len = batch.seq_lens[i]
            blocks = list(batch.block_tables[i][: math.ceil(seq_len / self.block_size)])
            k = self.k[layer][blocks].reshape(-1, *self.k[layer].shape[2:])[:seq_len]
            v = self.v[layer][blocks].reshape(-1, *self.v[layer].shape[2:])[:seq_len]
            out[i] = _split_kv_decode(np.asarray(query[i], np.float32), k, v, scale)
        return out.astype(self.dtype).astype(np.float32)

    def read_cache(self, layer: int) -> tuple[FloatArray, FloatArray]:
        return self.k[layer].astype(np.float32), self.v[layer].astype(np.float32)

    def read_blocks(self, layer: int, blocks: Sequence[int]) -> tuple[FloatArray, FloatArray]:
        ids = list(blocks)
        return self.k[layer][ids].astype(np.float32), self.v[layer][ids].astype(np.float32)


def _split_kv_decode(q: FloatArray, k: FloatArray, v: FloatArray, scale: float) -> FloatArray:
    """One query token, all heads (``q`` [H, D]; ``k``, ``v`` [t, H_kv, D]), in chunks of keys."""
    group = q.shape[0] // k.shape[1]
    k = np.repeat(k.astype(np.float32), group, axis=1)
    v = np.repeat(v.astype(np.float32), group, axis=1)
    parts, lses = [], []
    for start in range(0, k.shape[0], CHUNK):
        scores = np.einsum("hd,thd->ht", q, k[start : start + CHUNK]) * np.float32(scale)
        top = scores.max(axis=1, keepdims=True)
        weights = np.exp(scores - top)
        total = weights.sum(axis=1, keepdims=True)
        parts.append(np.einsum("ht,thd->hd", weights / total, v[start : start + CHUNK]))
        lses.append(top[:, 0] + np.log(total[:, 0]))
    lse = np.stack(lses)  # [chunks, H]
    w = np.exp(lse - lse.max(axis=0))
    merged: FloatArray = np.einsum("ch,chd->hd", w / w.sum(axis=0), np.stack(parts))
    return merged


def make_backend() -> DecodeOnlyBackend:
    """The factory: ``--backend tests/decode_only_backend/decode_backend.py:make_backend``."""
    return DecodeOnlyBackend()
