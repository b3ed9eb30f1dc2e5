"""KV cache storage shared by the torch-based backends, and the numpy <-> torch boundary.

The spec's :class:`~spec.backend.Backend` contract passes numpy float arrays;
these backends keep one K and one V tensor per layer, each
``[num_blocks, block_size, num_kv_heads, head_dim]`` in the geometry's cache
dtype on one device, filled with NaN at creation exactly like
:class:`spec.kv_memory.KVMemory`, so a read of a slot nobody wrote is visible,
and ``read_cache`` of both agree. A quantized cache (``kv_dtype``) is a
``torch.float8_e4m3fn`` / ``float8_e5m2`` tensor holding the stored fp8 values,
which ``read_cache`` returns as they are (not times the scale).

A pool of more than :data:`spec.kv_memory.LAZY_ELEMENTS` elements per layer is
allocated with ``torch.empty`` instead: filling it would touch every page (4 GiB
for a pool past 2^31 fp16 elements), while an untouched CPU allocation costs no
resident memory. Its unwritten slots hold whatever the allocator gives; the
conformance suite writes every block it compares first, and reads such a pool
with ``read_blocks``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from backend_gpu.kernels._fp8 import FP8_TORCH
from spec.backend import FloatArray, KVGeometry
from spec.batch import BatchMetadata
from spec.errors import InvalidRequestError
from spec.kv_memory import LAZY_ELEMENTS

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def default_device() -> torch.device:
    """CUDA when there is one, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class TorchKVCache:
    """Per-layer K and V tensors of one geometry, plus conversions at the numpy boundary."""

    def __init__(self, geometry: KVGeometry, device: torch.device) -> None:
        g = geometry
        shape = (g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
        self.geometry = g
        self.device = device
        self.dtype = TORCH_DTYPES[g.dtype]  # the activation dtype: queries, new K and V, outputs
        self.cache_dtype = FP8_TORCH[g.kv_dtype] if g.kv_dtype else self.dtype
        self.k = [self._nans(shape) for _ in range(g.num_layers)]
        self.v = [self._nans(shape) for _ in range(g.num_layers)]

    def _nans(self, shape: tuple[int, ...]) -> torch.Tensor:
        """NaN-filled storage, or uninitialised (lazy) storage for a pool too large to fill."""
        if self.geometry.num_elements > LAZY_ELEMENTS:
            return torch.empty(shape, dtype=self.cache_dtype, device=self.device)
        return torch.full(shape, float("nan"), dtype=self.cache_dtype, device=self.device)

    def scales(self, layer: int) -> tuple[float, float]:
        """This layer's ``(k_scale, v_scale)``; ``(1.0, 1.0)`` for an unquantized cache."""
        g = self.geometry
        return g.kv_scales[layer] if g.kv_dtype else (1.0, 1.0)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V tensors (the live storage, not copies)."""
        if not 0 <= layer < self.geometry.num_layers:
            raise InvalidRequestError(f"layer {layer} is outside 0..{self.geometry.num_layers - 1}")
        return self.k[layer], self.v[layer]

    def tensor(self, name: str, x: FloatArray, min_rows: int, heads: int) -> torch.Tensor:
        """``x`` (numpy ``[>= min_rows, heads, head_dim]``) in the cache dtype, on the device."""
        d = self.geometry.head_dim
        if not isinstance(x, np.ndarray) or x.dtype.kind != "f":
            raise InvalidRequestError(f"{name} must be a numpy float array, got {type(x).__name__}")
        if x.ndim != 3 or x.shape[0] < min_rows or x.shape[1:] != (heads, d):
            raise InvalidRequestError(
                f"{name} has shape {x.shape}, expected [>= {min_rows}, {heads}, {d}]"
            )
        host = torch.from_numpy(np.array(x, dtype=np.float32))  # our copy: inputs are read-only
        return host.to(device=self.device, dtype=self.dtype)

    def slots(self, slot_mapping: Sequence[int]) -> torch.Tensor:
        """The slot mapping as int64 on the device, each slot in the pool or ``-1``."""
        slots = np.asarray(slot_mapping, dtype=np.int64).reshape(-1)
        num_slots = self.geometry.num_blocks * self.geometry.block_size
        bad = (slots != -1) & ((slots < 0) | (slots >= num_slots))
        if bad.any():
            raise InvalidRequestError(f"slot {int(slots[bad][0])} is outside 0..{num_slots - 1}")
        return torch.from_numpy(slots).to(self.device)

    def check_batch(self, batch: BatchMetadata) -> None:
        """The batch was laid out for this cache's block size (not, say, the manager's)."""
        if batch.block_size != self.geometry.block_size:
            raise InvalidRequestError(
                f"batch block size {batch.block_size} differs from the cache's "
                f"{self.geometry.block_size}"
            )

    def read(self, layer: int) -> tuple[FloatArray, FloatArray]:
        """This layer's K and V as float32 numpy copies (exact for every cache dtype)."""
        k, v = self.layer(layer)
        return to_numpy(k), to_numpy(v)

    def read_blocks(self, layer: int, blocks: Sequence[int]) -> tuple[FloatArray, FloatArray]:
        """K and V of just ``blocks`` (``[len(blocks), B, H_kv, D]``), without copying the pool."""
        k, v = self.layer(layer)
        ids = np.asarray(blocks, dtype=np.int64).reshape(-1)
        if ((ids < 0) | (ids >= self.geometry.num_blocks)).any():
            raise InvalidRequestError(
                f"blocks {ids.tolist()} not all in 0..{self.geometry.num_blocks - 1}"
            )
        index = torch.from_numpy(ids).to(self.device)
        return to_numpy(k[index]), to_numpy(v[index])


class TorchCacheBackend:
    """What the torch-based backends share: the cache they hold and the numpy boundary.

    Subclasses compute; this class only converts and checks their inputs.
    """

    def __init__(self, device: str | torch.device | None = None) -> None:
        self.device = torch.device(device) if device is not None else default_device()
        self._cache: TorchKVCache | None = None

    def create_cache(self, geometry: KVGeometry) -> None:
        self._cache = TorchKVCache(geometry, self.device)

    def read_cache(self, layer: int) -> tuple[FloatArray, FloatArray]:
        return self._mem().read(layer)

    def read_blocks(self, layer: int, blocks: Sequence[int]) -> tuple[FloatArray, FloatArray]:
        return self._mem().read_blocks(layer, blocks)

    def _mem(self) -> TorchKVCache:
        if self._cache is None:
            raise InvalidRequestError("create_cache() must be called first")
        return self._cache

    def _kv_inputs(
        self, layer: int, key: FloatArray, value: FloatArray, slot_mapping: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k, v, k_cache, v_cache)`` for a KV write: new tokens on the device, live storage."""
        cache = self._mem()
        k_cache, v_cache = cache.layer(layer)
        n, h = len(slot_mapping), cache.geometry.num_kv_heads
        return cache.tensor("key", key, n, h), cache.tensor("value", value, n, h), k_cache, v_cache

    def _query_inputs(
        self, layer: int, query: FloatArray, batch: BatchMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, k_cache, v_cache)`` for attention, once the batch fits this cache."""
        cache = self._mem()
        k_cache, v_cache = cache.layer(layer)
        cache.check_batch(batch)
        heads = query.shape[1] if isinstance(query, np.ndarray) and query.ndim == 3 else -1
        return cache.tensor("query", query, batch.num_tokens, heads), k_cache, v_cache


def to_numpy(x: torch.Tensor) -> FloatArray:
    """A float32 numpy copy of ``x`` (float16, bfloat16 and fp8 widen exactly)."""
    out: FloatArray = x.detach().to(device="cpu", dtype=torch.float32).numpy().copy()
    return out
