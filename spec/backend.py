"""The backend contract: what any implementation of paged KV memory and attention provides.

The spec decides (block tables, slot mappings, copy lists, batch metadata); a
backend executes those decisions on its own memory. This module is the one
place that says what "execute" means, so that the Triton backend, the eager
PyTorch backend, the spec itself (:class:`ReferenceBackend`) and any third
party's backend are interchangeable under the conformance suite and the engine.

Arrays cross the boundary as numpy ``float32`` (or ``float64``) so that a
backend in any framework can plug in. Values handed to a backend are already
representable in its cache dtype (the caller rounds them), so writing then
reading back must return them bit for bit. A backend keeps its cache in the
layout ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer, for K and
for V, or converts to it in :meth:`Backend.read_cache`.

>>> backend = ReferenceBackend()
>>> backend.create_cache(KVGeometry(num_layers=1, num_blocks=2, block_size=2,
...                                 num_kv_heads=1, head_dim=1))
>>> x = np.array([[[5.0]]], dtype=np.float32)
>>> backend.write_kv(0, x, x, slot_mapping=[3])
>>> backend.copy_blocks([(1, 0)])
>>> float(backend.read_cache(0)[0][0, 1, 0, 0])     # slot 3 is block 1, offset 1
5.0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from spec.attention import paged_attention
from spec.batch import BatchMetadata
from spec.errors import InvalidRequestError
from spec.kv_memory import KVMemory

FloatArray = NDArray[np.floating]

DTYPES = ("float32", "float16", "bfloat16")
"""Cache dtypes the contract knows, by name (numpy has no bfloat16)."""

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KVGeometry:
    """The shape of a KV cache: ``num_layers`` x (K, V) x ``[num_blocks, block_size, H_kv, D]``."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype {self.dtype!r} is not one of {DTYPES}")

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports. The conformance suite skips, and reports, the rest.

    ``None`` for a set means "any value".
    """

    name: str
    device: str = "cpu"
    dtypes: frozenset[str] = frozenset(DTYPES)
    block_sizes: frozenset[int] | None = None
    head_dims: frozenset[int] | None = None
    max_gqa_ratio: int | None = None
    copy_on_write: bool = True
    prefix_caching: bool = True

    def unsupported(self, geometry: KVGeometry, num_heads: int) -> list[str]:
        """Why this backend cannot run ``geometry`` with ``num_heads`` query heads; [] if it can."""
        reasons = []
        if geometry.dtype not in self.dtypes:
            reasons.append(f"dtype {geometry.dtype}")
        if self.block_sizes is not None and geometry.block_size not in self.block_sizes:
            reasons.append(f"block size {geometry.block_size}")
        if self.head_dims is not None and geometry.head_dim not in self.head_dims:
            reasons.append(f"head dim {geometry.head_dim}")
        ratio = num_heads // geometry.num_kv_heads
        if self.max_gqa_ratio is not None and ratio > self.max_gqa_ratio:
            reasons.append(f"GQA ratio {ratio}")
        return reasons


@runtime_checkable
class Backend(Protocol):
    """Paged KV memory and attention, driven by the spec's decisions.

    The order within one step is: :meth:`copy_blocks` (the step's copy-on-write
    copies), then :meth:`write_kv` for the new tokens, then :meth:`attention`,
    layer by layer.
    """

    @property
    def capabilities(self) -> Capabilities:
        """What this backend supports."""
        ...

    def create_cache(self, geometry: KVGeometry) -> None:
        """Allocate (and so discard any previous) KV cache of this geometry."""
        ...

    def write_kv(
        self, layer: int, key: FloatArray, value: FloatArray, slot_mapping: Sequence[int]
    ) -> None:
        """Write row ``i`` of ``key``/``value`` (``[>= T, H_kv, D]``) into slot ``slot_mapping[i]``.

        ``T = len(slot_mapping)``: rows past it are padding. Slot ``-1`` writes nothing.
        """
        ...

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy block ``src`` onto ``dst``, K and V, every layer. No block is both."""
        ...

    def attention(
        self, layer: int, query: FloatArray, batch: BatchMetadata, scale: float
    ) -> FloatArray:
        """Paged causal attention for every token of ``batch``: ``[T, H, D]`` in and out."""
        ...

    def read_cache(self, layer: int) -> tuple[FloatArray, FloatArray]:
        """This layer's K and V as ``[num_blocks, block_size, H_kv, D]`` float arrays."""
        ...


class ReferenceBackend:
    """The spec itself as a backend: float64 :class:`KVMemory` and reference attention."""

    def __init__(self) -> None:
        self._memory: KVMemory | None = None

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(name="reference", device="cpu")

    def create_cache(self, geometry: KVGeometry) -> None:
        g = geometry
        self._memory = KVMemory(
            g.num_layers, g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim
        )

    def write_kv(
        self, layer: int, key: FloatArray, value: FloatArray, slot_mapping: Sequence[int]
    ) -> None:
        self._mem().write(layer, key.astype(np.float64), value.astype(np.float64), slot_mapping)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        self._mem().copy_blocks(copies)

    def attention(
        self, layer: int, query: FloatArray, batch: BatchMetadata, scale: float
    ) -> FloatArray:
        return paged_attention(query.astype(np.float64), batch, self._mem(), layer, scale)

    def read_cache(self, layer: int) -> tuple[FloatArray, FloatArray]:
        mem = self._mem()
        return mem.k[layer].copy(), mem.v[layer].copy()

    def _mem(self) -> KVMemory:
        if self._memory is None:
            raise InvalidRequestError("create_cache() must be called first")
        return self._memory
