"""A tiny out-of-tree backend: the worked example of docs/plugging-in.md.

Everything a backend needs is in :mod:`spec.backend` (the contract) and
:mod:`spec.batch` (the step's metadata); it never imports ``conformance``.
It keeps the cache as float32 numpy arrays in the contract's layout and
declares only float32 and float16, so the suite skips bfloat16 and says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from spec.backend import FloatArray
from spec.batch import BatchMetadata
from spec.capabilities import Capabilities
from spec.kv_geometry import KVGeometry


class MyBackend:
    """Paged KV memory in numpy; attention gathers each sequence's keys through its table."""

    def __init__(self) -> None:
        self.k: list[np.ndarray] = []  # per layer: [num_blocks, block_size, H_kv, D]
        self.v: list[np.ndarray] = []
        self.block_size = 0

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(name="my-backend", dtypes=frozenset({"float32", "float16"}))

    def create_cache(self, geometry: KVGeometry) -> None:
        g = geometry
        shape = (g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(g.num_layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(g.num_layers)]
        self.block_size = g.block_size

    def write_kv(
        self, layer: int, key: FloatArray, value: FloatArray, slot_mapping: Sequence[int]
    ) -> None:
        for row, slot in enumerate(slot_mapping):
            if slot == -1:  # padding: write nothing
                continue
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
        out = np.zeros((batch.num_tokens, *query.shape[1:]), np.float32)
        for i in range(batch.num_seqs):
            seq_len, first = batch.seq_lens[i], batch.query_start_loc[i]
            blocks = list(batch.block_tables[i][: math.ceil(seq_len / self.block_size)])
            k = self.k[layer][blocks].reshape(-1, *self.k[layer].shape[2:])[:seq_len]
            v = self.v[layer][blocks].reshape(-1, *self.v[layer].shape[2:])[:seq_len]
            for j in range(batch.query_len(i)):
                position = seq_len - batch.query_len(i) + j  # new tokens come last
                out[first + j] = _attend(
                    query[first + j], k[: position + 1], v[: position + 1], scale
                )
        return out

    def read_cache(self, layer: int) -> tuple[FloatArray, FloatArray]:
        return self.k[layer].copy(), self.v[layer].copy()


def _attend(q: FloatArray, k: FloatArray, v: FloatArray, scale: float) -> FloatArray:
    """One query token, all heads: ``q`` [H, D], ``k`` and ``v`` [t, H_kv, D]."""
    group = q.shape[0] // k.shape[1]  # query heads per KV head
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("hd,thd->ht", q, k) * scale
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    out: FloatArray = np.einsum("ht,thd->hd", weights, v)
    return out


def make_backend() -> MyBackend:
    """The factory: ``--backend tests/third_party_backend/my_backend.py:make_backend``."""
    return MyBackend()
