"""The spec's :class:`~spec.backend.Backend` on the Triton kernels of :mod:`backend_gpu.kernels`.

On CUDA the kernels compile; on CPU they run under Triton's interpreter, which
importing :mod:`backend_gpu` turns on when there is no CUDA. Metadata comes
from :class:`~spec.batch.BatchMetadata` (host tuples) and goes to the device as
the int32/int64 tensors the kernels take; the grid sizes come from the host
values, so no device read-back is needed beyond the wrappers' index checks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

import backend_gpu  # noqa: F401  (sets TRITON_INTERPRET on CPU-only machines first)
from backend_gpu._cache import TorchKVCache, default_device, to_numpy
from backend_gpu.kernels import copy_blocks, paged_attention, reshape_and_cache
from backend_gpu.kernels.attention import MAX_HEAD_DIM
from spec.backend import DTYPES, Capabilities, FloatArray, KVGeometry
from spec.batch import BatchMetadata
from spec.errors import InvalidRequestError


class TritonBackend:
    """Paged KV memory and unified paged attention on Triton kernels.

    ``num_splits`` forces the attention kernel's split-KV path (``> 1``) or the
    single pass (``1``); ``None`` lets its heuristic choose.
    """

    def __init__(self, device: str | torch.device | None = None, num_splits: int | None = None):
        self.device = torch.device(device) if device is not None else default_device()
        self.num_splits = num_splits
        self._cache: TorchKVCache | None = None

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            name="triton",
            device=str(self.device),
            dtypes=frozenset(DTYPES),
            block_sizes=None,
            head_dims=frozenset(range(1, MAX_HEAD_DIM + 1)),
            max_gqa_ratio=None,
        )

    def create_cache(self, geometry: KVGeometry) -> None:
        if geometry.head_dim > MAX_HEAD_DIM:
            raise InvalidRequestError(f"head_dim {geometry.head_dim} > {MAX_HEAD_DIM}")
        self._cache = TorchKVCache(geometry, self.device)

    def write_kv(
        self, layer: int, key: FloatArray, value: FloatArray, slot_mapping: Sequence[int]
    ) -> None:
        cache = self._mem()
        k_cache, v_cache = cache.layer(layer)
        n, h = len(slot_mapping), cache.geometry.num_kv_heads
        k, v = cache.tensor("key", key, n, h), cache.tensor("value", value, n, h)
        reshape_and_cache(k, v, k_cache, v_cache, cache.slots(slot_mapping), check_slots=False)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        cache = self._mem()
        copy_blocks(cache.k, cache.v, list(copies))

    def attention(
        self, layer: int, query: FloatArray, batch: BatchMetadata, scale: float
    ) -> FloatArray:
        cache = self._mem()
        k_cache, v_cache = cache.layer(layer)
        cache.check_batch(batch)
        heads = query.shape[1] if isinstance(query, np.ndarray) and query.ndim == 3 else -1
        q = cache.tensor("query", query, batch.num_tokens, heads)
        dev = self.device
        out = paged_attention(
            q[: batch.num_tokens],
            k_cache,
            v_cache,
            torch.tensor(batch.query_start_loc, dtype=torch.int32, device=dev),
            torch.tensor(batch.seq_lens, dtype=torch.int32, device=dev),
            _tables(batch, dev),
            scale,
            num_splits=self.num_splits,
            max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len,
        )
        return to_numpy(out)

    def read_cache(self, layer: int) -> tuple[FloatArray, FloatArray]:
        return self._mem().read(layer)

    def _mem(self) -> TorchKVCache:
        if self._cache is None:
            raise InvalidRequestError("create_cache() must be called first")
        return self._cache


def _tables(batch: BatchMetadata, device: torch.device) -> torch.Tensor:
    """``[S, W]`` int32 block tables (``W >= 1`` so that an all-empty batch still has a row)."""
    width = max(1, max((len(t) for t in batch.block_tables), default=0))
    rows = [list(t) + [-1] * (width - len(t)) for t in batch.block_tables]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(batch.num_seqs, width)
